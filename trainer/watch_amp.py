"""fp16's GradScaler, as the Watch (trainer/watch.py) meets it: in a plain loop (the Watch steps
and updates it), inside accelerate's optimizer (its step steps and updates it) and under
Lightning's "16-mixed" (Lightning steps and updates it, calling the gated optimizer from inside
`GradScaler.step`). docs/device.md says why each rule is here.

- The Watch measures and clips true gradients: unscaled in place first, unless the framework
  did already this step; inside `GradScaler.step` of a fused optimizer the scaler has set
  `grad_scale` for the kernel to unscale, which would then be a second division: cleared.
- An overflow (inf/nan gradients) is the scaler's: its flag rides the step's transfer.
- A step the Watch refuses still leaves the scaler updated, else its next `unscale_` refuses.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["Scaling"]


class Scaling:
    """The GradScaler of a Watch's optimizer (None: fp32 / bf16, nothing to do)."""

    def __init__(self, optimizer: Any, scaler: Any = None) -> None:
        """`scaler`: the user's; without it, accelerate's (`AcceleratedOptimizer.scaler`),
        whose optimizer is the one inside the wrapper and whose step steps the scaler."""
        self.scaler: Any = scaler if scaler is not None else getattr(optimizer, "scaler", None)
        self.in_step = scaler is None and self.scaler is not None  # accelerate's wrapper
        self.optimizer: Any = optimizer.optimizer if self.in_step else optimizer
        self.overflowed = False  # the scaler skipped this step's optimizer call

    @property
    def on(self) -> bool:
        return self.scaler is not None and self.scaler.is_enabled()

    def _state(self) -> dict[str, Any] | None:
        return self.scaler._per_optimizer_states.get(id(self.optimizer))

    def unscale(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The gradients unscaled in place (unless done this step), and (the overflow flag,
        the scale) as device tensors; None without a scaler."""
        if not self.on:
            return None
        if self.scaler._scale is None:  # GradScaler makes its scale at its first scale()
            raise RuntimeError(
                "spikewatch was given a GradScaler that scaled no loss this step: backward "
                "scaler.scale(loss), not loss (or leave the scaler out)"
            )
        scale = self.scaler._scale.to(device, non_blocking=True).float()
        if self.overflowed:  # the scaler skipped the optimizer: its gradients hold inf/nan
            return torch.ones((), device=device), scale
        from torch.amp.grad_scaler import OptState

        state = self.scaler._per_optimizer_states[id(self.optimizer)]
        if state["stage"] is OptState.READY:
            self.scaler.unscale_(self.optimizer)
            if getattr(self.optimizer, "grad_scale", None) is not None:
                self.optimizer.grad_scale = None  # inside GradScaler.step (fused): done here
        found = [f.to(device, non_blocking=True) for f in state["found_inf_per_device"].values()]
        flag = torch.stack(found).sum() if found else torch.zeros((), device=device)
        return flag, scale

    def step(self, plain_step: Any) -> None:
        """A plain loop's update: through the scaler (which skips an overflow and sets its
        scale) when there is one."""
        if self.on:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            plain_step()

    def settle(self) -> None:
        """A refused step whose gradients were unscaled: the scaler is updated all the same
        (it backs off on an overflow; its next unscale_ would otherwise refuse to run)."""
        if not self.on:
            return
        from torch.amp.grad_scaler import OptState

        state = self._state()
        if state is not None and state["stage"] is not OptState.READY:
            self.scaler.update()
