"""Early warning, measured (issue 19): which signal moves before the loss does, how early, and
how often it cries wolf.

    python benchmarks/studies/early_warning.py --root runs/warn             # run, then the tables
    python benchmarks/studies/early_warning.py --root runs/warn --report    # the tables only
    python benchmarks/studies/early_warning.py --root runs/warn --clean-root runs/spikes  # + grid

**Spikes.** The genuine-spike search (benchmarks/studies/spike_search.py) found none on this model,
so the spikes are developing faults: the `ablation` config (lr 3e-3) with an `lr_ramp` fault that
multiplies the learning rate by 1000^(i/100) over batches 250-349, run with detection only (no
rollback, no same-step tier), one run per seed. A spike's **loss onset** is the onset the online
detector gave its first `spike` verdict (or the first non-finite step, if earlier).

**Clean runs** are runs with no loss spike and no non-finite step: the same config without the
fault, 2000 steps (`warning-clean-2k`), plus, with `--clean-root`, every such run of the
spike-search grid (high learning rates, no clipping, beta2 0.999: rough runs that never spike).

**Signals.** Each is a rule on a probe's series, layer by layer; a warning *episode* starts at a
step where the rule holds and did not hold on the step before. The three the detector raises
online (observatory/detect.py) are read from the warnings the runs recorded; the others are
computed here from the stored series with the same episode rule. A spike is **warned** by a
signal when one of its episodes starts within `--horizon` (100) steps before the loss onset,
onset included; the **lead** is the onset minus the first such start. **False warnings** are
episodes on clean runs, per 10k steps.

**Recovery.** The same ramp with rollback on (checkpoints every 25 steps) three times per seed:
with the detector's warnings (each pins the newest checkpoint as a pre-spike anchor), with them
switched off, and with `guard.policy.warning_horizon=100` (the rollback goes to before the
earliest warning episode within 100 steps of the onset, and skips from there); the table
compares rollbacks, steps redone, halts and the final validation loss, against the same runs
without the fault (`warning-clean`, 500 steps).
Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # the other studies
sys.path.insert(0, str(Path(__file__).parents[1]))  # benchmarks/_common
import numpy as np  # noqa: E402
from _common import machine  # noqa: E402
from sqlalchemy import select  # noqa: E402

from spikewatch.observatory import metric_names as M  # noqa: E402
from spikewatch.observatory import store  # noqa: E402
from spikewatch.observatory.reports.census import grad_spike_mask  # noqa: E402
from spikewatch.observatory.reports.sweeps import list_sweeps, sweep_report  # noqa: E402
from spikewatch.observatory.store import across_runs as across  # noqa: E402
from spikewatch.observatory.store.db import resolve_url  # noqa: E402
from spikewatch.observatory.store.models import Event  # noqa: E402
from spikewatch.trainer.builtin.sweep import run_sweep  # noqa: E402

STEPS = 500
LR = 3e-3
RAMP = 'faults=[{kind="lr_ramp", start=250, length=100, factor=1000}]'
WATCH_ONLY = ["guard.same_step.enabled=false", "guard.rollback=false"]
COMMON = [f"train.max_steps={STEPS}", "probes.state_interval=1", "eval.interval=50"]
NO_WARNINGS = [
    "guard.detector.grad_threshold=1e9",
    "guard.detector.update_jump=1e9",
    "guard.detector.attn_warn=none",
]
GROUPS: dict[str, list[str]] = {
    "warning-ramp": [*COMMON, *WATCH_ONLY, RAMP],
    "warning-clean": [*COMMON, *WATCH_ONLY],  # the reference of the recovery table
    "warning-clean-2k": [*COMMON, *WATCH_ONLY, "train.max_steps=2000"],
    "recovery-ramp-warnings": [*COMMON, RAMP, "checkpoint.interval=25"],
    "recovery-ramp-no-warnings": [*COMMON, RAMP, "checkpoint.interval=25", *NO_WARNINGS],
    "recovery-ramp-warning-target": [
        *COMMON,
        RAMP,
        "checkpoint.interval=25",
        "guard.policy.warning_horizon=100",
    ],
}
SEEDS = {"warning-ramp": 6, "warning-clean": 3, "warning-clean-2k": 3}
SEEDS["recovery-ramp-warnings"] = 4
SEEDS["recovery-ramp-no-warnings"] = SEEDS["recovery-ramp-warnings"]
SEEDS["recovery-ramp-warning-target"] = SEEDS["recovery-ramp-warnings"]


@dataclass
class RunData:
    run_id: str
    steps: int
    onset: int | None  # loss onset of the first spike (or first non-finite step)
    detected: int | None
    episodes: dict[str, set[int]] = field(default_factory=dict)  # signal -> episode starts


def episode_starts(steps: np.ndarray, warn: np.ndarray) -> set[int]:
    """Steps where the rule holds and did not on the previous recorded step."""
    prev = np.concatenate([[False], warn[:-1]])
    return set(steps[warn & ~prev].tolist())


def jump(factor: float, window: int = 100, history: int = 20) -> Callable:
    return lambda v: grad_spike_mask(v, factor=factor, window=window, history=history)


def rise(delta: float, window: int = 100, history: int = 20) -> Callable:
    """The value exceeds the median of its previous `window` values by `delta` (absolute)."""

    def rule(v: np.ndarray) -> np.ndarray:
        out = np.zeros(len(v), bool)
        for i in range(history, len(v)):
            prev = v[max(0, i - window) : i]
            prev = prev[np.isfinite(prev)]
            out[i] = len(prev) >= history and v[i] > np.median(prev) + delta
        return out

    return rule


def drop(factor: float, window: int = 100, history: int = 20):
    """The value falls below its previous `window` values' median / `factor`."""

    def rule(v: np.ndarray) -> np.ndarray:
        out = np.zeros(len(v), bool)
        for i in range(history, len(v)):
            prev = v[max(0, i - window) : i]
            prev = prev[np.isfinite(prev)]
            out[i] = len(prev) >= history and v[i] < np.median(prev) / factor
        return out

    return rule


