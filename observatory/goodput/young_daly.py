"""Checkpoint intervals that minimise expected lost work: Young (1974) and Daly (2006).

With save cost C and mean time between failures M, Young's first-order optimum is
sqrt(2 C M); Daly's higher-order one is sqrt(2 C M) (1 + sqrt(C / 2M) / 3 + C / 18M) - C for
C < 2M (else M). The expected fraction of time lost at interval t is about C/t (saving) plus
(t + C) / 2M (rework after a failure, on average half an interval, plus the save in flight).
"""

from __future__ import annotations

import math
import re

__all__ = ["daly", "expected_overhead", "overhead", "parse_duration", "young"]

_UNITS = {"s": 1.0, "sec": 1.0, "min": 60.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def young(save_s: float, mtbf_s: float) -> float:
    _check(save_s, mtbf_s)
    return math.sqrt(2 * save_s * mtbf_s)


def daly(save_s: float, mtbf_s: float) -> float:
    _check(save_s, mtbf_s)
    if save_s >= 2 * mtbf_s:
        return mtbf_s
    r = math.sqrt(2 * save_s * mtbf_s)
    return r * (1 + math.sqrt(save_s / (2 * mtbf_s)) / 3 + save_s / (18 * mtbf_s)) - save_s


def overhead(interval_s: float, save_s: float, mtbf_s: float) -> float:
    """Expected fraction of wall time lost to saving and to rework after failures."""
    return save_s / interval_s + (interval_s + save_s) / (2 * mtbf_s)


def expected_overhead(
    interval_s: float, save_s: float, mtbf_s: float, restart_s: float = 0.0
) -> float:
    """The exact expected fraction of wall time lost under exponential failures (Daly 2006, eq.
    for the wall time of a segment: M e^(R/M) (e^((t + C)/M) - 1) per t of work), of which
    `overhead` is the first-order expansion: the two part as C/M grows."""
    _check(save_s, mtbf_s)
    wall = mtbf_s * math.exp(restart_s / mtbf_s) * math.expm1((interval_s + save_s) / mtbf_s)
    return 1 - interval_s / wall


def parse_duration(text: str) -> float:
    """'3.1h', '5min', '90s', '2d', or a bare number of seconds -> seconds."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[-+]?\d+)?)\s*([a-z]*)\s*", text.lower())
    if not m or m.group(2) not in {"", *_UNITS}:
        raise ValueError(f"not a duration: {text!r} (use e.g. 90s, 5min, 3.1h, 2d)")
    return float(m.group(1)) * (_UNITS[m.group(2)] if m.group(2) else 1.0)


def _check(save_s: float, mtbf_s: float) -> None:
    if save_s <= 0 or mtbf_s <= 0:
        raise ValueError(f"save cost and MTBF must be positive, got {save_s}, {mtbf_s}")
