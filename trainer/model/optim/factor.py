"""Optimizers that can refuse a step without the host: a step factor folded into the update.

On a GPU the host must not read a value between backward and the update (ARCHITECTURE.md, "the
GPU never waits for the host"): the decision to refuse an update (non-finite values, the
same-step tier) is a device tensor, `factor` (1.0 = apply, 0.0 = refuse), that the optimizer
folds into its arithmetic, as OLMo-core's skip-step optimizers do. Unlike theirs, a refused
step here leaves parameters, moments and the step count *exactly* as they were, non-finite
gradients included (0 * nan is nan, so the gradients are masked first, and the update is
divided by an infinite denominator rather than multiplied by 0).

The step count lives on the host (a Python int per parameter, as the bias corrections need it
as a number). A factor step counts at once, as if applied; the loop learns the factor from its
one host read and tells the optimizer (`settle`), which takes the count back if the step was
refused. Read at the step's end (the CPU default) that happens before the next step starts, so
the counts are torch's exactly. Read one step late (the GPU default: core/step_core.py), the
step right after a refused one runs with its bias corrections one step further along (1 - b^(k+1)
for 1 - b^k: ~0.1% for b2 = 0.999 after 1,000 steps) and the count is right again after it.

The step core (trainer/core/step_core.py) drives any `StepFactor`: spikewatch's `AdamW` and
the built-in Muon (the `FactorStep` mixin), and torch's own Adam / AdamW with `fused=True` (CUDA
or CPU), whose fused kernel takes a device `found_inf` flag (GradScaler's) and then leaves
parameters, moments and step counts untouched: `FoundInf` sets it from the factor. Other
optimizers keep the host path (the step's values are read before the update).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import torch
from torch.distributed.tensor import DTensor

__all__ = ["AdamW", "FactorStep", "FoundInf", "StepFactor", "factor_optimizer", "masked_grads"]

log = logging.getLogger(__name__)


class StepFactor(Protocol):
    """What the step core needs of an optimizer to refuse its next step on the device."""

    def set_step_factor(
        self, factor: torch.Tensor | None, refuse: torch.Tensor | None = None
    ) -> None: ...

    def settle(self, applied: bool) -> None: ...


class FactorStep:
    """Mixin for an optimizer whose next `step()` takes a device step factor.

    `set_step_factor(f)` before `step()` (f: a 0-dim float tensor on the parameters' device,
    1.0 or 0.0; None = a plain step), `settle(applied)` once the host knows whether it was
    applied (the step count moves only then)."""

    _factor: torch.Tensor | None = None
    _unsettled: list[tuple[torch.Tensor, list[torch.Tensor]]] | None = None  # (factor, params)
    # factor steps that may await their word when the next one starts: 1 for a loop that reads
    # one step late (the step core sets it), else 0 (the factor is read: a sync, logged)
    unsettled_allowed: int = 0

    def set_step_factor(
        self, factor: torch.Tensor | None, refuse: torch.Tensor | None = None
    ) -> None:
        self._factor = factor

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """One step of every group with gradients, the factor (if set) folded in."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        factor = self._take_factor()
        counted: list[torch.Tensor] = []
        for group in self.param_groups:  # type: ignore[attr-defined]
            params = [p for p in group["params"] if p.grad is not None]
            if params and self._group_step(group, params, factor):
                counted += params
        self._stepped(factor, counted)
        return loss

    def _group_step(
        self, group: dict[str, Any], params: list[torch.Tensor], factor: torch.Tensor | None
    ) -> bool:
        """Update one group's `params`; True when their step counts count this step."""
        raise NotImplementedError

    def _take_factor(self) -> torch.Tensor | None:
        """The factor of this step (consumed). Earlier steps beyond `unsettled_allowed` that
        still await their word are settled first by reading their factor (a sync, logged)."""
        while self._unsettled and len(self._unsettled) > self.unsettled_allowed:
            log.debug("%s: a step factor was not settled; reading it", type(self).__name__)
            self.settle(bool(self._unsettled[0][0]))
        factor, self._factor = self._factor, None
        return factor

    def _stepped(self, factor: torch.Tensor | None, params: list[torch.Tensor]) -> None:
        """After the update of `params`: counted now; a factor step is taken back if settled
        as refused."""
        self._count(params, 1)
        if factor is not None:
            self._unsettled = [*(self._unsettled or []), (factor, params)]

    def settle(self, applied: bool) -> None:
        """The host's word on the oldest factor step not yet settled: refused, its count is
        taken back."""
        if not self._unsettled:
            return
        (_, params), *self._unsettled = self._unsettled
        if not applied:
            self._count(params, -1)

    def _count(self, params: Iterable[torch.Tensor], by: int) -> None:
        state = self.state  # type: ignore[attr-defined]
        for p in params:
            state[p]["step"] = state[p]["step"] + by

    def state_dict(self) -> dict[str, Any]:
        """torch's format: step counts as float32 CPU tensors, so that torch's optimizer can
        load it too (the live state keeps them as host numbers)."""
        while self._unsettled:  # the count must be right in a checkpoint (reads the factor)
            self.settle(bool(self._unsettled[0][0]))
        out = super().state_dict()  # type: ignore[misc]
        out["state"] = {
            i: {k: torch.tensor(float(v)) if k == "step" else v for k, v in s.items()}
            for i, s in out["state"].items()
        }
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Also torch.optim.AdamW's state (its step counts are CPU tensors: read once here)."""
        self._unsettled = None
        super().load_state_dict(state_dict)  # type: ignore[misc]
        for s in self.state.values():  # type: ignore[attr-defined]
            if torch.is_tensor(s.get("step")):
                s["step"] = int(s["step"].item())


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2), else the tensor: the update is elementwise."""
    return t.to_local() if isinstance(t, DTensor) else t


class FoundInf:
    """torch's fused Adam / AdamW, refused on the device through its `found_inf` flag (the
    one GradScaler sets): 1.0 skips the whole update in the kernel and takes the step counts
    back. The refusal is folded in by a step pre-hook, as the step starts, into whatever flag
    is there then: a GradScaler's `step` sets its own `found_inf` just before it calls the
    optimizer, and would otherwise overwrite spikewatch's (a refused update applied). The flag
    is cleared once the step is settled, so a later plain step is a plain one."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self._refuse: torch.Tensor | None = None
        self._ours = False  # the flag is spikewatch's own (no GradScaler's step set one)
        optimizer.register_step_pre_hook(self._fold)

    def set_step_factor(
        self, factor: torch.Tensor | None, refuse: torch.Tensor | None = None
    ) -> None:
        """`refuse`: the flag (1.0 where the factor is 0) where the factor's op made it too
        (the same-step tier's, read late): no op on the loop thread to make it."""
        if factor is None:
            self._refuse = None
        else:
            self._refuse = (factor == 0).float() if refuse is None else refuse

    def _fold(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        refuse, self._refuse = self._refuse, None
        if refuse is None:
            return
        theirs = getattr(optimizer, "found_inf", None)  # a GradScaler's, set for this step
        self._ours = theirs is None
        optimizer.found_inf = refuse if theirs is None else torch.maximum(theirs, refuse)

    def settle(self, applied: bool) -> None:
        """Clear the flag spikewatch set; a GradScaler's is the scaler's to delete (its `step`
        does, after the optimizer's, which may be running still: Lightning's gated step)."""
        self._refuse = None
        if self._ours:
            self.optimizer.__dict__.pop("found_inf", None)
        self._ours = False


def _fused_adam(optimizer: Any) -> bool:
    return isinstance(optimizer, torch.optim.Adam) and all(
        g.get("fused") and not g.get("amsgrad") for g in optimizer.param_groups
    )


def factor_optimizer(optimizer: Any) -> StepFactor | None:
    """How to refuse `optimizer`'s step on the device (looking inside framework wrappers, as
    accelerate's and Lightning's), or None when it cannot be."""
    for _ in range(4):
        if isinstance(optimizer, FactorStep):
            return optimizer
        if _fused_adam(optimizer):
            return FoundInf(optimizer)
        optimizer = getattr(optimizer, "optimizer", None)
        if optimizer is None:
            return None
    return None


def inner_optimizer(optimizer: Any) -> Any:
    """The optimizer the user built, inside a framework's wrappers (accelerate's and
    Lightning's keep it as `.optimizer`)."""
    inner = optimizer
    for _ in range(4):
        nested = getattr(inner, "optimizer", None)
        if not isinstance(nested, torch.optim.Optimizer) or nested is inner:
            break
        inner = nested
    return inner


def optimizer_name(optimizer: Any) -> str:
    """The optimizer's class, and the one inside a framework's wrapper where there is one
    ('AdamW (inside AcceleratedOptimizer)'): what a user built, not what wraps it."""
    name, inner = type(optimizer).__name__, inner_optimizer(optimizer)
    return name if inner is optimizer else f"{type(inner).__name__} (inside {name})"


def masked_grads(params: Sequence[torch.Tensor], factor: torch.Tensor | None) -> list[torch.Tensor]:
    """The gradients (local shards) of `params`; zeroed in place where the step is refused,
    so that a non-finite gradient cannot reach the moments (0 * nan is nan)."""
    grads = [local(p.grad) for p in params]  # type: ignore[arg-type]
    if factor is not None:
        refused = factor == 0
        for g in grads:
            g.masked_fill_(refused, 0.0)
    return grads


def pick(factor: torch.Tensor | None, applied: float, refused: float) -> float | torch.Tensor:
    """`applied` as a number when there is no factor; else a 0-dim device tensor holding
    `applied` (as the float32 the kernels would use) or `refused`."""
    if factor is None:
        return applied
    return torch.where(factor > 0, applied, refused).to(factor.dtype)


# torch.optim.AdamW's other group settings, as this AdamW has them: a state_dict saved here loads
# into torch's AdamW (which would otherwise take a missing `decoupled_weight_decay` as Adam's L2)
_TORCH = dict(
    amsgrad=False,
    maximize=False,
    foreach=None,
    capturable=False,
    differentiable=False,
    fused=None,
    decoupled_weight_decay=True,
)


class AdamW(FactorStep, torch.optim.Optimizer):
    """torch.optim.AdamW's arithmetic (decoupled weight decay, its single-tensor code path: the
    same numbers to the bit), refusable on the device by a step factor.

    With factor 1 each line is torch's; with factor 0: the decay multiplies by 1, the moments'
    weights are 0 on a masked (zero) gradient, and the update's denominator is +inf, so the
    parameter gains exactly 0."""

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
    ) -> None:
        if lr < 0 or eps < 0 or weight_decay < 0 or not all(0 <= b < 1 for b in betas):
            raise ValueError(f"invalid AdamW settings: lr={lr}, betas={betas}, eps={eps}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, **_TORCH)
        super().__init__(params, defaults)

    def _group_step(
        self, group: dict[str, Any], params: list[torch.Tensor], factor: torch.Tensor | None
    ) -> bool:
        adamw_group(self.state, group, params, factor)
        return True


def adamw_group(
    state: Any, group: dict[str, Any], params: list[torch.Tensor], factor: torch.Tensor | None
) -> None:
    """One group's AdamW update (torch's single-tensor path), the factor folded in."""
    lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
    b1, b2 = group["betas"]
    decay = pick(factor, 1 - lr * wd, 1.0)
    w1, w2 = pick(factor, 1 - b1, 0.0), pick(factor, b2, 1.0)
    eps_t = pick(factor, eps, math.inf)  # refused: an infinite denominator, an update of 0
    for p, g in zip(params, masked_grads(params, factor), strict=True):
        s = state[p]
        if not s:
            s["step"] = 0  # a host number: the bias corrections need no device read
            s["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            s["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        t = s["step"] + 1
        x, m, v = local(p), local(s["exp_avg"]), local(s["exp_avg_sq"])
        x.mul_(decay)
        m.lerp_(g, as_dtype(w1, m.dtype))
        v.mul_(w2).addcmul_(g, g, value=1 - b2)  # refused: g is 0, so nothing is added
        denom = (v.sqrt() / (1 - b2**t) ** 0.5).add_(eps_t)
        x.addcdiv_(m, denom, value=-lr / (1 - b1**t))


def as_dtype(w: float | torch.Tensor, dtype: torch.dtype) -> float | torch.Tensor:
    """lerp's tensor weight must share the tensor's dtype (bf16 moments)."""
    return w if isinstance(w, float) or w.dtype == dtype else w.to(dtype)
