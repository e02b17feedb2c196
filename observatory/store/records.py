"""What travels from the trainer to the database: validated, JSON-safe records.

A record is `(kind, run, data)`. It is built and checked on the caller's thread, so a bad value
raises there with a message that names it, before anything is queued; once queued, a record is
known to be storable, and it survives the spool file as one JSON line.
"""

from __future__ import annotations

import hashlib
import json
import numbers
import time
import uuid
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

import numpy as np

from spikewatch.observatory.store.models import CHECKSUM_STATUSES, EVENT_KINDS, RUN_STATUSES
from spikewatch.observatory.store.names import MAX_INDEX, parse_name

__all__ = ["MAX_STEP", "Record", "RecordError"]

MAX_STEP = 2**31 - 1  # stored as INTEGER
MAX_KEY_LEN = 64
KINDS = ("run", "branch", "status", "metrics", "series", "event", "checkpoint", "heartbeat")


class RecordError(ValueError):
    """A value the store cannot take; the message names the field and the value."""


class Record(NamedTuple):
    kind: str  # one of KINDS
    run: str  # the trainer's run id
    data: dict[str, Any]

    def to_json(self) -> str:
        body = [self.kind, self.run, self.data]
        return json.dumps(body, allow_nan=True, separators=(",", ":"), default=_plain)

    @property
    def size(self) -> int:
        """Metric values it carries (what batches are sized by), at least 1."""
        if self.kind == "metrics":
            return len(self.data["values"]) + 1
        if self.kind == "series":
            return sum(len(steps) for steps, _ in self.data["series"].values()) + 1
        return 1

    @classmethod
    def from_json(cls, line: str) -> Record:
        kind, run, data = json.loads(line)
        if kind not in KINDS:
            raise RecordError(f"unknown record kind {kind!r}")
        if not isinstance(run, str) or not isinstance(data, dict):
            raise RecordError(f"not a record: {line[:80]!r}")
        return cls(kind, run, data)


def _plain(x: object) -> Any:
    """numpy arrays (a series record's columns) as JSON lists."""
    if isinstance(x, np.ndarray):
        return x.tolist()
    raise TypeError(f"{type(x).__name__} is not JSON serialisable")


def check_run_key(run: object) -> str:
    if not isinstance(run, str) or not run or len(run) > MAX_KEY_LEN or not run.isprintable():
        raise RecordError(f"run id must be a printable str of 1..{MAX_KEY_LEN} chars: {run!r}")
    return run


