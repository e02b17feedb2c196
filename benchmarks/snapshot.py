"""The host-memory tier on a ~100M-parameter model with AdamW (the built-in GPT, 14 layers,
d=768): what a snapshot costs the loop, and a restore from memory against one from disk.

- stall: how long the loop is blocked per snapshot (the save call, plus any wait for the copy
  before the next optimizer step), as a fraction of one training step of the same model;
- slowdown: how much slower the step that overlaps the copy is (the copy shares the machine);
- restore: copying a snapshot back into the live tensors, against reading the same state from
  a disk checkpoint (verified, loaded, set) in the same process.

Steps with and without a snapshot alternate (A B A B ...); medians over the repetitions.

    python benchmarks/snapshot.py [--reps 4] [--layers 14] [--d-model 768]

Last line: {"stall_ratio": r, "restore_ratio": r, "snapshot_mb": m, ...}. On a GPU it also
measures the device-to-host copy (pinned buffers, a side stream).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1]))
from _common import machine, median  # noqa: E402

from spikewatch.trainer.builtin.loop import build_trainer  # noqa: E402
from spikewatch.trainer.checkpoints.memory import snapshot_bytes  # noqa: E402
from spikewatch.trainer.checkpoints.tiers import DISK, MEMORY  # noqa: E402
from spikewatch.trainer.config import load_config  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=4)
    p.add_argument("--layers", type=int, default=14)
    p.add_argument("--d-model", type=int, default=768)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    args = p.parse_args()
    print(json.dumps(machine()))
    tmp = Path(tempfile.mkdtemp(prefix="snapshot-bench-"))
    cfg = load_config(
        None,
        [
            f"model.n_layer={args.layers}",
            f"model.d_model={args.d_model}",
            f"model.n_head={args.d_model // 64}",
            f"model.max_seq_len={args.seq_len}",
            f"data.seq_len={args.seq_len}",
            f"data.batch_size={args.batch_size}",
            "schedule.warmup_steps=1",
            "train.max_steps=1000",
            "train.progress=false",
            "eval.interval=none",
            "checkpoint.interval=1000",  # the disk tier, saved by hand below
            "checkpoint.memory_interval=1000",  # the memory tier, likewise
            "checkpoint.memory_budget_mb=100000",
            "guard.enabled=false",
        ],
    )
    tr = build_trainer(cfg, run_dir=tmp / "run")
    core, tiers = tr.core, tr.core.checkpointer
    memory = tiers.memory
    assert memory is not None
    n_params = sum(p.numel() for p in tr.model.parameters())
    core.start()
    tr._train_step()  # Adam's moments exist from here on
    nbytes = snapshot_bytes(tr.model, tr.optimizer)
    plain, after, stalls = [], [], []
    for _ in range(args.reps):
        t0 = time.perf_counter()
        tr._train_step()
        plain.append(time.perf_counter() - t0)
        core.save([MEMORY])  # the save call ...
        t0 = time.perf_counter()
        tr._train_step()  # ... and the step whose forward/backward overlaps the copy
        after.append(time.perf_counter() - t0)
        stalls.append(memory.last_stall_s)  # the call plus any wait before the update
    step = median(plain)
    core.save([MEMORY, DISK])
    tiers.wait()
    saved = core.step_count
    mem_s, disk_s = [], []
    for _ in range(args.reps):
        t0 = time.perf_counter()
        core.restore(tiers.read(saved), resume=False)
        mem_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        path = tiers.path_of(saved, DISK)
        core.restore(tiers.read(Path(path)), resume=False)
        disk_s.append(time.perf_counter() - t0)
    out = {
        "parameters_m": round(n_params / 1e6, 1),
        "snapshot_mb": round(nbytes / 2**20, 1),
        "step_s": round(step, 3),
        "stall_s": round(median(stalls), 4),
        "stall_ratio": round(median(stalls) / step, 4),
        "overlap_step_slowdown": round(median(after) / step - 1, 3),
        "restore_memory_s": round(median(mem_s), 3),
        "restore_disk_s": round(median(disk_s), 3),
        "restore_ratio": round(median(mem_s) / median(disk_s), 4),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
