"""The same-step tier: refuse an isolated extreme update on the step it happens, decided on device.

OLMo-core's answer to a one-batch blow-up (its skip-step optimizers): compare the step's loss
and gradient norm with their rolling mean and standard deviation over the last `window`
accepted steps, and refuse the update when either lies more than `sigma` deviations above. Here
the statistics live in device tensors and the verdict is a device tensor computed right after
backward (log-space, like the detector, so the multiplicative noise of a loss is one scale). It
rides the step's one host transfer with every other value, so the tier adds no
synchronisation; the loop then refuses the update (a `SkipUpdate`, recorded as a skip) before
`optimizer.step`.

The spike guard's rollback stays the tier for what persists: after `max_refusals` refusals in a
row the tier lets the next extreme update through (and learns from it), so a spike that keeps
coming reaches the detector as consecutive excursions and is rolled back, and a real new level
is learnt instead of being refused for ever. Non-finite values are the loop's (always refused)
and never enter the statistics.
"""

from __future__ import annotations

from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field

__all__ = ["SameStepConfig", "SameStepGate"]

_RIDES = ["_same_step_refuse", "_same_step_z_loss", "_same_step_z_grad"]  # never stored


class SameStepConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(
        True, description="Refuse an isolated extreme update on its own step (no rollback)."
    )
    window: int = Field(128, ge=8, description="Accepted steps in the rolling statistics.")
    min_history: int = Field(32, ge=4, description="Accepted steps before the tier can refuse.")
    sigma: float = Field(6.0, gt=0, description="Deviations above the rolling mean that refuse.")
    max_refusals: int = Field(
        2, ge=1, description="Refusals in a row; the next extreme update goes through."
    )
    floor: float = Field(
        0.01, gt=0, description="Smallest deviation in log units (a perfectly flat history)."
    )


class SameStepGate:
    """Per step: `check(loss, grad_norm)` -> a (3,) device tensor (refuse 0/1, z of the loss,
    z of the grad norm); the rolling statistics are updated on device in the same call."""

    def __init__(self, cfg: SameStepConfig, device: torch.device) -> None:
        self.cfg = cfg
        self.device = device
        self.values = torch.zeros(2, cfg.window, device=device)  # log loss, log grad norm
        self.count = torch.zeros((), dtype=torch.long, device=device)  # accepted, <= window
        self.pos = torch.zeros((), dtype=torch.long, device=device)
        self.refused = torch.zeros((), dtype=torch.long, device=device)  # refusals in a row
        self._slots = torch.arange(cfg.window, device=device)

    @torch.no_grad()
    def check(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        x = torch.stack([loss.detach().float(), grad_norm.detach().float()]).log()
        finite = torch.isfinite(x).all()
        valid = (self._slots < self.count).float()  # (window,)
        n = valid.sum().clamp(min=1.0)
        mean = (self.values * valid).sum(dim=1) / n
        var = ((self.values - mean[:, None]).square() * valid).sum(dim=1) / (n - 1).clamp(min=1)
        z = (x - mean) / var.sqrt().clamp(min=cfg.floor)
        extreme = (self.count >= cfg.min_history) & finite & (z > cfg.sigma).any()
        refuse = extreme & (self.refused < cfg.max_refusals)
        learn = finite & ~refuse  # a normal value, or an extreme one let through
        slot = self._slots == self.pos
        self.values.copy_(torch.where(slot & learn, x[:, None].nan_to_num(), self.values))
        step = learn.long()
        self.pos.copy_((self.pos + step) % cfg.window)
        self.count.copy_((self.count + step).clamp(max=cfg.window))
        self.refused.copy_(torch.where(refuse, self.refused + 1, torch.zeros_like(self.refused)))
        return torch.stack([refuse.float(), z[0], z[1]])

    def ride(self, xfer: Any, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        """Check this step, the verdict riding the step's host transfer (`step.HostTransfer`)."""
        xfer.add(_RIDES, self.check(loss, grad_norm))

    def verdict(self, metrics: dict[str, float]) -> str:
        """After the transfer: take the tier's values out of `metrics`; the reason of a
        refusal, or "" for an update that may go on."""
        refuse, z_loss, z_grad = (metrics.pop(name) for name in _RIDES)
        return self.reason(z_loss, z_grad, self.cfg.sigma) if refuse > 0 else ""

    def reset(self) -> None:
        """Forget the history (the loss moved to a new level on purpose, or was accepted as
        one): the tier re-arms after `min_history` steps."""
        self.count.zero_()
        self.pos.zero_()
        self.refused.zero_()

    @staticmethod
    def reason(z_loss: float, z_grad: float, sigma: float) -> str:
        what = [
            f"{name} {z:.1f} deviations above its rolling mean"
            for name, z in (("loss", z_loss), ("grad norm", z_grad))
            if z > sigma
        ]
        return f"same-step tier: {' and '.join(what)}: update refused"

    def state_dict(self) -> dict[str, Any]:
        """For the checkpoint (one host copy, at save time only)."""
        return {
            "values": self.values.cpu().tolist(),
            "count": int(self.count),
            "pos": int(self.pos),
            "refused": int(self.refused),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        values = torch.tensor(state["values"], dtype=torch.float32)
        if values.shape != self.values.shape:  # another window: start the history afresh
            self.reset()
            return
        self.values.copy_(values.to(self.device))
        self.count.fill_(int(state["count"]))
        self.pos.fill_(int(state["pos"]))
        self.refused.fill_(int(state["refused"]))