def check_int(name: str, value: object, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise RecordError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if not lo <= int(value) <= hi:
        raise RecordError(f"{name} must be in [{lo}, {hi}], got {value}")
    return int(value)


def check_step(value: object, name: str = "step") -> int:
    return check_int(name, value, 0, MAX_STEP)


def check_branch(value: object, name: str = "branch") -> int:
    return check_int(name, value, 0, MAX_INDEX)


def check_choice(name: str, value: object, allowed: Iterable[str]) -> str:
    allowed = tuple(allowed)
    if value not in allowed:
        raise RecordError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")
    return str(value)


def check_text(name: str, value: object, *, max_len: int | None = None) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise RecordError(f"{name} must be a str or None, got {type(value).__name__}")
    if max_len is not None and len(value) > max_len:
        raise RecordError(f"{name} is longer than {max_len} chars")
    return value


def check_json(name: str, value: object) -> Any:
    """A JSON document PostgreSQL accepts: no NaN/Infinity, string keys, JSON types only."""
    try:
        return json.loads(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError) as e:
        raise RecordError(f"{name} must be JSON-serialisable without NaN/Infinity: {e}") from e


class MetricsChecker:
    """Validates metric dicts; remembers names already seen so a step costs one dict pass."""

    def __init__(self) -> None:
        self._names: set[str] = set()

    def __call__(self, metrics: object) -> dict[str, float]:
        if not isinstance(metrics, Mapping):
            raise RecordError(
                f"metrics must be a mapping name -> number, got {type(metrics).__name__}"
            )
        out = dict(metrics)  # a copy: the caller may reuse its dict
        # the hot path, in C loops: known names and plain floats (a training step's usual dict)
        if self._names.issuperset(out) and set(map(type, out.values())) <= {float}:
            return out
        return self._slow(out)

    def name(self, name: str) -> None:
        if name not in self._names:
            try:
                parse_name(name)
            except ValueError as e:
                raise RecordError(str(e)) from e
            self._names.add(name)

    def series(self, series: object) -> dict[str, list[np.ndarray]]:
        """`{name: (steps, values)}`, many steps of each metric at once, as int64 / float64
        columns of one length (a step given twice keeps its first value in the store)."""
        if not isinstance(series, Mapping):
            raise RecordError(f"series must be a mapping name -> (steps, values), got {series!r}")
        out = {}
        for name, (steps, values) in series.items():
            self.name(name)
            try:
                st = np.asarray(steps, dtype=np.int64)
                v = np.asarray(values, dtype=np.float64)
            except (TypeError, ValueError) as e:
                raise RecordError(f"series {name!r}: steps and values must be numbers: {e}") from e
            if st.ndim != 1 or st.shape != v.shape:
                raise RecordError(
                    f"series {name!r}: steps and values must be 1-D of one length, "
                    f"got {st.shape} and {v.shape}"
                )
            if len(st) and (st.min() < 0 or st.max() > MAX_STEP):
                raise RecordError(f"series {name!r}: steps must be in [0, {MAX_STEP}]")
            out[name] = [st, v]
        return out

    def _slow(self, out: dict[str, float]) -> dict[str, float]:
        for name, value in out.items():
            self.name(name)
            if type(value) is not float:
                out[name] = self._number(name, value)
        return out

    @staticmethod
    def _number(name: str, value: object) -> float:
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise RecordError(f"metric {name!r} must be a real number, got {type(value).__name__}")
        return float(value)


def new_uid() -> str:
    return uuid.uuid4().hex


def content_uid(run: str, fields: Mapping[str, Any]) -> str:
    """An event's uid from everything it says: the same event, sent again, has the same uid."""
    body = json.dumps([run, fields], sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(body.encode()).hexdigest()[:32]


RUN_FIELDS = {
    "name": 200,
    "sweep_group": 200,
    "hypothesis": None,
    "run_dir": 1000,
}


def run_record(run: str, *, config: object, tags: object, **text: object) -> Record:
    data: dict[str, Any] = {"status": "running", "ended_at": None}
    for field, max_len in RUN_FIELDS.items():
        data[field] = check_text(field, text.get(field), max_len=max_len)
    if not isinstance(config, Mapping):
        raise RecordError(f"config must be a mapping, got {type(config).__name__}")
    data["config"] = check_json("config", dict(config))
    if isinstance(tags, str) or not all(isinstance(t, str) for t in tags):  # type: ignore[attr-defined]
        raise RecordError(f"tags must be a list of str, got {tags!r}")
    data["tags"] = list(tags)  # type: ignore[call-overload]
    return Record("run", check_run_key(run), data)


def status_record(run: str, status: object) -> Record:
    return Record(
        "status", check_run_key(run), {"status": check_choice("status", status, RUN_STATUSES)}
    )


def heartbeat_record(run: str, period_s: object) -> Record:
    """The run's process is alive now (the writer's clock), and says so every `period_s`."""
    if (
        isinstance(period_s, bool)
        or not isinstance(period_s, (int, float))
        or not (0 < period_s < 86400)
    ):
        raise RecordError(f"heartbeat period must be seconds in (0, 86400), got {period_s!r}")
    return Record("heartbeat", check_run_key(run), {"at": time.time(), "period_s": period_s})


def event_record(run: str, kind: object, **fields: Any) -> Record:
    """Without a uid, the event's uid is `content_uid`: sent again (a resumed run recomputing
    its steps), it is stored once."""
    uid = check_text("uid", fields["uid"], max_len=64)
    data = {
        "kind": check_choice("event kind", kind, EVENT_KINDS),
        "branch": check_branch(fields["branch"]),
        "step": None if fields["step"] is None else check_step(fields["step"]),
        "source": check_text("source", fields["source"], max_len=32) or "trainer",
        "message": check_text("message", fields["message"]) or "",
        "data": check_json("event data", dict(fields["data"] or {})),
    }
    data["uid"] = uid or content_uid(check_run_key(run), data)
    return Record("event", run, data)


def checkpoint_record(run: str, **fields: Any) -> Record:
    if not isinstance(fields["pinned"], bool):
        raise RecordError(f"pinned must be a bool, got {fields['pinned']!r}")
    data = {
        "step": check_step(fields["step"]),
        "branch": check_branch(fields["branch"]),
        "path": check_text("path", fields["path"], max_len=1000),
        "pinned": fields["pinned"],
        "checksum_status": check_choice(
            "checksum_status", fields["checksum_status"], CHECKSUM_STATUSES
        ),
    }
    if not data["path"]:
        raise RecordError("checkpoint path must be a non-empty str")
    return Record("checkpoint", check_run_key(run), data)


def sample_row(run_id: int, event: Mapping[str, Any], sample: Mapping[str, Any]) -> dict[str, Any]:
    """A `samples` row from one named sample of a rollback event's data (checked: a bad one
    is an error that names it, and the event is kept by the sink's error path)."""

    def number(key: str) -> float | None:
        v = sample.get(key)
        return None if v is None or isinstance(v, str) else float(v)  # "nan": a tagged NaN

    return {
        "run_id": run_id,
        "event_uid": event["uid"],
        "branch": event["branch"],
        "step": event.get("step"),
        "batch": check_int("sample batch", sample.get("batch"), 0, 2**31 - 1),
        "row": check_int("sample row", sample.get("row"), 0, 2**31 - 1),
        "sample_id": check_text("sample id", sample.get("id"), max_len=500),
        "loss": number("loss"),
        "grad_norm": number("grad_norm"),
        "preview": check_text("sample preview", sample.get("preview"), max_len=2000),
    }
