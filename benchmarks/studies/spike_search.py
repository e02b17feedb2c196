"""The genuine-spike search of issue 19: does the baseline spike by itself, and under what recipe?

    python benchmarks/studies/spike_search.py --root runs/spikes            # run (or resume) it
    python benchmarks/studies/spike_search.py --root runs/spikes --report   # the table only

Each arm is the `ablation` config (2 layers, d=128, 4 heads, byte-level, T=128, B=16) with the
`baseline` variant and a set of destabilising knobs, run for `--steps` steps at each learning rate
of `--lr`, with no injected fault, no checkpoints and so no rollback: the online detector records
what happens and nothing intervenes. Every probe runs every step (`probes.state_interval=1`), so
the early-warning study (`benchmarks/studies/early_warning.py`) can read the same runs.

Each arm is its own sweep group (`spike-search-<arm>`), so the grid resumes where it stopped and
each arm's census is `spikewatch sweep-report spike-search-<arm> --markdown`. The table printed
at the end has, per arm and learning rate: the census (loss spikes, gradient spikes, non-finite
steps per 1k steps), the final validation loss and the wall time of the run.
Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # the other studies
sys.path.insert(0, str(Path(__file__).parents[1]))  # benchmarks/_common
import numpy as np  # noqa: E402
from _common import machine  # noqa: E402
from numpy.lib.stride_tricks import sliding_window_view  # noqa: E402

from spikewatch.observatory import metric_names as M  # noqa: E402
from spikewatch.observatory import store  # noqa: E402
from spikewatch.observatory.reports.sweeps import sweep_report  # noqa: E402
from spikewatch.observatory.store.db import resolve_url  # noqa: E402
from spikewatch.trainer.builtin.sweep import run_sweep  # noqa: E402

COMMON = [
    "probes.state_interval=1",
    "eval.interval=100",
    "guard.same_step.enabled=false",
    "guard.rollback=false",
]
# The destabilisers, cumulative from the top: "max" is every one of them at once.
MAX = [
    "optim.betas=[0.9,0.999]",
    "optim.grad_clip=none",
    "schedule.warmup_steps=0",
    "optim.weight_decay=0",
    "schedule.name=constant",
]
LRS = [1e-2, 3e-2]
ARMS: dict[str, tuple[list[str], list[float]]] = {  # arm: (knobs, learning rates)
    "max": (MAX, LRS),
    "max-eps": ([*MAX, "optim.eps=1e-12"], LRS),
    "max-b4": ([*MAX, "data.batch_size=4"], LRS),
    "b2-noclip": (MAX[:2], LRS),
    "noclip": (MAX[1:2], LRS),
    "long": ([], LRS),
    "max-4l256": ([*MAX, "model.n_layer=4", "model.d_model=256", "model.n_head=8"], LRS),
    "max-lr0.1": (MAX, [1e-1]),
}


def group_of(arm: str) -> str:
    return f"spike-search-{arm}"


def run(args: argparse.Namespace) -> dict[str, float]:
    walls = {}
    for arm in args.arms:
        t0 = time.perf_counter()
        result = run_sweep(
            "ablation",
            variants=["baseline"],
            lrs=ARMS[arm][1],
            overrides=[f"train.max_steps={args.steps}", *COMMON, *ARMS[arm][0]],
            root=args.root,
            group=group_of(arm),
            db_url=args.db,
            jobs=args.jobs,
        )
        walls[arm] = time.perf_counter() - t0
        print(f"{arm}: {walls[arm]:.0f} s, cells {result.cells}", flush=True)
    return walls


def largest_excursion(session, run_id: str) -> tuple[float, int] | None:
    """The largest ratio of a step's loss to the median of the 50 steps before it, and its step:
    how close the run came to a loss spike, whether or not the detector called one."""
    data = store.series(session, run_id=run_id, metric=M.LOSS, buckets=20_000)
    if not data:
        return None
    buckets = [b for d in data for b in d.buckets if b.max_value is not None]
    v = np.array([b.max_value for b in buckets])
    if len(v) <= 50:
        return None
    med = np.median(sliding_window_view(v[:-1], 50), axis=1)
    ratio = v[50:] / med
    i = int(np.nanargmax(ratio))
    return float(ratio[i]), int(buckets[50 + i].start)


def report(args: argparse.Namespace) -> list[dict]:
    url = resolve_url(args.db or f"sqlite:///{Path(args.root).resolve() / 'spikewatch.db'}")
    rows = []
    with store.session_factory(url)() as session:
        for arm in args.arms:
            for c in sweep_report(session, group_of(arm)).cells:
                exc = largest_excursion(session, c.run_id) if c.run_id else None
                rows.append(
                    {
                        "arm": arm,
                        "knobs": " ".join(ARMS[arm][0]) or "(ablation defaults)",
                        "lr": c.lr,
                        "status": c.status,
                        "steps": c.last_step,
                        "loss_spikes_per_1k": c.census.loss_spikes_per_1k,
                        "grad_spikes_per_1k": c.census.grad_spikes_per_1k,
                        "nonfinite_per_1k": c.census.nonfinite_per_1k,
                        "final_val": c.final_val,
                        "peak_attn": c.peak_attn,
                        "largest_excursion": exc[0] if exc else None,
                        "excursion_step": exc[1] if exc else None,
                    }
                )
    print(
        "| arm | lr | steps | loss spikes/1k | grad spikes/1k | non-finite/1k | val | peak logit "
        "| largest loss / median of 50 before (step) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        val = "–" if r["final_val"] is None else f"{r['final_val']:.3f}"
        peak = "–" if r["peak_attn"] is None else f"{r['peak_attn']:.0f}"
        exc = r["largest_excursion"]
        exc_s = "–" if exc is None else f"{exc:.2f} ({r['excursion_step']})"
        print(
            f"| {r['arm']} | {r['lr']:g} | {r['steps']} | {_f(r['loss_spikes_per_1k'])} | "
            f"{_f(r['grad_spikes_per_1k'])} | {_f(r['nonfinite_per_1k'])} | {val} | {peak} | "
            f"{exc_s} |"
        )
    return rows


def _f(v: float | None) -> str:
    return "–" if v is None else f"{v:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="runs/spikes")
    ap.add_argument("--db", default=None)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--arms", type=lambda s: s.split(","), default=list(ARMS))
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--report", action="store_true", help="print the table of what is stored")
    args = ap.parse_args()
    print("machine:", json.dumps(machine()))
    walls = {} if args.report else run(args)
    rows = report(args)
    print(json.dumps({"wall_s": walls, "runs": rows}))


if __name__ == "__main__":
    main()
