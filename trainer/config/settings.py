"""What `Watch` (the user's own training) is configured by: the same sections as `TrainConfig`,
for a loop spikewatch does not own."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError

from spikewatch.trainer.config.legacy import rename_legacy
from spikewatch.trainer.config.sections import (
    CheckpointConfig,
    ConfigError,
    GuardConfig,
    ProbesConfig,
    _Section,
)

__all__ = ["WatchSettings"]

# The Watch's defaults: rollback targets in host memory ('auto': on a GPU every 5 to 25 steps,
# as the snapshot's measured cost allows, at most 0.5% of the step time; elsewhere every 25:
# trainer/checkpoints/memory.py), and on disk every 100 (for a crash: a resume reads only
# disk), written in the background (the loop waits only if its next update comes before the
# tensors are copied; a synchronous save with fsync cost the small benchmark step 0.6% of its
# time). Under torchrun the sharded save is synchronous whatever this says
# (trainer/checkpoints/sharded.py).
DISK_INTERVAL = 100
MEMORY_INTERVAL = "auto"
CHECKPOINT_DEFAULTS = {
    "interval": DISK_INTERVAL,
    "memory_interval": MEMORY_INTERVAL,
    "async_save": True,
}


class WatchSettings(_Section):
    """What `Watch` (the user's own training) needs; the same sections as `TrainConfig`."""

    name: str = Field("run", min_length=1, description="Run name; prefixes the run id.")
    max_steps: int | None = Field(
        None, ge=1, description="Planned optimizer steps, for the dashboard; None = unknown."
    )
    warmup_steps: int = Field(
        0, ge=0, description="Steps the detector ignores (the loss falls too fast for a level)."
    )
    grad_clip: float | None = Field(
        None,
        gt=0,
        description="Clip the global grad norm to this (done by the Watch, after it has "
        "measured the norm before clipping); None = no clipping.",
    )
    checkpoint: CheckpointConfig = Field(
        default_factory=lambda: CheckpointConfig(**CHECKPOINT_DEFAULTS),
        description="Retained checkpoints for rollback (interval None = detect only).",
    )
    probes: ProbesConfig = Field(default_factory=ProbesConfig, description="Telemetry.")
    guard: GuardConfig = Field(
        default_factory=GuardConfig,
        description="The spike guard: detection and automatic rollback. classify_cause takes "
        "effect where the Watch can draw a batch again (`batches(batch_at, loss_fn=...)`).",
    )
    blocklist: str | None = Field(
        None,
        description="A JSON-lines blocklist (`spikewatch quarantine`'s, `data-check`'s): the "
        "rows of `batches()` it names by (batch, row) or by id are left out of the run.",
    )
    distributed_timeout_s: float = Field(
        600.0,
        gt=0,
        description="Under torchrun: seconds the ranks wait for each other to agree a step's "
        "decision before the job fails (a rank that died never hangs the others for longer).",
    )

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    @classmethod
    def build(
        cls,
        settings: WatchSettings | Mapping[str, Any] | None,
        name: str | None = None,
        max_steps: int | None = None,
        grad_clip: float | None = None,
        warmup_steps: int | None = None,
        checkpoint_every: int | None = None,
        blocklist: str | Path | None = None,
    ) -> WatchSettings:
        """`settings` (a WatchSettings or its dict), the keywords that are not None on top."""
        base = settings.to_dict() if isinstance(settings, WatchSettings) else dict(settings or {})
        try:
            base = rename_legacy(base)
        except ValueError as e:
            raise ConfigError(f"invalid Watch settings: {e}") from e
        given = {"name": name, "max_steps": max_steps, "grad_clip": grad_clip}
        given["warmup_steps"] = warmup_steps
        given["blocklist"] = None if blocklist is None else str(blocklist)
        base.update({k: v for k, v in given.items() if v is not None})
        # a checkpoint section keeps the default intervals it does not set
        section = {**CHECKPOINT_DEFAULTS, **base.get("checkpoint", {})}
        if checkpoint_every is not None:
            section["interval"] = checkpoint_every
        base["checkpoint"] = section
        try:
            return cls.model_validate(base)
        except ValidationError as e:  # each key named, an unknown one with the allowed keys
            from spikewatch.trainer.config.load import format_error

            raise ConfigError(format_error(e, cls, "invalid Watch settings")) from None
