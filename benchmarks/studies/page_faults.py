"""Page faults a step, with and without spikewatch, with glibc's default malloc and held still.

On a CPU, a step's activations come from malloc; glibc by default trims the top of its heap
between steps, and how often a step's activations are then faulted in afresh depends on the
order of its allocations. This counts it: each configuration runs in a fresh process (malloc's
state is per process), one run of `integrations.py`'s tiny Llama, and reports the process's
minor page faults and kernel time a step (`getrusage`), which unlike step times do not drift
with the machine's load. `bare` is the Watch with every part off (no probes, no store, no
checkpoints): only its gate around the framework's optimizer.

    python benchmarks/studies/page_faults.py [--steps 150] [--batch-size 16] [--only lightning,loop]

Last line: {"<run>_<variant>_<malloc>_faults": per step, ...}.
"""

from __future__ import annotations

import argparse
import json
import logging
import resource
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # the other studies
sys.path.insert(0, str(Path(__file__).parents[1]))  # benchmarks/_common
from _common import machine  # noqa: E402

VARIANTS: dict[str, dict] = {
    "full": {},
    "bare": {
        "db": "none",
        "settings": {
            "probes": {"enabled": False, "attn_max": False},
            "checkpoint": {"interval": None},
        },
    },
}


def one(args: argparse.Namespace) -> None:
    """In the child: one run, then its faults and kernel time a step as a JSON line."""
    import integrations
    import torch
    from _common import steady_allocator

    if args.malloc == "steady":
        steady_allocator()
    logging.disable(logging.WARNING)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    shape = argparse.Namespace(
        steps=args.steps, d_model=128, layers=2, seq_len=128, batch_size=args.batch_size
    )
    base = integrations._watch_kwargs
    integrations._watch_kwargs = lambda tmp: {**base(tmp), **VARIANTS.get(args.variant, {})}
    run = {"lightning": integrations.lightning_times, "loop": integrations.loop_times}[args.run]
    with tempfile.TemporaryDirectory() as tmp:
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        run(shape, args.variant != "without", Path(tmp))
        r1 = resource.getrusage(resource.RUSAGE_SELF)
    print(
        json.dumps(
            {
                "faults": round((r1.ru_minflt - r0.ru_minflt) / args.steps),
                "sys_ms": round(1e3 * (r1.ru_stime - r0.ru_stime) / args.steps, 2),
            }
        )
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--only", default="lightning,loop")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--run", default="lightning", help=argparse.SUPPRESS)
    ap.add_argument("--variant", default="full", help=argparse.SUPPRESS)
    ap.add_argument("--malloc", default="default", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        one(args)
        return
    print("machine:", json.dumps(machine()))
    print(f"shape: B={args.batch_size}, T=128, d=128, 2 layers, {args.steps} steps")
    out = {}
    for malloc in ("default", "steady"):
        for run in args.only.split(","):
            for variant in ("without", "full", "bare"):
                if run == "loop" and variant == "bare":
                    continue  # the plain loop has no gate: bare is the Lightning question
                child = [sys.executable, __file__, "--child", "--run", run]
                child += ["--variant", variant, "--malloc", malloc]
                child += ["--steps", str(args.steps), "--batch-size", str(args.batch_size)]
                done = subprocess.run(child, capture_output=True, text=True, check=True)
                got = json.loads(done.stdout.strip().splitlines()[-1])
                key = f"{run}_{variant}_{malloc}"
                out[f"{key}_faults"] = got["faults"]
                print(
                    f"{run:9s} {variant:8s} malloc {malloc:7s}: {got['faults']:5d} faults a "
                    f"step, {got['sys_ms']:.2f} ms a step in the kernel",
                    flush=True,
                )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
