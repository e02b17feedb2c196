"""Where spikewatch's cost in a plain loop goes, part by part, in milliseconds per step.

The same tiny Llama as `integrations.py` (B=8, T=128, d=128, 2 layers), two identical models in
one process stepping alternately, one of them watched with every default on. Each part of the
watched step is timed where it runs (its functions wrapped with a clock); the forward and
backward of both models are timed too, so the per-step difference splits into: the extra
forward (the per-head attention maxima and the attention function around them), and the
Watch's step beyond the plain loop's own clip, optimizer step, schedule and zeroing.

    python benchmarks/overhead_parts.py [--steps 600] [--batch-size 8]

Last line: {"ratio": without / with, "overhead_ms": ..., "<part>_ms": ...}. Parts nest
(`watch_step` holds `gate`, which holds `measure`...): they are not to be summed.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import torch  # noqa: E402  (after _common set the thread environment)
from _common import allocator_flag, clocked, plain_update, quiet_one_thread  # noqa: E402
from integrations import _batches, _cosine, _model  # noqa: E402

SKIP = 20  # warm-up steps left out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch-size", type=int, default=8)
    allocator_flag(ap)
    args = ap.parse_args()
    args.d_model, args.layers, args.seq_len = 128, 2, 128
    quiet_one_thread(args)

    import spikewatch.trainer.checkpoints.disk as disk
    import spikewatch.trainer.checkpoints.memory as memory
    import spikewatch.trainer.core.probes as probes
    import spikewatch.trainer.core.same_step as same_step
    import spikewatch.trainer.core.step_core as step_core
    import spikewatch.trainer.watch as watch_mod
    from spikewatch import Watch
    from spikewatch.trainer.model.attn_max import AttnMax

    spent: Counter = Counter()
    for obj, name, label in [
        (AttnMax, "record_logits", "attn_max"),
        (watch_mod.Watch, "step", "watch_step"),
        (watch_mod.Watch, "gate", "gate"),
        (watch_mod.Watch, "_tensors", "clip_and_gather"),
        (step_core.StepCore, "gate", "measure"),
        (same_step.SameStepGate, "limits", "same_step"),
        (step_core.StepCore, "_agree", "guard_and_policy"),
        (watch_mod.Watch, "conclude", "conclude"),
        (probes.Probes, "after_update", "update_and_adam_stats"),
        (step_core.StepCore, "save_if_due", "checkpoints"),
        (memory.MemoryTier, "save", "memory_save"),
        (disk.Checkpointer, "save", "disk_save"),
        (torch.nn.utils, "clip_grad_norm_", "plain_clip"),
    ]:
        clocked(obj, name, label, lambda: spent)

    batches = _batches(args)

    def make() -> tuple:
        model = _model(args).train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
        return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, _cosine(args.steps))

    plain, watched = make(), make()
    with tempfile.TemporaryDirectory() as tmp:
        w = Watch(*watched, grad_clip=1.0, run_dir=Path(tmp) / "run", db=f"sqlite:///{tmp}/b.db")
        w.open()
        total = Counter()
        for i in range(args.steps):
            if i == SKIP:
                spent.clear()
            for which in (0, 1) if i % 2 else (1, 0):
                model, opt, sched = watched if which else plain
                t0 = time.perf_counter()
                if which:
                    w.begin_step(i)
                t1 = time.perf_counter()
                loss = model(input_ids=batches[i], labels=batches[i]).loss
                t2 = time.perf_counter()
                loss.backward()
                t3 = time.perf_counter()
                if which:
                    w.step(loss)
                else:
                    plain_update(model, opt, sched)
                t4 = time.perf_counter()
                if i >= SKIP:
                    total[f"step{which}"] += t4 - t0
                    total[f"forward{which}"] += t2 - t1
                    total[f"backward{which}"] += t3 - t2
        w.close()
    n = args.steps - SKIP
    ms = {k: 1e3 * v / n for k, v in {**total, **spent}.items()}
    out = {
        "ratio": round(total["step0"] / total["step1"], 4),
        "step_ms_without": round(ms["step0"], 2),
        "overhead_ms": round(ms["step1"] - ms["step0"], 2),
        "extra_forward_ms": round(ms["forward1"] - ms["forward0"], 2),
        "extra_backward_ms": round(ms["backward1"] - ms["backward0"], 2),
    }
    out.update({f"{k}_ms": round(v, 3) for k, v in sorted(ms.items()) if not k[-1].isdigit()})
    print(f"B={args.batch_size}: {ms['step0']:.1f} ms/step without, {ms['step1']:.1f} with")
    for k, v in sorted(out.items(), key=lambda kv: -kv[1]):
        if k.endswith("_ms"):
            print(f"  {k:28s} {v:8.3f}  ({100 * v / ms['step0']:.2f}% of the plain step)")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
