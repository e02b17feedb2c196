"""spikewatch in a Hugging Face Trainer run: a tiny Llama (made from a config, no download)
trained on the shipped byte-level corpus, with a region of poisoned batches (labels shifted by
one byte) that makes a real spike. One callback does the rest.

    python examples/hf_trainer.py --steps 300 --poison-at 200 --db sqlite:///x.db \
        --summary-json s.json

`--no-rollback` detects and records only; `--save-every N` writes Trainer checkpoints and
`--resume` continues from the newest (HF's own resume, the guard's state with it);
`--grad-accum K` splits each batch into K micro-batches; `--poison-rows K` poisons only the
first K rows of each poisoned batch (the rollback names them: `"samples"` in the summary).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from spikewatch import without_blocked
from spikewatch.corpus import shift_labels, text_corpus, window_starts, windows
from spikewatch.hf import SpikewatchCallback

WORLD = int(os.environ.get("WORLD_SIZE", "1"))  # processes under torchrun (1 without)


class Batches(torch.utils.data.Dataset):
    """Sequence i of the run's data stream: row i % B of global batch i // B, a pure function
    of its index, so the Trainer's sampler order (and its resume) decides what each step sees.
    The poisoned region covers global batches [poison_at, poison_at + poison_len) (with
    `poison_rows`, their first rows only); with `poison_rank`, only the rows that rank trains
    (under torchrun each rank trains its consecutive share of every global batch)."""

    def __init__(
        self, data: torch.Tensor, args: argparse.Namespace, n_batches: int, ids: bool = True
    ) -> None:
        self.data, self.args, self.n, self.ids = data, args, n_batches * args.batch_size, ids

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        a = self.args
        batch, row = divmod(i, a.batch_size)
        x, y = windows(self.data, batch, a.batch_size, a.seq_len, a.seed)
        x, y = x[row], y[row]
        rank = row // (a.batch_size // WORLD)
        if a.poison_at is not None and 0 <= batch - a.poison_at < a.poison_len:
            if a.poison_rank in (None, rank) and row < (a.poison_rows or a.batch_size):
                y = shift_labels(y)
        # HF shifts labels inside the model: labels[t] is the target of input t-1.
        item = {"input_ids": x, "labels": torch.cat([x[:1], y[:-1]])}
        if self.ids:  # the row's own id: where it starts in the corpus
            start = window_starts(len(self.data), batch, a.batch_size, a.seq_len, a.seed)[row]
            item["id"] = f"text:{start}"
        return item


def _without_blocked(data: Batches, args: argparse.Namespace) -> torch.utils.data.Dataset:
    """With --blocklist (`spikewatch quarantine RUN --out FILE` of an earlier run): the rows
    its rollbacks named left out; the Trainer reads the stream in order, so global batch b's
    row r is item b * batch_size + r."""
    if not args.blocklist:
        return data
    return without_blocked(data, args.blocklist, position=lambda b, r: b * args.batch_size + r)


def collate(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The rows stacked; their ids (the Trainer keeps them with remove_unused_columns=False)
    name the rows a rollback blames, and spikewatch takes them out of the model's inputs."""
    out: dict[str, Any] = {k: torch.stack([r[k] for r in rows]) for k in ("input_ids", "labels")}
    if "id" in rows[0]:
        out["id"] = [r["id"] for r in rows]
    return out


# The stream is shuffled already, by index: the Trainer reads it in order. transformers < 5
# has no such argument and shuffles the rows (the run works; a poisoned region scatters).
SEQUENTIAL = (
    {"train_sampling_strategy": "sequential"}
    if "train_sampling_strategy" in TrainingArguments.__dataclass_fields__
    else {}
)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--epochs", type=int, default=0, help="epoch-based: --steps/E batches, E epochs")
    p.add_argument("--poison-at", type=int, default=None, help="first poisoned batch index")
    p.add_argument("--poison-len", type=int, default=20, help="poisoned batches")
    p.add_argument("--poison-rank", type=int, default=None, help="poison only this rank's rows")
    p.add_argument(
        "--poison-rows", type=int, default=None, help="poison only the first K rows of a batch"
    )
    p.add_argument("--db", default=None, help="store URL ('none' for no store)")
    p.add_argument("--summary-json", default=None)
    p.add_argument("--output-dir", default="runs/hf_trainer")
    p.add_argument("--no-rollback", action="store_true")
    p.add_argument(
        "--blocklist", default=None, help="a quarantine's file: its samples are left out"
    )
    p.add_argument("--save-every", type=int, default=0, help="Trainer checkpoints; 0 = none")
    p.add_argument("--resume", action="store_true", help="resume from the newest checkpoint")
    p.add_argument("--grad-accum", type=int, default=1)
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
    p.add_argument("--compile", action="store_true", help="TrainingArguments(torch_compile=True)")
    p.add_argument(
        "--precision",
        choices=("fp32", "bf16", "fp16"),
        default="fp32",
        help="mixed precision (fp16: with a GradScaler, which spikewatch takes into account)",
    )
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    train, val = text_corpus()
    torch.manual_seed(args.seed)
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
    model = LlamaForCausalLM(config)
    callback = SpikewatchCallback(
        db=args.db,
        name="hf-trainer",
        checkpoint_every=args.checkpoint_every or None,
        settings={  # --no-rollback: detect and record only (no refused update either)
            "guard": {
                "rollback": not args.no_rollback,
                "same_step": {"enabled": not args.no_rollback},
            }
        },
    )
    training_args = TrainingArguments(
        output_dir=args.output_dir,
        max_steps=-1 if args.epochs else args.steps,
        num_train_epochs=args.epochs or 1,
        per_device_train_batch_size=args.batch_size // (args.grad_accum * WORLD),
        gradient_accumulation_steps=args.grad_accum,
        learning_rate=args.lr,
        adam_beta2=0.95,
        weight_decay=0.1,
        warmup_steps=max(1, args.steps // 10),
        lr_scheduler_type="cosine",
        max_grad_norm=1.0,
        logging_steps=50,
        eval_strategy="steps",
        eval_steps=50,
        per_device_eval_batch_size=args.batch_size,
        save_strategy="steps" if args.save_every else "no",
        save_steps=args.save_every or 500,
        save_total_limit=2,
        report_to=[],
        remove_unused_columns=False,  # the rows' "id" reaches spikewatch (collate keeps it)
        seed=args.seed,
        data_seed=args.seed,
        **SEQUENTIAL,
        use_cpu=not torch.cuda.is_available(),
        dataloader_num_workers=0,
        disable_tqdm=True,
        torch_compile=args.compile,
        bf16=args.precision == "bf16",
        fp16=args.precision == "fp16",  # accelerate's GradScaler: the callback finds it
    )
    eval_args = argparse.Namespace(**{**vars(args), "poison_at": None, "seed": 1234})
    trainer = Trainer(
        model=model,
        args=training_args,
        # Room for the steps a rollback repeats (the data flows on while the step goes back).
        train_dataset=_without_blocked(
            Batches(
                train, args, n_batches=args.steps // args.epochs if args.epochs else 2 * args.steps
            ),
            args,
        ),
        eval_dataset=Batches(val, eval_args, n_batches=8, ids=False),
        data_collator=collate,
        callbacks=[callback],
    )
    resume = args.resume and any(Path(args.output_dir).glob("checkpoint-*"))
    trainer.train(resume_from_checkpoint=True if resume else None)
    trainer.evaluate()  # the final validation loss, into the summary
    if args.summary_json:
        callback.write_summary(args.summary_json)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
