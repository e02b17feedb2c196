"""What a callback may ask of the loop after seeing a step, before its update is applied, and
what it tells the run's record (`Note`). Everything that travels is a frozen dataclass: the
loop keeps its own records and no callback writes into another's."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["Action", "Continue", "Halt", "Note", "Rollback", "SkipUpdate", "Spike", "strongest"]


@dataclass(frozen=True)
class Spike:
    """What the spike guard knew when it asked for a rollback or a halt: the verdict, the loss
    level before the spike and at its peak, and the (step, batch index) pairs to replay to
    tell its cause (empty: no replay): the spike's own batches, and `control`, batches the run
    trained on without trouble before the restore point, for the same steps (a spike that
    comes back on those is the state's, not the data's)."""

    onset_step: int
    detect_step: int
    peak_step: int
    score: float
    signal: str = "loss"
    repeats: int = 0  # rollbacks within the policy's repeat window before this one
    pre_spike_loss: float | None = None
    peak_loss: float | None = None
    replay: tuple[tuple[int, int], ...] = ()
    control: tuple[tuple[int, int], ...] = ()
    ranks: tuple[int, ...] = ()  # under torchrun: the ranks whose own loss departed
    # under torchrun: each rolled-back step's own loss on every rank, as first computed
    rank_losses: tuple[tuple[int, tuple[float, ...]], ...] = ()

    def record(self) -> dict[str, Any]:
        """The fields an intervention record carries (JSON types)."""
        out = asdict(self)
        out["replay"] = [list(r) for r in self.replay]
        out["control"] = [list(r) for r in self.control]
        out["ranks"] = list(self.ranks)
        out["rank_losses"] = [[s, list(v)] for s, v in self.rank_losses]
        return out

    @classmethod
    def from_record(cls, d: Mapping[str, Any]) -> Spike:
        fields = {k: d[k] for k in cls.__dataclass_fields__ if k in d}
        fields["replay"] = tuple((int(s), int(b)) for s, b in d.get("replay", ()))
        fields["control"] = tuple((int(s), int(b)) for s, b in d.get("control", ()))
        fields["ranks"] = tuple(int(r) for r in d.get("ranks", ()))
        fields["rank_losses"] = tuple(
            (int(s), tuple(float(x) for x in v)) for s, v in d.get("rank_losses", ())
        )
        return cls(**fields)


@dataclass(frozen=True)
class Note:
    """For the run's record (the Recorder stores it as an event): a detector verdict ("spike",
    "nonfinite") or a "note" (a warning, a rollback's outcome, an LR cut given back...)."""

    step: int
    kind: str
    message: str
    data: Mapping[str, Any] = field(default_factory=dict)
    source: str = "detector"


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


@dataclass(frozen=True)
class Halt:
    """Refuse this update and end the run cleanly (with a checkpoint), saying why."""

    reason: str
    spike: Spike | None = None


@dataclass(frozen=True)
class Rollback:
    """Restore the checkpoint of `to_step`, skip the batch-index ranges, scale the LR."""

    to_step: int
    skip_ranges: tuple[tuple[int, int], ...] = field(default_factory=tuple)
    lr_scale: float = 1.0
    reason: str = ""
    spike: Spike | None = None  # what the spike guard saw (None: a request, a user callback)

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
