"""spikewatch in a plain PyTorch loop (nanoGPT-style): a small byte-level GPT on the shipped
corpus, with a region of poisoned batches (labels shifted by one byte) that makes a real spike.

    python examples/plain_loop.py --steps 300 --poison-at 200 --db sqlite:///x.db \
        --summary-json s.json

The Watch records every probe into the store, rolls back to a checkpoint from before the
spike's onset, skips the poisoned batches and carries on. `--no-rollback` detects and records
only (the same run without the cure). `--run-dir D` starts in D or, when D holds checkpoints
(a killed or preempted run), resumes it: one command line starts and restarts
(`Watch(resume="auto")`). Unchanged
under `torchrun --standalone --nproc_per_node=N` (DDP, or `--strategy fsdp2`), where the Watch
hands each rank its consecutive share of every global batch `batch_at` returns, and
`--poison-rank R` poisons only rank R's rows.
`--compile` runs the model under torch.compile: the probes keep it to one training graph.
"""

from __future__ import annotations

import argparse
import math
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from spikewatch import AdamW, AttnMax, Watch
from spikewatch.corpus import poisoned_rows, shift_labels, text_corpus, windows


class Attention(nn.Module):
    def __init__(self, d: int, n_head: int, layer: int, rec: AttnMax) -> None:
        super().__init__()
        self.n_head, self.layer, self.rec = n_head, layer, rec
        self.c_attn, self.c_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = self.rec.sdpa(self.layer, q, k, v)  # (B, nh, T, hs); per-head max logit recorded
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self, d: int, n_head: int, layer: int, rec: AttnMax) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = Attention(d, n_head, layer, rec)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, d: int, n_layer: int, n_head: int, seq_len: int) -> None:
        super().__init__()
        self.attn = AttnMax()  # the Watch's recorder is put here once it exists
        self.wte, self.wpe = nn.Embedding(256, d), nn.Embedding(seq_len, d)
        self.h = nn.ModuleList(Block(d, n_head, i, self.attn) for i in range(n_layer))
        self.ln_f, self.lm_head = nn.LayerNorm(d), nn.Linear(d, 256, bias=False)

    def use_recorder(self, rec: AttnMax) -> None:
        for block in self.h:
            block.attn.rec = rec
        # the maxima's shape: one (layers, heads) table on the device, written in place (in a
        # compiled model from the graph itself, with no Python per layer)
        rec.reserve(len(self.h), self.h[0].attn.n_head)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(x.size(1), device=x.device)
        h = self.wte(x) + self.wpe(pos)
        for block in self.h:
            h = block(h)
        logits = self.lm_head(self.ln_f(h))
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--poison-at", type=int, default=None, help="first poisoned batch index")
    p.add_argument("--poison-len", type=int, default=20, help="poisoned batches")
    p.add_argument("--poison-rank", type=int, default=None, help="poison only this rank's rows")
    p.add_argument(
        "--poison-rows", type=int, default=None, help="poison only the first K rows of a batch"
    )
    p.add_argument("--strategy", choices=("ddp", "fsdp2"), default="ddp", help="under torchrun")
    p.add_argument("--db", default=None, help="store URL ('none' for no store)")
    p.add_argument("--summary-json", default=None)
    p.add_argument("--run-dir", default=None)
    p.add_argument("--resume", default=None, metavar="RUN_DIR")
    p.add_argument("--no-rollback", action="store_true")
    p.add_argument(
        "--blocklist", default=None, help="a quarantine's file: its samples are left out"
    )
    p.add_argument(
        "--whole-batches", action="store_true", help="a rollback skips whole batches, not rows"
    )
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=16, help="the global batch")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--checkpoint-every", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument(
        "--precision",
        choices=("fp32", "bf16", "fp16"),
        default="fp32",
        help="mixed precision (fp16: with a GradScaler, which spikewatch takes into account)",
    )
    args = p.parse_args(argv)
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    rank, world = _init_distributed()
    train, val = text_corpus()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gpt = GPT(args.d_model, args.layers, args.heads, args.seq_len).to(device)
    model: nn.Module = gpt
    if world > 1 and args.strategy == "fsdp2":
        for block in gpt.h:
            fully_shard(block)
        fully_shard(gpt)
    elif world > 1:
        model = DDP(gpt)
    if args.compile:
        model = torch.compile(model)
    # An optimizer the Watch can refuse on the device, so the host reads nothing before the
    # update: torch's fused AdamW on a GPU, spikewatch's AdamW (torch's arithmetic) elsewhere.
    if device.type == "cuda" and not (world > 1 and args.strategy == "fsdp2"):
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), fused=True)
    else:
        optimizer = AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95))
    warmup = max(1, args.steps // 10)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: _cosine(s, warmup, args))
    low = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.precision)
    scaler = torch.amp.GradScaler(device.type) if args.precision == "fp16" else None

    def forward(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device.type, dtype=low or torch.float32, enabled=low is not None):
            return model(x, y)

    def batch_at(index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Global batch `index`; under torchrun the Watch hands each rank its share."""
        x, y = windows(train, index, args.batch_size, args.seq_len, args.seed)
        poisoned = args.poison_at is not None and 0 <= index - args.poison_at < args.poison_len
        if poisoned:
            bad = poisoned_rows(args.batch_size, world, args.poison_rows, args.poison_rank)
            y = torch.where(bad[:, None], shift_labels(y), y)
        return x.to(device), y.to(device)

    with Watch(
        model,
        optimizer,
        scheduler,
        name="plain-loop",
        db=args.db,
        run_dir=args.resume or args.run_dir,
        resume=True if args.resume else "auto",  # --run-dir D: start there, or resume
        max_steps=args.steps,
        grad_clip=1.0,
        warmup_steps=warmup,
        checkpoint_every=args.checkpoint_every,
        blocklist=args.blocklist,  # `spikewatch quarantine RUN --out FILE` of an earlier run
        settings={
            "guard": {
                "rollback": not args.no_rollback,
                "same_step": {"enabled": not args.no_rollback},  # detect and record only
                "skip_samples": not args.whole_batches,
            }
        },
        scaler=scaler,  # fp16: the Watch steps and updates it
    ) as watch:
        gpt.use_recorder(watch.attn)
        for x, y in watch.batches(batch_at, loss_fn=lambda batch: forward(*batch), decode=_text):
            loss = forward(x, y)
            (loss if scaler is None else scaler.scale(loss)).backward()
            watch.step(loss)
            if watch.step_count % 50 == 0 and watch.step_count < args.steps:
                watch.log_eval(evaluate(model, val, args))
        watch.log_eval(evaluate(model, val, args))  # the final one (also after a late resume)
    if args.summary_json:
        watch.write_summary(args.summary_json)
    if world > 1:
        dist.destroy_process_group()
    return 0


def _text(tokens: list[int]) -> str:
    """A row's bytes as text, for the samples a rollback names."""
    return bytes(tokens).decode("utf-8", errors="replace")


def _init_distributed() -> tuple[int, int]:
    """Under torchrun: the process group (gloo on CPU); (rank, world size)."""
    if "RANK" not in os.environ:
        return 0, 1
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    return dist.get_rank(), dist.get_world_size()


def _cosine(step: int, warmup: int, args: argparse.Namespace) -> float:
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, args.steps - warmup))
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


@torch.no_grad()
def evaluate(
    model: nn.Module, val: torch.Tensor, args: argparse.Namespace, batches: int = 8
) -> float:
    model.eval()
    device = next(model.parameters()).device
    batch = [windows(val, i, args.batch_size, args.seq_len, seed=1234) for i in range(batches)]
    losses = [model(x.to(device), y.to(device)) for x, y in batch]
    model.train()
    return float(torch.stack(losses).mean())


if __name__ == "__main__":
    raise SystemExit(main())
