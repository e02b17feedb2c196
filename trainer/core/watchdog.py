"""The stall watchdog: a thread that notices when no step has ended for too long.

A rank stuck in a collective or a loader that never returns does not crash; it stops. The loop
beats once a step; this thread learns the run's pace from the beats and reports a stall (with
every thread's stack), its end, a lasting slowdown and, under torchrun, the ranks behind and
the straggler. Its bounds, their defaults and why: docs/stalls.md, "The watchdog's rules".
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import json
import logging
import os
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["EXIT_STALLED", "LastGrad", "StallConfig", "Watchdog", "thread_stacks"]

log = logging.getLogger(__name__)

EXIT_STALLED = 75  # EX_TEMPFAIL: a temporary failure, worth a restart


class StallConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(True, description="Watch for steps that stop ending (a hang).")
    factor: float = Field(10.0, gt=1, description="A stall: no step for factor x median step.")
    min_s: float = Field(120.0, gt=0, description="... and for at least this many seconds.")
    warmup_steps: int = Field(
        5, ge=1, description="Steps timed before the watchdog judges (compilation, warm-up)."
    )
    slowdown: float | None = Field(
        1.5,
        gt=1,
        description="A slowdown: the median of the last `slowdown_window` step times this many "
        "times the run's own baseline (the median of up to 256 earlier steps, frozen while a "
        "slowdown lasts); None = off.",
    )
    slowdown_window: int = Field(16, ge=4, description="Recent steps a slowdown is judged on.")
    slowdown_min_s: float = Field(
        0.005,
        ge=0,
        description="... and at least this many seconds a step slower than the baseline: a run "
        "of millisecond steps is not told of a millisecond of the machine's noise.",
    )
    slowdown_lasting_s: float = Field(
        30.0,
        ge=0,
        description="... and the slow pace held this many seconds of steps, every step judged "
        "slow: a shared machine's noise slows a run of fast steps for a second or two at a time "
        "(a 16-step median moves with it), a throttled device or a degraded link for minutes.",
    )
    heartbeat_s: float | None = Field(
        10.0,
        gt=0,
        description="Tell the run's record the process is alive every this many seconds, "
        "steps or not: a run whose process is gone (killed) reads 'gone' after two; None = off.",
    )
    exit_after_s: float | None = Field(
        None,
        gt=0,
        description="Exit with code 75 after a stall this long (recorded first), for an elastic "
        "launcher to restart the process; None = never.",
    )


# Where a rank's loop is within a step, in order: its last step ended, the next step's batch
# is in hand (`begin_step`), it reached the gate (the step's reductions). A rank stuck in its
# loader stays at ENDED while a rank waiting for it in a collective is past it.
ENDED, BEGUN, GATED = 0, 1, 2
PHASES = ("ended", "batch in hand", "at the gate")


class RankBeats:
    """Each rank's progress (step, phase) under torchrun, through the rendezvous store: every
    rank's watchdog thread publishes its own once a wake when it changed (one small `set`), and
    a stall reads them all, so that it names the ranks that are behind. The loop thread only
    sets an int pair (`Watchdog.mark`): no store call on it."""

    PREFIX = "spikewatch/progress/"

    def __init__(self, store: Any, rank: int, size: int) -> None:
        self.store, self.rank, self.size = store, rank, size
        self._sent: tuple[int, int] | None = None
        self._pace_sent: dict[str, str] = {}

    @classmethod
    def of_process_group(cls) -> RankBeats | None:
        """The default process group's store (torchrun's rendezvous store), or None."""
        try:
            import torch.distributed as dist

            if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
                return None
            store = dist.distributed_c10d._get_default_store()
        except Exception:  # no store to be had: the stall is told without the ranks
            return None
        return cls(store, dist.get_rank(), dist.get_world_size())

    def publish(self, progress: tuple[int, int]) -> None:
        if progress != self._sent:
            self.store.set(f"{self.PREFIX}{self.rank}", f"{progress[0]} {progress[1]}")
            self._sent = progress

    PACE = "spikewatch/pace/"  # the median wait for its batches
    FORWARD = "spikewatch/forward/"  # the median forward (batch in hand to the forward's end)
    BACKWARD = "spikewatch/backward/"  # the median backward (forward's end to its last gradient)

    def publish_pace(self, seconds: float, kind: str = PACE) -> None:
        """This rank's recent median of `kind` (seconds), when it changed."""
        said = f"{seconds:.4g}"
        if said != self._pace_sent.get(kind):
            self.store.set(f"{kind}{self.rank}", said)
            self._pace_sent[kind] = said

    def read_pace(self, kind: str = PACE) -> dict[int, float]:
        """Every rank's last published median of `kind`; empty until every rank has published
        one."""
        return {r: float(v) for r, v in self._every_rank(kind).items()}

    def _every_rank(self, prefix: str) -> dict[int, str]:
        """Every rank's value under `prefix`, or none until every rank has set one: two store
        calls, however many ranks (a `check` and a `multi_get`)."""
        keys = [f"{prefix}{r}" for r in range(self.size)]
        if not self.store.check(keys):
            return {}
        many = getattr(self.store, "multi_get", None)
        values = many(keys) if many is not None else [self.store.get(k) for k in keys]
        return {r: bytes(v).decode() for r, v in enumerate(values)}

    ARRIVAL = "spikewatch/arrival/"  # the newest blocks of collectives' enqueue times

    def publish_arrivals(self, blocks: dict[str, list[int]]) -> None:
        """This rank's `arrival_blocks`, when they changed (one small `set`)."""
        said = json.dumps(blocks, sort_keys=True)
        if said != self._pace_sent.get(self.ARRIVAL):
            self.store.set(f"{self.ARRIVAL}{self.rank}", said)
            self._pace_sent[self.ARRIVAL] = said

    def read_arrivals(self) -> dict[int, dict[str, list[int]]]:
        """Every rank's last published `arrival_blocks`; empty until every rank has some."""
        return {r: json.loads(v) for r, v in self._every_rank(self.ARRIVAL).items()}

    def read(self) -> dict[int, tuple[int, int]]:
        """Every rank's last published progress (a rank that never published is left out)."""
        out = {}
        for r in range(self.size):
            key = f"{self.PREFIX}{r}"
            if self.store.check([key]):
                step, phase = self.store.get(key).decode().split()
                out[r] = (int(step), int(phase))
        return out


