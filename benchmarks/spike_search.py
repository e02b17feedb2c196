"""The genuine-spike search of issue 19: does the baseline spike by itself, and under what recipe?

    python benchmarks/spike_search.py --root runs/spikes            # run (or resume) the grid
    python benchmarks/spike_search.py --root runs/spikes --report   # the table only

Each arm is the `ablation` config (2 layers, d=128, 4 heads, byte-level, T=128, B=16) with the
`baseline` variant and a set of destabilising knobs, run for `--steps` steps at each learning rate
of `--lr`, with no injected fault, no checkpoints and so no rollback: the online detector records
what happens and nothing intervenes. Every probe runs every step (`probes.state_interval=1`), so
the early-warning study (`benchmarks/early_warning.py`) can read the same runs.

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

sys.path.insert(0, str(Path(__file__).parent))
from _common import machine  # noqa: E402

from observatory.db import resolve_url  # noqa: E402
from observatory.store import session_factory  # noqa: E402
from observatory.sweeps import sweep_report  # noqa: E402
from trainer.sweep import run_sweep  # noqa: E402

COMMON = [
    "probes.state_interval=1",
    "eval.interval=100",
    "watch.same_step.enabled=false",
    "watch.rollback=false",
]
# The destabilisers, cumulative from the top: "max" is every one of them at once.
MAX = [
    "optim.betas=[0.9,0.999]",
    "optim.grad_clip=none",
    "schedule.warmup_steps=0",
    "optim.weight_decay=0",
    "schedule.name=constant",
]
ARMS: dict[str, list[str]] = {
    "max": MAX,
    "max-eps": [*MAX, "optim.eps=1e-12"],
    "max-b4": [*MAX, "data.batch_size=4"],
    "b2-noclip": MAX[:2],
    "noclip": MAX[1:2],
    "long": [],
    "max-4l256": [*MAX, "model.n_layer=4", "model.d_model=256", "model.n_head=8"],
}
LRS = [1e-2, 3e-2]


def group_of(arm: str) -> str:
    return f"spike-search-{arm}"


def run(args: argparse.Namespace) -> dict[str, float]:
    walls = {}
    for arm in args.arms:
        t0 = time.perf_counter()
        result = run_sweep(
            "ablation",
            variants=["baseline"],
            lrs=args.lr,
            overrides=[f"train.max_steps={args.steps}", *COMMON, *ARMS[arm]],
            root=args.root,
            group=group_of(arm),
            db_url=args.db,
            jobs=args.jobs,
        )
        walls[arm] = time.perf_counter() - t0
        print(f"{arm}: {walls[arm]:.0f} s, cells {result.cells}", flush=True)
    return walls


def report(args: argparse.Namespace) -> list[dict]:
    url = resolve_url(args.db or f"sqlite:///{Path(args.root).resolve() / 'spikewatch.db'}")
    rows = []
    with session_factory(url)() as session:
        for arm in args.arms:
            for c in sweep_report(session, group_of(arm)).cells:
                rows.append(
                    {
                        "arm": arm,
                        "knobs": " ".join(ARMS[arm]) or "(ablation defaults)",
                        "lr": c.lr,
                        "status": c.status,
                        "steps": c.last_step,
                        "loss_spikes_per_1k": c.census.loss_spikes_per_1k,
                        "grad_spikes_per_1k": c.census.grad_spikes_per_1k,
                        "nonfinite_per_1k": c.census.nonfinite_per_1k,
                        "final_val": c.final_val,
                        "peak_attn": c.peak_attn,
                    }
                )
    print(
        "| arm | lr | steps | loss spikes/1k | grad spikes/1k | non-finite/1k | val | peak logit |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        val = "–" if r["final_val"] is None else f"{r['final_val']:.3f}"
        peak = "–" if r["peak_attn"] is None else f"{r['peak_attn']:.0f}"
        print(
            f"| {r['arm']} | {r['lr']:g} | {r['steps']} | {r['loss_spikes_per_1k']:.2f} | "
            f"{r['grad_spikes_per_1k']:.2f} | {r['nonfinite_per_1k']:.2f} | {val} | {peak} |"
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="runs/spikes")
    ap.add_argument("--db", default=None)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--lr", type=lambda s: [float(x) for x in s.split(",")], default=LRS)
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
