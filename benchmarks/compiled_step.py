"""A compiled plain loop with and without spikewatch (issue 38): throughput with / without, under
torch.compile (Inductor) and eager, measured interleaved as integrations.py does: two identical
models in one process stepping alternately, one watched, so both see the same machine.

The model is examples/plain_loop.py's GPT (d=128, 2 layers, T=128, B=16 by default). "With" is
the Watch as the example runs it: every probe on (per-head attention maxima through
`AttnMax.sdpa`, per-layer grad norms, update ratios and Adam moments every 10 steps), the
detector and the same-step tier, the SQLite store, a disk checkpoint every 25 steps, and
spikewatch's AdamW (torch's arithmetic, refused on the device). "Without" is the same loop by
hand with torch's AdamW: clip at 1.0, step, schedule, zero. Compile time is each model's first
step (its graphs compile there); the graphs are counted by Dynamo.

    python benchmarks/compiled_step.py [--steps 300] [--batch-size 16] [--modes compiled,eager]

Last line: {"compiled_ratio": r, "eager_ratio": r, "compile_s_with": s, "compile_s_without": s,
"graphs_with": n, "graphs_without": n}.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import torch  # noqa: E402  (after _common set the thread environment)
from _common import allocator_flag, median, plain_update, quiet_one_thread  # noqa: E402

REPO = Path(__file__).parents[1]
WARM = 10


def _example():  # noqa: ANN202
    spec = importlib.util.spec_from_file_location("plain_loop", REPO / "examples/plain_loop.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _loops(args: argparse.Namespace, compiled: bool, tmp: Path) -> list[dict]:
    from spikewatch import AdamW, Watch

    ex = _example()
    loops = []
    for watched in (False, True):
        torch.manual_seed(0)
        gpt = ex.GPT(args.d_model, args.layers, 4, args.seq_len).train()
        model = torch.compile(gpt) if compiled else gpt
        kind = AdamW if watched else torch.optim.AdamW
        opt = kind(gpt.parameters(), lr=3e-3, betas=(0.9, 0.95))
        cosine = lambda s: 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / args.steps)))  # noqa: E731
        sched = torch.optim.lr_scheduler.LambdaLR(opt, cosine)
        watch = None
        if watched:
            watch = Watch(
                gpt,
                opt,
                sched,
                grad_clip=1.0,
                max_steps=args.steps,
                checkpoint_every=25,
                db=f"sqlite:///{tmp}/bench.db",
                run_dir=tmp / f"run-{'c' if compiled else 'e'}",
                settings=json.loads(args.settings),
            )
            watch.open()
            gpt.use_recorder(watch.attn)
        loops.append(dict(model=model, opt=opt, sched=sched, watch=watch, times=[]))
    return loops


def _step(loop: dict, x: torch.Tensor, y: torch.Tensor, i: int) -> None:
    watch = loop["watch"]
    if watch is not None:
        watch.begin_step(i)
    loss = loop["model"](x, y)
    loss.backward()
    if watch is not None:
        watch.step(loss)
    else:
        plain_update(loop["model"], loop["opt"], loop["sched"])


def measure(args: argparse.Namespace, compiled: bool) -> dict[str, float]:
    from spikewatch.corpus import text_corpus, windows

    train, _ = text_corpus()
    batches = [windows(train, i, args.batch_size, args.seq_len) for i in range(args.steps)]
    with tempfile.TemporaryDirectory() as tmp:
        torch._dynamo.reset()
        loops = _loops(args, compiled, Path(tmp))
        start = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        graphs = []
        for loop in loops:  # the first step of each alone: its compile time, its graphs
            before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
            t0 = time.perf_counter()
            _step(loop, *batches[0], 0)
            loop["compile_s"] = time.perf_counter() - t0
            graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"] - before)
        for i in range(1, args.steps):
            for loop in loops if i % 2 else loops[::-1]:
                t0 = time.perf_counter()
                _step(loop, *batches[i], i)
                loop["times"].append(time.perf_counter() - t0)
        after = torch._dynamo.utils.counters["stats"]["unique_graphs"] - start
        for loop in loops:
            if loop["watch"] is not None:
                loop["watch"].close()
    off, on = (median(loop["times"][WARM:]) for loop in loops)
    print(
        f"{'compiled' if compiled else 'eager'}: without {off * 1e3:.1f} ms, with {on * 1e3:.1f}"
        f" ms a step; first step {loops[0]['compile_s']:.1f} s / {loops[1]['compile_s']:.1f} s;"
        f" graphs {graphs} (+{after - sum(graphs)} later)"
    )
    return {
        "ratio": off / on,
        "compile_s_without": loops[0]["compile_s"],
        "compile_s_with": loops[1]["compile_s"],
        "graphs_without": graphs[0],
        "graphs_with": graphs[1],
        "graphs_later": after - sum(graphs),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--modes", default="compiled,eager")
    ap.add_argument("--settings", default="{}", help="WatchSettings as JSON (parts off, say)")
    allocator_flag(ap)
    args = ap.parse_args()
    quiet_one_thread(args)
    out: dict[str, float] = {}
    for mode in args.modes.split(","):
        r = measure(args, compiled=mode == "compiled")
        out[f"{mode}_ratio"] = r.pop("ratio")
        if mode == "compiled":
            out.update(r)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
