"""A third-party nanoGPT loop with the Watch patched in from the README alone.

    python benchmarks/nano_gpt_public.py [--steps 150] [--poison 100:120] [--kill-at 130]

The loop is `train()` in `nano_gpt/trainer.py` of the PyPI package nano-gpt 0.1.0 (Allen
Porter's packaging of Karpathy's GPT-2 tutorial loop, MIT): its own `for step in range(...)`
counter driving `get_lr(config, step)`, its gradient accumulation inside `compute_loss` (the
loss read with `.item()` each micro-batch), `clip_grad_norm_`, the LR set by hand on the param
groups, `optimizer.step()`, and an iterator over its data loader. It is read from the installed
package when this runs, never copied into this repository, and edited as text: `PATCH` below,
the lines the README's "a loop you keep as it is" asks for; its size is counted and printed.
Karpathy's own train.py cannot be fetched on this machine; this loop was not written here either.

The driver (`DRIVER`, the user's script around `train()`): a byte-level GPT of nano_gpt's own
model class (2 layers, 128 wide, T = 64, B = 8, accumulation 2) on the registry's Shakespeare,
CPU, with nano_gpt's bf16 autocast; a stream of consecutive windows, as nano_gpt's loader gives
them, with `--poison A:B` turning micro-batches A..B-1 into random bytes (a corrupt stretch of
a shard). Runs, each in a fresh process: without spikewatch (clean and poisoned), with it (clean
and poisoned), and with it killed at `--kill-at` (after its disk checkpoint at 100) and run again
with the same command. Prints the diff, each run's fixed validation loss (20 windows of the held-
out tenth), seconds, what the Watch did, the LR of the first step after the resume against the
uninterrupted run's, and one JSON line.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

try:
    import nano_gpt
except ImportError:  # pragma: no cover - the dev install has it
    raise SystemExit("nano-gpt is not installed: pip install nano-gpt==0.1.0") from None

PACKAGE = Path(nano_gpt.__file__).parent

# The spikewatch patch, as the README's "a loop you keep as it is" has it: (the loop's line,
# what replaces it). `SW_RUN_DIR` is where the driver puts the run (the user would write a path).
PATCH = [
    ("from torch import nn\n", "from torch import nn\nfrom spikewatch import Watch\n"),
    (
        "    train_ds = iter(train_data_loader)\n",
        "    watch = Watch(raw_model, optimizer, max_steps=config.max_steps,\n"
        '                  run_dir=os.environ["SW_RUN_DIR"], resume="auto")\n'
        "    watch.route(optimizer)\n"
        "    accumulate = config.grad_accum_steps(worker_state.ddp_world_size)\n"
        "    train_ds = iter(watch.batches(train_data_loader, accumulate=accumulate))\n",
    ),
    (
        "    for step in range(config.step, config.max_steps):\n",
        "    step = watch.step_count\n    while step < config.max_steps:\n",
    ),
    (
        "            backward=True,\n        )\n        if worker_state.ddp:\n",
        "            backward=True,\n        )\n"
        "        watch.observe_loss(loss_accum)\n"
        "        if worker_state.ddp:\n",
    ),
    (
        "            log.log(stats.log_record())\n",
        "            log.log(stats.log_record())\n"
        "        step = watch.step_count\n"
        "    watch.close()\n",
    ),
]

DRIVER = """
import json, os, sys, time
import torch
from nano_gpt.config import GPTConfig, TrainConfig
from nano_gpt.model import GPT
from nano_gpt.trainer import WorkerState, create_optimizer, train
from spikewatch.corpus import text_corpus

steps = int(os.environ["SW_STEPS"])
B, T, ACC = 8, 64, 2
poison = [int(v) for v in os.environ.get("SW_POISON", "0:0").split(":")]
train_data, val_data = (t.long() for t in text_corpus())


