"""Step time of the same training with and without spikewatch: a Hugging Face Trainer run, a
Lightning run and a plain PyTorch loop, each on the same tiny Llama (byte-level, made from a
config) with the same AdamW, cosine schedule and clipping at 1.0.

"With" is the whole loop: every probe on (per-layer grad norms, per-head attention maxima
through the registered attention function, update ratios and Adam moments every 10 steps),
the detector and policy, retained checkpoints every 25 steps and the store (SQLite, through the
asynchronous sink). Each repetition runs both variants of all three, alternating which goes
first; per-step times come from inside the loop after a warm-up, and a ratio is the median
step time without over the median with (throughput with / without; 1.0 = free).

    python benchmarks/integrations.py [--reps 3] [--steps 40] [--d-model 128]

Last line: {"hf_ratio": r, "lightning_ratio": r, "loop_ratio": r, ...}.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import torch  # noqa: E402  (after _common set the thread environment)
from _common import machine, median  # noqa: E402

WARM = 5


def _model(args: argparse.Namespace) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=args.d_model,
        intermediate_size=4 * args.d_model,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=args.seq_len,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(cfg)


def _batches(args: argparse.Namespace) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    n = args.steps + 10
    return [torch.randint(0, 256, (args.batch_size, args.seq_len), generator=g) for _ in range(n)]


def _cosine(steps: int) -> Callable[[int], float]:
    return lambda s: 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / steps)))


def _watch_kwargs(tmp: Path) -> dict:
    return {"db": f"sqlite:///{tmp / 'bench.db'}", "checkpoint_every": 25}


# -- the plain loop -------------------------------------------------------------------------
def loop_times(args: argparse.Namespace, watched: bool, tmp: Path) -> list[float]:
    from spikewatch import Watch
    from spikewatch.hf import attach_attention

    model = _model(args).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _cosine(args.steps))
    batches = _batches(args)
    watch = None
    if watched:
        watch = Watch(model, opt, sched, grad_clip=1.0, run_dir=tmp / "loop", **_watch_kwargs(tmp))
        attach_attention(model, watch.attn)
    stamps = []
    for i in range(args.steps):
        x = batches[i]
        if watch is not None:
            watch.begin_step(i)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        if watch is not None:
            watch.step(loss)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
        stamps.append(time.perf_counter())
    if watch is not None:
        watch.close()
    return _diffs(stamps)


# -- Hugging Face ---------------------------------------------------------------------------
def hf_times(args: argparse.Namespace, watched: bool, tmp: Path) -> list[float]:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from spikewatch.hf import SpikewatchCallback

    class Clock(TrainerCallback):
        def __init__(self) -> None:
            self.t: list[float] = []

        def on_step_end(self, *a, **k) -> None:  # noqa: ANN002, ANN003
            self.t.append(time.perf_counter())

    batches = _batches(args)
    rows = [{"input_ids": r, "labels": r} for b in batches for r in b]
    clock = Clock()
    callbacks: list = [clock]
    if watched:
        callbacks.append(SpikewatchCallback(**_watch_kwargs(tmp)))
    targs = TrainingArguments(
        output_dir=str(tmp / f"hf-{watched}"),
        max_steps=args.steps,
        per_device_train_batch_size=args.batch_size,
        learning_rate=1e-3,
        adam_beta2=0.95,
        weight_decay=0.1,
        lr_scheduler_type="cosine",
        max_grad_norm=1.0,
        save_strategy="no",
        logging_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        train_sampling_strategy="sequential",
        dataloader_num_workers=0,
    )
    Trainer(model=_model(args), args=targs, train_dataset=rows, callbacks=callbacks).train()
    return _diffs(clock.t)


# -- Lightning ------------------------------------------------------------------------------
def lightning_times(args: argparse.Namespace, watched: bool, tmp: Path) -> list[float]:
    import lightning.pytorch as pl

    from spikewatch.lightning import SpikewatchCallback

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = _model(args)

        def training_step(self, x: torch.Tensor, idx: int) -> torch.Tensor:
            return self.model(input_ids=x, labels=x).loss

        def configure_optimizers(self):  # noqa: ANN202
            opt = torch.optim.AdamW(self.parameters(), lr=1e-3, betas=(0.9, 0.95))
            sched = torch.optim.lr_scheduler.LambdaLR(opt, _cosine(args.steps))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    class Clock(pl.Callback):
        def __init__(self) -> None:
            self.t: list[float] = []

        def on_train_batch_end(self, *a) -> None:  # noqa: ANN002
            self.t.append(time.perf_counter())

    clock = Clock()
    callbacks: list = [clock]
    if watched:
        callbacks.append(SpikewatchCallback(**_watch_kwargs(tmp)))
    trainer = pl.Trainer(
        max_steps=args.steps,
        accelerator="cpu",
        devices=1,
        gradient_clip_val=1.0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp / f"pl-{watched}"),
        callbacks=callbacks,
    )
    loader = torch.utils.data.DataLoader(_batches(args), batch_size=None)
    trainer.fit(Module(), train_dataloaders=loader)
    return _diffs(clock.t)


def _diffs(stamps: list[float]) -> list[float]:
    return [b - a for a, b in zip(stamps[WARM:], stamps[WARM + 1 :], strict=False)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=16)
    args = ap.parse_args()
    logging.disable(logging.WARNING)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    print("machine:", json.dumps(machine()))
    runners = {"loop": loop_times, "hf": hf_times, "lightning": lightning_times}
    times = {(k, w): [] for k in runners for w in (False, True)}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.reps):
            for name, run in runners.items():
                for watched in (False, True) if r % 2 == 0 else (True, False):
                    times[name, watched] += run(args, watched, Path(tmp) / f"r{r}")
    out: dict[str, float] = {}
    for name in runners:
        off, on = median(times[name, False]), median(times[name, True])
        out[f"{name}_ratio"] = round(off / on, 4)
        out[f"{name}_step_ms_without"] = round(1e3 * off, 2)
        out[f"{name}_step_ms_with"] = round(1e3 * on, 2)
        print(
            f"{name}: {1e3 * off:.1f} ms/step without, {1e3 * on:.1f} ms with, ratio {off / on:.3f}"
        )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
