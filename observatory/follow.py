"""`spikewatch watch`: follow the logs of training we do not control, into the store, live.

Sources, each followed as it grows:
  a TensorBoard log directory: every directory below it holding `events.out.tfevents.*` files
    is one run (HF Trainer, Lightning, torchtitan and Megatron write one per run; a new event
    file appearing there, after a restart, continues the same run);
  a CSV file with a header row `step,<metric>,...`;
  a JSON-lines file, one object per line with a `step` (or `global_step`, `iteration`) and
    numbers (nested objects flatten to `a/b`).
Every scalar becomes a series of the run (the recognised loss tag, or `--metric`, is stored
under spikewatch's loss name and a recognised grad-norm tag under its grad-norm name,
observatory/metric_names.py, so the dashboard draws them as for native runs). The online
detector (observatory/detect.py) runs on the loss and the grad norm; its verdicts are events,
exactly as the trainer records them.

Files are read incrementally from an offset, never whole. A TensorBoard record is verified
by its two masked CRC-32C checksums (length and data); a record still being written (its tail
not there yet) is read on a later poll once complete; a record whose data fails its checksum is
reported (a log line and a note event) and skipped; a length that fails its checksum leaves the
rest of that file unreadable (reported once). CSV and JSON lines wait for their newline; a line
that is not a row is reported and skipped.

Restart-safe by idempotence: a new `watch` reads every source from the start again; points
keep their first value (observatory/store/ingest.py) and events have content-derived uids, so the
store ends with every point and event exactly once, and the detector, which sees the same
points in the same order, makes the same verdicts.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import math
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import crc32c

from observatory import metric_names as M
from observatory.detect import Detector, DetectorConfig
from observatory.scan import _scalars
from observatory.store.sink import BaseSink
from observatory.strict_json import tagged

__all__ = ["Follower", "LOSS_TAGS", "GRAD_TAGS", "masked_crc"]

log = logging.getLogger(__name__)

TB_GLOB = "events.out.tfevents.*"
LOSS_TAGS = M.FOREIGN_LOSS_TAGS
GRAD_TAGS = M.FOREIGN_GRAD_NORM_TAGS
STEP_KEYS = ("step", "global_step", "iteration")
MAX_RUN_KEY = 64


def masked_crc(data: bytes) -> int:
    """TFRecord's masked CRC-32C."""
    crc = crc32c.crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


class _Tail:
    """New bytes of one file from an offset; what follows the last newline waits."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0

    def lines(self) -> Iterator[tuple[int, bytes]]:
        """(byte offset, line) of every complete new line."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return
        end = data.rfind(b"\n")
        if end < 0:
            return
        at, self.offset = self.offset, self.offset + end + 1
        for line in data[: end + 1].split(b"\n")[:-1]:
            yield at, line
            at += len(line) + 1