def stream(d, poisoned=(0, 0)):
    i, pos = 0, 0
    g = torch.Generator().manual_seed(7)
    while True:
        if pos + B * T + 1 > len(d):
            pos = 0
        chunk = d[pos: pos + B * T + 1]
        x, y = chunk[:-1].view(B, T), chunk[1:].view(B, T)
        if poisoned[0] <= i < poisoned[1]:  # a corrupt stretch of the shard: random bytes
            x = torch.randint(0, 256, (B, T), generator=g)
            y = torch.randint(0, 256, (B, T), generator=g)
        print(f"YIELD {int(poisoned[0] <= i < poisoned[1])}")  # which micro-batch the loop got
        yield x, y
        pos += B * T
        i += 1


torch.manual_seed(1337)
model = GPT(GPTConfig(block_size=T, vocab_size=256, n_layer=2, n_head=4, n_embd=128), None)
config = TrainConfig(total_batch_size=B * T * ACC, micro_batch_size=B, sequence_length=T,
                     max_lr=3e-3, warmup_steps=30, max_steps=steps, eval_steps=10**9,
                     checkpoint_steps=10**9)
opt = create_optimizer(model, config, None, False)
lrs = []  # the LR of each update this process applies
def applied(o, args, kwargs):  # the optimizer is called for the updates applied alone
    lrs.append(o.param_groups[0]["lr"])
    print("APPLIED")


opt.register_step_pre_hook(applied)
t0 = time.perf_counter()
train(model, opt, WorkerState("cpu"), config, stream(train_data, poison))
seconds = time.perf_counter() - t0
model.eval()
with torch.no_grad(), torch.autocast(device_type="cpu", dtype=torch.bfloat16):
    val = [float(model(x, y)[1]) for _, (x, y) in zip(range(20), stream(val_data))]
print("REPORT " + json.dumps({"val_loss": sum(val) / len(val), "seconds": seconds, "lrs": lrs}))
"""

ACC = 2  # the driver's accumulation steps
LINE = re.compile(r"step: (\d+) \| loss: ([\d.]+) .* lr: ([\d.]+)")
RESUMED = re.compile(r"resumed run \S+ at step (\d+)")
PLAN = ("rollback checkpoints:", "is recorded in", "no per-head attention maxima")


def edit(text: str, pairs: list[tuple[str, str]]) -> str:
    for old, new in pairs:
        if text.count(old) != 1:
            raise SystemExit(f"the loop changed: {old!r} is not in it once (nano-gpt upgraded?)")
        text = text.replace(old, new)
    return text


def build(tmp: Path) -> tuple[Path, Path, str]:
    """Two copies of the package (as installed, and with the patch), and the patch's diff."""
    bare, watched = tmp / "bare", tmp / "watched"
    for root in (bare, watched):
        shutil.copytree(PACKAGE, root / "nano_gpt", ignore=shutil.ignore_patterns("__pycache__"))
    original = (PACKAGE / "trainer.py").read_text()
    patched = edit(original, PATCH)
    (watched / "nano_gpt" / "trainer.py").write_text(patched)
    diff = "".join(difflib.unified_diff(original.splitlines(True), patched.splitlines(True),
                                        "trainer.py", "trainer.py (spikewatch)", n=1))  # fmt: skip
    (tmp / "driver.py").write_text(DRIVER)
    return bare, watched, diff


