"""JSON out without NaN or infinity, which jq, browsers and PostgreSQL reject. Two encodings,
each in one place: `strict` (null: summaries, where a missing number is the truth) and
`tagged` (the strings "nan", "inf", "-inf": event data and API values, where it must show)."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["strict", "tagged", "tagged_number", "write_json"]


def strict(obj: Any) -> Any:
    """`obj` with every non-finite float replaced by None (tuples become lists)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, Mapping):
        return {str(k): strict(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [strict(v) for v in obj]
    return obj


def tagged_number(v: Any) -> Any:
    """A non-finite float as the string "nan", "inf" or "-inf" (event data and API values,
    where a NaN must stay visible); anything else as it is."""
    if isinstance(v, float) and not math.isfinite(v):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
    return v


def tagged(obj: Any) -> Any:
    """`obj` with every non-finite float as `tagged_number` says (tuples become lists)."""
    if isinstance(obj, Mapping):
        return {str(k): tagged(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [tagged(v) for v in obj]
    return tagged_number(obj)


def write_json(path: str | os.PathLike[str], obj: Any) -> None:
    """Write strict JSON atomically (a temporary file, then a rename)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(json.dumps(strict(obj), indent=2, allow_nan=False))
    tmp.replace(p)
