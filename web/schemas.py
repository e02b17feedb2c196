"""Response shapes of the JSON API: derived from the store's dataclasses (`out_model`), never
written twice, so a field the store gains is served.

JSON has no NaN or infinity, and a spike that went non-finite must still reach the chart: such
values travel as the strings "nan", "inf" and "-inf".
"""

from __future__ import annotations

import typing
from dataclasses import fields as dc_fields
from dataclasses import is_dataclass
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, create_model

from spikewatch.observatory.reports.census import Census
from spikewatch.observatory.reports.sweeps import (
    Cell,
    CensusRow,
    Rate,
    SweepInfo,
    SweepReport,
    VariantSummary,
)
from spikewatch.observatory.store.queries import (
    BranchRow,
    Bucket,
    CheckpointRow,
    EventRow,
    Matrix,
    RunSummary,
    SampleRow,
    SeriesData,
)
from spikewatch.observatory.strict_json import tagged_number

__all__ = [
    "BranchOut",
    "BucketOut",
    "CheckpointOut",
    "EventOut",
    "SampleOut",
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


def out_model(
    dc: type, *, name: str | None = None, extra: dict[str, Any] | None = None
) -> type[BaseModel]:
    """The API shape of a store dataclass, derived from it (one definition: a field added to
    the store is in the API): every field, with a float (which may be NaN or infinite) as
    `Num`, and a nested dataclass as its registered shape; `extra` adds computed attributes
    (properties) as (type, default) pairs."""
    hints = typing.get_type_hints(dc)
    fields: dict[str, Any] = {f.name: (_api_type(hints[f.name]), ...) for f in dc_fields(dc)}
    fields.update(extra or {})
    model = create_model(name or f"{dc.__name__}Out", __base__=_Out, **fields)
    _SHAPES[dc] = model
    return model


_SHAPES: dict[type, type[BaseModel]] = {}


def many(model: type[BaseModel]) -> Any:
    """`list[model]` for a `response_model` (a derived shape is a value, not a static type)."""
    return list[model]  # type: ignore[valid-type]


def _api_type(tp: Any) -> Any:
    args = typing.get_args(tp)
    if tp is float or (float in args and type(None) in args and len(args) == 2):
        return Num
    origin = typing.get_origin(tp)
    if origin is list:
        return list[_api_type(args[0])]  # type: ignore[misc]
    if isinstance(tp, type) and is_dataclass(tp):
        return _SHAPES[tp]  # nested shapes are made first (below)
    return tp


RunOut = out_model(RunSummary, name="RunOut")
BucketOut = out_model(Bucket, name="BucketOut")
SeriesOut = out_model(SeriesData, name="SeriesOut")
MatrixOut = out_model(Matrix, name="MatrixOut")
EventOut = out_model(EventRow, name="EventOut")
BranchOut = out_model(BranchRow, name="BranchOut")
CheckpointOut = out_model(CheckpointRow, name="CheckpointOut")
SampleOut = out_model(SampleRow, name="SampleOut")
SweepOut = out_model(SweepInfo, name="SweepOut")
CensusOut = out_model(
    Census,
    name="CensusOut",
    extra={
        f"{k}_per_1k": (Num, None) for k in ("loss_spikes", "grad_spikes", "nonfinite", "rollbacks")
    },
)
RateOut = out_model(Rate, name="RateOut")
CensusRowOut = out_model(CensusRow, name="CensusRowOut")
CellOut = out_model(Cell, name="CellOut", extra={"diverged": (bool, ...)})
VariantOut = out_model(VariantSummary, name="VariantOut")
SweepReportOut = out_model(SweepReport, name="SweepReportOut")