def run(tmp: Path, package: Path, name: str, steps: int, poison: str = "0:0",
        kill_at: int = 0) -> dict:  # fmt: skip
    out = tmp / name
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": str(package), "SW_STEPS": str(steps), "SW_POISON": poison,
           "SW_RUN_DIR": str(out / "run"), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "SPIKEWATCH_DB_URL": f"sqlite:///{tmp}/sw.db"}  # fmt: skip
    cmd = [sys.executable, str(tmp / "driver.py")]
    result: dict = {}
    t0 = time.perf_counter()
    if kill_at:  # SIGKILL once the loop logs step `kill_at`
        p = subprocess.Popen(cmd, env=env, cwd=out, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)  # fmt: skip
        assert p.stdout is not None
        for line in p.stdout:
            m = LINE.search(line)
            if m and int(m.group(1)) >= kill_at:
                p.send_signal(signal.SIGKILL)
                break
        p.wait()
        result["killed_at"] = kill_at
    done = subprocess.run(cmd, env=env, cwd=out, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"{name} failed:\n{done.stdout[-6000:]}")
    lines = done.stdout.splitlines()  # the loop's log and the Watch's lines, in order
    report = next(ln for ln in lines if ln.startswith("REPORT "))
    result.update(json.loads(report[7:]))
    result["wall_seconds"] = round(time.perf_counter() - t0, 1)
    result["updates"] = len(result["lrs"])
    said = [ln for ln in lines if (ln.startswith("spikewatch:") and not any(p in ln for p in PLAN))
            or "rolled back from step" in ln or "update refused" in ln]  # fmt: skip
    result["spikewatch"] = said
    resumed = [int(m.group(1)) for ln in said if (m := RESUMED.search(ln))]
    result["resumed_at"] = resumed[0] if resumed else None
    # the poisoned micro-batches the loop trained on after the Watch's first rollback: of the
    # stream's yields before each of the loop's step lines, the last ACC are the step's (the
    # ones before them, drawn and passed over by `watch.batches`, were skipped); a step trained
    # on them if its update was applied (the driver's "APPLIED": the optimizer was called, as
    # it is for an applied update alone on this CPU's host path). Counted from the optimizer,
    # not from the Watch's console, which tells a stretch of refusals in one line
    first = next((i for i, ln in enumerate(lines) if "rolled back from step" in ln), None)
    trained, applied, rolled, drawn, refusals = 0, False, False, [], 0
    for ln in lines[first + 1 :] if first is not None else []:
        if ln.startswith("YIELD "):
            drawn.append(ln == "YIELD 1")
        elif ln == "APPLIED":
            applied = True
        elif "rolled back from step" in ln:
            rolled = True
        elif LINE.search(ln):
            poisoned = sum(drawn[-ACC:]) if drawn else 0
            trained += poisoned if applied else 0
            refusals += not (applied or rolled)
            drawn, applied, rolled = [], False, False
    result["poisoned_micro_batches_trained_after_rollback"] = trained
    result["refused_after_rollback"] = refusals
    return result


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--poison", default="100:120", help="micro-batches A:B as random bytes")
    ap.add_argument("--kill-at", type=int, default=130, help="SIGKILL at this step, rerun")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        bare, watched, diff = build(tmp)
        lines = [ln for ln in diff.splitlines() if ln[:1] in "+-" and ln[:3] not in ("+++", "---")]
        print(diff)
        runs = {
            "without": run(tmp, bare, "without", args.steps),
            "clean": run(tmp, watched, "clean", args.steps),
            "without_poisoned": run(tmp, bare, "without_poisoned", args.steps, args.poison),
            "poisoned": run(tmp, watched, "poisoned", args.steps, args.poison),
            "killed_and_rerun": run(tmp, watched, "killed", args.steps, kill_at=args.kill_at),
        }
        listed = subprocess.run(
            [sys.executable, "-m", "spikewatch", "runs", "--json", "--db", f"sqlite:///{tmp}/sw.db"],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
    resumed = runs["killed_and_rerun"]
    first = resumed["resumed_at"]
    out = {
        "loop": "nano_gpt/trainer.py train()",
        "nano_gpt": getattr(nano_gpt, "__version__", "0.1.0"),
        "diff_lines_raw": len(lines),
        "diff_lines_changed_ignoring_whitespace": len({ln[1:].strip() for ln in lines}),
        "time_ratio": round(runs["clean"]["seconds"] / runs["without"]["seconds"], 3),
        "resumed_at": first,
        "lr_after_resume": resumed["lrs"][0] if first is not None else None,
        "lr_uninterrupted": runs["clean"]["lrs"][first] if first is not None else None,
        "runs": {k: {kk: v for kk, v in r.items() if kk != "lrs"} for k, r in runs.items()},
        "store": json.loads(listed),
    }
    for name, r in runs.items():
        print(f"{name}: val loss {r['val_loss']:.4f}, {r['seconds']:.1f} s in train(), "
              f"{r['updates']} updates in this process; {r['spikewatch']}")  # fmt: skip
    print(f"time ratio {out['time_ratio']}; resumed at step {first}: lr {out['lr_after_resume']}"
          f" (uninterrupted: {out['lr_uninterrupted']})")  # fmt: skip
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
