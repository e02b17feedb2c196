"""`spikewatch follow`: follow the logs of training we do not control, into the store, live.

TensorBoard, CSV, JSON lines, MLflow and W&B logs are read incrementally as they grow, their
loss goes through the same online detector as a native run's, and a restarted follower goes on
where it stopped with every point and event stored once. Sources, reading rules and restarts:
docs/follow.md, "How `spikewatch follow` reads".
"""

from __future__ import annotations

import contextlib
import csv
import hashlib
import io
import json
import logging
import math
import os
import re
import statistics
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from spikewatch.observatory import metric_names as M
from spikewatch.observatory.detect import Detector, DetectorConfig, Verdict
from spikewatch.observatory.readers.scan import flat_numbers
from spikewatch.observatory.readers.tfevents import Columns, EventError, Records, masked_crc
from spikewatch.observatory.readers.wandb_log import WANDB_GLOB, WandbLog
from spikewatch.observatory.store.sink import BaseSink
from spikewatch.observatory.strict_json import tagged

__all__ = ["FollowError", "Follower", "default_state_path", "LOSS_TAGS", "GRAD_TAGS", "masked_crc"]

log = logging.getLogger(__name__)

TB_GLOB = "events.out.tfevents.*"
LOSS_TAGS = M.FOREIGN_LOSS_TAGS
GRAD_TAGS = M.FOREIGN_GRAD_NORM_TAGS
STEP_KEYS = M.FOREIGN_STEP_KEYS
MAX_RUN_KEY = 64


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


STALL_MIN_S = 120.0  # as the Watch's watchdog: a followed log silent this long at least
STALL_FACTOR = 10.0  # ... and 10x the interval at which it usually grows
STALL_GROWTHS = 3  # growths seen before its pace is judged


@dataclass
class _Run:
    """One run being followed: its store key, detector and where it is."""

    key: str
    detector: Detector
    name: str = ""
    steps: int = 0  # loss points fed to the detector
    spikes: int = 0
    first_onset: int | None = None
    last_step: int | None = None
    loss_tag: str | None = None
    last_fed: int = -1  # the detector takes increasing steps only
    grad_at: dict[int, float] = field(default_factory=dict)
    names: dict[str, str] = field(default_factory=dict)
    reported: set[tuple[str, int]] = field(default_factory=set)
    grew_at: float | None = None  # when a poll last found its log grown (the follower's clock)
    gaps: deque[float] = field(default_factory=lambda: deque(maxlen=64))  # between growths
    stalled_at: float | None = None  # a stall said, no growth since


def _mlflow_runs(root: Path) -> list[Path]:
    """The runs of an MLflow file store (`mlruns/`), an experiment in it, or one run: the
    directories with a `metrics/` folder and a `meta.yaml`."""
    for pattern in ("", "*", "*/*"):
        found = [
            d.parent
            for d in sorted(root.glob(f"{pattern}/metrics" if pattern else "metrics"))
            if d.is_dir() and (d.parent / "meta.yaml").is_file()
        ]
        if found:
            return found
    return []


def _run_state(r: _Run) -> dict[str, Any]:
    return {
        "name": r.name,
        "detector": r.detector.state_dict(),
        "loss_tag": r.loss_tag,
        "last_fed": r.last_fed,
        "grad_at": [[s, v] for s, v in r.grad_at.items()],
        "names": r.names,
        "reported": [list(x) for x in r.reported],
        "steps": r.steps,
        "spikes": r.spikes,
        "first_onset": r.first_onset,
        "last_step": r.last_step,
    }


def _restore_run(key: str, d: dict[str, Any], cfg: DetectorConfig) -> _Run:
    detector = Detector(cfg)
    detector.load_state_dict(d["detector"])
    return _Run(
        key,
        detector,
        loss_tag=d["loss_tag"],
        last_fed=d["last_fed"],
        grad_at={int(s): float(v) for s, v in d["grad_at"]},
        names=dict(d["names"]),
        reported={(str(p), int(at)) for p, at in d["reported"]},
        name=d["name"],
        steps=d["steps"],
        spikes=d["spikes"],
        first_onset=d["first_onset"],
        last_step=d["last_step"],
    )


def default_state_path(spool_dir: Path, url: str, paths: list[Path]) -> Path:
    """Where a watch keeps its offsets by default: one file per store and set of paths."""
    key = "\n".join([url, *sorted(str(p.resolve()) for p in paths)])
    return spool_dir / f"watch-{hashlib.sha1(key.encode()).hexdigest()[:12]}.json"


