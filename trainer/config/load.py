"""TOML in, dotted `--set` overrides on top, named variant overlays, validation.

Precedence is CLI `--set` > variants > TOML file > defaults.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from spikewatch.trainer.config.legacy import rename_legacy, rename_legacy_key
from spikewatch.trainer.config.sections import ConfigError, TrainConfig

__all__ = [
    "apply_overrides",
    "apply_variants",
    "find_config",
    "load_config",
    "validate_config",
    "variant_names",
]

CONFIG_DIR = Path(__file__).parents[1] / "configs"
VARIANT_DIR = CONFIG_DIR / "variants"


def format_error(
    err: ValidationError, root: type[BaseModel] = TrainConfig, title: str = "invalid config"
) -> str:
    """A validation error as lines naming each dotted key; an unknown key with the keys its
    section allows (the CLI's config and the Watch's settings alike)."""
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "<config>"
        if e["type"] == "extra_forbidden":
            lines.append(f"unknown key '{key}'; allowed: {_allowed_keys(e['loc'][:-1], root)}")
        else:
            got = e.get("input")
            shown = "" if isinstance(got, dict) else f" (got {got!r})"
            lines.append(f"{key}: {e['msg']}{shown}")
    return f"{title}:\n  " + "\n  ".join(lines)


_format_error = format_error


def _allowed_keys(loc: tuple[Any, ...], root: type[BaseModel] = TrainConfig) -> str:
    cls: type[BaseModel] = root
    for part in loc:
        field = cls.model_fields.get(str(part))
        ann = getattr(field, "annotation", None)
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return "see trainer/config.py"
        cls = ann
    return ", ".join(sorted(cls.model_fields))


def _parse_value(text: str) -> Any:
    """TOML literal if it parses (1e-3, true, [1, 2], "s"); none/null = None; else the string."""
    if text.strip().lower() in ("none", "null"):
        return None
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Return a copy of `raw` with each `a.b=value` applied; the key path must exist."""
    out = json.loads(json.dumps(raw))
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r} is not of the form key=value")
        parts = rename_legacy_key(key.strip()).split(".")
        cls: type[BaseModel] = TrainConfig
        node = out
        for i, part in enumerate(parts):
            if part not in cls.model_fields:
                where = ".".join(parts[:i]) or "<top level>"
                raise ConfigError(
                    f"unknown key '{key}' in --set; allowed in {where}: "
                    f"{', '.join(sorted(cls.model_fields))}"
                )
            if i == len(parts) - 1:
                node[part] = _parse_value(value)
                break
            ann = cls.model_fields[part].annotation
            if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
                raise ConfigError(f"'{'.'.join(parts[: i + 1])}' is a value, not a section")
            cls = ann
            node = node.setdefault(part, {})
    return out


def find_config(p: Path) -> Path:
    """A path as given, else a preset in trainer/configs by file name or by bare name."""
    for candidate in (p, CONFIG_DIR / p.name, CONFIG_DIR / f"{p.name}.toml"):
        if candidate.is_file():
            return candidate
    return p


def variant_names() -> list[str]:
    """The named overlays in trainer/configs/variants (baseline, qk_norm, z_loss, muonclip, ...)."""
    return sorted(p.stem for p in VARIANT_DIR.glob("*.toml"))


def _merge(base: dict[str, Any], overlay: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in overlay.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def apply_variants(raw: dict[str, Any], variants: list[str]) -> dict[str, Any]:
    """`raw` with each named overlay merged over it, in order (a key set later wins)."""
    for name in variants:
        path = VARIANT_DIR / f"{name}.toml"
        if not path.is_file():
            raise ConfigError(f"unknown variant {name!r}; known: {', '.join(variant_names())}")
        try:
            overlay = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"variant {name!r} ({path}): not valid TOML: {e}") from None
        raw = _merge(raw, overlay)
    return raw


def load_config(
    path: str | Path | None = None,
    overrides: list[str] | None = None,
    variants: list[str] | None = None,
) -> TrainConfig:
    """Load a TOML file (a resolved .json one too), merge the variant overlays, apply `--set`
    overrides (they win over both), validate it all."""
    raw: dict[str, Any] = {}
    if path is not None:
        p = find_config(Path(path))
        try:
            text = p.read_text()
            raw = json.loads(text) if p.suffix == ".json" else tomllib.loads(text)
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: not valid TOML: {e}") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON: {e}") from None
    raw = apply_variants(rename_legacy(raw), variants or [])
    return validate_config(apply_overrides(raw, overrides or []))


def validate_config(raw: dict[str, Any]) -> TrainConfig:
    try:
        return TrainConfig.model_validate(rename_legacy(raw))
    except ValidationError as e:
        raise ConfigError(_format_error(e)) from None
