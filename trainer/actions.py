"""What a callback may ask of the loop after seeing a step, before its update is applied."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Action", "Continue", "Halt", "Rollback", "SkipUpdate", "strongest"]


@dataclass(frozen=True)
class Continue:
    """Apply the update and go on; `pin` asks to pin the newest checkpoint with that reason
    (a pre-spike anchor that retention must keep); `lr_scale` multiplies the run's LR scale
    from the next step on (above 1 only to give back a cut made by an earlier rollback: the
    scale never exceeds 1)."""

    pin: str | None = None
    lr_scale: float = 1.0

    def __post_init__(self) -> None:
        if not 0 < self.lr_scale < float("inf"):
            raise ValueError(f"Continue.lr_scale must be positive, got {self.lr_scale}")


@dataclass(frozen=True)
class SkipUpdate:
    """Refuse this step's update: the weights and optimizer state stay as they were."""

    reason: str = ""
    info: dict = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class Halt:
    """Refuse this update and end the run cleanly (with a checkpoint), saying why."""

    reason: str
    info: dict = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class Rollback:
    """Restore the checkpoint of `to_step`, skip the batch-index ranges, scale the LR."""

    to_step: int
    skip_ranges: tuple[tuple[int, int], ...] = field(default_factory=tuple)
    lr_scale: float = 1.0
    reason: str = ""
    # Stored as the intervention record; the asking callback may add the outcome to it later.
    info: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if self.to_step < 0:
            raise ValueError(f"Rollback.to_step must be >= 0, got {self.to_step}")
        if not 0 < self.lr_scale <= 1:
            raise ValueError(f"Rollback.lr_scale must lie in (0, 1], got {self.lr_scale}")
        for start, end in self.skip_ranges:
            if end <= start:
                raise ValueError(f"empty skip range [{start}, {end})")


Action = Continue | SkipUpdate | Rollback | Halt

_RANK = {Continue: 0, SkipUpdate: 1, Rollback: 2, Halt: 3}


def strongest(actions: list[Action]) -> Action:
    """Halt beats Rollback beats SkipUpdate beats Continue; among equals the first (highest
    priority) wins."""
    best: Action = Continue()
    for a in actions:
        if _RANK[type(a)] > _RANK[type(best)]:
            best = a
    return best
