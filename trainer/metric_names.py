"""Metric names, spelled in one place. Namespaced `group/name`; per layer `layer/L/...`."""

from __future__ import annotations

LOSS = "train/loss"  # what backward saw: ce + z-loss term
CE = "train/ce"
Z_MEAN = "train/z_mean"  # mean log-sum-exp of the output logits
LOGIT_MAX = "train/logit_max"  # max output logit
GRAD_NORM = "optim/grad_norm"  # global, before clipping
CLIP_FACTOR = "optim/clip_factor"  # 1.0 = not clipped
LR = "optim/lr"
TOKENS_PER_S = "perf/tokens_per_s"
VAL_LOSS = "val/loss"


def attn_max(layer: int, head: int) -> str:
    """Max pre-softmax attention logit of one head."""
    return f"layer/{layer}/head/{head}/attn_max"


def layer_attn_max(layer: int) -> str:
    """Max pre-softmax attention logit over the heads of one block."""
    return f"layer/{layer}/attn_max"


def layer(name: str, stat: str) -> str:
    """A per-layer statistic; `name` is 'embed', '<i>/attn', '<i>/mlp' or 'lm_head'."""
    return f"layer/{name}/{stat}"