KINDS = (RankBeats.PACE, RankBeats.FORWARD, RankBeats.BACKWARD)  # in the order judged
WHAT = {RankBeats.PACE: "its batches", RankBeats.FORWARD: "its forward",
        RankBeats.BACKWARD: "its backward"}  # fmt: skip
SLOW_IN = {RankBeats.PACE: "batches", RankBeats.FORWARD: "forward",
           RankBeats.BACKWARD: "backward"}  # the event's `slow_in`  # fmt: skip
ARRIVING = "arrival"  # the event's `slow_in` for a rank late at its collectives (FSDP2)
KEY = {RankBeats.PACE: "batch_wait_s", RankBeats.FORWARD: "forward_s",
       RankBeats.BACKWARD: "backward_s"}  # the event's figure  # fmt: skip


class LastGrad:
    """Under torchrun (DDP): when this rank's backward has made its last gradient, its own
    compute done (a DDP rank then waits in the all-reduce for the others' gradients, so its
    backward's wall time is the slowest rank's). The parameter whose gradient comes last is
    learnt on the first backward (every parameter's post-accumulate hook notes the order) and
    its hook alone is kept: one Python call a backward after that."""

    def __init__(self, params: Any, on_ready: Callable[[], None]) -> None:
        self.on_ready = on_ready
        self._order: list[int] = []
        self._learning = True
        self._handles = {
            id(p): p.register_post_accumulate_grad_hook(self._hook)
            for p in params
            if p.requires_grad
        }

    def _hook(self, p: Any) -> None:
        if self._learning:
            self._order.append(id(p))
        self.on_ready()

    def settle(self) -> None:
        """A backward has run since the hooks were placed (the next step's forward ended):
        the last parameter is known, the other hooks go."""
        if not self._learning or not self._order:
            return
        self._learning = False
        last = self._order[-1]
        for key in [k for k in self._handles if k != last]:
            self._handles.pop(key).remove()

    def remove(self) -> None:
        for handle in self._handles.values():
            handle.remove()
        self._handles.clear()


def straggler(pace: dict[int, float], factor: float, min_s: float) -> tuple[int, float] | None:
    """The rank that keeps the others waiting: its median (wait for its batches, or forward)
    above `factor` times the other ranks' median and `min_s` longer; (rank, the others')."""
    if len(pace) < 2:
        return None
    rank = max(pace, key=lambda r: pace[r])
    others = statistics.median(v for r, v in pace.items() if r != rank)
    slowest = pace[rank]
    if slowest > factor * others and slowest - others >= min_s:
        return rank, others
    return None


