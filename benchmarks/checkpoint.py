"""Checkpoint cost: spikewatch's sync save vs a bare `torch.save` of the same state, the loop's
stall with async saving, and resume time. Interleaved, medians.

A bare `torch.save` writes one file and neither fsyncs nor checksums; spikewatch's save writes
five files with CRC-32s computed while the next file is written, fsyncs them, renames
atomically and prunes. Before each timed save, earlier outputs are deleted and flushed.
Last line: a JSON object with `sync_vs_torch_save` (throughput ratio, >= 0.9 wanted),
`async_stall_ratio` (the loop's stall: save() plus any wait before its next update, over the
sync save time; <= 0.15 wanted), `resume_s` and the raw times.

    python benchmarks/checkpoint.py [--d-model 512] [--layers 8] [--reps 5]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import torch  # noqa: E402
from _common import machine, median  # noqa: E402

from spikewatch.trainer.builtin.loop import build_trainer  # noqa: E402
from spikewatch.trainer.checkpoints.disk import Checkpointer  # noqa: E402
from spikewatch.trainer.config import load_config  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    print("machine:", json.dumps(machine()))
    cfg = load_config(
        "tiny_cpu",
        [
            f"model.d_model={args.d_model}",
            f"model.n_layer={args.layers}",
            "model.n_head=8",
            "data.batch_size=2",
            "data.seq_len=32",
            "train.max_steps=100",
            "train.stop_after=2",
            "train.progress=false",
            "eval.interval=none",
            "eval.batches=1",
            "checkpoint.interval=1000",
        ],
    )
    root = Path(tempfile.mkdtemp(prefix="ckbench-"))
    try:
        tr = build_trainer(cfg, run_dir=root / "run")
        tr.fit()  # two steps: the optimizer state exists
        state_bytes = sum(v.numel() * v.element_size() for v in tr.model.state_dict().values())
        print(f"model {state_bytes / 2**20:.0f} MiB (+ optimizer state)")
        times: dict[str, list[float]] = {
            "torch_save": [],
            "sync": [],
            "sync_nofsync": [],
            "async_stall": [],
            "async_total": [],
        }
        # Async saving is measured in steady state, as in training: one checkpointer whose host
        # buffers were mapped by an earlier save.
        # Async saving in steady state, as in training: one checkpointer (its host buffers
        # mapped by an earlier save); after save() the loop runs the next forward and backward,
        # then must wait (before_mutation) if the tensors are still being copied.
        async_cp = _checkpointer(tr, root / "async", "async")
        async_cp.save(tr.step_count, tr.core.snapshot)
        async_cp.wait()
        x, y = tr.sampler.batch(0, 1)
        for rep in range(args.reps):
            order = list(times)[:3] if rep % 2 == 0 else list(times)[:3][::-1]
            for kind in order:
                _measure(kind, tr, root / f"{kind}-{rep}", times)
            os.sync()
            t0 = time.perf_counter()
            stall = async_cp.save(tr.step_count, tr.core.snapshot)
            tr.model(x, y).loss.backward()  # the loop's next step, up to its update
            stall += async_cp.before_mutation()
            tr.optimizer.zero_grad(set_to_none=True)
            times["async_stall"].append(stall)
            async_cp.wait()
            times["async_total"].append(time.perf_counter() - t0)
        resume = []
        for _ in range(3):
            t0 = time.perf_counter()
            tr.resume()
            resume.append(time.perf_counter() - t0)
        m = {k: median(v) for k, v in times.items()}
        out = {
            "sync_vs_torch_save": m["torch_save"] / m["sync"],
            "sync_nofsync_vs_torch_save": m["torch_save"] / m["sync_nofsync"],
            "async_stall_ratio": m["async_stall"] / m["sync"],
            "resume_s": median(resume),
            "torch_save_s": m["torch_save"],
            "sync_save_s": m["sync"],
            "async_stall_s": m["async_stall"],
            "async_total_s": m["async_total"],
            "state_mib": state_bytes / 2**20,
        }
        for k, v in out.items():
            print(f"{k:>28}: {v:.4f}")
        print(json.dumps(out))
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _quiesce(root: Path) -> None:
    """Same starting state for every variant: earlier outputs deleted and flushed, so no
    variant pays for another's dirty pages (the kernel throttles writers above a threshold)."""
    for p in root.iterdir():
        if p.name != "run":
            shutil.rmtree(p, ignore_errors=True)
    os.sync()


def _measure(kind: str, tr, where: Path, times: dict[str, list[float]]) -> None:
    _quiesce(where.parent)
    where.mkdir(parents=True)
    if kind == "torch_save":
        t0 = time.perf_counter()
        state = {"model": tr.model.state_dict(), "optimizer": tr.optimizer.state_dict()}
        torch.save(state, where / "state.pt")
        times[kind].append(time.perf_counter() - t0)
        return
    cp = _checkpointer(tr, where, kind)
    t0 = time.perf_counter()
    cp.save(tr.step_count, tr.core.snapshot)
    cp.wait()
    times[kind].append(time.perf_counter() - t0)


def _checkpointer(tr, where: Path, kind: str) -> Checkpointer:
    update = {
        "interval": 1,
        "keep_last": 100,
        "async_save": kind == "async",
        "fsync": kind != "sync_nofsync",
    }
    return Checkpointer(where, tr.cfg.checkpoint.model_copy(update=update))


if __name__ == "__main__":
    main()
