"""One training step's arithmetic: forward/backward over micro-batches, clipping, the update.

The loop decides *whether* to apply an update; these functions only compute. Everything stays on
device: the loop makes the step's single host transfer from what `forward_backward` returns.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from spikewatch.trainer.core.transfer import Clip, StepTensors, clip_by_global_norm
from spikewatch.trainer.model.gpt import GPT
from spikewatch.trainer.model.optim import qk_clip

__all__ = ["apply_update", "forward_backward", "forward_loss"]


def _autocast(device: torch.device, dtype: str) -> contextlib.AbstractContextManager:
    if dtype == "bfloat16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def forward_backward(
    model: torch.nn.Module,  # the GPT, or its DDP wrapper
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    micro_batch: int,
    dtype: str,
    need_attn_max: bool,
    grad_clip: float | None,
    need_logit_stats: bool = False,
    poison_nan: bool = False,
    clip: Clip | None = None,
    no_sync: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> StepTensors:
    """x, y: (B, T). Accumulates gradients of the mean loss over B; clips them in place.

    Under torchrun, `no_sync` holds back the gradient reduction on all but the last
    micro-batch, and `clip` is the sharded clipping of fsdp2 (trainer/core/world.py)."""
    n_micro = x.size(0) // micro_batch
    loss_sum = x.new_zeros((), dtype=torch.float32)
    ce_sum = torch.zeros_like(loss_sum)
    z_sum: torch.Tensor | None = None
    logit_max: torch.Tensor | None = None
    attn_max: torch.Tensor | None = None
    for i, (xm, ym) in enumerate(zip(x.split(micro_batch), y.split(micro_batch), strict=True)):
        with no_sync() if i < n_micro - 1 else contextlib.nullcontext():
            with _autocast(x.device, dtype):
                out = model(xm, ym, need_attn_max=need_attn_max, need_logit_stats=need_logit_stats)
            loss = out.loss * float("nan") if poison_nan else out.loss  # an injected fault
            (loss / n_micro).backward()
        loss_sum += loss.detach()
        ce_sum += out.ce
        if out.z_mean is not None:
            z_sum = out.z_mean if z_sum is None else z_sum + out.z_mean
        if out.logit_max is not None:
            logit_max = _max(logit_max, out.logit_max)
        if out.attn_max is not None:
            attn_max = _max(attn_max, out.attn_max)
    norm, factor, per_tensor = (clip or clip_by_global_norm)(list(model.parameters()), grad_clip)
    return StepTensors(
        loss=loss_sum / n_micro,
        ce=ce_sum / n_micro,
        grad_norm=norm,
        clip_factor=factor,
        z_mean=None if z_sum is None else z_sum / n_micro,
        logit_max=logit_max,
        attn_max=attn_max,
        grad_norms=per_tensor,
    )


@torch.no_grad()
def forward_loss(
    model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, *, micro_batch: int, dtype: str
) -> torch.Tensor:
    """The mean loss `forward_backward` would report for x, y, forward only."""
    total = x.new_zeros((), dtype=torch.float32)
    n_micro = x.size(0) // micro_batch
    for xm, ym in zip(x.split(micro_batch), y.split(micro_batch), strict=True):
        with _autocast(x.device, dtype):
            total += model(xm, ym).loss.float()
    return total / n_micro


def _max(a: torch.Tensor | None, b: torch.Tensor) -> torch.Tensor:
    return b if a is None else torch.maximum(a, b)


def apply_update(
    model: GPT,
    optimizer: torch.optim.Optimizer,
    lr_mult: float,
    attn_max: torch.Tensor | None,
    qk_clip_tau: float | None,
    factor: torch.Tensor | None = None,
) -> None:
    """Set this step's LR on every group, step the optimizer (which folds in the step factor
    the core gave it, if any), then QK-Clip if asked (not on a refused step)."""
    for group in optimizer.param_groups:
        group["lr"] = group["base_lr"] * lr_mult
    optimizer.step()
    if qk_clip_tau is not None and attn_max is not None:
        qk_clip(model.attention_modules(), attn_max, qk_clip_tau, factor)