ARRIVAL_BLOCK = 128  # collectives a block: each rank sums its enqueue times over the same ones
# wakes between two reads of the flight recorder: a dump of its whole ring (~2,000 entries),
# 40-45 ms of the watchdog's thread on a 2-core CPU, so about 0.15% of a core at one in 30
ARRIVAL_EVERY = 30
ARRIVAL_KEEP = 12  # blocks a rank publishes: a read judges all those new since the last


def arrival_blocks(block: int = ARRIVAL_BLOCK, keep: int = ARRIVAL_KEEP) -> dict[str, list[int]]:
    """This rank's collectives as torch's flight recorder holds them, in blocks of `block`
    sequence numbers of its busiest process group (FSDP2's all-gathers and reduce-scatters):
    for each of the newest `keep` complete blocks ("<group>:<block>"), the sum of their
    enqueue times (ns since the epoch) and the block's span (ns). The same block's sums on two
    ranks differ by how much later one reached those collectives than the other: under FSDP2
    every rank waits inside them for the slowest, so its steps, forwards and backwards take as
    long as the others' and only its arrivals tell it. Empty where the recorder is not there."""
    import pickle

    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return {}
    try:
        from torch._C._distributed_c10d import _dump_fr_trace  # type: ignore[attr-defined]

        raw = _dump_fr_trace(includeCollectives=True, includeStackTraces=False, onlyActive=False)
        entries = pickle.loads(raw).get("entries") or []
    except Exception as e:  # a torch without the recorder, or a dump it cannot make now
        log.debug("the flight recorder could not be read: %s", e)
        return {}
    times: dict[str, dict[int, int]] = collections.defaultdict(dict)
    for entry in entries:
        seq = int(entry.get("collective_seq_id", -1))
        created = int(entry.get("time_created_ns", 0))
        if entry.get("is_p2p") or seq < 0 or created <= 0:
            continue
        times[str((entry.get("process_group") or ["?"])[0])][seq] = created
    if not times:
        return {}
    group = max(times, key=lambda g: len(times[g]))
    blocks: dict[int, list[int]] = collections.defaultdict(list)
    for seq, created in times[group].items():
        blocks[seq // block].append(created)
    full = sorted(b for b, ts in blocks.items() if len(ts) == block)[-keep:]
    return {f"{group}:{b}": [sum(blocks[b]), max(blocks[b]) - min(blocks[b])] for b in full}


def late_arrival(
    arrivals: dict[int, dict[str, list[int]]], step_s: float
) -> list[tuple[int, dict[int, float]]]:
    """From every rank's `arrival_blocks`: each block all of them hold (by its number, oldest
    first) and each rank's lateness a step in it (seconds: its enqueue times summed over the
    median rank's, spread over the block's steps at `step_s` a step)."""
    if len(arrivals) < 2 or step_s <= 0:
        return []
    common = set.intersection(*(set(d) for d in arrivals.values()))
    out = []
    for key in sorted(common, key=lambda k: int(k.rsplit(":", 1)[1])):
        sums = {r: d[key][0] for r, d in arrivals.items()}
        span_s = statistics.median(d[key][1] for d in arrivals.values()) / 1e9
        steps = max(span_s / step_s, 1.0)
        late = {}
        for r, total in sums.items():
            others = statistics.median(v for q, v in sums.items() if q != r)
            late[r] = (total - others) / 1e9 / steps
        out.append((int(key.rsplit(":", 1)[1]), late))
    return out


def behind(progress: dict[int, tuple[int, int]]) -> list[int]:
    """The ranks the others wait for: those least far along, when not all are as far."""
    if len(set(progress.values())) < 2:
        return []
    least = min(progress.values())
    return sorted(r for r, p in progress.items() if p == least)


def ranks_said(progress: dict[int, tuple[int, int]], late: list[int]) -> str:
    """'rank 1 behind (step 30, batch in hand; the others at step 30, at the gate)'."""
    if not late:
        return "every rank at the same point (" + _at(next(iter(progress.values()))) + ")"
    others = sorted({p for r, p in progress.items() if r not in late})
    names = ", ".join(str(r) for r in late)
    return (
        f"rank{'s' if len(late) > 1 else ''} {names} behind ({_at(progress[late[0]])}; "
        f"the others at {'; '.join(_at(p) for p in others)})"
    )


def _at(p: tuple[int, int]) -> str:
    step, phase = p
    return f"step {step} ended" if phase == ENDED else f"step {step}, {PHASES[phase]}"


def collectives_in_flight() -> list[dict[str, Any]]:
    """This rank's collectives enqueued and not completed, from torch's flight recorder (its
    ring of recent collectives, gloo's and NCCL's, kept by default; sized with
    TORCH_FR_BUFFER_SIZE): for each process group with one in flight, the oldest (the one this
    rank waits in), its op, its sequence number and its inputs' sizes. Empty where
    torch.distributed is not up or the recorder cannot be read. Read from the watchdog's
    thread while the loop thread may be inside that very collective."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return []
    try:
        from torch._C._distributed_c10d import _dump_fr_trace_json  # type: ignore[attr-defined]

        dump = json.loads(_dump_fr_trace_json(includeCollectives=True, onlyActive=True))
        out = []
        for pg, status in (dump.get("pg_status") or {}).items():
            done = int(status.get("last_completed_collective", -1))
            if int(status.get("last_enqueued_collective", -1)) <= done:
                continue
            for e in dump.get("entries") or []:
                group = e.get("process_group") or [pg, ""]
                if str(group[0]) == str(pg) and int(e.get("collective_seq_id", -1)) == done + 1:
                    out.append({
                        "op": e.get("profiling_name"),
                        "process_group": group[1] or str(group[0]),
                        "seq": done + 1,
                        "input_sizes": e.get("input_sizes"),
                    })  # fmt: skip
                    break
        return out
    except Exception as e:  # a torch without the recorder, or a dump it cannot make now
        log.debug("the flight recorder could not be read: %s", e)
        return []


def collectives_said(inflight: list[dict[str, Any]]) -> str:
    """`collectives_in_flight` in a few words: "gloo:all_reduce #31 on default_pg"."""
    return ", ".join(f"{c['op']} #{c['seq']} on {c['process_group']}" for c in inflight)


def thread_stacks(skip: int | None = None) -> dict[str, str]:
    """Every thread's Python stack, by thread name (the watchdog's own, `skip`, left out)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    out = {}
    for ident, frame in sys._current_frames().items():
        if ident == skip:
            continue
        name = names.get(ident, f"thread-{ident}")
        out[name] = "".join(traceback.format_stack(frame))
    return out


