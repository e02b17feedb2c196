"""Muon in the Moonlight form, with AdamW for the parameters that are not hidden matrices.

Moonlight (Liu et al. 2025): Nesterov momentum 0.95, 5 Newton-Schulz steps with the quintic
coefficients (3.4445, -4.7750, 2.0315), the orthogonalised update scaled by 0.2*sqrt(max(A, B))
so its RMS matches AdamW's and one learning rate serves both, and decoupled weight decay.
One optimizer object holds both kinds of group (`use_muon`), so the loop, the schedule and the
checkpoint see a single `torch.optim.Optimizer`. It takes a device step factor
(trainer/model/optim/factor.py): a refused step leaves weights, momenta, moments and counts as
they were, with no host read.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from spikewatch.trainer.model.optim.factor import FactorStep, adamw_group, masked_grads, pick

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


class Muon(FactorStep, torch.optim.Optimizer):
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

    def _group_step(
        self, group: dict[str, Any], params: list[torch.Tensor], factor: torch.Tensor | None
    ) -> bool:
        if group["use_muon"]:
            self._muon_group(group, params, factor)
            return False  # Adam's bias corrections count steps; Muon's update does not
        adamw_group(self.state, group, params, factor)
        return True

    def _muon_group(
        self, group: dict[str, Any], params: list[torch.Tensor], factor: torch.Tensor | None
    ) -> None:
        lr, wd, mu = group["lr"], group["weight_decay"], group["momentum"]
        decay, keep = pick(factor, 1 - lr * wd, 1.0), pick(factor, mu, 1.0)
        for p, g in zip(params, masked_grads(params, factor), strict=True):
            state = self.state[p]
            if not state:
                state["momentum_buffer"] = torch.zeros_like(p)
            buf = state["momentum_buffer"]
            buf.mul_(keep).add_(g)  # refused: g is 0 and the buffer is kept
            u = newton_schulz(g.add(buf, alpha=mu), group["ns_steps"])  # Nesterov
            if factor is not None:
                u.mul_(factor)
            p.mul_(decay)
            p.add_(u, alpha=-lr * 0.2 * math.sqrt(max(p.shape)))
