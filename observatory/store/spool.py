"""The local spool: records the database could not take yet, kept as JSON lines on disk.

Segments are files `spool-<time_ns>-<pid>.jsonl` in the spool directory (the run directory's
`spool/`). The owner appends to one open segment under an exclusive `flock`; `rotate()` closes it
so it can be replayed and deleted. A new sink adopts the segments a dead process left behind
(their lock is free) and replays them too, so a crash while the database is away loses nothing
that reached the file. Replays are idempotent (observatory/store/ingest.py), so replaying a segment
twice, e.g. after a crash between the replay and the delete, is harmless.
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO

from spikewatch.observatory.store.records import Record, RecordError

__all__ = ["Spool"]

log = logging.getLogger(__name__)


class Spool:
    """Thread-safe append; segments replayed oldest first."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.dir = Path(directory)
        self._lock = threading.Lock()
        self._file: IO[bytes] | None = None
        self._path: Path | None = None
        self._closed: list[Path] = []
        self._adopt()

    def _adopt(self) -> None:
        """Take over segments of processes that are gone (their flock is released)."""
        if not self.dir.is_dir():
            return
        for path in sorted(self.dir.glob("spool-*.jsonl")):
            with open(path, "a") as f:
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # a live sink still writes it
                fcntl.flock(f, fcntl.LOCK_UN)
            log.warning("spool: adopting %s left by an earlier process", path)
            self._closed.append(path)

    def pending(self) -> bool:
        with self._lock:
            return bool(self._closed) or self._file is not None

    def append(self, records: Sequence[Record]) -> None:
        """Write `records` to the open segment, all or none: a write that fails part way (a
        full disk) is cut back, so a later append never follows a torn line. Raises OSError
        when the directory cannot be made or written."""
        data = "".join(r.to_json() + "\n" for r in records).encode("utf-8")
        with self._lock:
            if self._file is None:
                self._open()
            assert self._file is not None
            fd = self._file.fileno()
            start = os.lseek(fd, 0, os.SEEK_END)
            try:
                view = memoryview(data)
                while view:  # unbuffered: in the OS once written, survives a crash of this process
                    view = view[os.write(fd, view) :]
            except OSError:
                try:
                    os.ftruncate(fd, start)
                except OSError:  # cannot even cut it back: start a new segment next time
                    self._file.close()
                    if self._path is not None:
                        self._closed.append(self._path)
                    self._file, self._path = None, None
                raise

    def _open(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / f"spool-{time.time_ns()}-{os.getpid()}.jsonl"
        self._file = open(path, "ab", buffering=0)  # noqa: SIM115 - kept open
        self._path = path
        fcntl.flock(self._file, fcntl.LOCK_EX)
        log.debug("spool: keeping records in %s until the database takes them", self._path)

    def rotate(self) -> list[Path]:
        """Close the open segment; return every segment waiting for replay, oldest first."""
        with self._lock:
            if self._file is not None and self._path is not None:
                self._file.close()  # releases the flock
                self._closed.append(self._path)
                self._file, self._path = None, None
            return list(self._closed)

    def done(self, path: Path) -> None:
        """A segment is in the database: delete it."""
        with self._lock:
            self._closed.remove(path)
        path.unlink(missing_ok=True)

    def reject(self, path: Path, why: str) -> None:
        """Set a segment that can never be replayed aside (kept on disk, named *.rejected)."""
        with self._lock:
            self._closed.remove(path)
        target = path.with_suffix(".rejected")
        path.rename(target)
        log.error("spool: %s cannot be replayed (%s); kept as %s", path.name, why, target)

    @staticmethod
    def read(path: Path, chunk: int) -> Iterator[list[Record]]:
        """Records of a segment in chunks of about `chunk` metric values. A torn last line (a
        crash mid-write) is skipped; a line that is not a record is set aside in
        `<segment>.rejected-lines` (kept on disk, named in the log) and the rest is read on."""
        batch: list[Record] = []
        size = 0
        with open(path, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                if not raw.endswith(b"\n"):
                    log.warning("spool: %s:%d is incomplete (torn write), skipped", path, lineno)
                    break
                try:
                    rec = Record.from_json(raw.decode("utf-8"))
                except (ValueError, TypeError, RecordError) as e:
                    Spool._set_aside(path, lineno, raw, e)
                    continue
                batch.append(rec)
                size += rec.size
                if size >= chunk:
                    yield batch
                    batch, size = [], 0
        if batch:
            yield batch

    @staticmethod
    def _set_aside(path: Path, lineno: int, raw: bytes, why: Exception) -> None:
        target = path.with_suffix(".rejected-lines")
        with open(target, "ab") as out:
            out.write(raw)
        log.error("spool: %s:%d is not a record (%s); kept in %s", path.name, lineno, why, target)