class FollowError(ValueError):
    """Sources that cannot be followed as given (says which and what to do)."""


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
        state_path: Path | None = None,
        stall_min_s: float = STALL_MIN_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`state_path`: where to keep what has been read (each source's byte offset, each
        run's detector), so that a restarted watch goes on from there instead of the start.
        `stall_min_s`: a log that has not grown for max(this, STALL_FACTOR x its usual interval)
        is a stalled run (`stall` event, alerted); its next growth, `resumed`."""
        self.paths = [Path(p) for p in paths]
        self.sink = sink
        self.metric = metric
        self.run_name = run_name
        self.detector_cfg = detector or DetectorConfig(ignore_before=20)
        self.runs: dict[str, _Run] = {}
        self._tb: dict[Path, Records] = {}
        self._wandb: dict[Path, WandbLog] = {}
        self._lines: dict[Path, _Tail] = {}
        self._header: dict[Path, list[str]] = {}
        self._owner: dict[str, Path] = {}  # run id -> the one source it follows
        self.state_path = Path(state_path) if state_path is not None else None
        self._started: set[str] = set()  # runs told to the store in this process
        if self.state_path is not None and self.state_path.is_file():
            self._load_state(json.loads(self.state_path.read_text()))
        self.values = 0  # stored so far
        self.stall_min_s, self.clock = stall_min_s, clock
        self._grew: set[str] = set()  # runs whose log grew in this poll

    # -- discovery ------------------------------------------------------------------------
    def _sources(self) -> Iterator[tuple[str, str, Path, Path]]:
        """(kind, run name, path, the run's own directory or file) of every source now present.
        A run is named by its path relative to the common root of the paths given (`watch
        a/tb b/tb`: runs a/tb and b/tb; `watch lightning_logs`: lightning_logs/version_0, ...),
        a file without its suffix."""
        base = Path(os.path.commonpath([p.resolve().parent for p in self.paths]))

        def named(where: Path) -> str:
            return self.run_name or where.resolve().relative_to(base).as_posix()

        for root in self.paths:
            if root.is_dir() and (runs := _mlflow_runs(root)):
                for run_dir in runs:
                    for f in sorted(p for p in (run_dir / "metrics").rglob("*") if p.is_file()):
                        yield "mlflow", named(run_dir), f, run_dir
            elif root.is_dir():
                for f in sorted(root.rglob(TB_GLOB)):
                    yield "tb", named(f.parent), f, f.parent
                for f in sorted(root.rglob(WANDB_GLOB)):  # W&B: one file per run directory
                    yield "wandb", named(f.parent), f, f
            elif root.suffix == ".wandb":
                yield "wandb", named(root.parent), root, root
            elif root.name.startswith("events.out.tfevents."):
                yield "tb", named(root.parent), root, root.parent
            elif root.suffix == ".csv":
                yield "csv", named(root.with_suffix("")), root, root
            elif root.suffix in (".jsonl", ".ndjson", ".json"):
                yield "jsonl", named(root.with_suffix("")), root, root
            elif root.suffix == ".db":  # MLflow's default store: sqlite:///mlflow.db
                yield "mlflow-db", named(root.with_suffix("")), root, root

    def _run(self, name: str, source: Path) -> _Run:
        """The run of a source (a TensorBoard or MLflow run directory, or a file); two sources
        are never merged into one run: a second source whose name makes the same run id is
        refused."""
        key = run_key(name)
        owner = self._owner.setdefault(key, source.resolve())
        if owner != source.resolve():
            raise FollowError(
                f"{owner} and {source} would both be run {key!r}: "
                + (
                    "--run-name names one run; give one path"
                    if self.run_name
                    else "rename one, or watch them in two commands with --run-name"
                )
            )
        run = self.runs.get(key)
        if run is None:
            run = self.runs[key] = _Run(key, Detector(self.detector_cfg), name=name)
        if key not in self._started:  # new, or restored from the saved state: running again
            self.sink.start_run(key, name=name, config={"source": "watch"}, tags=["watch"])
            self._started.add(key)
        return run

    # -- one poll -------------------------------------------------------------------------
    def poll(self) -> int:
        """Read, store and detect what is new in every source; returns the values stored."""
        before = self.values
        for kind, name, path, source in list(self._sources()):
            if kind == "mlflow-db":  # a database of many runs, each its own
                self._read_mlflow_db(name, path)
                continue
            run = self._run(name, source)
            if kind == "tb":
                self._read_tb(run, path)
            elif kind == "wandb":
                self._read_wandb(run, path)
            elif kind == "mlflow":
                self._read_mlflow(run, path, source)
            else:
                self._read_lines(run, kind, path)
        self._judge_pace()
        if self.state_path is not None and self.values > before:
            self.save_state()
        return self.values - before

    # -- saved offsets ----------------------------------------------------------------------
    def save_state(self) -> None:
        """Once what was read is durable (in the store, or in the sink's spool file that a
        restart replays), write where each source was read to and each run's detector."""
        if self.state_path is None:
            return
        self.sink.persist()
        sources: dict[str, dict[str, Any]] = {
            str(p): {"offset": r.offset, "dead": r.dead} for p, r in self._tb.items()
        }
        for p, t in self._lines.items():
            sources[str(p)] = {"offset": t.offset, "header": self._header.get(p)}
        for p, w in self._wandb.items():
            sources[str(p)] = {"offset": w.offset, "kind": "wandb"}
        runs = {key: _run_state(r) for key, r in self.runs.items()}
        owners = {k: str(v) for k, v in self._owner.items()}
        state = {"version": 1, "sources": sources, "runs": runs, "owners": owners}
        tmp = self.state_path.with_name(self.state_path.name + ".tmp")
        self.state_path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(state))  # Python reads its own NaN back
        tmp.replace(self.state_path)

    def _load_state(self, state: dict[str, Any]) -> None:
        for where, src in state.get("sources", {}).items():
            path = Path(where)
            size = path.stat().st_size if path.is_file() else -1
            if size < src["offset"]:  # replaced or truncated since: read it again, whole
                log.warning(
                    "watch: %s is shorter than where it was read to; reading it again", path
                )
                continue
            if src.get("kind") == "wandb":
                self._wandb[path] = WandbLog(path)
                self._wandb[path].offset = src["offset"]
            elif "header" in src:
                self._lines[path] = _Tail(path)
                self._lines[path].offset = src["offset"]
                if src["header"] is not None:
                    self._header[path] = list(src["header"])
            else:
                self._tb[path] = Records(path)
                self._tb[path].offset, self._tb[path].dead = src["offset"], src["dead"]
        for key, r in state.get("runs", {}).items():
            self.runs[key] = _restore_run(key, r, self.detector_cfg)
        self._owner.update({k: Path(v) for k, v in state.get("owners", {}).items()})

    def _read_tb(self, run: _Run, path: Path) -> None:
        rec = self._tb.setdefault(path, Records(path))
        columns, problems = rec.read_scalars()
        for at, what in problems:
            self._report(run, path, at, what)
        self._store(run, columns)

    def _read_wandb(self, run: _Run, path: Path) -> None:
        log_ = self._wandb.setdefault(path, WandbLog(path))
        try:
            columns, problems = log_.read_scalars()
        except EventError as e:
            raise FollowError(str(e)) from None
        for at, what in problems:
            self._report(run, path, at, what)
        self._store(run, columns)

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
        self._store(run, _columns(by_step))

    def _read_mlflow(self, run: _Run, path: Path, run_dir: Path) -> None:
        """One metric of an MLflow file-store run: lines `timestamp value step` (older
        MLflow: `timestamp value`, the step then 0), the metric named by its path."""
        tag = path.relative_to(run_dir / "metrics").as_posix()
        tail = self._lines.setdefault(path, _Tail(path))
        by_step: dict[int, dict[str, float]] = {}
        for at, raw in tail.lines():
            cells = raw.decode("utf-8", "replace").split()
            try:
                value, step = float(cells[1]), int(cells[2]) if len(cells) > 2 else 0
            except (ValueError, IndexError):
                self._report(run, path, at, f"not an MLflow metric line: {raw[:80]!r}")
                continue
            by_step.setdefault(step, {})[tag] = value
        self._store(run, _columns(by_step))

    def _read_mlflow_db(self, name: str, path: Path) -> None:
        """MLflow's SQLite store (its default since 3.0): the metric rows added since the last
        poll (by rowid), each MLflow run a run of ours named `<file>/<MLflow run name>`."""
        import sqlite3

        tail = self._lines.setdefault(path, _Tail(path))  # its offset: the last rowid read
        try:
            with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as con:
                names = dict(con.execute("SELECT run_uuid, name FROM runs").fetchall())
                rows = con.execute(
                    "SELECT rowid, run_uuid, key, value, step, is_nan FROM metrics "
                    "WHERE rowid > ? ORDER BY rowid",
                    (tail.offset,),
                ).fetchall()
        except sqlite3.Error as e:
            raise FollowError(f"{path}: not an MLflow database ({e})") from None
        per_run: dict[str, dict[int, dict[str, float]]] = {}
        for rowid, uuid, key, value, step, is_nan in rows:
            per_run.setdefault(uuid, {}).setdefault(int(step), {})[key] = (
                math.nan if is_nan else float(value)
            )
            tail.offset = rowid
        for uuid, by_step in per_run.items():
            label = f"{name}/{names.get(uuid) or uuid}"
            run = self._run(label, path / uuid)  # one MLflow run: the file and its run id
            self._store(run, _columns(by_step))

    def _row(self, kind: str, path: Path, line: str) -> tuple[int | None, dict[str, float]]:
        if kind == "csv":
            cells = next(csv.reader(io.StringIO(line)))
            header = self._header.get(path)
            if header is None:
                names = [c.strip() for c in cells]
                if not any(k in names for k in STEP_KEYS):
                    keys = ", ".join(STEP_KEYS)
                    raise ValueError(f"the first row must be a header with a step column ({keys})")
                self._header[path] = names
                return None, {}
            row = dict(zip(header, cells, strict=False))
            step = int(float(row.pop(next(k for k in STEP_KEYS if k in row))))
            return step, {k: float(v) if v.strip() else math.nan for k, v in row.items()}
        obj = json.loads(line)
        if not isinstance(obj, dict):
            raise TypeError("a JSON line must be an object")
        key = next(k for k in STEP_KEYS if k in obj)
        step = int(obj.pop(key))
        return step, {k: float(v) for k, v in flat_numbers(obj).items()}

    # -- into the store -------------------------------------------------------------------
    def _store(self, run: _Run, columns: Columns) -> None:
        """One poll's new points of a run, one column per tag: stored in one record, and the
        loss (with the grad norm) fed to the detector in step order."""
        named: Columns = {}
        for tag, (steps, values) in columns.items():
            keep = steps >= 0
            if not keep.all():
                steps, values = steps[keep], values[keep]
            if len(steps):
                named[tag] = steps, values
        if not named:
            return
        if run.loss_tag is None:  # the table's priority, as `scan` picks it
            run.loss_tag = self.metric if self.metric in named else None
            if not self.metric:
                run.loss_tag = M.foreign_loss_tag(named)
        named = {self._name(run, tag): column for tag, column in named.items()}
        # the detector first: the sink's writer thread would contend with it for the GIL
        self._detect(run, named.get(M.LOSS), named.get(M.GRAD_NORM))
        self.sink.log_series(run.key, 0, named)
        self.values += sum(len(steps) for steps, _ in named.values())
        self._grew.add(run.key)

    def _name(self, run: _Run, tag: str) -> str:
        name = run.names.get(tag)
        if name is None or (tag == run.loss_tag and name != M.LOSS):
            if tag == run.loss_tag:
                name = M.LOSS
            elif tag in GRAD_TAGS:
                name = M.GRAD_NORM
            else:
                name = metric_name(tag)
            run.names[tag] = name
        return name

    def _detect(
        self,
        run: _Run,
        loss: tuple[np.ndarray, np.ndarray] | None,
        grad: tuple[np.ndarray, np.ndarray] | None,
    ) -> None:
        """Each new loss step, in step order, with its grad norm if that was logged (in this
        poll or an earlier one); a re-logged step (a restarted run) keeps its first value."""
        if grad is not None:
            for step, g in zip(grad[0].tolist(), grad[1].tolist(), strict=True):
                if step > run.last_fed:
                    run.grad_at[step] = g
        if loss is None:
            return
        order = np.argsort(loss[0], kind="stable")
        for step, value in zip(loss[0][order].tolist(), loss[1][order].tolist(), strict=True):
            if step <= run.last_fed:
                continue
            run.last_fed = step
            run.steps, run.last_step = run.steps + 1, step
            for v in run.detector.update(step, value, run.grad_at.pop(step, None)):
                kind = v.kind if v.kind in ("spike", "nonfinite") else "note"
                if v.kind in ("spike", "nonfinite", "divergence"):
                    self._say(run, v)
                data = tagged(v.to_dict())
                self.sink.log_event(
                    run.key, kind, step=v.step, message=v.message, data=data, source="detector"
                )
        if run.grad_at:
            run.grad_at = {s: g for s, g in run.grad_at.items() if s > run.last_fed}

    def _say(self, run: _Run, v: Verdict) -> None:
        """A spike, non-finite step or divergence, on the console as it is found."""
        if v.kind == "spike":
            run.spikes += 1
            run.first_onset = v.onset_step if run.first_onset is None else run.first_onset
            what = f"loss spike at step {v.step} (onset {v.onset_step}): {v.message}"
        elif v.kind == "nonfinite":
            what = f"non-finite loss or grad norm at step {v.step}"
        else:
            what = f"slow divergence at step {v.step}: {v.message}"
        log.warning("watch: %s: %s", run.name or run.key, what)

    def _judge_pace(self) -> None:
        """A log that stopped growing: once it has grown a few times, no growth for longer
        than max(stall_min_s, STALL_FACTOR x the median interval between its growths) records
        a `stall` for its run (the runs list says "stalled"; alerted as the Watch's); its
        next growth records `resumed` with the stall's length."""
        now = self.clock()
        grew, self._grew = self._grew, set()
        for run in self.runs.values():
            if run.key in grew:
                if run.stalled_at is not None:
                    lasted = now - (run.grew_at or now)
                    log.warning("watch: %s: the log grows again after %.0f s", run.name, lasted)
                    self.sink.log_event(
                        run.key, "resumed", step=run.last_step,
                        message=f"the log grows again after {lasted:.0f} s",
                        data={"stalled_s": round(lasted, 3)}, source="watch",
                    )  # fmt: skip
                    run.stalled_at = None
                elif run.grew_at is not None:
                    run.gaps.append(now - run.grew_at)
                run.grew_at = now
                continue
            if run.grew_at is None or run.stalled_at is not None or len(run.gaps) < STALL_GROWTHS:
                continue
            usual = statistics.median(run.gaps)
            bound = max(self.stall_min_s, STALL_FACTOR * usual)
            idle = now - run.grew_at
            if idle > bound:
                run.stalled_at = now
                message = (
                    f"stall: the log has not grown for {idle:.0f} s (it grew every {usual:.1f} s; "
                    f"bound {bound:.0f} s)"
                )
                log.warning("watch: %s: %s", run.name, message)
                self.sink.log_event(
                    run.key, "stall", step=run.last_step, message=message,
                    data={"idle_s": round(idle, 3), "bound_s": round(bound, 3),
                          "usual_s": round(usual, 3)},
                    source="watch",
                )  # fmt: skip

    def summary(self) -> list[dict[str, Any]]:
        """Per run: its id, name, loss steps read, spikes and the first spike's onset."""
        return [
            {
                "run_id": r.key,
                "name": r.name,
                "steps": r.steps,
                "last_step": r.last_step,
                "spikes": r.spikes,
                "first_onset": r.first_onset,
            }
            for r in self.runs.values()
        ]

    def finish(self, status: str) -> None:
        """Mark every followed run (`completed` after --once, `stopped` when the watch ends)."""
        for key in self.runs:
            self.sink.set_status(key, status)

    def _report(self, run: _Run, path: Path, at: int, what: str) -> None:
        if (str(path), at) in run.reported:
            return
        run.reported.add((str(path), at))
        log.warning("watch: %s at byte %d: %s", path, at, what)
        message = f"{path.name} at byte {at}: {what}"
        self.sink.log_event(
            run.key, "note", message=message, data={"kind": "corrupt_record"}, source="watch"
        )


def _columns(by_step: dict[int, dict[str, float]]) -> Columns:
    """Rows `{step: {tag: value}}` as one column per tag, in step order."""
    cols: dict[str, tuple[list[int], list[float]]] = {}
    for step in sorted(by_step):
        for tag, value in by_step[step].items():
            steps, values = cols.setdefault(tag, ([], []))
            steps.append(step)
            values.append(value)
    return {t: (np.array(st, np.int64), np.array(v, np.float64)) for t, (st, v) in cols.items()}
