"""The long-lived threads that checkpoint work runs on off the loop, per kind of work
("ckpt-writer": a disk checkpoint's copy and write, jobs in the order given; "ckpt-write": its
files, written in parallel; "mem-copy": a host-memory snapshot's copy on a CPU), shared by
every tier in the process.

Starting a thread costs the loop ~0.3 ms (it waits until the thread runs); a save started one
and its decision another. Work still queued at the interpreter's exit is finished first, as a
non-daemon thread's was. A process forked from this one starts its own threads."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

__all__ = ["worker"]

_WORKERS: dict[str, ThreadPoolExecutor] = {}
_LOCK = threading.Lock()


def worker(name: str, threads: int = 1) -> ThreadPoolExecutor:
    """The threads for `name`'s jobs (made on first use; one thread runs them in order)."""
    pool = _WORKERS.get(name)
    if pool is None:
        with _LOCK:
            pool = _WORKERS.get(name)
            if pool is None:
                pool = _WORKERS[name] = ThreadPoolExecutor(threads, thread_name_prefix=name)
    return pool


def _forget_in_child() -> None:
    # the parent's threads do not exist in a forked child: its executors would queue for ever
    global _LOCK
    _WORKERS.clear()
    _LOCK = threading.Lock()


os.register_at_fork(after_in_child=_forget_in_child)