class _Records:
    """Complete, verified TFRecords of one event file from an offset."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.dead = False  # a length failed its checksum: nothing after it can be framed
        self.corrupt: list[int] = []  # offsets of records skipped for a bad data checksum

    def read(self) -> Iterator[bytes]:
        if self.dead:
            return
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            while True:
                head = f.read(12)
                if len(head) < 12:
                    return  # not written yet
                (n,), (crc_len,) = struct.unpack("<Q", head[:8]), struct.unpack("<I", head[8:])
                if masked_crc(head[:8]) != crc_len:
                    self.dead = True
                    self.corrupt.append(self.offset)
                    log.error("watch: %s: bad length checksum at byte %d", self.path, self.offset)
                    return
                body = f.read(n + 4)
                if len(body) < n + 4:
                    return  # a record still being written: read it once complete
                at, self.offset = self.offset, self.offset + 12 + n + 4
                data, (crc,) = body[:n], struct.unpack("<I", body[n:])
                if masked_crc(data) != crc:
                    self.corrupt.append(at)
                    log.error(
                        "watch: %s: record at byte %d fails its checksum, skipped", self.path, at
                    )
                    continue
                yield data


@dataclass
class _Run:
    """One run being followed: its store key, detector and where it is."""

    key: str
    detector: Detector
    loss_tag: str | None = None
    last_fed: int = -1  # the detector takes increasing steps only
    grad_at: dict[int, float] = field(default_factory=dict)
    names: dict[str, str] = field(default_factory=dict)
    reported: set[tuple[str, int]] = field(default_factory=set)


def run_key(name: str) -> str:
    key = re.sub(r"[^A-Za-z0-9._=+-]+", "-", name).strip("-") or "watched"
    return key[-MAX_RUN_KEY:]


def metric_name(tag: str) -> str:
    """A tag as a metric name the store takes (no '*', no surrounding or inner spaces)."""
    return re.sub(r"\s+", "_", tag.strip()).replace("*", "x") or "value"


class Follower:
    """Polls its sources; `poll()` reads what is new, stores it and runs the detector."""

    def __init__(
        self,
        paths: list[Path],
        sink: BaseSink,
        *,
        metric: str | None = None,
        run_name: str | None = None,
        detector: DetectorConfig | None = None,
    ) -> None:
        self.paths = [Path(p) for p in paths]
        self.sink = sink
        self.metric = metric
        self.run_name = run_name
        self.detector_cfg = detector or DetectorConfig(ignore_before=20)
        self.runs: dict[str, _Run] = {}
        self._tb: dict[Path, _Records] = {}
        self._lines: dict[Path, _Tail] = {}
        self._header: dict[Path, list[str]] = {}
        self.values = 0  # stored so far

    # -- discovery ------------------------------------------------------------------------
    def _sources(self) -> Iterator[tuple[str, str, Path]]:
        """(kind, run name, path) of every source now present."""
        for root in self.paths:
            if root.is_dir():
                for f in sorted(root.rglob(TB_GLOB)):
                    rel = f.parent.relative_to(root)
                    parts = [root.resolve().name, *rel.parts]
                    yield "tb", self.run_name or "-".join(parts), f
            elif root.name.startswith("events.out.tfevents."):
                yield "tb", self.run_name or root.parent.resolve().name, root
            elif root.suffix == ".csv":
                yield "csv", self.run_name or root.stem, root
            elif root.suffix in (".jsonl", ".ndjson", ".json"):
                yield "jsonl", self.run_name or root.stem, root

    def _run(self, name: str) -> _Run:
        key = run_key(name)
        run = self.runs.get(key)
        if run is None:
            run = _Run(key, Detector(self.detector_cfg))
            self.sink.start_run(key, name=name, config={"source": "watch"}, tags=["watch"])
            self.runs[key] = run
        return run

    # -- one poll -------------------------------------------------------------------------
    def poll(self) -> int:
        """Read, store and detect what is new in every source; returns the values stored."""
        before = self.values
        for kind, name, path in list(self._sources()):
            run = self._run(name)
            if kind == "tb":
                self._read_tb(run, path)
            else:
                self._read_lines(run, kind, path)
        return self.values - before

    def _read_tb(self, run: _Run, path: Path) -> None:
        rec = self._tb.setdefault(path, _Records(path))
        by_step: dict[int, dict[str, float]] = {}
        for data in rec.read():
            for step, tag, value in _scalars(data):
                by_step.setdefault(int(step), {})[tag] = float(value)
        for at in rec.corrupt:
            self._report(run, path, at, "a TensorBoard record failed its checksum; skipped")
        self._store(run, by_step)

    def _read_lines(self, run: _Run, kind: str, path: Path) -> None:
        tail = self._lines.setdefault(path, _Tail(path))
        by_step: dict[int, dict[str, float]] = {}
        for at, raw in tail.lines():
            line = raw.decode("utf-8", "replace").strip()
            if not line:
                continue
            try:
                step, values = self._row(kind, path, line)
            except (ValueError, KeyError, TypeError, StopIteration) as e:
                self._report(run, path, at, f"not a row ({e}): {line[:80]!r}")
                continue
            if step is not None:
                by_step.setdefault(step, {}).update(values)
        self._store(run, by_step)

    def _row(self, kind: str, path: Path, line: str) -> tuple[int | None, dict[str, float]]:
        if kind == "csv":
            cells = next(csv.reader(io.StringIO(line)))
            header = self._header.get(path)
            if header is None:
                if "step" not in cells:
                    raise ValueError("the first row must be a header with a 'step' column")
                self._header[path] = [c.strip() for c in cells]
                return None, {}
            row = dict(zip(header, cells, strict=False))
            step = int(float(row.pop("step")))
            return step, {k: float(v) if v.strip() else math.nan for k, v in row.items()}
        obj = json.loads(line)
        if not isinstance(obj, dict):
            raise TypeError("a JSON line must be an object")
        key = next(k for k in STEP_KEYS if k in obj)
        step = int(obj.pop(key))
        return step, {k: float(v) for k, v in _flat(obj).items()}

    # -- into the store -------------------------------------------------------------------
    def _store(self, run: _Run, by_step: dict[int, dict[str, float]]) -> None:
        for step in sorted(by_step):
            if step < 0:
                continue
            tags = by_step[step]
            metrics = {self._name(run, tag): v for tag, v in tags.items()}
            self.sink.log_metrics(run.key, 0, step, metrics)
            self.values += len(metrics)
            self._detect(run, step, metrics)

    def _name(self, run: _Run, tag: str) -> str:
        name = run.names.get(tag)
        if name is None:
            if run.loss_tag is None and (
                tag == self.metric or (not self.metric and tag in LOSS_TAGS)
            ):
                run.loss_tag = tag
            if tag == run.loss_tag:
                name = M.LOSS
            elif tag in GRAD_TAGS:
                name = M.GRAD_NORM
            else:
                name = metric_name(tag)
            run.names[tag] = name
        return name

    def _detect(self, run: _Run, step: int, metrics: dict[str, float]) -> None:
        if M.GRAD_NORM in metrics:
            run.grad_at[step] = metrics[M.GRAD_NORM]
        if M.LOSS not in metrics or step <= run.last_fed:
            return  # a re-logged step (a restarted run): its first value stands
        run.last_fed = step
        grad = run.grad_at.pop(step, None)
        for s in [s for s in run.grad_at if s < step]:
            del run.grad_at[s]
        for v in run.detector.update(step, metrics[M.LOSS], grad):
            kind = v.kind if v.kind in ("spike", "nonfinite") else "note"
            data = tagged(v.to_dict())
            self.sink.log_event(
                run.key, kind, step=v.step, message=v.message, data=data, source="detector"
            )

    def _report(self, run: _Run, path: Path, at: int, what: str) -> None:
        if (str(path), at) in run.reported:
            return
        run.reported.add((str(path), at))
        log.warning("watch: %s at byte %d: %s", path, at, what)
        message = f"{path.name} at byte {at}: {what}"
        self.sink.log_event(
            run.key, "note", message=message, data={"kind": "corrupt_record"}, source="watch"
        )


def _flat(obj: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in obj.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}/"))
        elif isinstance(v, int | float) and not isinstance(v, bool):
            out[f"{prefix}{k}"] = v
    return out
