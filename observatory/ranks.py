"""Which ranks' data (or devices) departed: the seed of per-rank outlier detection.

Under torchrun every rank trains its share of the global batch and reports its own loss
(`rank/<r>/loss`); the detector watches their mean. When a spike is found, each rank's
excursion is its largest log-loss from the onset to the detection step over its own median
before the onset. A rank departed when its excursion is at least half the largest one (and
clearly above noise): a poisoned shard names its rank alone, a fault every rank shares (a bad
learning rate, a bad global state) names them all. A rank that keeps departing with no data
cause is a suspect device; Megatron re-runs steps to find such ranks, this points at them from
telemetry the run already has.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence

__all__ = ["MIN_EXCURSION", "departed_ranks"]

MIN_EXCURSION = 0.05  # in log-loss: below it no rank departed (the noise of a step's loss)


def departed_ranks(
    rank_losses: Mapping[int, Sequence[float]], onset_step: int, detect_step: int, window: int = 50
) -> list[int]:
    """`rank_losses`: step -> every rank's own loss (rank order). The ranks that departed at a
    spike with this onset and detection step (empty: no per-rank losses, or none departed)."""
    before = [v for s, v in rank_losses.items() if onset_step - window <= s < onset_step]
    during = [v for s, v in rank_losses.items() if onset_step <= s <= detect_step]
    if not before or not during:
        return []
    n = min(len(v) for v in before + during)
    excursions = []
    for r in range(n):
        base = [math.log(v[r]) for v in before if 0 < v[r] < math.inf]
        if not base:
            return []
        level = statistics.median(base)
        peak = max((_log(v[r]) for v in during), default=-math.inf)
        excursions.append(peak - level)
    top = max(excursions)
    if not top > MIN_EXCURSION:
        return []
    return [r for r, e in enumerate(excursions) if e >= 0.5 * top]


def _log(x: float) -> float:
    return math.log(x) if 0 < x < math.inf else math.inf
