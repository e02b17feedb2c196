"""Offline detection over an existing loss log: the online detector, with the same defaults.

Inputs: a CSV with a header row `step,loss[,...]` (choose the column with `metric`), or a
TensorBoard log directory (every `events.out.tfevents.*` file below it; `metric` is the scalar's
tag). TensorBoard files are read with a small TFRecord + protobuf reader of our own
(observatory/readers/tfevents.py), so no TensorFlow or TensorBoard install is needed.
"""

from __future__ import annotations

import csv
import json
import logging
import math
from pathlib import Path
from typing import Any

from spikewatch.observatory import metric_names as M
from spikewatch.observatory.detect import Detector, DetectorConfig
from spikewatch.observatory.readers.tfevents import EventError, Records

log = logging.getLogger(__name__)

__all__ = ["ScanError", "read_csv", "read_tensorboard", "scan", "scan_path"]


class ScanError(ValueError):
    """An input that cannot be scanned; the message says where and why."""


def read_csv(path: Path, metric: str | None = None) -> tuple[str, list[tuple[int, float]]]:
    with open(path, newline="") as f:
        reader = csv.reader(f)
        header = [h.strip() for h in next(reader, [])]
        step_key = next((k for k in M.FOREIGN_STEP_KEYS if k in header), None)
        if step_key is None or len(header) < 2:
            raise ScanError(
                f"{path}: the first row must be a header with a step column "
                f"({', '.join(M.FOREIGN_STEP_KEYS)}) and a metric"
            )
        columns = [h for h in header if h != step_key]
        name = metric or M.foreign_loss_tag(columns) or columns[0]
        if name not in header:
            raise ScanError(f"{path}: no column {name!r}; columns: {', '.join(columns)}")
        si, vi = header.index(step_key), header.index(name)
        out = []
        for line, row in enumerate(reader, start=2):
            if not row or all(not c.strip() for c in row):
                continue
            try:
                step = int(float(row[si]))
                value = float(row[vi]) if row[vi].strip() else math.nan
            except (ValueError, IndexError):
                raise ScanError(f"{path}:{line}: not a number in {row!r}") from None
            out.append((step, value))
    return name, out


def read_jsonl(path: Path, metric: str | None = None) -> tuple[str, list[tuple[int, float]]]:
    """A JSON-lines log (one object per line, a step key and numbers; nested objects flatten
    to `a/b`), as `spikewatch follow` reads it."""
    series: dict[str, dict[int, float]] = {}
    with open(path) as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                key = next(k for k in M.FOREIGN_STEP_KEYS if k in obj)
                step = int(obj.pop(key))
            except (ValueError, StopIteration, TypeError, AttributeError):
                raise ScanError(f"{path}:{line_no}: not an object with a step") from None
            for tag, value in flat_numbers(obj).items():
                series.setdefault(tag, {})[step] = float(value)
    name = metric or M.foreign_loss_tag(series)
    if name is None or name not in series:
        raise ScanError(f"{path}: no {metric or 'loss'!r}; keys: {', '.join(sorted(series))}")
    return name, sorted(series[name].items())


def flat_numbers(obj: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """The numbers of a JSON object, nested keys joined by '/'."""
    out: dict[str, float] = {}
    for k, v in obj.items():
        if isinstance(v, dict):
            out.update(flat_numbers(v, f"{prefix}{k}/"))
        elif isinstance(v, int | float) and not isinstance(v, bool):
            out[f"{prefix}{k}"] = v
    return out


def read_tensorboard(path: Path, metric: str | None = None) -> tuple[str, list[tuple[int, float]]]:
    files = sorted(path.rglob("events.out.tfevents.*"))
    if not files:
        raise ScanError(f"{path}: no TensorBoard event files (events.out.tfevents.*) below it")
    series: dict[str, dict[int, float]] = {}
    for f in files:
        records = Records(f)
        try:
            columns, problems = records.read_scalars()
        except EventError as e:
            raise ScanError(f"{f}: {e}") from None
        for at, what in problems:
            log.warning("scan: %s at byte %d: %s", f, at, what)
        if not records.dead and records.offset < f.stat().st_size:
            raise ScanError(f"{f}: truncated record at byte {records.offset}")
        for tag, (steps, values) in columns.items():
            column = series.setdefault(tag, {})
            column.update(zip(steps.tolist(), values.tolist(), strict=True))  # re-logged: last
    name = metric or M.foreign_loss_tag(series)
    if name is None or name not in series:
        wanted = repr(metric) if metric else "loss (" + ", ".join(M.FOREIGN_LOSS_TAGS) + ")"
        raise ScanError(
            f"{path}: no scalar {wanted}; tags: {', '.join(sorted(series)) or 'none'} "
            "(--metric TAG picks one)"
        )
    return name, sorted(series[name].items())


def scan(points: list[tuple[int, float]], cfg: DetectorConfig | None = None) -> dict[str, Any]:
    """Run the detector over (step, value) points; the `spikewatch scan --json` object."""
    det = Detector(cfg)
    spikes: list[dict[str, Any]] = []
    trends: list[dict[str, Any]] = []
    open_spike: dict[str, Any] | None = None
    for step, value in sorted(dict(points).items()):  # a re-logged step: the last value
        if value <= 0 and math.isfinite(value):
            raise ScanError(
                f"step {step}: value {value} is not positive (the detector works on "
                "log-loss; pass a loss-like metric)"
            )
        for v in det.update(step, value):
            if v.kind in ("spike", "nonfinite"):
                open_spike = {
                    "onset_step": v.onset_step,
                    "peak_step": v.peak_step,
                    "end_step": None,
                    "kind": v.kind,
                    "score": v.score if math.isfinite(v.score) else None,
                }
                spikes.append(open_spike)
            elif v.kind == "divergence":
                trends.append({"step": v.step, "kind": v.kind, "score": v.score})
        if open_spike is not None and open_spike["kind"] == "spike" and det.excursion:
            peak_step, peak = max(det.excursion, key=lambda e: e[1])  # the peak so far
            open_spike["peak_step"], open_spike["score"] = peak_step, peak
        elif open_spike is not None and open_spike["kind"] == "spike":
            open_spike["end_step"] = step
            open_spike = None
        elif open_spike is not None and open_spike["kind"] == "nonfinite":
            open_spike["end_step"] = step
            open_spike = None
    return {
        "spikes": spikes,
        "trends": trends,
        "points": len(points),
        "detector": det.cfg.model_dump(),
    }


def scan_path(
    path: str | Path, metric: str | None = None, cfg: DetectorConfig | None = None
) -> dict[str, Any]:
    p = Path(path)
    if p.is_dir():
        name, points = read_tensorboard(p, metric)
    elif p.is_file() and p.suffix in (".jsonl", ".ndjson", ".json"):
        name, points = read_jsonl(p, metric)
    elif p.is_file():
        name, points = read_csv(p, metric)
    else:
        raise ScanError(f"{path}: no such file or directory")
    if not points:
        raise ScanError(f"{path}: no values of {name!r}")
    return {"metric": name, **scan(points, cfg)}
