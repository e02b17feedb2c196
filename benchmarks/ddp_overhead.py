"""Two-rank DDP step time with spikewatch over without: the same plain loop on the same tiny
Llama (byte-level, made from a config), two gloo ranks, each on its half of every global batch.

"With" is the whole loop as a user gets it under torchrun: the Watch joins the process group,
the loss is averaged and each rank's own loss gathered every step, rank 0 decides and the
decision is broadcast, every probe on, the store on rank 0 (SQLite), checkpoints every 25 steps
(sharded, DCP). Repetitions alternate which variant goes first; a ratio is the median step time
without over the median with (1.0 = free). Two ranks on two cores are noisy: the machine's load
average is printed with the figures.

    python benchmarks/ddp_overhead.py [--reps 3] [--steps 60]

Last line: {"ddp_ratio": r, "step_ms_without": t, "step_ms_with": t, "load_avg": l, ...}.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
import tempfile
import time
import warnings
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1]))
import torch  # noqa: E402  (after _common set the thread environment)
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from _common import machine, median, plain_step  # noqa: E402
from integrations import _batches, _cosine, _model  # noqa: E402

WARM = 5


def _times(args: argparse.Namespace, watched: bool, tmp: Path, rank: int) -> list[float]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from spikewatch import Watch
    from spikewatch.hf import attach_attention

    inner = _model(args).train()
    model = DDP(inner)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _cosine(args.steps))
    half = args.batch_size // 2
    batches = [b[rank * half : (rank + 1) * half] for b in _batches(args)]
    watch = None
    if watched:
        db = f"sqlite:///{tmp / 'bench.db'}"
        watch = Watch(model, opt, sched, grad_clip=1.0, run_root=tmp, db=db, checkpoint_every=25)
        watch.open()
        attach_attention(inner, watch.attn)
    stamps = []
    for i in range(args.steps):
        plain_step(model, opt, sched, watch, batches[i], i)
        stamps.append(time.perf_counter())
    if watch is not None:
        watch.close()
    return [b - a for a, b in zip(stamps[WARM:], stamps[WARM + 1 :], strict=False)]


def _worker(rank: int, port: int, args: argparse.Namespace, root: str, out: str) -> None:
    env = dict(RANK=rank, WORLD_SIZE=2, LOCAL_RANK=rank, MASTER_PORT=port)
    os.environ.update({k: str(v) for k, v in env.items()}, MASTER_ADDR="127.0.0.1")
    logging.disable(logging.WARNING)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=300))
    times: dict[str, list[float]] = {"off": [], "on": []}
    for r in range(args.reps):
        for watched in (False, True) if r % 2 == 0 else (True, False):
            tmp = Path(root) / f"r{r}-{watched}"
            times["on" if watched else "off"] += _times(args, watched, tmp, rank)
    if rank == 0:
        Path(out).write_text(json.dumps(times))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=16, help="the global batch")
    args = ap.parse_args()
    print("machine:", json.dumps(machine()))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "times.json"
        load0 = os.getloadavg()[0]
        mp.spawn(_worker, args=(port, args, tmp, str(out)), nprocs=2, join=True)
        times = json.loads(out.read_text())
    off, on = median(times["off"]), median(times["on"])
    result = {
        "ddp_ratio": round(off / on, 4),
        "step_ms_without": round(1e3 * off, 2),
        "step_ms_with": round(1e3 * on, 2),
        "load_avg": round(max(load0, os.getloadavg()[0]), 2),
        "shape": f"B={args.batch_size} (2 ranks), T={args.seq_len}, d={args.d_model}, "
        f"{args.layers} layers",
    }
    print(f"2-rank DDP: {result['step_ms_without']} ms/step without, {result['step_ms_with']} with")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
