"""Same-step refusals in clean runs (issue 58 item 6): how often the same-step tier refuses an
update where no fault was injected.

Trains the built-in trainer's configs with no fault (`faults=[]`) over several seeds and counts
the refused updates (`skip_update` interventions), each with the deviations the tier gave, so a
refusal beside a real loss jump can be told from one on noise. A refusal in a clean run drops a
step; the goal is at most 1 in 10,000 clean steps.

    python benchmarks/false_refusals.py [--configs tiny_cpu,demo] [--steps 2000] [--seeds 3]

Prints one JSON line: steps, refusals, the rate per 10,000 steps, and each refusal's step and
reason.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from spikewatch.trainer.builtin.loop import fit
from spikewatch.trainer.config import load_config


def one(config: str, steps: int, seed: int, tmp: Path) -> tuple[int, list[dict]]:
    cfg = load_config(
        config,
        [f"train.max_steps={steps}", f"train.seed={seed}", "faults=[]", "train.progress=false",
         "eval.interval=none", "schedule.warmup_steps=30"],
    )  # fmt: skip
    result = fit(cfg, run_dir=tmp / f"{config}-{seed}")
    summary = result.summary()
    refused = [
        {"config": config, "seed": seed, "step": i.get("step"), "reason": i.get("reason")}
        for i in summary.get("interventions", [])
        if i.get("kind") == "skip_update"
    ]
    return int(summary["steps"]), refused


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="tiny_cpu,demo")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--seeds", type=int, default=3)
    args = ap.parse_args(argv)
    total, refusals = 0, []
    with tempfile.TemporaryDirectory() as tmp:
        for config in [c for c in args.configs.split(",") if c]:
            for seed in range(args.seeds):
                n, refused = one(config, args.steps, seed, Path(tmp))
                total += n
                refusals += refused
    out = {
        "steps": total,
        "refusals": len(refusals),
        "per_10k_steps": round(1e4 * len(refusals) / max(total, 1), 2),
        "each": refusals,
    }
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
