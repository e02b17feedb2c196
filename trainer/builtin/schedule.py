"""Learning-rate schedules as pure functions of the step, so a checkpoint needs no scheduler state.

cosine: linear warmup, then cosine from the peak to `min_lr_ratio * peak` at `max_steps`.
wsd: linear warmup, a stable plateau, then a linear decay to the floor over the last
`decay_fraction` of the run (Hu et al. 2024, MiniCPM).
"""

from __future__ import annotations

import math

from spikewatch.trainer.config import ScheduleConfig

__all__ = ["lr_multiplier"]


def lr_multiplier(cfg: ScheduleConfig, step: int, max_steps: int) -> float:
    """Multiplier of the peak LR for 1-based `step` (the step about to be taken)."""
    s = step - 1
    if s < cfg.warmup_steps:
        return (s + 1) / cfg.warmup_steps
    floor = cfg.min_lr_ratio
    if cfg.name == "constant":
        return 1.0
    if cfg.name == "cosine":
        span = max(1, max_steps - cfg.warmup_steps - 1)
        progress = min(1.0, (s - cfg.warmup_steps) / span)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    decay_steps = max(1, round(cfg.decay_fraction * max_steps))
    decay_start = max(cfg.warmup_steps, max_steps - decay_steps)
    if s < decay_start:
        return 1.0
    progress = min(1.0, (s - decay_start + 1) / max(1, max_steps - decay_start))
    return 1.0 - (1.0 - floor) * progress
