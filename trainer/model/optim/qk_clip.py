"""QK-Clip (Kimi K2): bound each head's max attention logit at tau by rescaling W_q and W_k.

After an update, every head whose max pre-softmax logit S (from this step's forward) exceeded
tau has its rows of W_q and W_k multiplied by sqrt(tau / S): q.k scales by tau / S, so the same
inputs give exactly tau. Heads at or below tau are untouched. It runs on device with no host
sync, after any optimizer (MuonClip = Muon + this; `optim.qk_clip_tau` adds it to AdamW).
With QK-norm on, the norms undo a rescale of W_q / W_k, so QK-Clip has no effect there.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from spikewatch.trainer.model.gpt import Attention

__all__ = ["qk_clip"]


@torch.no_grad()
def qk_clip(
    attn: Sequence[Attention],
    attn_max: torch.Tensor,
    tau: float,
    factor: torch.Tensor | None = None,
) -> torch.Tensor:
    """attn_max: (L, nh) max logits; `factor` the step factor (0: a refused step, left alone).
    Returns the (L, nh) logit scale applied (1 = untouched)."""
    over = attn_max > tau
    if factor is not None:
        over = over & (factor > 0)
    gamma = torch.where(over, tau / attn_max, torch.ones_like(attn_max))  # (L, nh)
    for layer, mod in enumerate(attn):
        rows = gamma[layer].sqrt().repeat_interleave(mod.head_dim)[:, None]  # (d, 1)
        mod.q_proj.weight.mul_(rows.to(mod.q_proj.weight.dtype))
        mod.k_proj.weight.mul_(rows.to(mod.k_proj.weight.dtype))
    return gamma
