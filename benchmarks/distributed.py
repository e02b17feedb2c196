"""Scale-out on CPU/gloo: 2-rank DDP and FSDP2 tokens/s vs 1 process at the same global batch,
and the save time of a sharded (torch.distributed.checkpoint) checkpoint vs a single-process one.

The single process runs here; two spawned ranks stay up and run DDP and FSDP2 on command, so
the variants interleave (1 DDP FSDP2, 1 DDP FSDP2, ...) without paying process start-up, and
the figures are medians. Throughput is timed from inside `fit()` after a warm-up (every rank and
the single process train with one thread; on a 2-core machine two ranks have the cores to
themselves). A save is one synchronous `Checkpointer.save` of a trained state (weights and Adam
moments, checksums, fsync, atomic rename) of a larger model, repeated in place.
Last line: a JSON object with `ddp_vs_single_tokens_per_s`, `fsdp2_vs_single_tokens_per_s`,
`dcp_ddp_vs_single_save_time`, `dcp_fsdp2_vs_single_save_time` (time ratios: < 1 is faster)
and the raw figures.

    python benchmarks/distributed.py [--steps 40] [--reps 3] [--d-model 128] [--ckpt-d-model 384]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from _common import machine, median  # noqa: E402

from spikewatch.trainer.builtin.loop import Trainer, build_trainer  # noqa: E402
from spikewatch.trainer.config import TrainConfig, load_config  # noqa: E402
from spikewatch.trainer.core.callbacks import Callback, StepState  # noqa: E402

WARMUP = 5
STRATEGIES = ("ddp", "fsdp2")


class _Clock(Callback):
    def __init__(self) -> None:
        self.t: list[float] = []

    def post_step(self, state: StepState) -> None:
        self.t.append(time.perf_counter())


def _config(args: argparse.Namespace, strategy: str | None, ckpt: bool) -> TrainConfig:
    d, layers = (args.ckpt_d_model, args.ckpt_layers) if ckpt else (args.d_model, args.layers)
    return load_config(
        "tiny_cpu",
        [
            f"model.d_model={d}",
            f"model.n_layer={layers}",
            f"data.batch_size={args.batch}",
            f"data.seq_len={args.seq_len}",
            f"model.max_seq_len={args.seq_len}",
            f"train.max_steps={2 if ckpt else args.steps}",
            "schedule.warmup_steps=1",
            "train.progress=false",
            "eval.interval=none",
            "eval.batches=1",
            "guard.enabled=false",
            f"checkpoint.interval={1000 if ckpt else 'none'}",
            f"distributed.strategy={strategy or 'none'}",
        ],
    )


def _throughput(cfg: TrainConfig, run_dir: Path) -> float:
    clock = _Clock()
    build_trainer(cfg, run_dir=run_dir, callbacks=[clock]).fit()
    t = clock.t[WARMUP:]
    return (len(t) - 1) * cfg.data.batch_size * cfg.data.seq_len / (t[-1] - t[0])


def _save_seconds(tr: Trainer) -> float:
    t0 = time.perf_counter()
    tr.core.checkpointer.save(tr.step_count, tr.core.snapshot)
    tr.core.checkpointer.wait()
    return time.perf_counter() - t0


def _worker(rank: int, port: int, args: argparse.Namespace, inbox, outbox, root: str) -> None:
    """One of two ranks: runs what the parent asks, in lockstep with the other rank."""
    env = dict(RANK=rank, WORLD_SIZE=2, LOCAL_RANK=rank, MASTER_PORT=port)
    os.environ.update({k: str(v) for k, v in env.items()}, MASTER_ADDR="127.0.0.1")
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=600))
    savers: dict[str, Trainer] = {}
    try:
        while (msg := inbox.get()) is not None:
            kind, strategy, n = msg
            where = Path(root) / f"{kind}-{strategy}-{n}"
            if kind == "fit":
                value = _throughput(_config(args, strategy, ckpt=False), where)
            else:
                if strategy not in savers:
                    tr = build_trainer(_config(args, strategy, ckpt=True), run_dir=where)
                    tr.fit()  # two steps: the optimizer state exists
                    savers[strategy] = tr
                value = _save_seconds(savers[strategy])
            if rank == 0:
                outbox.put(value)
    finally:
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=16, help="the global batch (both variants)")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--ckpt-d-model", type=int, default=384)
    ap.add_argument("--ckpt-layers", type=int, default=6)
    args = ap.parse_args()
    print("machine:", json.dumps(machine()))
    root = Path(tempfile.mkdtemp(prefix="distbench-"))
    ctx = mp.get_context("spawn")
    inboxes, outbox = [ctx.Queue(), ctx.Queue()], ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [
        ctx.Process(target=_worker, args=(r, port, args, inboxes[r], outbox, str(root)))
        for r in range(2)
    ]
    for p in procs:
        p.start()

    def ask(kind: str, strategy: str, n: int) -> float:
        for q in inboxes:
            q.put((kind, strategy, n))
        return outbox.get(timeout=900)

    try:
        tps: dict[str, list[float]] = {k: [] for k in ("single", *STRATEGIES)}
        saves: dict[str, list[float]] = {k: [] for k in ("single", *STRATEGIES)}
        single_saver = build_trainer(_config(args, None, ckpt=True), run_dir=root / "save-1")
        single_saver.fit()
        for n in range(args.reps):
            tps["single"].append(_throughput(_config(args, None, False), root / f"fit-{n}"))
            for strategy in STRATEGIES:
                tps[strategy].append(ask("fit", strategy, n))
            saves["single"].append(_save_seconds(single_saver))
            for strategy in STRATEGIES:
                saves[strategy].append(ask("save", strategy, n))
            print(
                f"rep {n}: tokens/s {[round(v[-1]) for v in tps.values()]}, save s "
                f"{[round(v[-1], 3) for v in saves.values()]}"
            )
        t = {k: median(v) for k, v in tps.items()}
        s = {k: median(v) for k, v in saves.items()}
        state = sum(v.numel() * v.element_size() for v in single_saver.model.state_dict().values())
        out = {
            "ddp_vs_single_tokens_per_s": t["ddp"] / t["single"],
            "fsdp2_vs_single_tokens_per_s": t["fsdp2"] / t["single"],
            "dcp_ddp_vs_single_save_time": s["ddp"] / s["single"],
            "dcp_fsdp2_vs_single_save_time": s["fsdp2"] / s["single"],
            "single_tokens_per_s": t["single"],
            "ddp_tokens_per_s": t["ddp"],
            "fsdp2_tokens_per_s": t["fsdp2"],
            "single_save_s": s["single"],
            "dcp_ddp_save_s": s["ddp"],
            "dcp_fsdp2_save_s": s["fsdp2"],
            "ckpt_weights_mib": state / 2**20,
            "global_batch_tokens": args.batch * args.seq_len,
        }
        for k, v in out.items():
            print(f"{k:>32}: {v:.4f}")
        print(json.dumps(out))
    finally:
        for q in inboxes:
            q.put(None)
        for p in procs:
            p.join(timeout=60)
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
