"""Metric names, spelled in one place, on the ground floor: the trainer writes them, the
observatory detects and reports on them, the dashboard draws them, and all three import them
from here (observatory/ imports neither trainer/ nor web/).

Names are namespaced `group/name`; per layer `layer/<layer>/<stat>`, where <layer> is a block
index with the child module (`3/attn`, `3/self_attn`) or a module path (`embed`,
`model.embed_tokens`); per head `layer/<i>/head/<h>/attn_max`. The store keeps per-layer and
per-head values under *templates* with `*` for the indices (`layer/*/attn/grad_norm`).
"""

from __future__ import annotations

from collections.abc import Iterable

LOSS = "train/loss"  # what backward saw: ce + z-loss term
CE = "train/ce"
Z_MEAN = "train/z_mean"  # mean log-sum-exp of the output logits
LOGIT_MAX = "train/logit_max"  # max output logit
GRAD_NORM = "optim/grad_norm"  # global, before clipping
CLIP_FACTOR = "optim/clip_factor"  # 1.0 = not clipped
LOSS_SCALE = "amp/loss_scale"  # a GradScaler's scale (fp16): halved at each overflow
LR = "optim/lr"
TOKENS_PER_S = "perf/tokens_per_s"
VAL_LOSS = "val/loss"

# Per-layer statistics (the <stat> of `layer/<layer>/<stat>`)
STAT_GRAD_NORM = "grad_norm"
STAT_PARAM_NORM = "param_norm"
STAT_UPDATE_NORM = "update_norm"
STAT_UPDATE_RATIO = "update_ratio"
STAT_ADAM_M_NORM = "adam_m_norm"
STAT_ADAM_SQRT_V_MEAN = "adam_sqrt_v_mean"
STAT_ADAM_SQRT_V_MAX = "adam_sqrt_v_max"
STAT_ADAM_V_TINY_FRAC = "adam_v_tiny_frac"
STAT_MUON_MOMENTUM_NORM = "muon_momentum_norm"
STAT_ATTN_MAX = "attn_max"

ATTN_PART = "attn"  # the built-in GPT's name for a block's attention module
LAYER_PREFIX = "layer/*/"  # every per-layer template starts so
HEAD_PREFIX = "layer/*/head/*/"  # and every per-head one so
LAYER_ATTN_MAX = f"{LAYER_PREFIX}{STAT_ATTN_MAX}"  # template: max logit over a layer's heads
HEAD_ATTN_MAX = f"{HEAD_PREFIX}{STAT_ATTN_MAX}"  # template: max logit of each head


def attn_max(layer: int, head: int) -> str:
    """Max pre-softmax attention logit of one head."""
    return f"layer/{layer}/head/{head}/{STAT_ATTN_MAX}"


def layer_attn_max(layer: int) -> str:
    """Max pre-softmax attention logit over the heads of one block."""
    return f"layer/{layer}/{STAT_ATTN_MAX}"


CKPT_MEMORY_BYTES = "checkpoint/memory_bytes"  # the host-memory tier's snapshots, this rank
CKPT_MEMORY_INTERVAL = "checkpoint/memory_interval"  # steps between snapshots ('auto': measured)


def checkpoint_stall(tier: str) -> str:
    """Seconds a save to `tier` ("memory", "disk") blocked the loop."""
    return f"checkpoint/{tier}_stall_s"


RANK_PREFIX = "rank/*/"  # every per-rank template starts so (stored with the rank as its row)
RANK_LOSS = f"{RANK_PREFIX}loss"  # template: the loss of each rank's own data (torchrun)


def rank_loss(rank: int) -> str:
    """The loss of one rank's own data, its share of the global batch (torchrun only)."""
    return f"rank/{rank}/loss"


def layer(name: str, stat: str) -> str:
    """A per-layer statistic; `name` is 'embed', '<i>/attn', '<i>/mlp', 'lm_head', or a
    module of the user's model ('<i>/self_attn', 'model.embed_tokens')."""
    return f"layer/{name}/{stat}"


def template(stat: str, part: str | None = None) -> str:
    """The store's template of a per-layer statistic: `layer/*/<part>/<stat>`."""
    return f"{LAYER_PREFIX}{part}/{stat}" if part else f"{LAYER_PREFIX}{stat}"


def is_per_layer(name: str, stat: str) -> bool:
    """A flat per-layer name of this statistic (not a per-head one)."""
    return name.endswith(f"/{stat}") and "/head/" not in name


# The one tag table of `spikewatch scan`, `spikewatch follow` and docs/follow.md: what other
# trainers' logs call the training loss and the gradient norm, by priority (the first one a log
# has is its loss), stored under LOSS and GRAD_NORM. tests/observatory/test_tag_table.py writes
# a log with each and reads it through both commands.
FOREIGN_LOSS_TAGS = (
    LOSS,  # spikewatch; HF Trainer's TensorBoard log ("train/" + its "loss")
    "loss",  # HF Trainer's JSON / CSV logs, nanoGPT-style loops
    "train_loss",  # Lightning, self.log("train_loss", ...)
    "train_loss_step",  # Lightning with on_step=True, on_epoch=True
    "loss_metrics/global_avg_loss",  # torchtitan
    "lm loss",  # Megatron-LM
    "Loss/train",  # PyTorch's TensorBoard tutorial
    "train/loss_step",
)
FOREIGN_GRAD_NORM_TAGS = (
    GRAD_NORM,
    "train/grad_norm",  # HF Trainer
    "grad_norm",  # torchtitan, Lightning users
    "grad-norm",  # Megatron-LM
    "gradient_norm",
)
# The step column of CSV and JSON-lines logs
FOREIGN_STEP_KEYS = ("step", "global_step", "iteration", "iter", "_step")


def foreign_loss_tag(tags: Iterable[str]) -> str | None:
    """The loss among a log's tags: the first of FOREIGN_LOSS_TAGS it has."""
    present = set(tags)
    return next((t for t in FOREIGN_LOSS_TAGS if t in present), None)
