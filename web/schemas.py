"""Response shapes of the JSON API, apart from the store's rows.

JSON has no NaN or infinity, and a spike that went non-finite must still reach the chart: such
values travel as the strings "nan", "inf" and "-inf".
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from observatory.strict_json import tagged_number

__all__ = [
    "BranchOut",
    "BucketOut",
    "CheckpointOut",
    "EventOut",
    "MatrixOut",
    "RunOut",
    "SeriesOut",
    "SweepOut",
    "SweepReportOut",
]


Num = Annotated[float | str | None, BeforeValidator(tagged_number)]


class _Out(BaseModel):
    model_config = ConfigDict(from_attributes=True)


class ErrorOut(BaseModel):
    detail: str = Field(description="What was wrong, in words.")


def errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` for the error statuses a route can answer."""
    what = {
        400: "a value the store cannot use",
        401: "a bearer token is required",
        403: "control is off, or the token is wrong",
        404: "no such run, metric, branch or sweep",
        409: "the run is not running",
    }
    return {code: {"model": ErrorOut, "description": what[code]} for code in codes}


class RunOut(_Out):
    run_id: str
    name: str | None
    status: str
    tags: list[str]
    sweep_group: str | None
    hypothesis: str | None
    config: dict[str, Any]
    run_dir: str | None
    created_at: datetime
    updated_at: datetime
    ended_at: datetime | None
    branches: int
    last_step: int | None
    last_loss: Num
    spikes: int
    rollbacks: int


class BucketOut(_Out):
    start: int
    end: int
    n: int
    n_nan: int
    nan_step: int | None
    min_value: Num
    min_step: int | None
    max_value: Num
    max_step: int | None


class SeriesOut(_Out):
    run_id: str
    metric: str
    branch: int
    segments: list[tuple[int, int, int]]
    bucket_width: int
    buckets: list[BucketOut]


class MatrixOut(_Out):
    run_id: str
    metric: str
    branch: int
    rows: list[int]
    starts: list[int]
    bucket_width: int
    min_value: list[list[Num]]
    min_step: list[list[int | None]]
    max_value: list[list[Num]]
    max_step: list[list[int | None]]
    n: list[list[int]]
    n_nan: list[list[int]]


class EventOut(_Out):
    uid: str
    branch: int
    step: int | None
    kind: str
    source: str
    message: str
    data: dict[str, Any]
    created_at: datetime


class BranchOut(_Out):
    number: int
    parent: int | None
    fork_step: int | None
    reason: str | None
    created_at: datetime


class CheckpointOut(_Out):
    branch: int
    step: int
    path: str
    pinned: bool
    checksum_status: str
    created_at: datetime


class SweepOut(_Out):
    name: str
    hypothesis: str | None
    spec: dict[str, Any]
    created_at: datetime


class CellOut(_Out):
    variant: str
    lr: float
    seed: int
    run_id: str | None
    status: str
    last_step: int | None
    max_steps: int | None
    init_loss: Num
    final_train: Num
    final_val: Num
    peak_attn: Num
    spikes: int
    first_spike: int | None
    rollbacks: int
    recovery_steps: int
    diverged: bool


class VariantOut(_Out):
    variant: str
    val_by_lr: list[Num]
    peak_by_lr: list[Num]
    diverged_by_lr: list[bool]
    init_loss: Num
    best_loss: Num
    lr_sensitivity: Num
    spikes: int
    rollbacks: int
    done: int
    total: int


class SweepReportOut(_Out):
    group: str | None
    hypothesis: str | None
    created_at: datetime | None
    lrs: list[float]
    variants: list[VariantOut]
    cells: list[CellOut]