# Offline signals: (name, per-layer stat or scalar metric, rule, rule in words)
OFFLINE: list[tuple[str, str, Callable, str]] = [
    ("layer grad norm 10x", M.STAT_GRAD_NORM, jump(10.0), "a layer's grad norm > 10x its median"),
    ("layer grad norm 3x", M.STAT_GRAD_NORM, jump(3.0), "a layer's grad norm > 3x its median"),
    ("update/param ratio 3x", M.STAT_UPDATE_RATIO, jump(3.0), "a layer's ratio > 3x its median"),
    (
        "Adam v collapse",
        M.STAT_ADAM_V_TINY_FRAC,
        rise(0.05),
        "a layer's fraction of v < 1e-16 rises 0.05 above its median",
    ),
    ("attention logit 2x", M.STAT_ATTN_MAX, jump(2.0), "a layer's max logit > 2x its median"),
    ("output logit 2x", M.LOGIT_MAX, jump(2.0), "max output logit > 2x its median"),
]
ONLINE = {  # the detector's own warnings, by the signal name its verdicts carry
    "detector: grad norm z > 12": lambda s: s == M.STAT_GRAD_NORM,
    "detector: update norm 3x": lambda s: s.endswith(M.STAT_UPDATE_NORM),
    "detector: attention logit > 100": lambda s: s.endswith(M.STAT_ATTN_MAX),
}


def load(session, run_id: str, steps: int) -> RunData:
    rows = across.runs_by_key(session, [run_id])
    pk = rows[run_id].id
    events = session.execute(
        select(Event.step, Event.kind, Event.data).where(Event.run_id == pk).order_by(Event.step)
    ).all()
    starts = [
        (int(d.get("onset_step", step)), step)
        for step, kind, d in events
        if kind == "spike" or (kind == "nonfinite")
    ]
    onset, detected = min(starts) if starts else (None, None)
    data = RunData(run_id, steps, onset, detected)
    for name, match in ONLINE.items():
        data.episodes[name] = {
            step
            for step, kind, d in events
            if kind == "note" and d.get("kind") == "warning" and match(str(d.get("signal", "")))
        }
    tree_of = across.trees(session, [pk])
    for name, stat, rule, _ in OFFLINE:
        found: set[int] = set()
        if stat.startswith("train/"):
            series = store.series(session, run_id=run_id, metric=stat, buckets=20_000)
            b = [x for d in series for x in d.buckets if x.max_value is not None]
            layers = {stat: (np.array([x.start for x in b]), np.array([x.max_value for x in b]))}
        else:
            layers = across.layer_values(session, [pk], tree_of, stat)[pk]
        for st, v in layers.values():
            if len(v):
                found |= episode_starts(st, rule(v))
        data.episodes[name] = found
    return data


def runs_of(session, groups: list[str]) -> list[RunData]:
    out = []
    for g in groups:
        try:
            cells = sweep_report(session, g).cells
        except store.NotFoundError:  # not run yet
            continue
        for c in cells:
            if c.run_id and c.last_step:
                out.append(load(session, c.run_id, c.last_step))
    return out


