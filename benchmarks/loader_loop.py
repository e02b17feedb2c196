"""The Watch's cost in an accelerate DataLoader loop (issue 64's "time <= 1.03x"): the same loop
(`accelerator.prepare`, a shuffled DataLoader, `accelerator.accumulate` with 2 micro-batches a
step, the plain-loop example's GPT) with and without spikewatch (`route`, `batches(loader,
accumulate=2)`, `observe_loss`), alternated A B B A over `--reps` rounds in this process so the
machine's drift falls on both; each round's median step time after `--warmup` steps.

    python benchmarks/loader_loop.py [--reps 4 --steps 60 --d-model 128]

Prints one JSON line: the ratio without / with (throughput kept, 1.0 = free) and both medians.
`--smoke` runs it at a tiny size (its test)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

REPO = Path(__file__).resolve().parents[1]


def _example(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(f"bench_{name}", REPO / "examples" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def one_round(args: argparse.Namespace, watched: bool, tmp: Path) -> float:
    """The median step time (seconds) of one run of the loop."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    from spikewatch import Watch
    from spikewatch.corpus import text_corpus

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = _example("plain_loop").GPT(args.d_model, args.layers, 4, args.seq_len)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    windows = _example("dataloader_loop").Windows(text_corpus()[0], args.seq_len)
    loader = DataLoader(windows, batch_size=args.batch_size, shuffle=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    steps = args.steps + args.warmup
    batches: Any = loader
    watch = None
    if watched:
        watch = Watch(model, optimizer, scheduler, run_dir=tmp / f"run{time.monotonic_ns()}",
                      db="none", max_steps=steps)  # fmt: skip
        watch.open()
        model.use_recorder(watch.attn)  # the per-head maxima, as the example records them
        watch.route(optimizer, scheduler)
        batches = watch.batches(loader, accumulate=2, loss_fn=lambda b: model(b[0], b[1]))
    stamps: list[float] = []
    for x, y, _ in batches:
        with accelerator.accumulate(model):
            loss = model(x, y)
            if watch is not None:
                watch.observe_loss(loss)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            stamps.append(time.perf_counter())
            if len(stamps) >= steps:
                break
    if watch is not None:
        watch.close()
    times = [b - a for a, b in zip(stamps, stamps[1:], strict=False)][args.warmup :]
    return statistics.median(times)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=4)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--smoke", action="store_true", help="a tiny size, two rounds (its test)")
    args = p.parse_args(argv)
    if args.smoke:
        args.reps, args.steps, args.warmup = 1, 6, 1
        args.d_model, args.seq_len, args.batch_size = 32, 32, 4
    torch.set_num_threads(1)
    bare: list[float] = []
    watched: list[float] = []
    with tempfile.TemporaryDirectory(prefix="loader-loop-") as tmp:
        for r in range(args.reps):
            order = (False, True) if r % 2 == 0 else (True, False)  # A B, then B A
            for w in order:
                (watched if w else bare).append(one_round(args, w, Path(tmp)))
    out = {
        "ratio": round(statistics.median(bare) / statistics.median(watched), 4),
        "bare_ms": round(1e3 * statistics.median(bare), 2),
        "watched_ms": round(1e3 * statistics.median(watched), 2),
        "reps": args.reps,
        "steps": args.steps,
        "d_model": args.d_model,
    }
    print(json.dumps(out))  # noqa: T201
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
