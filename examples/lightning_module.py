"""spikewatch in a PyTorch Lightning run: a LightningModule around a tiny Llama (made from a
config, no download) on the shipped byte-level corpus, with a region of poisoned batches
(labels shifted by one byte) that makes a real spike. One callback does the rest.

    python examples/lightning_module.py --steps 300 --poison-at 200 --db sqlite:///x.db \
        --summary-json s.json

`--no-rollback` detects and records only; `--save-every N` writes Lightning checkpoints and
`--resume` continues from the newest one (the guard's state and the data position with it).
Unchanged under `torchrun --standalone --nproc_per_node=N` (Lightning's `strategy="ddp"` with
`devices=N`): `cb.dataset` hands each rank its consecutive share of every global batch, and
`--poison-rank R` poisons only rank R's rows.
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

import lightning.pytorch as pl
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from spikewatch import AdamW
from spikewatch.corpus import poisoned_rows, shift_labels, text_corpus, windows
from spikewatch.lightning import SpikewatchCallback


class TinyLlama(pl.LightningModule):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.args = args
        config = LlamaConfig(
            vocab_size=256,
            hidden_size=args.d_model,
            intermediate_size=4 * args.d_model,
            num_hidden_layers=args.layers,
            num_attention_heads=args.heads,
            num_key_value_heads=args.kv_heads,
            max_position_embeddings=args.seq_len,
            attn_implementation="sdpa",
        )
        self.model = LlamaForCausalLM(config)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = self.model(input_ids=x).logits  # (B, T, V)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], idx: int) -> torch.Tensor:
        return self(*batch)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], idx: int) -> None:
        self.log("val_loss", self(*batch), prog_bar=False)

    def configure_optimizers(self):  # noqa: ANN201
        a = self.args
        # refusable on the device (no host read before the update): torch's fused kernel on a
        # GPU, spikewatch's AdamW (torch's arithmetic) elsewhere
        kind, extra = (
            (torch.optim.AdamW, {"fused": True}) if self.device.type == "cuda" else (AdamW, {})
        )
        opt = kind(self.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1, **extra)
        warmup = max(1, a.steps // 10)

        def cosine(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            progress = min(1.0, (step - warmup) / max(1, a.steps - warmup))
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, cosine)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--poison-at", type=int, default=None, help="first poisoned batch index")
    p.add_argument("--poison-len", type=int, default=20, help="poisoned batches")
    p.add_argument("--poison-rank", type=int, default=None, help="poison only this rank's rows")
    p.add_argument(
        "--poison-rows", type=int, default=None, help="poison only the first K rows of a batch"
    )
    p.add_argument("--db", default=None, help="store URL ('none' for no store)")
    p.add_argument("--summary-json", default=None)
    p.add_argument("--output-dir", default="runs/lightning_module")
    p.add_argument("--no-rollback", action="store_true")
    p.add_argument("--save-every", type=int, default=0, help="Lightning checkpoints; 0 = none")
    p.add_argument(
        "--epochs",
        type=int,
        default=0,
        help="epoch-based, from a plain DataLoader of --steps/E batches (instead of the Watch's "
        "skip-aware stream): max_epochs=E",
    )
    p.add_argument("--resume", action="store_true", help="resume from the last checkpoint")
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2, help="grouped-query attention")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=16, help="the global batch")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument(
        "--checkpoint-every",
        type=int,
        default=0,
        help="also keep the Watch's rollback targets on disk every N steps (default: host "
        "memory only; the framework's own checkpoints carry the Watch's state for a resume)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compile", action="store_true", help="trainer.fit(torch.compile(module))")
    p.add_argument(
        "--precision",
        choices=("fp32", "bf16", "fp16"),
        default="fp32",
        help="mixed precision (fp16: with a GradScaler, which spikewatch takes into account)",
    )
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    train, val = text_corpus()
    pl.seed_everything(args.seed, verbose=False)
    module = TinyLlama(args)
    fitted = torch.compile(module) if args.compile else module
    callback = SpikewatchCallback(
        db=args.db,
        name="lightning",
        checkpoint_every=args.checkpoint_every or None,
        warmup_steps=max(1, args.steps // 10),  # the LR warmup: no level to detect against yet
        settings={  # --no-rollback: detect and record only (no refused update either)
            "guard": {
                "rollback": not args.no_rollback,
                "same_step": {"enabled": not args.no_rollback},
            }
        },
    )
    world = int(os.environ.get("WORLD_SIZE", "1"))  # processes under torchrun

    def batch_at(index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Global batch `index`; under torchrun cb.dataset hands each rank its share."""
        x, y = windows(train, index, args.batch_size, args.seq_len, args.seed)
        poisoned = args.poison_at is not None and 0 <= index - args.poison_at < args.poison_len
        if poisoned:
            bad = poisoned_rows(args.batch_size, world, args.poison_rows, args.poison_rank)
            y = torch.where(bad[:, None], shift_labels(y), y)
        return x, y

    val_batches = [windows(val, i, args.batch_size, args.seq_len, seed=1234) for i in range(8)]
    val_loader = torch.utils.data.DataLoader(val_batches, batch_size=None)
    saving = []
    if args.save_every:
        saving = [
            pl.callbacks.ModelCheckpoint(
                dirpath=Path(args.output_dir) / "checkpoints",
                every_n_train_steps=args.save_every,
                filename="{step}",
                save_top_k=-1,
            )
        ]
    trainer = pl.Trainer(
        max_steps=-1 if args.epochs else args.steps,
        max_epochs=args.epochs or None,
        accelerator="auto",
        devices=world,
        strategy="ddp" if world > 1 else "auto",
        precision={"fp32": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed"}[args.precision],
        gradient_clip_val=1.0,
        val_check_interval=50,
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        limit_val_batches=len(val_batches),
        logger=False,
        enable_checkpointing=bool(saving),
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=args.output_dir,
        callbacks=[callback, *saving],
    )
    if args.epochs:  # the user's own loader: a list of batches, the same ones each epoch
        own = [batch_at(i) for i in range(args.steps // args.epochs)]
        train_loader = torch.utils.data.DataLoader(own, batch_size=None)
    else:
        train_loader = torch.utils.data.DataLoader(callback.dataset(batch_at), batch_size=None)
    saved = sorted(
        (Path(args.output_dir) / "checkpoints").glob("step=*.ckpt"),
        key=lambda p: int(p.stem.split("=")[1]),
    )
    trainer.fit(
        fitted,
        train_dataloaders=train_loader,
        val_dataloaders=val_loader,
        ckpt_path=str(saved[-1]) if args.resume and saved else None,
    )
    trainer.validate(module, dataloaders=val_loader, verbose=False)  # into the summary
    if args.summary_json:
        callback.write_summary(args.summary_json)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
