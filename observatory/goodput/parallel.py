"""The engine's lanes over this machine's cores: each process runs a share of every scenario's
seeds, and the shares are put back in order. A seed draws the same numbers in any process
(lanes._Draws: a generator per seed and stream), so the outputs do not depend on the split.

How the other processes come depends on this one:
- one thread (the CLI, a script): a child forked for each share, which sends its lanes back
  through a pipe and exits (a fork costs milliseconds; nothing is kept, nothing to join);
- threads (a web server): a thread must not be forked, so helpers: Python processes that run
  this module's `serve` (their main module is this one, never the program's: multiprocessing's
  pools import the program's main module in each worker, and a script without a main guard
  would run again there), kept for the life of this process and fed shares through pipes. A
  helper still starting, or busy with another question, is not waited for: its share is run
  here. `warm()` starts them ahead (the dashboard's app does).
A share whose process fails is run here instead, with a warning.
"""

from __future__ import annotations

import atexit
import logging
import os
import pickle
import select
import subprocess
import sys
import threading
from typing import IO, TYPE_CHECKING, Any

import numpy as np

from spikewatch.observatory.goodput.lanes import Lanes
from spikewatch.observatory.goodput.rounds import run_part

if TYPE_CHECKING:
    from spikewatch.observatory.goodput.model import Scenario

__all__ = ["serve", "split", "warm", "workers_default"]

log = logging.getLogger(__name__)

ENV = "SPIKEWATCH_SIMULATE_WORKERS"
MIN_SHARE = 96  # lanes a process must get to be worth its share: below, a round is mostly
# numpy's per-call cost, which a second process pays again
_READY = b"R"
_helpers: list[_Helper] = []
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
    """engine.simulate's lanes, in up to `workers` processes (this one included) when there
    are enough of them."""
    n = min(workers or workers_default(), int(seeds.sum()) // MIN_SHARE)
    forking = _forking()
    helpers = [] if n <= 1 or forking else _idle_helpers(n - 1)
    if not forking:
        n = len(helpers) + 1
    if n <= 1:
        return run_part(scenarios, seeds, seed)
    cuts = (seeds[:, None] * np.arange(n + 1)) // n  # scenario i's share k: cuts[i, k:k+2]
    shares = [(cuts[:, k + 1] - cuts[:, k], cuts[:, k]) for k in range(n)]
    others: list[_Forked | _Helper | None] = []
    for k, (counts, first) in enumerate(shares[1:]):
        args = (scenarios, counts, seed, first)
        try:
            others.append(_Forked(args) if forking else helpers[k].send(args))
        except OSError as e:
            log.warning("goodput: a share runs in this process (%s)", e)
            others.append(None)
    parts = [run_part(scenarios, shares[0][0], seed, shares[0][1])]
    for (counts, first), other in zip(shares[1:], others, strict=True):
        parts.append(_result(other, scenarios, counts, seed, first))
    return _merge(parts)


def _forking() -> bool:
    """Shares in forked children: this process runs no other thread (a thread must not be
    forked) and can fork."""
    return threading.active_count() == 1 and hasattr(os, "fork")


def _result(
    other: _Forked | _Helper | None,
    scenarios: list[Scenario],
    counts: np.ndarray,
    seed: int,
    first: np.ndarray,
) -> Lanes:
    if other is not None:
        try:
            return other.result()
        except Exception as e:  # noqa: BLE001 - a share that failed elsewhere is run here
            log.warning("goodput: a simulation process failed (%s); running its share here", e)
    return run_part(scenarios, counts, seed, first)


def _receive(f: IO[bytes]) -> Lanes:
    out = pickle.load(f)
    if isinstance(out, BaseException):
        raise out
    return out


class _Forked:
    """A share run in a child forked for it alone."""

    def __init__(self, args: tuple) -> None:
        r, w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # the child: run, send the lanes (or the error), leave at once
            os.close(r)
            try:
                out: Any = run_part(*args)
            except BaseException as e:  # noqa: BLE001 - handed to the parent
                out = e
            with os.fdopen(w, "wb") as f:
                pickle.dump(out, f, protocol=pickle.HIGHEST_PROTOCOL)
            os._exit(0)
        os.close(w)
        self.r = r

    def result(self) -> Lanes:
        try:
            with os.fdopen(self.r, "rb") as f:
                return _receive(f)
        except EOFError:
            raise RuntimeError("the simulation process ended without its lanes") from None
        finally:
            os.waitpid(self.pid, 0)


class _Helper:
    """A process running `serve`; `lock` is held from a share's send until its result."""

    def __init__(self) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        env |= {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
        cmd = [
            sys.executable,
            "-c",
            "from spikewatch.observatory.goodput.parallel import serve; serve()",
        ]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        self.lock = threading.Lock()
        self.ready = False

    def idle(self) -> bool:
        """Started and free (then held by the caller until its result comes)."""
        if self.proc.poll() is not None or not self.lock.acquire(blocking=False):
            return False
        if not self.ready:
            assert self.proc.stdout is not None
            if select.select([self.proc.stdout], [], [], 0)[0]:
                self.ready = self.proc.stdout.read(1) == _READY
        if not self.ready:
            self.lock.release()
        return self.ready

    def send(self, args: tuple) -> _Helper:
        assert self.proc.stdin is not None
        try:
            pickle.dump(args, self.proc.stdin, protocol=pickle.HIGHEST_PROTOCOL)
            self.proc.stdin.flush()
        except BaseException:
            self.lock.release()
            raise
        return self

    def result(self) -> Lanes:
        assert self.proc.stdout is not None
        try:
            return _receive(self.proc.stdout)
        except EOFError:
            raise RuntimeError("the simulation helper ended") from None
        finally:
            self.lock.release()


def warm(n: int | None = None) -> None:
    """Start the helpers a process with threads splits lanes over (`n`: all but this
    process's share of workers_default()), without waiting for them."""
    with _lock:
        _helpers[:] = [h for h in _helpers if h.proc.poll() is None]
        want = (workers_default() if n is None else n + 1) - 1
        while len(_helpers) < want:
            try:
                _helpers.append(_Helper())
            except OSError as e:
                log.warning("goodput: no simulation helper (%s)", e)
                return


def _idle_helpers(n: int) -> list[_Helper]:
    warm()
    with _lock:
        return [h for h in _helpers if h.idle()][:n]


def serve() -> None:
    """A helper's loop: shares in on stdin, lanes (or the error) out on stdout, until EOF."""
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing else may write where the lanes go
    stdout.write(_READY)
    stdout.flush()
    while True:
        try:
            args = pickle.load(stdin)
        except EOFError:
            return
        try:
            out: Any = run_part(*args)
        except Exception as e:  # noqa: BLE001 - handed to the caller
            out = e
        pickle.dump(out, stdout, protocol=pickle.HIGHEST_PROTOCOL)
        stdout.flush()


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

    counts = sum(np.diff(p.offsets) for p in parts)
    return Lanes.join(parts).select(order, np.concatenate([[0], np.cumsum(counts)]))


@atexit.register
def _close() -> None:
    for h in _helpers:
        if h.proc.poll() is None:
            h.proc.kill()
