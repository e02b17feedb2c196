"""Data or device (issue 39): ten injected faults of each kind on rank 1 of two, each rolled
back and classified by the replay.

`tiny_cpu` under `torchrun --nproc_per_node=2` (DDP, gloo). Run A: ten device faults
(`bit_flip`: rank 1's output logits computed wrong the first time a batch is trained, five
batches in a row so that the spike outlasts the same-step tier), 100 batches apart. Run B: the
same with `bad_device` (rank 1's device wrong every time it computes those batches: its replay
agrees with it, only rank 0 computing rank 1's rows tells). Run C: the same positions with rank
1's shard's labels shifted (a data fault). The policy's repeat window
is shortened to 50 steps so that each fault is a first spike (classification is what is
measured here, not escalation). Per run: the rollbacks, their causes and named ranks, and the
suspect-device flags; the replay's cost per rollback.

    python benchmarks/device_or_data.py [--faults 10] [--spacing 100]

Last line: {"device_right": n, "bad_device_right": n, "data_right": n, "faults": n, and per run
the checks that named the device and the suspects flagged, "replay_s_median": s}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _run(kind: str, starts: list[int], steps: int, out: Path) -> list[dict]:
    faults = ", ".join(f'{{kind="{kind}", start={s}, length=5, rank=1}}' for s in starts)
    over = [
        "distributed.strategy=ddp",
        f"train.max_steps={steps}",
        "train.progress=false",
        "checkpoint.interval=10",
        "eval.interval=none",
        "guard.policy.repeat_window=50",
        f"faults=[{faults}]",
    ]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    cmd += [
        "-m",
        "spikewatch.trainer.cli",
        "train",
        "tiny_cpu",
        "--summary-json",
        str(out / "s.json"),
    ]
    for o in over:
        cmd += ["--set", o]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    subprocess.run(cmd, cwd=out, env=env, check=True, capture_output=True)
    summary = json.loads((out / "s.json").read_text())
    return [i for i in summary["interventions"] if i["kind"] == "rollback"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--faults", type=int, default=10)
    ap.add_argument("--spacing", type=int, default=100)
    args = ap.parse_args()
    starts = [150 + k * args.spacing for k in range(args.faults)]
    steps = starts[-1] + args.spacing
    result: dict[str, object] = {"faults": args.faults}
    costs = []
    with tempfile.TemporaryDirectory() as tmp:
        runs = (
            ("bit_flip", "device"),
            ("bad_device", "device"),
            ("shifted_labels", "data_x_state"),
        )
        for kind, want in runs:
            out = Path(tmp) / kind
            out.mkdir()
            rollbacks = _run(kind, starts, steps, out)
            right = [
                r
                for r in rollbacks
                if r.get("cause") == want
                and (r.get("device_ranks") if want == "device" else r.get("ranks")) == [1]
            ]
            covered = {s for s in starts if any(s <= r["batch_index"] <= s + 15 for r in rollbacks)}
            for r in rollbacks:
                if r not in right:
                    keys = ("step", "onset_step", "batch_index", "cause", "ranks", "device_ranks")
                    keys += ("device_step", "device_check", "device_losses", "to_step", "replay")
                    print("  not classified", want, {k: r.get(k) for k in keys})
            print(
                f"{kind}: {len(rollbacks)} rollbacks, causes "
                f"{sorted({str(r.get('cause')) for r in rollbacks})}, {len(right)} classified "
                f"{want} with rank 1; faults reached by a rollback: {len(covered)} of {len(starts)}"
            )
            name = {"bit_flip": "device", "bad_device": "bad_device"}.get(kind, "data")
            result[f"{name}_right"] = len(right)
            result[f"{name}_checks"] = sorted({str(r.get("device_check")) for r in right})
            if want == "device":
                result[f"{name}_suspects_flagged"] = sorted(
                    {r for x in rollbacks for r in x.get("suspect_devices", [])}
                )
            costs += [r["replay_s"] for r in rollbacks if "replay_s" in r]
    result["replay_s_median"] = statistics.median(costs) if costs else None
    print(json.dumps(result))


if __name__ == "__main__":
    main()
