"""One training step's arithmetic: forward/backward over micro-batches, clipping, the update.

The loop decides *whether* to apply an update; these functions only compute. Everything stays on
device: the loop makes the step's single host transfer from what `forward_backward` returns.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from trainer.model.gpt import GPT
from trainer.model.optim import qk_clip

__all__ = ["HostTransfer", "StepTensors", "apply_update", "forward_backward"]


@dataclass
class StepTensors:
    """Device tensors of one step, before the host transfer."""

    loss: torch.Tensor  # () mean over micro-batches of ce + z-loss term
    ce: torch.Tensor  # ()
    grad_norm: torch.Tensor  # () global, before clipping
    clip_factor: torch.Tensor  # () min(1, max_norm / norm)
    z_mean: torch.Tensor | None  # ()
    logit_max: torch.Tensor | None  # ()
    attn_max: torch.Tensor | None  # (L, nh) over the whole global batch
    grad_norms: torch.Tensor  # (P,) per parameter, in model.parameters() order, pre-clip
    stop: torch.Tensor | None = None  # () ranks asked to stop (torchrun only), agreed by all


# (parameters, max norm) -> (total norm, clip factor, per-tensor norms), clipping in place
Clip = Callable[[list[torch.Tensor], float | None], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


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


def _max(a: torch.Tensor | None, b: torch.Tensor) -> torch.Tensor:
    return b if a is None else torch.maximum(a, b)


def clip_by_global_norm(
    params: Sequence[torch.Tensor], max_norm: float | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """torch.nn.utils.clip_grad_norm_'s arithmetic, keeping the per-tensor norms it computes
    (the per-layer grad-norm probe then costs nothing). Returns (total, factor, per-tensor)."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    per_tensor = torch.stack(torch._foreach_norm(grads))  # (P,)
    total = torch.linalg.vector_norm(per_tensor)
    if max_norm is None:
        return total, torch.ones_like(total), per_tensor
    factor = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    torch._foreach_mul_([p.grad for p in params if p.grad is not None], factor)
    return total, factor, per_tensor


def apply_update(
    model: GPT,
    optimizer: torch.optim.Optimizer,
    lr_mult: float,
    attn_max: torch.Tensor | None,
    qk_clip_tau: float | None,
) -> None:
    """Set this step's LR on every group, step the optimizer, then QK-Clip if asked."""
    for group in optimizer.param_groups:
        group["lr"] = group["base_lr"] * lr_mult
    optimizer.step()
    if qk_clip_tau is not None and attn_max is not None:
        qk_clip(model.attention_modules(), attn_max, qk_clip_tau)


class HostTransfer:
    """Named device tensors gathered into one host copy (the loop's one sync per step)."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.late: list[bool] = []
        self.parts: list[torch.Tensor] = []

    def add(self, names: list[str], values: torch.Tensor, late: bool = False) -> None:
        if names:
            self.names += names
            self.late += [late] * len(names)
            self.parts.append(values.detach().float().reshape(-1))

    def fetch(self) -> tuple[dict[str, float], dict[str, float]]:
        values = torch.cat(self.parts).tolist()
        now, late = {}, {}
        for name, is_late, v in zip(self.names, self.late, values, strict=True):
            (late if is_late else now)[name] = v
        return now, late
