"""Optional framework imports: a missing extra is a one-line error naming it."""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["require"]


def require(module: str, extra: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(
            f"spikewatch.{extra} needs {module.split('.')[0]}: pip install 'spikewatch[{extra}]'"
        ) from e
