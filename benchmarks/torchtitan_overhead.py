"""torchtitan's Llama 3 debug model on a CPU, one process: throughput with spikewatch over
without (issue 48's CPU figure, goal >= 0.95). Both run torchtitan's own entry point,
`python -m torchtitan.train`, through the tests' CPU shim (tests/spikewatch/titan_cpu.py): the
plain `Trainer` (`--config debug_cpu_plain`) and `SpikewatchTrainer` (`--config debug_cpu`,
every probe on, the store in SQLite, host-memory snapshots every 25 steps). Throughput is
torchtitan's own `tps` (tokens per second) of its log lines after the first 20 steps (compile
and warm-up excluded), the median over each run; repetitions alternate which variant goes
first, and the ratio is of the medians over repetitions.

    python benchmarks/torchtitan_overhead.py [--reps 3] [--steps 100] [--seq-len 256]

Last line: {"torchtitan_ratio": r, "tps_without": t, "tps_with": t, "load_avg": l, ...}.
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
TPS = re.compile(r"step:\s+(\d+).*?tps:\s+([\d,]+)")


def run(config: str, steps: int, seq_len: int, work: Path) -> float:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
        "-m", "torchtitan.train", "--module", "tests.spikewatch.titan_cpu", "--config", config,
        "--dump_folder", str(work / "out"), "--training.steps", str(steps),
        "--training.seq_len", str(seq_len), "--metrics.log_freq", "5",
        "--spikewatch.db", f"sqlite:///{work / 'x.db'}",
    ]  # fmt: skip
    if config.endswith("_plain"):
        cmd = cmd[: cmd.index("--spikewatch.db")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, check=True)
    found = [
        float(tps.replace(",", ""))
        for step, tps in TPS.findall(done.stdout + done.stderr)
        if int(step) > 20
    ]
    if not found:
        raise RuntimeError(f"{config}: no throughput in its log")
    return statistics.median(found)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--seq-len", type=int, default=256)
    args = p.parse_args()
    without, with_ = [], []
    for rep in range(args.reps):
        order = (
            ["debug_cpu_plain", "debug_cpu"] if rep % 2 == 0 else ["debug_cpu", "debug_cpu_plain"]
        )
        for config in order:
            with tempfile.TemporaryDirectory() as tmp:
                tps = run(config, args.steps, args.seq_len, Path(tmp))
            (without if config.endswith("_plain") else with_).append(tps)
            print(f"rep {rep} {config}: {tps:.0f} tokens/s")
    out = {
        "torchtitan_ratio": round(statistics.median(with_) / statistics.median(without), 3),
        "tps_without": round(statistics.median(without)),
        "tps_with": round(statistics.median(with_)),
        "reps": args.reps,
        "steps": args.steps,
        "seq_len": args.seq_len,
        "load_avg": round(os.getloadavg()[0], 2),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
