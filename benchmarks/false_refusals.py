"""Same-step refusals in clean runs (issue 58 item 6): how often the same-step tier refuses an
update where no fault was injected.

Trains the built-in trainer's configs with no fault (`faults=[]`) over several seeds and counts
the refused updates (`skip_update` interventions), each with how far above its rolling mean the
tier found the loss and the gradient norm, so a refusal beside a real loss jump can be told
from one on noise. A refusal in a clean run drops a step; the goal is at most 1 in 10,000 clean
steps. `--loops` adds the Watch in loops of the user's shape, clean: the plain-loop and the
DataLoader examples, and a tiny Hugging Face Llama in a plain loop (two micro-batches a step,
bf16 autocast), each over `--seeds` seeds (the plain-loop example has one).

    python benchmarks/false_refusals.py [--configs tiny_cpu,demo] [--steps 2000] [--seeds 3]
        [--loops 1500]

Prints one JSON line: steps, refusals, the rate per 10,000 steps, and each refusal's step and
reason.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from spikewatch.trainer.builtin.loop import fit
from spikewatch.trainer.config import load_config


def one(config: str, steps: int, seed: int, tmp: Path) -> tuple[int, list[dict]]:
    cfg = load_config(
        config,
        [f"train.max_steps={steps}", f"train.seed={seed}", "faults=[]", "train.progress=false",
         "eval.interval=none", "schedule.warmup_steps=30"],
    )  # fmt: skip
    result = fit(cfg, run_dir=tmp / f"{config}-{seed}")
    summary = result.summary()
    refused = [
        {"config": config, "seed": seed, "step": i.get("step"), "reason": i.get("reason")}
        for i in summary.get("interventions", [])
        if i.get("kind") == "skip_update"
    ]
    return int(summary["steps"]), refused


REPO = Path(__file__).resolve().parents[1]


def _refusals(summary: dict, where: str, seed: int) -> list[dict]:
    return [
        {"config": where, "seed": seed, "step": i.get("step"), "reason": i.get("reason")}
        for i in summary.get("interventions", [])
        if i.get("kind") == "skip_update" and str(i.get("reason", "")).startswith("same-step")
    ]


def example(name: str, steps: int, seed: int | None, tmp: Path) -> tuple[int, list[dict]]:
    """One of examples/ run clean (no poison), its summary read back."""
    out = tmp / f"{name}-{seed}.json"
    run_dir = tmp / f"{name}-{seed}"
    cmd = [sys.executable, str(REPO / "examples" / f"{name}.py"), "--steps", str(steps),
           "--db", "none", "--run-dir", str(run_dir), "--summary-json", str(out)]  # fmt: skip
    if seed is not None:
        cmd += ["--seed", str(seed)]
    subprocess.run(cmd, check=True, capture_output=True, cwd=tmp)
    summary = json.loads(out.read_text())
    return int(summary["steps"]), _refusals(summary, name, seed or 0)


def llama(steps: int, seed: int, tmp: Path) -> tuple[int, list[dict]]:
    """A tiny LlamaForCausalLM (from a config, no download) in a plain loop with the Watch:
    random windows of the corpus, two micro-batches a step, bf16 autocast, clip 1.0."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from spikewatch import Watch
    from spikewatch.corpus import text_corpus

    torch.manual_seed(seed)
    train, _ = text_corpus()
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=176,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=64, attn_implementation="sdpa")  # fmt: skip
    model = LlamaForCausalLM(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95))

    def batch_at(i: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed * 1_000_003 + i)
        start = torch.randint(0, len(train) - 65, (16,), generator=g)
        return torch.stack([train[s : s + 64].long() for s in start.tolist()])

    with Watch(model, optimizer, db="none", run_dir=tmp / f"llama-{seed}", max_steps=steps,
               grad_clip=1.0, name="llama-clean") as watch:  # fmt: skip
        for x in watch.batches(batch_at):
            for half in x.chunk(2):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = model(input_ids=half, labels=half).loss
                watch.observe_loss(loss)
                (loss / 2).backward()
            watch.step()
    summary = watch.summary()
    return int(summary["steps"]), _refusals(summary, "hf_llama", seed)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="tiny_cpu,demo")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--loops", type=int, default=0, help="steps of each own-loop run (0: none)")
    args = ap.parse_args(argv)
    total, refusals = 0, []
    with tempfile.TemporaryDirectory() as tmp:
        for config in [c for c in args.configs.split(",") if c]:
            for seed in range(args.seeds):
                n, refused = one(config, args.steps, seed, Path(tmp))
                total += n
                refusals += refused
        if args.loops:
            runs = [lambda: example("plain_loop", args.loops, None, Path(tmp))]
            for seed in range(args.seeds):
                runs.append(lambda s=seed: example("dataloader_loop", args.loops, s, Path(tmp)))
                runs.append(lambda s=seed: llama(args.loops, s, Path(tmp)))
            for run in runs:
                n, refused = run()
                total += n
                refusals += refused
    out = {
        "steps": total,
        "refusals": len(refusals),
        "per_10k_steps": round(1e4 * len(refusals) / max(total, 1), 2),
        "each": refusals,
    }
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
