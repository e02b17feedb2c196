"""The engine's lanes over this machine's cores: each process runs a share of every scenario's
seeds, and the shares are put back in order. A seed draws the same numbers in any process
(engine._Draws: a generator per seed and stream), so the outputs do not depend on the split.

The other processes are a pool kept for the life of this one: forked from it when it runs no
other thread (the CLI: a fork costs milliseconds), else started from a fork server that has
imported the engine (a web server's threads must not be forked). A pool that breaks is
dropped, and its share is run here instead, with a warning.
"""

from __future__ import annotations

import atexit
import logging
import os
import pickle
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from observatory.goodput.engine import BUCKETS, Lanes, run_part

if TYPE_CHECKING:
    import multiprocessing.context
    from concurrent.futures import Future, ProcessPoolExecutor

    from observatory.goodput.model import Scenario

__all__ = ["split", "workers_default"]

log = logging.getLogger(__name__)

ENV = "SPIKEWATCH_SIMULATE_WORKERS"
MIN_SHARE = 96  # lanes a process must get to be worth its share: below, a round is mostly
# numpy's per-call cost, which a second process pays again
_pool: ProcessPoolExecutor | None = None
_pool_size = 0
_lock = threading.Lock()


def workers_default() -> int:
    """$SPIKEWATCH_SIMULATE_WORKERS, else the cores this process may use (at most 8)."""
    text = os.environ.get(ENV, "").strip()
    if text:
        try:
            return max(1, int(text))
        except ValueError:
            raise ValueError(f"${ENV} is a number of processes, not {text!r}") from None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(cores or 1, 8))


def split(scenarios: list[Scenario], seeds: np.ndarray, seed: int, workers: int | None) -> Lanes:
    """engine.simulate's lanes, in `workers` processes (this one included) when there are
    enough of them."""
    n = min(workers or workers_default(), int(seeds.sum()) // MIN_SHARE)
    if n <= 1:
        return run_part(scenarios, seeds, seed)
    cuts = (seeds[:, None] * np.arange(n + 1)) // n  # scenario i's share k: cuts[i, k:k+2]
    shares = [(cuts[:, k + 1] - cuts[:, k], cuts[:, k]) for k in range(n)]
    futures = _submit(scenarios, seed, shares[1:])
    parts = [run_part(scenarios, shares[0][0], seed, shares[0][1])]
    for (counts, first), future in zip(shares[1:], futures, strict=True):
        parts.append(_result(future, scenarios, counts, seed, first))
    return _merge(parts)


def _submit(scenarios: list[Scenario], seed: int, shares: list) -> list[Any]:
    from concurrent.futures import ProcessPoolExecutor  # only when lanes are split

    if threading.active_count() == 1 and hasattr(os, "fork"):
        try:  # one thread (the CLI): a child forked for each share, none kept
            return [_Forked(run_part, scenarios, c, seed, f) for c, f in shares]
        except OSError as e:
            log.warning("goodput: simulating in one process (%s)", e)
            return [None] * len(shares)
    global _pool, _pool_size
    with _lock:
        try:
            if _pool is None or _pool_size < len(shares):
                if _pool is not None:
                    _pool.shutdown(wait=False)
                _pool, _pool_size = ProcessPoolExecutor(len(shares), _context()), len(shares)
            return [_pool.submit(run_part, scenarios, c, seed, f) for c, f in shares]
        except (OSError, RuntimeError) as e:  # no processes to be had: this one does it all
            log.warning("goodput: simulating in one process (%s)", e)
            _pool = None
            return [None] * len(shares)


def _result(
    future: Future | _Forked | None,
    scenarios: list[Scenario],
    counts: np.ndarray,
    seed: int,
    first: np.ndarray,
) -> Lanes:
    global _pool
    if future is not None:
        try:
            return future.result()
        except Exception as e:  # noqa: BLE001 - a broken pool: its share is run here
            log.warning("goodput: a simulation process failed (%s); running its share here", e)
            with _lock:
                _pool = None
    return run_part(scenarios, counts, seed, first)


class _Forked:
    """A share run in a child forked for it alone: no pool to start, feed or join at exit."""

    def __init__(self, fn: Callable[..., Lanes], *args: Any) -> None:
        r, w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # the child: run, send the result (or the error), leave at once
            os.close(r)
            try:
                out: Any = fn(*args)
            except BaseException as e:  # noqa: BLE001 - handed to the parent
                out = e
            with os.fdopen(w, "wb") as f:
                pickle.dump(out, f, protocol=pickle.HIGHEST_PROTOCOL)
            os._exit(0)
        os.close(w)
        self.r = r

    def result(self) -> Lanes:
        with os.fdopen(self.r, "rb") as f:
            data = f.read()
        os.waitpid(self.pid, 0)
        if not data:
            raise RuntimeError("the simulation process ended without a result")
        out = pickle.loads(data)
        if isinstance(out, BaseException):
            raise out
        return out


def _context() -> multiprocessing.context.BaseContext:
    import multiprocessing

    methods = multiprocessing.get_all_start_methods()
    if "fork" in methods and threading.active_count() == 1:
        return multiprocessing.get_context("fork")
    if "forkserver" in methods:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["observatory.goodput.engine"])
        return ctx
    return multiprocessing.get_context("spawn")


def _merge(parts: list[Lanes]) -> Lanes:
    """The parts' lanes in one scenario-major order: scenario i's lanes of part 0, then of
    part 1, ... (each part holds a contiguous range of every scenario's seeds)."""
    starts = np.cumsum([0] + [p.wall_s.size for p in parts[:-1]])
    order = np.concatenate(
        [
            np.arange(p.offsets[i], p.offsets[i + 1]) + start
            for i in range(parts[0].offsets.size - 1)
            for p, start in zip(parts, starts, strict=True)
        ]
    )

    def cat(get) -> np.ndarray:  # noqa: ANN001
        return np.concatenate([get(p) for p in parts])[order]

    counts = sum(np.diff(p.offsets) for p in parts)
    return Lanes(
        offsets=np.concatenate([[0], np.cumsum(counts)]),
        finished=cat(lambda p: p.finished),
        wall_s=cat(lambda p: p.wall_s),
        buckets={k: cat(lambda p, k=k: p.buckets[k]) for k in BUCKETS},
        failures=cat(lambda p: p.failures),
        spikes=cat(lambda p: p.spikes),
        restores_from_memory=cat(lambda p: p.restores_from_memory),
        further_back=cat(lambda p: p.further_back),
        further_steps=cat(lambda p: p.further_steps),
        modes={k: cat(lambda p, k=k: p.modes[k]) for k in parts[0].modes},
    )


@atexit.register
def _close() -> None:
    if _pool is not None:
        _pool.shutdown(wait=False, cancel_futures=True)
