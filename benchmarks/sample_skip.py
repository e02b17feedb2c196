"""Skipping samples instead of batches (issue 39), on a fault set where a few rows of each
poisoned batch are bad and the rest are clean.

`tiny_cpu` (d=64, B=16, T=64), `--steps` steps; batches `--at` .. `--at + 9` have their first K
rows' labels shifted by one byte (K = 1..4 of 16), every guard default on. Each K is trained
twice, the rollback skipping whole batches (`guard.skip_samples=false`) and skipping only the
rows the attribution names (the default), and a clean run once. Per K: whether a rollback
happened, precision and recall of the named rows against the spoilt rows of the batches the
rollback measured, the share of the clean rows in those batches that the sample skip trains
on and the batch skip throws away ("tokens kept"), and the final validation loss of each.

    python benchmarks/sample_skip.py [--steps 300] [--at 150] [--rows 1,2,3,4] [--jobs 2]
        [--seeds 0,1,2]   (with several: each K's val difference, samples minus batches, per seed)

Last line: {"rows_K": {"precision", "recall", "tokens_kept", "val_samples", "val_batches",
"val_clean", "rollbacks"}, ...}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _run(job: tuple[int | None, bool, int, int, str, int]) -> dict:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from spikewatch.trainer.builtin.loop import fit
    from spikewatch.trainer.config import load_config

    rows, samples, steps, at, root, seed = job
    over = [f"train.max_steps={steps}", "train.progress=false", "checkpoint.interval=10"]
    over.append(f"train.seed={seed}")
    over.append(f"eval.interval={steps}")
    if rows is not None:
        over.append(f'faults=[{{kind="shifted_labels", start={at}, length=10, rows={rows}}}]')
    if not samples:
        over.append("guard.skip_samples=false")
    name = "clean" if rows is None else f"r{rows}-{'samples' if samples else 'batches'}"
    name += f"-s{seed}"
    r = fit(load_config("tiny_cpu", over), run_dir=Path(root) / name)
    return {
        "rows": rows,
        "seed": seed,
        "samples": samples,
        "val": r.final_val_loss,
        "interventions": r.interventions,
    }


def _scores(rows: int, at: int, batch: int, interventions: list[dict]) -> dict:
    """Precision / recall of the named rows, and the clean rows kept, over every rollback."""
    named, truth, clean, measured = set(), set(), 0, 0
    for i in interventions:
        if i["kind"] != "rollback" or "attribution" not in i:
            continue
        lo, hi = (i.get("batches_kept") or i["skip_ranges"])[0]
        named |= {(s["batch"], s["row"]) for s in i.get("samples", [])}
        spoilt = {(b, r) for b in range(max(lo, at), min(hi, at + 10)) for r in range(rows)}
        truth |= spoilt
        measured += (hi - lo) * batch
        clean += (hi - lo) * batch - len(spoilt)
    tp = len(named & truth)
    kept = (clean - len(named - truth)) / clean if clean else None
    return {
        "precision": tp / len(named) if named else None,
        "recall": tp / len(truth) if truth else None,
        "tokens_kept": kept,
        "rows_measured": measured,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--at", type=int, default=150)
    ap.add_argument("--rows", default="1,2,3,4")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--seeds", default="0", help="train.seed values; the table is the first's")
    args = ap.parse_args()
    ks = [int(k) for k in args.rows.split(",")]
    seeds = [int(x) for x in args.seeds.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        jobs = []
        for seed in seeds:
            jobs += [(None, True, args.steps, args.at, tmp, seed)]
            jobs += [(k, s, args.steps, args.at, tmp, seed) for k in ks for s in (True, False)]
        with ProcessPoolExecutor(args.jobs) as pool:
            every = list(pool.map(_run, jobs))
    if len(seeds) > 1:  # samples skipped minus batches skipped, final val, per K over seeds
        for k in ks:
            diffs = [
                next(d for d in every if d["rows"] == k and d["samples"] and d["seed"] == s)["val"]
                - next(d for d in every if d["rows"] == k and not d["samples"] and d["seed"] == s)[
                    "val"
                ]
                for s in seeds
            ]
            mean, spread = statistics.mean(diffs), statistics.stdev(diffs)
            print(f"K={k}: val(samples) - val(batches) per seed {[round(d, 4) for d in diffs]}, "
                  f"mean {mean:+.4f} (sd {spread:.4f})")  # fmt: skip
    done = [d for d in every if d["seed"] == seeds[0]]
    clean = done[0]["val"]
    out: dict[str, dict] = {}
    cols = "bad rows of 16 | rollbacks | precision | recall | tokens kept | val samples"
    print(f"| {cols} | val batches | val clean |")
    print("|---|---|---|---|---|---|---|---|")
    for k in ks:
        smp = next(d for d in done if d["rows"] == k and d["samples"])
        bat = next(d for d in done if d["rows"] == k and not d["samples"])
        sc = _scores(k, args.at, 16, smp["interventions"])
        rb = sum(i["kind"] == "rollback" for i in smp["interventions"])
        row = {
            **sc,
            "val_samples": smp["val"],
            "val_batches": bat["val"],
            "val_clean": clean,
            "rollbacks": rb,
        }
        out[f"rows_{k}"] = row
        fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
        cells = " | ".join(fmt(sc[c]) for c in ("precision", "recall", "tokens_kept"))
        print(f"| {k} | {rb} | {cells} | {smp['val']:.4f} | {bat['val']:.4f} | {clean:.4f} |")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
