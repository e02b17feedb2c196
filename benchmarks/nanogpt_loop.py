"""The time per iteration of examples/nanogpt/train.py (a loop in nanoGPT's shape) against
train_spikewatch.py (the same loop with the Watch), on this machine's CPU, eager.

Runs the two in turn, A B B A, each `--rounds` times, as separate processes (one thread each),
and takes the median of every iteration's own time as the loop prints it (`--log_interval=1`),
leaving out the first 10 (warm-up) and the evaluations. Prints one JSON line: the medians and
their ratio (with / without).

    python benchmarks/nanogpt_loop.py [--iters 200] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LOOP = REPO / "examples" / "nanogpt"
TIME = re.compile(r"^iter (\d+): loss [\d.]+, time ([\d.]+)ms$")


def one(script: str, iters: int, tmp: Path) -> list[float]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SPIKEWATCH_DB_URL": f"sqlite:///{tmp}/r.db"}
    out = subprocess.run(
        [sys.executable, str(LOOP / script), f"--max_iters={iters}", "--log_interval=1",
         f"--eval_interval={iters + 1}", f"--out_dir={tmp}/{script}"],
        capture_output=True, text=True, env=env, check=True,
    )  # fmt: skip
    times = []
    for line in out.stdout.splitlines():
        m = TIME.match(line)
        if m and int(m.group(1)) >= 10:
            times.append(float(m.group(2)))
    return times


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args(argv)
    bare: list[float] = []
    watched: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            order = ("train.py", "train_spikewatch.py")
            for script in order if i % 2 == 0 else order[::-1]:
                into = bare if script == "train.py" else watched
                into += one(script, args.iters, Path(tmp) / f"{i}")
    out = {
        "iters": args.iters,
        "rounds": args.rounds,
        "ms_per_iter_bare": round(statistics.median(bare), 2),
        "ms_per_iter_watched": round(statistics.median(watched), 2),
    }
    out["time_ratio"] = round(out["ms_per_iter_watched"] / out["ms_per_iter_bare"], 3)
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
