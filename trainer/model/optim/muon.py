"""Muon in the Moonlight form, with AdamW for the parameters that are not hidden matrices.

Moonlight (Liu et al. 2025): Nesterov momentum 0.95, 5 Newton-Schulz steps with the quintic
coefficients (3.4445, -4.7750, 2.0315), the orthogonalised update scaled by 0.2*sqrt(max(A, B))
so its RMS matches AdamW's and one learning rate serves both, and decoupled weight decay.
One optimizer object holds both kinds of group (`use_muon`), so the loop, the schedule and the
checkpoint see a single `torch.optim.Optimizer`.
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["Muon", "newton_schulz"]

NS_COEFFS = (3.4445, -4.7750, 2.0315)


def newton_schulz(g: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """Approximate the orthogonal factor U V^T of g (2-D); singular values land near 1."""
    a, b, c = NS_COEFFS
    dtype = torch.bfloat16 if g.is_cuda else torch.float32
    x = g.to(dtype)
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T
    x = x / (x.norm() + eps)
    for _ in range(steps):
        s = x @ x.T
        x = a * x + (b * s + c * s @ s) @ x
    if tall:
        x = x.T
    return x.to(g.dtype)


class Muon(torch.optim.Optimizer):
    """Groups with `use_muon=True` take the Muon update; the others take AdamW (torch's math)."""

    def __init__(
        self,
        params: list[dict[str, Any]],
        lr: float,
        momentum: float = 0.95,
        ns_steps: int = 5,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ) -> None:
        defaults = dict(
            lr=lr,
            momentum=momentum,
            ns_steps=ns_steps,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            use_muon=False,
        )
        super().__init__(params, defaults)
        for group in self.param_groups:
            if group["use_muon"] and any(p.ndim != 2 for p in group["params"]):
                raise ValueError("Muon groups may hold only 2-D weight matrices")

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["use_muon"]:
                self._muon_group(group)
            else:
                self._adamw_group(group)
        return loss

    def _muon_group(self, group: dict[str, Any]) -> None:
        lr, wd, mu = group["lr"], group["weight_decay"], group["momentum"]
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                state["momentum_buffer"] = torch.zeros_like(p)
            buf = state["momentum_buffer"]
            buf.mul_(mu).add_(p.grad)
            g = p.grad.add(buf, alpha=mu)  # Nesterov
            u = newton_schulz(g, group["ns_steps"])
            p.mul_(1 - lr * wd)
            p.add_(u, alpha=-lr * 0.2 * math.sqrt(max(p.shape)))

    def _adamw_group(self, group: dict[str, Any]) -> None:
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        b1, b2 = group["betas"]
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                state["step"] = 0  # a Python int: no device sync to read it
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
            state["step"] += 1
            t = state["step"]
            m, v, g = state["exp_avg"], state["exp_avg_sq"], p.grad
            p.mul_(1 - lr * wd)
            m.lerp_(g, 1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            denom = (v.sqrt() / math.sqrt(1 - b2**t)).add_(eps)
            p.addcdiv_(m, denom, value=-lr / (1 - b1**t))
