"""Metric names as the trainer spells them, split into (template, layer, head).

The trainer writes one flat namespace (`train/loss`, `layer/3/grad_norm`,
`layer/3/head/1/attn_max`). The store keeps per-layer and per-head values apart from scalars so
that a layer x step matrix is one indexed read, so each name is split into a template with `*`
for the indices (`layer/*/grad_norm`) and the indices themselves. `NO_INDEX` (-1) marks "not per
layer" / "not per head": a sentinel, not NULL, because NULLs never collide in a unique key and
series must be found again by that key.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from spikewatch.observatory import metric_names as M

__all__ = ["MAX_INDEX", "NO_INDEX", "MetricKey", "parse_name"]

NO_INDEX = -1
MAX_INDEX = 32767  # stored as SMALLINT
MAX_NAME_LEN = 200

_LAYER_HEAD = re.compile(r"^layer/(\d+)/head/(\d+)/(.+)$")
_LAYER = re.compile(r"^layer/(\d+)/(.+)$")
_RANK = re.compile(r"^rank/(\d+)/(.+)$")  # per rank (torchrun): a rank x step matrix, like layers


class MetricKey(NamedTuple):
    template: str  # e.g. "layer/*/head/*/attn_max"
    layer: int  # NO_INDEX for scalars
    head: int  # NO_INDEX unless per head


def parse_name(name: str) -> MetricKey:
    """Split a flat metric name; raise ValueError naming the metric when it cannot be stored."""
    if not isinstance(name, str) or not name or len(name) > MAX_NAME_LEN:
        raise ValueError(
            f"metric name must be a non-empty str of at most {MAX_NAME_LEN} chars: {name!r}"
        )
    if "*" in name or name != name.strip():
        raise ValueError(f"metric name may not contain '*' or surrounding spaces: {name!r}")
    if m := _LAYER_HEAD.match(name):
        key = MetricKey(f"{M.HEAD_PREFIX}{m[3]}", int(m[1]), int(m[2]))
    elif m := _LAYER.match(name):
        key = MetricKey(f"{M.LAYER_PREFIX}{m[2]}", int(m[1]), NO_INDEX)
    elif m := _RANK.match(name):
        key = MetricKey(f"{M.RANK_PREFIX}{m[2]}", int(m[1]), NO_INDEX)
    else:
        return MetricKey(name, NO_INDEX, NO_INDEX)
    if key.layer > MAX_INDEX or key.head > MAX_INDEX:
        raise ValueError(f"layer/head index above {MAX_INDEX} in metric name {name!r}")
    return key
