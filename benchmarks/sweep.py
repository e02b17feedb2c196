"""The ablation study's cost: the default grid's wall time with --jobs 2, as a ratio.

    python benchmarks/sweep.py                 # a 2 x 2 grid of `ablation` at --steps 60
    python benchmarks/sweep.py --full          # the default study: 6 variants x 5 LRs x 300 steps

Runs the same grid with `--jobs 1` and `--jobs 2` into fresh directories (the baseline in the
same run), and prints the wall times, the parallel speedup, and the projected wall time of the
full study (cells x mean cell time / speedup). `--full` runs the whole default study once with
`--jobs 2` instead and reports its measured wall time against the issue's 60 minutes.
Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import machine  # noqa: E402

from spikewatch.trainer.builtin.sweep import run_sweep  # noqa: E402

VARIANTS = ["baseline", "qk_norm", "muonclip", "z_loss", "qk_clip", "softcap"]
LRS = [1e-3, 3e-3, 1e-2, 3e-2, 1e-1]
FULL_STEPS = 300


def timed(root: Path, variants: list[str], lrs: list[float], steps: int, jobs: int) -> float:
    over = [f"train.max_steps={steps}"] if steps != FULL_STEPS else []
    t0 = time.perf_counter()
    result = run_sweep("ablation", variants=variants, lrs=lrs, overrides=over, root=root, jobs=jobs)
    elapsed = time.perf_counter() - t0
    if result.failed:
        raise SystemExit(f"cells failed: {result.failed}")
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--full", action="store_true")
    args = ap.parse_args()
    print("machine:", json.dumps(machine()))
    with tempfile.TemporaryDirectory() as tmp:
        if args.full:
            wall = timed(Path(tmp) / "full", VARIANTS, LRS, FULL_STEPS, 2)
            out = {"full_study_min": wall / 60, "ratio_to_60_min": wall / 3600}
        else:
            grid = (["baseline", "qk_norm"], [1e-2, 1e-1])
            seq = timed(Path(tmp) / "j1", *grid, args.steps, 1)
            par = timed(Path(tmp) / "j2", *grid, args.steps, 2)
            per_cell = seq / 4 * FULL_STEPS / args.steps  # a cell's time scales with its steps
            projected = len(VARIANTS) * len(LRS) * per_cell / (seq / par) / 60
            print(f"jobs 1: {seq:.0f} s, jobs 2: {par:.0f} s for 4 cells of {args.steps} steps")
            out = {
                "speedup_jobs2": seq / par,
                "projected_full_study_min": projected,
                "ratio_to_60_min": projected / 60,
            }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
