"""Deliberate faults, for tests and the demo: real loss spikes on demand.

A fault is keyed by global *batch index*, not by step: it is a property of the data region,
so a rollback that skips those indices also skips the fault, exactly as skipping bad batches
does in a real run (PaLM). Kinds, with what ARCHITECTURE.md measured on a small model:
- "shifted_labels": targets shifted by one byte value (loss ~7.4, lasting harm ~+3%);
- "repeated_bytes": one byte repeated (a dramatic but harmless spike);
- "random_bytes": uniform random bytes (seeded by the index);
- "lr_scale": the learning rate times `factor` on those batches (x30 for 3 steps: +26%);
- "nan_loss": a non-finite loss (exercises the refusal of non-finite updates);
- "flaky_lr_scale": like "lr_scale", but only the first time a batch index is trained: a
  transient fault (think of a flipped bit) that a replay does not reproduce;
- "lr_ramp": the learning rate times factor^((i + 1) / length) on the i-th batch of the range,
  growing geometrically to `factor` at its last batch: a fault whose damage develops over many
  steps (a mis-set schedule), for measuring which signal warns before the loss moves;
- "bit_flip": the output logits computed wrong the first time a batch is trained (a device
  wrong once: a replay on it computes otherwise);
- "bad_device": the output logits computed wrong every time that rank computes those batches
  (a device wrong the same way each time: only another rank computing its rows tells it from
  bad data).

Under torchrun a fault applies to each rank's shard of the global batch; with `rank` set, to
that rank's shard only (a bad shard on one host); the device kinds follow the rank that
computes (`device_rank`), not the rows: another rank computing those rows computes them right.
With `rows` set, a data fault spoils only the first `rows` rows of each global batch (a few
bad samples among good ones: the per-sample attribution's test). The LR kinds cannot be
restricted to a rank or to rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spikewatch.trainer.config import FaultConfig

__all__ = ["DEVICE_KINDS", "FaultEffect", "apply_faults"]

DEVICE_KINDS = ("bit_flip", "bad_device")  # a rank's compute, not its data


@dataclass(frozen=True)
class FaultEffect:
    x: torch.Tensor
    y: torch.Tensor
    lr_factor: float = 1.0
    nan_loss: bool = False
    kinds: tuple[str, ...] = ()
    bit_flip: bool = False


def apply_faults(
    faults: list[FaultConfig],
    index: int,
    x: torch.Tensor,
    y: torch.Tensor,
    first_time: bool = True,
    rank: int = 0,
    row0: int = 0,
    device_rank: int | None = None,
) -> FaultEffect:
    """The batch `index` (rank `rank`'s shard of it, whose first row is global row `row0`) as
    the faults leave it (unchanged when none covers the index), computed on rank `device_rank`
    (default `rank`)."""
    lr, nan, flip, kinds = 1.0, False, False, []
    device = rank if device_rank is None else device_rank
    for f in faults:
        where = device if f.kind in DEVICE_KINDS else rank
        if not f.start <= index < f.start + f.length or f.rank not in (None, where):
            continue
        kinds.append(f.kind)
        bad_x, bad_y = x, y
        if f.kind == "shifted_labels":
            bad_y = (y + 1) % 256
        elif f.kind == "repeated_bytes":
            bad_x = torch.full_like(x, ord("a"))
            bad_y = torch.full_like(y, ord("a"))
        elif f.kind == "random_bytes":
            g = torch.Generator().manual_seed(index)
            buf = torch.randint(0, 256, (x.size(0), x.size(1) + 1), generator=g)
            bad_x, bad_y = buf[:, :-1].to(x.device), buf[:, 1:].to(y.device)
        elif f.kind == "lr_scale" or (f.kind == "flaky_lr_scale" and first_time):
            lr *= f.factor
        elif f.kind == "lr_ramp":
            lr *= f.factor ** ((index - f.start + 1) / f.length)
        elif f.kind == "nan_loss":
            nan = True
        elif (f.kind == "bit_flip" and first_time) or f.kind == "bad_device":
            flip = True
        x, y = _rows(f, x, bad_x, row0), _rows(f, y, bad_y, row0)
    return FaultEffect(x, y, lr, nan, tuple(kinds), flip)


def flip_bits(logits: torch.Tensor) -> torch.Tensor:
    """A device's wrong result: exponent bit 25 of every 20th element flipped (x16 or /16; on
    the fp32 logits, a deterministic pattern)."""
    out = logits.detach().clone().float()
    flat = out.view(-1)
    bits = flat[::20].view(torch.int32) ^ (1 << 25)
    flat[::20] = bits.view(torch.float32)
    return logits + (out.to(logits.dtype) - logits).detach()  # the wrong values, same graph


def _rows(f: FaultConfig, good: torch.Tensor, bad: torch.Tensor, row0: int) -> torch.Tensor:
    """`bad` on the fault's rows (all of them without `rows`), `good` elsewhere."""
    if f.rows is None or bad is good:
        return bad
    spoilt = torch.arange(row0, row0 + good.size(0), device=good.device) < f.rows  # (B,)
    return torch.where(spoilt[:, None], bad, good)
