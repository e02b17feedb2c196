"""Rollback margin and extra skip, measured: which defaults recover best at the least cost.

    python benchmarks/rollback_defaults.py [--margins 1,10,30,100] [--extras 10,50,200]
                                           [--config demo] [--jobs 2]

PaLM restarted about 100 steps before a spike and skipped 200-500 batches; our defaults were
one step and ten batches. On two faults, the demo's (ten batches with shifted labels at batch
280) and an LR bump (one update at 30x the LR at batch 280), every (margin, extra skip) pair
trains the demo config and reports: the final validation loss and its excess over a clean run,
the rollbacks (a spike that came back needs another), the steps trained again (the cost of
going back further) and the batches skipped (data never trained on). The last line is a JSON
object with every row.
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

FAULTS = {
    "demo": '{kind="shifted_labels", start=280, length=10}',
    "lr_bump": '{kind="lr_scale", start=280, length=1, factor=30}',
}


def _train(args: tuple[str, list[str], str]) -> dict:
    config, overrides, run_dir = args
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import logging

    import torch

    from spikewatch.trainer.builtin.loop import fit
    from spikewatch.trainer.config import load_config

    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    r = fit(load_config(config, overrides), run_dir=run_dir)
    rollbacks = [i for i in r.interventions if i["kind"] == "rollback"]
    return {
        "val": r.final_val_loss,
        "rollbacks": len(rollbacks),
        "halted": r.halted is not None,
        "retrained": sum(i["from_step"] - i["to_step"] for i in rollbacks),
        "skipped": sum(e - s for i in rollbacks for s, e in i["skip_ranges"]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="demo")
    ap.add_argument("--margins", default="1,10,30,100")
    ap.add_argument("--extras", default="10,50,200")
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args()
    margins = [int(m) for m in args.margins.split(",")]
    extras = [int(e) for e in args.extras.split(",")]
    base = ["train.progress=false", "guard.classify_cause=false"]
    cells: list[tuple[str, int | None, int | None, list[str]]] = [
        ("clean", None, None, ["faults=[]"])
    ]
    for fault, spec in FAULTS.items():
        for m in margins:
            for e in extras:
                over = [
                    f"faults=[{spec}]",
                    f"guard.policy.margin={m}",
                    f"guard.policy.skip_extra={e}",
                ]
                cells.append((fault, m, e, over))
    with tempfile.TemporaryDirectory() as tmp, ProcessPoolExecutor(args.jobs) as pool:
        jobs = [(args.config, [*base, *over], f"{tmp}/{i}") for i, (*_, over) in enumerate(cells)]
        results = list(pool.map(_train, jobs))
    clean = results[0]["val"]
    print(f"clean {args.config} run: final val loss {clean:.4f}\n")
    print(
        "| fault | margin | extra skip | rollbacks | steps trained again | batches skipped "
        "| val loss | excess |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    rows = []
    for (fault, m, e, _), res in zip(cells[1:], results[1:], strict=True):
        row = {"fault": fault, "margin": m, "skip_extra": e, **res, "excess": res["val"] - clean}
        rows.append(row)
        halt = " (halted)" if res["halted"] else ""
        print(
            f"| {fault} | {m} | {e} | {res['rollbacks']}{halt} | {res['retrained']} | "
            f"{res['skipped']} | {res['val']:.4f} | {row['excess']:+.4f} |"
        )
    print(json.dumps({"config": args.config, "clean_val": clean, "rows": rows}))


if __name__ == "__main__":
    main()
