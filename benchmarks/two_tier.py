"""Two tiers against the fault set: what the same-step tier absorbs alone, what needs a rollback.

    python benchmarks/two_tier.py [--steps 250] [--at 150] [--jobs 2]

For each fault of the project's fault set (shifted labels, random bytes, an LR bump, a NaN
loss), once isolated (one batch) and once persistent, and for each strategy:

  none        detector records only (non-finite updates are always refused by the loop)
  rollback    the rollback tier alone (the first round's behaviour)
  same_step   the same-step tier alone (trainer/core/same_step.py), no rollback
  both        both tiers (the default)

it trains tiny_cpu with the fault at batch `--at` and reports the same-step refusals, the
rollbacks, the final validation loss and its excess over a clean run of the same config. The
last line is a JSON object with the table's rows.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

FAULTS = {  # name -> (kind, isolated length, persistent length)
    "shifted_labels": ("shifted_labels", 1, 10),
    "random_bytes": ("random_bytes", 1, 10),
    "lr_bump": ("lr_scale", 1, 5),
    "nan": ("nan_loss", 1, 3),
}
STRATEGIES = {
    "none": ["guard.rollback=false", "guard.same_step.enabled=false"],
    "rollback": ["guard.same_step.enabled=false"],
    "same_step": ["guard.rollback=false"],
    "both": [],
}


def _train(args: tuple[list[str], str]) -> dict:
    overrides, run_dir = args
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import logging

    import torch

    from spikewatch.trainer.builtin.loop import fit
    from spikewatch.trainer.config import load_config

    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    r = fit(load_config("tiny_cpu", overrides), run_dir=run_dir)
    kinds = [i["kind"] for i in r.interventions]
    why = [i for i in r.interventions if str(i.get("reason", "")).startswith("same-step")]
    tier = len(why)
    return {
        "val": r.final_val_loss,
        "same_step_refusals": tier,
        "other_skips": kinds.count("skip_update") - tier,
        "rollbacks": kinds.count("rollback"),
        "halted": r.halted is not None,
        "refused": [f"step {i.get('step')}: {i['reason']}" for i in why],  # how far above
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=250)
    ap.add_argument("--at", type=int, default=150)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument(
        "--reads",
        default="same_step",
        help="probes.read orders, comma-separated (same_step,next_step: both, and where the "
        "one-step-late read of a GPU changes an outcome, by how much)",
    )
    args = ap.parse_args()
    reads = args.reads.split(",")
    by_read = {read: _table(args, read) for read in reads}
    if len(reads) > 1:
        _compare(by_read)


def _compare(by_read: dict[str, dict]) -> None:
    (a, ra), (b, rb) = list(by_read.items())[:2]
    print(f"\n{b} against {a}: val loss, rollbacks, same-step refusals")
    print("| fault | shape | strategy | val | rollbacks | refusals |")
    print("|---|---|---|---:|---|---|")
    changed = 0
    for x, y in zip(ra["rows"], rb["rows"], strict=True):
        dv = y["val"] - x["val"]
        same = dv == 0 and (x["rollbacks"], x["same_step_refusals"]) == (
            y["rollbacks"],
            y["same_step_refusals"],
        )
        changed += not same
        print(
            f"| {x['fault']} | {x['shape']} | {x['strategy']} | {dv:+.6f} | "
            f"{x['rollbacks']} -> {y['rollbacks']} | "
            f"{x['same_step_refusals']} -> {y['same_step_refusals']} |"
        )
    worst = max(abs(y["val"] - x["val"]) for x, y in zip(ra["rows"], rb["rows"], strict=True))
    print(json.dumps({"compare": [a, b], "cells_changed": changed, "max_abs_val_change": worst}))


def _table(args: argparse.Namespace, read: str) -> dict:
    base = [
        "train.progress=false",
        f"train.max_steps={args.steps}",
        "checkpoint.interval=10",
        "eval.interval=none",
        "eval.batches=16",
        f"probes.read={read}",
    ]
    cells = [("clean", "-", "both", [])]
    for name, (kind, short, long) in FAULTS.items():
        for shape, n in (("isolated", short), ("persistent", long)):
            fault = f'faults=[{{kind="{kind}", start={args.at}, length={n}}}]'
            for strategy, over in STRATEGIES.items():
                cells.append((name, shape, strategy, [fault, *over]))
    with tempfile.TemporaryDirectory() as tmp, ProcessPoolExecutor(args.jobs) as pool:
        jobs = [([*base, *over], f"{tmp}/{i}") for i, (*_, over) in enumerate(cells)]
        results = list(pool.map(_train, jobs))
    clean = results[0]["val"]
    print(f"probes.read = {read}")
    rows = []
    print(f"clean run: final val loss {clean:.4f}\n")
    print("| fault | shape | strategy | same-step refusals | rollbacks | val loss | excess |")
    print("|---|---|---|---:|---:|---:|---:|")
    for (name, shape, strategy, _), res in zip(cells[1:], results[1:], strict=True):
        row = {"fault": name, "shape": shape, "strategy": strategy, **res}
        row["excess"] = res["val"] - clean
        rows.append(row)
        halt = " (halted)" if res["halted"] else ""
        print(
            f"| {name} | {shape} | {strategy} | {res['same_step_refusals']} | "
            f"{res['rollbacks']}{halt} | {res['val']:.4f} | {row['excess']:+.4f} |"
        )
    both = [r for r in rows if r["strategy"] == "both"]
    absorbed = [
        f"{r['fault']}/{r['shape']}"
        for r in both
        if r["rollbacks"] == 0 and r["same_step_refusals"] > 0
    ]
    nonfinite = [
        f"{r['fault']}/{r['shape']}" for r in both if r["rollbacks"] == 0 and r["other_skips"]
    ]
    rolled = [f"{r['fault']}/{r['shape']}" for r in both if r["rollbacks"] > 0]
    print(f"\nboth tiers: absorbed by the same-step tier alone: {', '.join(absorbed) or '-'}")
    print(
        f"both tiers: refused by the loop as non-finite, no rollback: {', '.join(nonfinite) or '-'}"
    )
    print(f"both tiers: needed a rollback: {', '.join(rolled) or '-'}")
    summary = {"absorbed": absorbed, "nonfinite_refused": nonfinite, "rolled_back": rolled}
    out = {"read": read, "clean_val": clean, **summary, "rows": rows}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