def warning_table(
    spiky: list[RunData], cleans: dict[str, list[RunData]], horizon: int
) -> list[dict]:
    rows = []
    for name in [*ONLINE, *(o[0] for o in OFFLINE)]:
        leads = []
        for r in spiky:
            assert r.onset is not None
            early = [s for s in r.episodes[name] if r.onset - horizon <= s <= r.onset]
            if early:
                leads.append(r.onset - min(early))
        row = {
            "signal": name,
            "warned": len(leads),
            "spikes": len(spiky),
            "median_lead": statistics.median(leads) if leads else None,
        }
        for kind, clean in cleans.items():
            steps = sum(r.steps for r in clean)
            false = sum(len(r.episodes[name]) for r in clean)
            row[f"false_per_10k_{kind}"] = 1e4 * false / steps if steps else None
        rows.append(row)
    return rows


def recovery_table(session) -> list[dict]:
    rows = []
    for g in ["warning-clean", *(g for g in GROUPS if g.startswith("recovery-"))]:
        try:
            cells = [c for c in sweep_report(session, g).cells if c.run_id]
        except store.NotFoundError:  # not run yet
            continue
        vals = [c.final_val for c in cells if c.final_val is not None]
        rows.append(
            {
                "arm": g,
                "runs": len(cells),
                "halted": sum(c.status == "halted" for c in cells),
                "rollbacks": sum(c.rollbacks for c in cells),
                "steps_redone": sum(c.recovery_steps for c in cells),
                "val_mean": statistics.mean(vals) if vals else None,
                "val_lo": min(vals) if vals else None,
                "val_hi": max(vals) if vals else None,
            }
        )
    return rows


def _f(v: float | None, fmt: str = ".1f") -> str:
    return "–" if v is None else format(v, fmt)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="runs/warn")
    ap.add_argument("--clean-root", default=None, help="also count this store's clean runs")
    ap.add_argument("--horizon", type=int, default=100)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--report", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="one seed of 60 steps a group, d=32")
    args = ap.parse_args()
    print("machine:", json.dumps(machine()))
    url = resolve_url(f"sqlite:///{Path(args.root).resolve() / 'spikewatch.db'}")
    groups, seeds = GROUPS, SEEDS
    if args.smoke:  # the study's whole path at a tiny size: its tables, not its findings
        tiny = ["train.max_steps=60", "model.d_model=32", "eval.interval=30"]
        ramp = 'faults=[{kind="lr_ramp", start=20, length=20, factor=1000}]'
        groups = {g: [ramp if o == RAMP else o for o in over] + tiny for g, over in GROUPS.items()}
        seeds = dict.fromkeys(SEEDS, 1)
    if not args.report:
        for group, over in groups.items():
            run_sweep(
                "ablation",
                variants=["baseline"],
                lrs=[LR],
                seeds=list(range(seeds[group])),
                overrides=over,
                root=args.root,
                group=group,
                db_url=url,
                jobs=args.jobs,
            )
    with store.session_factory(url)() as session:
        spiky = [r for r in runs_of(session, ["warning-ramp"]) if r.onset is not None]
        cleans = {"default": [r for r in runs_of(session, ["warning-clean-2k"]) if r.onset is None]}
        recovery = recovery_table(session)
    if args.clean_root:
        other = resolve_url(f"sqlite:///{Path(args.clean_root).resolve() / 'spikewatch.db'}")
        with store.session_factory(other)() as session:
            groups = [s.name for s in list_sweeps(session)]
            cleans["search"] = [r for r in runs_of(session, groups) if r.onset is None]
    table = warning_table(spiky, cleans, args.horizon)
    print(f"spikes: {len(spiky)}, loss onsets at steps {[r.onset for r in spiky]}")
    for kind, clean in cleans.items():
        print(f"clean runs ({kind}): {len(clean)}, {sum(r.steps for r in clean)} steps")
    head = " | ".join(f"false warnings per 10k clean steps ({kind})" for kind in cleans)
    print(f"| signal | spikes warned | median lead (steps) | {head} |")
    print("|---|---:|---:|" + "---:|" * len(cleans))
    for row in table:
        rates = " | ".join(_f(row[f"false_per_10k_{kind}"]) for kind in cleans)
        print(
            f"| {row['signal']} | {row['warned']}/{row['spikes']} | {_f(row['median_lead'])} | "
            f"{rates} |"
        )
    print()
    print("| arm | runs | halted | rollbacks | steps redone | final val loss (lowest-highest) |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in recovery:
        print(
            f"| {r['arm']} | {r['runs']} | {r['halted']} | {r['rollbacks']} | "
            f"{r['steps_redone']} | {_f(r['val_mean'], '.3f')} "
            f"({_f(r['val_lo'], '.3f')}-{_f(r['val_hi'], '.3f')}) |"
        )
    print(json.dumps({"warnings": table, "recovery": recovery}))


if __name__ == "__main__":
    main()
