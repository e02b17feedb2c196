"""Metric names, spelled in one place. Namespaced `group/name`; per layer `layer/L/...`."""

from __future__ import annotations

LOSS = "train/loss"  # what backward saw: ce + z-loss term
CE = "train/ce"
Z_MEAN = "train/z_mean"  # mean log-sum-exp of the output logits (only with z-loss on)
GRAD_NORM = "optim/grad_norm"  # global, before clipping
CLIP_FACTOR = "optim/clip_factor"  # 1.0 = not clipped
LR = "optim/lr"
TOKENS_PER_S = "perf/tokens_per_s"
VAL_LOSS = "val/loss"


def attn_max(layer: int, head: int) -> str:
    """Max pre-softmax attention logit of one head."""
    return f"layer/{layer}/head/{head}/attn_max"