class _Window:
    """The last `maxlen` values and their median, kept sorted as they come and go (a step's
    pace judged against 256 earlier steps without sorting them every step)."""

    def __init__(self, maxlen: int) -> None:
        self.maxlen = maxlen
        self._order: collections.deque[float] = collections.deque()
        self._sorted: list[float] = []

    def append(self, x: float) -> None:
        if len(self._order) == self.maxlen:
            old = self._order.popleft()
            del self._sorted[bisect.bisect_left(self._sorted, old)]
        self._order.append(x)
        bisect.insort(self._sorted, x)

    def clear(self) -> None:
        self._order.clear()
        self._sorted.clear()

    def median(self) -> float:
        s, n = self._sorted, len(self._sorted)
        return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2

    def __getitem__(self, i: int) -> float:
        return self._order[i]

    def __len__(self) -> int:
        return len(self._order)


class Watchdog:
    """See the module docstring. `on_stall(info)` runs on the watchdog's thread, `on_resume`
    on the loop's; each is called once per stall."""

    def __init__(
        self,
        cfg: StallConfig,
        on_stall: Callable[[dict[str, Any]], None],
        on_resume: Callable[[dict[str, Any]], None],
        *,
        on_exit: Callable[[], None] = lambda: None,
        on_slowdown: Callable[[dict[str, Any]], None] = lambda info: None,
        on_pace_back: Callable[[dict[str, Any]], None] = lambda info: None,
        on_heartbeat: Callable[[dict[str, Any]], None] = lambda info: None,
        on_straggler: Callable[[dict[str, Any]], None] = lambda info: None,
        ranks: RankBeats | None = None,
        clock: Callable[[], float] = time.monotonic,
        wake_s: float = 1.0,
    ) -> None:
        self.cfg = cfg
        self.on_stall, self.on_resume, self.on_exit = on_stall, on_resume, on_exit
        self.on_slowdown, self.on_pace_back = on_slowdown, on_pace_back
        self.on_heartbeat = on_heartbeat
        self.on_straggler = on_straggler
        self.ranks = ranks
        self.progress = (0, ENDED)  # this rank's (step, phase); the loop thread sets it
        self._heartbeat_at: float | None = None  # the last heartbeat told
        self.baseline = _Window(256)
        self.recent = _Window(cfg.slowdown_window)
        self._slow: dict[str, Any] | None = None  # the slowdown under way
        self._slow_from: tuple[int, float] | None = None  # judged slow since (step, seconds)
        self._per_token = False  # the pace in seconds per token (the steps' tokens are told)
        # under torchrun: this rank's waits for its batches (step end to batch in hand), and
        # on rank 0 the straggler under way and how many wakes in a row found one
        self.data_waits: collections.deque[float] = collections.deque(maxlen=cfg.slowdown_window)
        # ... and its forwards (batch in hand to the model's forward's end: no collective in a
        # DDP forward, so a rank slow in its compute shows there; the others wait in backward)
        self.forwards: collections.deque[float] = collections.deque(maxlen=cfg.slowdown_window)
        # ... and its backwards (the forward's end to its last gradient, before the all-reduce's
        # wait: a rank slow in its backward alone keeps the others waiting there)
        self.backwards: collections.deque[float] = collections.deque(maxlen=cfg.slowdown_window)
        self._forward_end: float | None = None
        self._grads_at: float | None = None
        self._begun_at: float | None = None
        self._straggler: dict[str, Any] | None = None
        self._straggling = dict.fromkeys(KINDS, 0)
        # FSDP2 (the client sets it): the ranks' arrivals at their collectives, from torch's
        # flight recorder, read every ARRIVAL_EVERY wakes; on rank 0 the last block judged
        self.arrivals = False
        self._wakes = 0
        self._arrival_block: int | None = None
        self._late_blocks = 0
        self._late_rank: int | None = None  # the rank those late blocks were of
        self.clock = clock
        self.wake_s = wake_s  # at most one wake a second: the watchdog's whole cost
        self.durations: collections.deque[float] = collections.deque(maxlen=64)
        self.step = 0
        self._lock = threading.Lock()
        self._last: float | None = None  # the last beat
        self._excluded = 0.0  # paused seconds since the last beat
        self._paused_at: float | None = None
        self._depth = 0
        self._stalled: dict[str, Any] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.loop_thread = threading.get_ident()

    # -- the loop thread ------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None or not self.cfg.enabled:
            return
        self.loop_thread = threading.get_ident()
        with self._lock:
            self._last = self.clock()
        self.heartbeat()  # alive from the start, not a period later
        self._thread = threading.Thread(target=self._run, name="spikewatch-watchdog", daemon=True)
        self._thread.start()

    def beat(self, step: int, tokens: int | None = None) -> None:
        """A step ended; `tokens`: how many it trained on, where the loop tells them (the pace
        is then judged per token: a step twice as long over twice the tokens is no slowdown)."""
        now = self.clock()
        took = None
        with self._lock:
            if self._last is not None:
                took = max(0.0, now - self._last - self._excluded)
                self.durations.append(took)
            self._last, self._excluded, self.step = now, 0.0, step
            self.progress = (step, ENDED)
            stalled, self._stalled = self._stalled, None
        if took is not None and stalled is None:  # a stall's step is the stall's, not pace
            self._pace(step, took, tokens)
        if stalled is not None:
            info = {"step": step, "stalled_s": round(now - stalled["since"], 3),
                    "after_step": stalled["step"]}  # fmt: skip
            log.warning("steps resumed at step %d after a stall of %.1f s", step,
                        info["stalled_s"])  # fmt: skip
            self.on_resume(info)

    def mark(self, step: int, phase: int) -> None:
        """The loop thread is at `phase` of `step` (BEGUN, GATED): one tuple set; under torchrun
        a batch in hand also times this rank's wait for it. The watchdog's thread publishes
        both to the other ranks."""
        self.progress = (step, phase)
        if phase == BEGUN and self.ranks is not None and self._last is not None:
            now = self.clock()
            self.data_waits.append(max(0.0, now - self._last - self._excluded))
            self._begun_at = now
        elif phase == GATED and self.ranks is not None:  # backward done (torchrun): its own
            # part, the forward's end to the last gradient
            ended, made = self._forward_end, self._grads_at
            self._forward_end = self._grads_at = None
            if ended is not None and made is not None and made > ended:
                self.backwards.append(made - ended)

    def forward_ended(self) -> None:
        """The model's forward ended (a hook, on the loop thread, under torchrun): the step's
        first one times this rank's compute from its batch in hand."""
        if self._begun_at is not None:
            now = self.clock()
            self.forwards.append(now - self._begun_at)
            self._begun_at = None
            self._forward_end = now

    def grads_ready(self) -> None:
        """A gradient was made (`LastGrad`'s hook, in backward, on the loop thread)."""
        self._grads_at = self.clock()

    def _pace(self, step: int, took: float, tokens: int | None = None) -> None:
        """The slowdown rule, on the loop thread: the recent steps' median against the run's
        own baseline; one report an episode, and one when the pace is back. Seconds per token
        where the steps' tokens are told (varying sequence lengths, a batch-size ramp), else
        per step; the floor is in seconds a step either way."""
        factor = self.cfg.slowdown
        if factor is None:
            return
        if tokens and not self._per_token:  # the loop tells its tokens: per token from now on
            self._per_token = True
            self.recent.clear()
            self.baseline.clear()
            self._slow = self._slow_from = None
        elif self._per_token and not tokens:  # a step without its tokens (one drawn before a
            return  # rollback and skipped): not judged, the baseline stays per token
        per = tokens if tokens else 1  # this step's tokens: the unit's scale, for the floor
        self.recent.append(took / per)
        # a step enters the baseline as it is about to leave the window (and only while no
        # slowdown is under way): the steps under judgement are never their own baseline
        if len(self.baseline) < 4 * self.cfg.slowdown_window:
            if len(self.recent) == self.recent.maxlen:
                self.baseline.append(self.recent[0])
            return
        base = self.baseline.median()
        now = self.recent.median()
        if self._slow is None:
            # slow from the median's crossing of the bar until it is back within 1.2x (as a
            # slowdown told ends), told once that has lasted; the baseline frozen meanwhile
            if self._slow_from is None:
                floor = self.cfg.slowdown_min_s
                slow = base > 0 and now > factor * base and (now - base) * per >= floor
            else:
                slow = now > 1.2 * base
            if not slow:
                self._slow_from = None
                self.baseline.append(self.recent[0])
                return
            since, lasted = self._slow_from or (step, 0.0)
            self._slow_from = (since, lasted + took)
            if lasted + took >= self.cfg.slowdown_lasting_s:
                self._slow_from = None
                self._slow = {
                    "step": step,
                    "since_step": since,
                    "lasted_s": round(lasted + took, 3),
                    "recent_s": round(now * per, 6),  # a step's seconds (at this step's tokens)
                    "baseline_s": round(base * per, 6),
                    "ratio": round(now / base, 3),
                }
                if self._per_token:
                    self._slow["tokens_per_s"] = round(1 / now, 3)
                    self._slow["baseline_tokens_per_s"] = round(1 / base, 3)
                    log.warning(
                        "slowdown at step %d: the last %d steps ran at %.4g tokens/s (median), "
                        "%.2fx slower than the run's own %.4g, since step %d (%.3g s)", step,
                        len(self.recent), 1 / now, now / base, 1 / base, since, lasted + took,
                    )  # fmt: skip
                else:
                    log.warning(
                        "slowdown at step %d: the last %d steps took %.3g s (median), %.2fx the "
                        "run's own %.3g s, since step %d (%.3g s)", step, len(self.recent), now,
                        now / base, base, since, lasted + took,
                    )  # fmt: skip
                self.on_slowdown(dict(self._slow))
        elif now <= 1.2 * base:
            info = {"step": step, "since_step": self._slow["since_step"], "recent_s":
                    round(now * per, 6), "baseline_s": round(base * per, 6)}  # fmt: skip
            self._slow = None
            log.info("the pace is back at step %d (%.3g s a step)", step, now * per)
            self.on_pace_back(info)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Work that is slow by nature (a checkpoint, an evaluation, a restore): not a stall,
        and not part of the pace."""
        with self._lock:
            self._depth += 1
            if self._depth == 1:
                self._paused_at = self.clock()
        try:
            yield
        finally:
            with self._lock:
                self._depth -= 1
                if self._depth == 0 and self._paused_at is not None:
                    self._excluded += self.clock() - self._paused_at
                    self._paused_at = None

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self._thread = None

    # -- the watchdog's thread ------------------------------------------------------------
    def bound(self) -> float | None:
        """Seconds without a step that make a stall; None while the pace is not known."""
        if len(self.durations) < self.cfg.warmup_steps:
            return None
        return max(self.cfg.min_s, self.cfg.factor * statistics.median(self.durations))

    def idle(self) -> float:
        """Seconds since the last step ended, paused work left out."""
        now = self.clock()
        with self._lock:
            if self._last is None:
                return 0.0
            paused = now - self._paused_at if self._paused_at is not None else 0.0
            return now - self._last - self._excluded - paused

    def check(self) -> dict[str, Any] | None:
        """One look: the stall found now (reported), or None."""
        bound = self.bound()
        if bound is None or self._stalled is not None:
            return None
        idle = self.idle()
        if idle <= bound:
            return None
        with self._lock:
            if self._stalled is not None:
                return None
            self._stalled = {"since": self.clock() - idle, "step": self.step}
        stacks = thread_stacks(skip=self._thread.ident if self._thread is not None else None)
        info: dict[str, Any] = {
            "step": self.step,
            "idle_s": round(idle, 3),
            "bound_s": round(bound, 3),
            "median_step_s": round(statistics.median(self.durations), 6),
            "stacks": stacks,
            "loop_stack": stacks.get(_name(self.loop_thread), ""),
        }
        where = ""
        if self.ranks is not None:
            progress = self._rank_progress()
            if progress:
                info["ranks"] = {str(r): list(p) for r, p in sorted(progress.items())}
                info["behind"] = behind(progress)
                where = "; " + ranks_said(progress, info["behind"])
            inflight = collectives_in_flight()
            if inflight:  # what this rank waits in, where torch's flight recorder tells
                info["collectives_in_flight"] = inflight
                where += "; in flight here: " + collectives_said(inflight)
        log.warning(
            "stall: no step has ended for %.1f s (bound %.1f s, %.0fx the median step) after "
            "step %d%s; the loop is at:\n%s", idle, bound, self.cfg.factor, self.step, where,
            info["loop_stack"],
        )  # fmt: skip
        self.on_stall(info)
        return info

    def _rank_progress(self) -> dict[int, tuple[int, int]]:
        """Every rank's progress, this rank's own as of now (empty if the store fails)."""
        assert self.ranks is not None
        try:
            self.ranks.publish(self.progress)
            return self.ranks.read()
        except Exception as e:  # the store: the stall is told without the ranks
            log.debug("the ranks' progress could not be read: %s", e)
            return {}

    def publish(self) -> None:
        """This rank's progress and batch wait to the others (under torchrun), when changed."""
        if self.ranks is None:
            return
        try:
            self.ranks.publish(self.progress)
            if len(self.data_waits) == self.data_waits.maxlen:
                self.ranks.publish_pace(statistics.median(self.data_waits))
            if len(self.forwards) == self.forwards.maxlen:
                self.ranks.publish_pace(statistics.median(self.forwards), RankBeats.FORWARD)
            if len(self.backwards) == self.backwards.maxlen:
                self.ranks.publish_pace(statistics.median(self.backwards), RankBeats.BACKWARD)
            self._wakes += 1
            if self.arrivals and self._wakes % ARRIVAL_EVERY == 0:
                blocks = arrival_blocks()
                if blocks:
                    self.ranks.publish_arrivals(blocks)
        except Exception as e:  # the store went away (the job ends): not the watchdog's end
            log.debug("progress not published: %s", e)

    def judge_ranks(self) -> dict[str, Any] | None:
        """On rank 0, once a wake: a rank that keeps the others waiting three wakes running is
        a straggler, told once (`on_straggler`); within 1.2x again, it may be told anew. Slow
        in its batches (its median wait for them above `slowdown` times the others' and
        `slowdown_min_s` longer), or else slow in its compute (its median forward so, or its
        median backward: the forward's end to its last gradient)."""
        factor = self.cfg.slowdown
        if self.ranks is None or self.ranks.rank != 0 or factor is None:
            return None
        try:
            paces = {k: self.ranks.read_pace(k) for k in KINDS}
        except Exception as e:  # the store: no judgement this wake
            log.debug("the ranks' pace could not be read: %s", e)
            return None
        if self._straggler is not None and self._straggler["slow_in"] == ARRIVING:
            arrived = self._new_arrivals()
            rank = self._straggler["rank"]
            if arrived and arrived[-1].get(rank, 0.0) < self.cfg.slowdown_min_s:
                log.info("rank %d keeps pace again (it reaches the collectives with the others)",
                         rank)  # fmt: skip
                self._straggler = None
                self._late_blocks = 0
            return None
        if self._straggler is not None:
            rank = self._straggler["rank"]
            kind = next(k for k, v in SLOW_IN.items() if v == self._straggler["slow_in"])
            pace = paces[kind]
            others = statistics.median(v for r, v in pace.items() if r != rank) if pace else 0.0
            if rank in pace and pace[rank] <= 1.2 * others + self.cfg.slowdown_min_s:
                log.info("rank %d keeps pace again (%s %.3g s)", rank, WHAT[kind], pace[rank])
                self._straggler = None
                self._straggling = dict.fromkeys(self._straggling, 0)
            return None
        for kind, pace in paces.items():
            found = straggler(pace, factor, self.cfg.slowdown_min_s)
            self._straggling[kind] = self._straggling[kind] + 1 if found else 0
            if found is None or self._straggling[kind] < 3:
                continue
            rank, others = found
            step_s = statistics.median(self.durations) if self.durations else None
            key = KEY[kind]
            self._straggler = info = {
                "step": self.step,
                "straggler": rank,
                "rank": rank,
                "slow_in": SLOW_IN[kind],
                key: round(pace[rank], 6),
                f"others_{key}": round(others, 6),
                "ratio": round(pace[rank] / others, 3) if others > 0 else None,
                "median_step_s": None if step_s is None else round(step_s, 6),
            }
            log.warning(
                "straggler: rank %d takes %.3g s a step for %s, the other ranks %.3g s: the job "
                "runs at its pace", rank, pace[rank], WHAT[kind], others,
            )  # fmt: skip
            self.on_straggler(info)
            return info
        return self._judge_arrivals(factor)

    def _new_arrivals(self) -> list[dict[int, float]]:
        """The ranks' lateness a step in each block of collectives they all hold that was not
        judged yet, oldest first (`late_arrival`)."""
        assert self.ranks is not None
        step_s = statistics.median(self.durations) if self.durations else 0.0
        try:
            blocks = late_arrival(self.ranks.read_arrivals(), step_s)
        except Exception as e:  # the store: no judgement this wake
            log.debug("the ranks' arrivals could not be read: %s", e)
            return []
        new = [
            (b, late)
            for b, late in blocks
            if self._arrival_block is None or b > self._arrival_block
        ]
        if new:
            self._arrival_block = new[-1][0]
        return [late for _, late in new]

    def _judge_arrivals(self, factor: float) -> dict[str, Any] | None:
        """FSDP2 (`arrivals`): a rank that reaches the collectives later than the others by
        `slowdown_min_s` a step or more, and by more than (`slowdown` - 1) times the rest of
        the step (its compute that much slower), in three blocks of collectives running, is a
        straggler, told once."""
        if not self.arrivals:
            return None
        step_s = statistics.median(self.durations) if self.durations else 0.0
        for late in self._new_arrivals():
            rank = max(late, key=lambda r: late[r])
            others = max(0.0, statistics.median(v for r, v in late.items() if r != rank))
            lag = late[rank] - others
            slow = lag >= self.cfg.slowdown_min_s and lag > (factor - 1) * max(step_s - lag, 0)
            # three blocks running of the same rank late (another rank late starts the count)
            same = rank == self._late_rank
            self._late_blocks = (self._late_blocks + 1 if same else 1) if slow else 0
            self._late_rank = rank if slow else None
            if self._late_blocks < 3:
                continue
            self._straggler = info = {
                "step": self.step,
                "straggler": rank,
                "rank": rank,
                "slow_in": ARRIVING,
                "late_s": round(late[rank], 6),
                "others_late_s": round(others, 6),
                "median_step_s": round(step_s, 6),
            }
            log.warning(
                "straggler: rank %d reaches the collectives %.3g s a step after the other "
                "ranks: the job runs at its pace", rank, late[rank],
            )  # fmt: skip
            self.on_straggler(info)
            return info
        return None

    def heartbeat(self) -> None:
        """Tell the record the process is alive, once a `heartbeat_s` period."""
        period = self.cfg.heartbeat_s
        now = self.clock()
        if period is None or (self._heartbeat_at is not None and now - self._heartbeat_at < period):
            return
        self._heartbeat_at = now
        self.on_heartbeat({"period_s": period})

    def _run(self) -> None:
        while not self._stop.wait(min(self.wake_s, self.cfg.heartbeat_s or self.wake_s)):
            try:
                self.heartbeat()
                self.publish()
                self.judge_ranks()
                self.check()
                self._maybe_exit()
            except Exception:  # the watchdog never takes the run down by mistake
                log.exception("the stall watchdog failed; it stops watching")
                return

    def _maybe_exit(self) -> None:
        limit = self.cfg.exit_after_s
        stalled = self._stalled
        if limit is None or stalled is None or self.clock() - stalled["since"] < limit:
            return
        log.error("stalled for %.0f s (exit_after_s): exiting with code %d for a restart",
                  self.clock() - stalled["since"], EXIT_STALLED)  # fmt: skip
        try:
            self.on_exit()  # the record made durable first
        finally:
            logging.shutdown()
        os._exit(EXIT_STALLED)


def _name(ident: int) -> str:
    for t in threading.enumerate():
        if t.ident == ident:
            return t.name
    return f"thread-{ident}"
