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
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

__all__ = ["Worker", "worker"]


class Worker:
    """`submit(fn, *args)` -> a Future, run on the long-lived threads; once the interpreter is
    shutting down (a run closed by its exit handler: the pools were shut down before exit
    handlers run), run right here instead, so that a last checkpoint is still written."""

    def __init__(self, name: str, threads: int) -> None:
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix=name)

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        try:
            return self.pool.submit(fn, *args)
        except RuntimeError:  # "cannot schedule new futures after (interpreter) shutdown"
            done: Future[Any] = Future()
            try:
                done.set_result(fn(*args))
            except BaseException as e:
                done.set_exception(e)
            return done


_WORKERS: dict[str, Worker] = {}
_LOCK = threading.Lock()


def worker(name: str, threads: int = 1) -> Worker:
    """The threads for `name`'s jobs (made on first use; one thread runs them in order)."""
    pool = _WORKERS.get(name)
    if pool is None:
        with _LOCK:
            pool = _WORKERS.get(name)
            if pool is None:
                pool = _WORKERS[name] = Worker(name, threads)
    return pool


def _forget_in_child() -> None:
    # the parent's threads do not exist in a forked child: its executors would queue for ever
    global _LOCK
    _WORKERS.clear()
    _LOCK = threading.Lock()


os.register_at_fork(after_in_child=_forget_in_child)
