"""Where a framework run's cost goes: the same turn-taking runs as `integrations.py
--interleaved` (one with spikewatch, one without, two threads, a step each), with a clock per
thread around the model's forward, the backward, the optimizer, the clip and each of the
Watch's and the callback's calls, in ms per step.

    python benchmarks/framework_parts.py [--steps 400] [--batch-size 16] [--run lightning]
                                         [--glibc-default]

The optimizer's clock holds Lightning's closure (forward and backward) on the run without
spikewatch, where the optimizer calls it, and not on the watched one, whose gate calls the
closure first: compare `forward` and `backward`, not `optimizer`.
Last line: {"<part>_ms_with": ..., "<part>_ms_without": ..., "ratio": ...}.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
import integrations  # noqa: E402
import torch  # noqa: E402  (after _common set the thread environment)
from _common import allocator_flag, clocked, quiet_one_thread  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--run", default="lightning", choices=["lightning", "hf"])
    allocator_flag(ap)
    args = ap.parse_args()
    quiet_one_thread(args)
    from transformers import LlamaForCausalLM

    import spikewatch.trainer.watch as watch_mod

    spent: dict[bool, Counter] = {True: Counter(), False: Counter()}
    watched_thread: list[int] = []

    def mine() -> Counter:
        return spent[threading.get_ident() in watched_thread]

    clocked(LlamaForCausalLM, "forward", "forward", mine)
    clocked(torch.autograd, "backward", "backward", mine)
    clocked(torch.optim.AdamW, "step", "optimizer", mine)
    clocked(torch.nn.utils, "clip_grad_norm_", "clip", mine)
    for name in ("begin_step", "gate", "apply", "conclude"):
        clocked(watch_mod.Watch, name, f"watch.{name}", mine)
    run = {"lightning": integrations.lightning_times, "hf": integrations.hf_times}[args.run]

    def marked(a: argparse.Namespace, watched: bool, *rest: Any) -> list[float]:
        if watched:
            watched_thread.append(threading.get_ident())
        return run(a, watched, *rest)

    marked.__name__ = run.__name__
    shape = argparse.Namespace(
        steps=args.steps, d_model=128, layers=2, seq_len=128, batch_size=args.batch_size
    )
    with tempfile.TemporaryDirectory() as tmp:
        ratio = integrations._one_orientation(shape, Path(tmp), marked, False, True)
    out: dict[str, float] = {"ratio": round(ratio, 4)}
    for label in sorted(set(spent[True]) | set(spent[False])):
        on, off = (1e3 * spent[w][label] / args.steps for w in (True, False))
        out[f"{label}_ms_with"], out[f"{label}_ms_without"] = round(on, 2), round(off, 2)
        print(f"  {label:20s} with {on:7.2f} ms/step   without {off:7.2f}   ({on - off:+.2f})")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
