"""Optimizers: AdamW, Muon (Moonlight form) and MuonClip (Muon + per-head QK-Clip), each
taking a device step factor (optim/factor.py), so that a refused update needs no host read.

No weight decay on embeddings, norms or gains. Under Muon, 2-D hidden weights take the Muon
update and the embedding, the output head and the gains take AdamW.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from spikewatch.trainer.config import OptimConfig
from spikewatch.trainer.model.gpt import GPT, param_kind
from spikewatch.trainer.model.optim.factor import AdamW
from spikewatch.trainer.model.optim.muon import Muon, newton_schulz
from spikewatch.trainer.model.optim.qk_clip import qk_clip

__all__ = ["AdamW", "Muon", "build_optimizer", "newton_schulz", "param_groups", "qk_clip"]


def param_groups(model: GPT, cfg: OptimConfig) -> list[dict[str, Any]]:
    """Named parameter groups; tied weights appear once (as the embedding)."""
    use_muon = cfg.name in ("muon", "muonclip")
    buckets: dict[str, list[torch.nn.Parameter]] = {"matrix": [], "decay": [], "no_decay": []}
    for name, p in model.named_parameters():  # named_parameters() yields a tied weight once
        kind = param_kind(name, p)
        if kind == "matrix":
            buckets["matrix" if use_muon else "decay"].append(p)
        elif kind == "head":
            buckets["decay"].append(p)
        else:
            buckets["no_decay"].append(p)
    groups = []
    if use_muon:
        groups.append(dict(name="muon", params=buckets["matrix"], use_muon=True))
    groups.append(dict(name="decay", params=buckets["decay"], weight_decay=cfg.weight_decay))
    groups.append(dict(name="no_decay", params=buckets["no_decay"], weight_decay=0.0))
    groups = [g for g in groups if g["params"]]
    for g in groups:
        g["base_lr"] = cfg.lr
    return groups


def build_optimizer(model: GPT, cfg: OptimConfig) -> torch.optim.Optimizer:
    groups = param_groups(model, cfg)
    if cfg.name == "adamw":
        params = [p for g in groups for p in g["params"]]
        if all(p.is_cuda and not isinstance(p, DTensor) for p in params):
            # torch's fused kernel: one launch for all tensors, refused through its found_inf
            return torch.optim.AdamW(
                groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay,
                fused=True,
            )  # fmt: skip
        # torch's arithmetic, refusable on the device (optim/factor.py)
        return AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)
    return Muon(
        groups,
        lr=cfg.lr,
        momentum=cfg.muon_momentum,
        ns_steps=cfg.ns_steps,
        betas=cfg.betas,
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
    )
