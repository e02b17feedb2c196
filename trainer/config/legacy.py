"""Names an older spikewatch used, read with a warning: the `watch` section is now `guard` (the
spike guard's settings; "watch" named four things). Configs, `--set` keys and the config.json of
runs written before the rename keep working."""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["rename_legacy", "rename_legacy_key"]

log = logging.getLogger(__name__)

_RENAMED = {"watch": "guard"}


def rename_legacy(raw: dict[str, Any]) -> dict[str, Any]:
    """A copy of a config dict with renamed top-level sections under their new names."""
    out = dict(raw)
    for old, new in _RENAMED.items():
        if old in out and isinstance(out[old], dict):
            if new in out:
                raise ValueError(f"config has both [{old}] and [{new}]: [{old}] is now [{new}]")
            log.warning("config section [%s] is now [%s]; reading it as [%s]", old, new, new)
            out[new] = out.pop(old)
    return out


def rename_legacy_key(key: str) -> str:
    """A dotted `--set` key with a renamed first part under its new name."""
    head, sep, rest = key.partition(".")
    if head in _RENAMED and sep:
        log.warning("--set %s: the section is now '%s'", key, _RENAMED[head])
        return f"{_RENAMED[head]}.{rest}"
    return key
