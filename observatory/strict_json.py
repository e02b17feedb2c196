"""Strict JSON out: NaN and infinity become null, since jq, browsers and PostgreSQL reject them."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["strict", "write_json"]


def strict(obj: Any) -> Any:
    """`obj` with every non-finite float replaced by None (tuples become lists)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, Mapping):
        return {str(k): strict(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [strict(v) for v in obj]
    return obj


def write_json(path: str | os.PathLike[str], obj: Any) -> None:
    """Write strict JSON atomically (a temporary file, then a rename)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(json.dumps(strict(obj), indent=2, allow_nan=False))
    tmp.replace(p)
