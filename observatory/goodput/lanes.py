"""The engine's lanes (one per scenario and seed): their constants and state, their random
draws, and what the report reads of them (goodput/engine.py tells the model; goodput/rounds.py
moves many lanes at once, goodput/scalar.py one at a time)."""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any

import numpy as np

from spikewatch.observatory.goodput.held import LaneRetention, Retention
from spikewatch.observatory.goodput.model import Scenario, Tier, expected_events
from spikewatch.observatory.goodput.state import (
    BUCKETS,
    COUNTS,
    FLOATS,
    INTS,
    MODE_COUNTS,
    NEVER,
    gaps,
    steps,
)

__all__ = ["Block", "Lanes", "MAX_EVENTS", "MAX_SAVES"]

MAX_EVENTS = 1_000_000  # failures and spikes a run is expected to meet
MAX_SAVES = 300_000  # saves of one tier in one run (retention is kept per save)


@dataclasses.dataclass
class Lanes:
    """Per lane (scenario-major: scenario i's seeds are lanes `of(i)`): wall seconds by bucket
    and counts of what happened."""

    offsets: np.ndarray  # scenario i's lanes are offsets[i]:offsets[i + 1]
    finished: np.ndarray  # False: gave up after GIVE_UP times the failure-free time
    wall_s: np.ndarray
    buckets: dict[str, np.ndarray]
    failures: np.ndarray
    spikes: np.ndarray
    restores_from_memory: np.ndarray
    further_back: np.ndarray  # rollbacks whose newest pre-onset save was no longer retained
    further_steps: np.ndarray  # and how many steps further back they had to go
    modes: dict[str, np.ndarray]  # what the optional failure modes did (MODE_COUNTS)

    @property
    def goodput(self) -> np.ndarray:
        return self.buckets["productive"] / self.wall_s

    def of(self, scenario: int) -> slice:
        return slice(int(self.offsets[scenario]), int(self.offsets[scenario + 1]))

    def pick(self, scenario: int) -> Lanes:
        """One scenario's lanes, on their own."""
        s = self.of(scenario)
        return self.select(s, np.array([0, s.stop - s.start]))

    def select(self, rows: slice | np.ndarray, offsets: np.ndarray) -> Lanes:
        """The lanes `rows`, in that order, as scenarios starting at `offsets`."""
        return Lanes(offsets=offsets, **_fields(self, lambda a: a[rows]))

    @staticmethod
    def join(parts: list[Lanes]) -> Lanes:
        """The scenarios of `parts`, one after another."""
        sizes = np.concatenate([np.diff(p.offsets) for p in parts])
        offsets = np.concatenate([[0], np.cumsum(sizes)])
        return Lanes(offsets=offsets, **_fields(parts, np.concatenate))


def _fields(of: Lanes | list[Lanes], make: Any) -> dict[str, Any]:
    """Every per-lane field of `of` (one Lanes, or a list for `make` to combine), made anew."""
    parts = of if isinstance(of, list) else [of]
    one = not isinstance(of, list)
    out: dict[str, Any] = {}
    for f in dataclasses.fields(Lanes):
        if f.name == "offsets":
            continue
        first = getattr(parts[0], f.name)
        if isinstance(first, dict):
            out[f.name] = {
                k: make(v if one else [getattr(p, f.name)[k] for p in parts])
                for k, v in first.items()
            }
        else:
            out[f.name] = make(first if one else [getattr(p, f.name) for p in parts])
    return out


class _Draws:
    """Per seed, the same unit draws in every scenario, extended on demand: each stream of
    each seed has its own generator, so what a seed draws does not depend on the batch."""

    STREAMS = ("fail", "spike", "cause", "back", "recover", "repeat", "sdc")

    def __init__(self, seeds: range, seed: int, n: int, streams: tuple[str, ...]) -> None:
        """Rows for seeds `seed + i`, i in `seeds`, of the `streams` the run uses."""
        self.rngs = {
            name: [np.random.default_rng([seed + i, 0x5EED, j]) for i in seeds]
            for j, name in enumerate(self.STREAMS)
            if name in streams
        }
        self.cols: dict[str, np.ndarray] = {}
        self.n = 0
        self._grow(n)

    def _grow(self, n: int) -> None:
        for name, rngs in self.rngs.items():
            draw = [
                r.random(n) if name in ("cause", "back", "repeat") else r.standard_exponential(n)
                for r in rngs
            ]
            fresh = np.stack(draw)
            self.cols[name] = (
                np.concatenate([self.cols[name], fresh], axis=1) if name in self.cols else fresh
            )
        self.n += n

    def take(self, name: str, seed: np.ndarray, idx: np.ndarray) -> np.ndarray:
        while idx.size and idx.max() >= self.n:
            self._grow(self.n)
        return self.cols[name][seed, idx]

    def reach(self, n: int) -> None:
        """Draws up to index n - 1 in every stream (a caller that knows its indices stay
        below n then reads `cols` directly)."""
        while n > self.n:
            self._grow(self.n)


def _param(scenarios: list[Scenario], seeds: np.ndarray, get, dtype=np.float64) -> np.ndarray:  # noqa: ANN001
    return np.repeat(np.array([get(s) for s in scenarios], dtype=dtype), seeds)


# a lane's constants, gathered the same way
CONST_F = ("step_s", "base_s", "st_m", "st_d", "stall", "rate_s", "restore_m", "restore_d",
           "write_d", "lam", "rate", "repeat", "lam_div", "rate_div")  # fmt: skip
CONST_I = ("km", "kd", "N", "mem_on", "survives", "seed", "scen")


class _At:
    """A set of lanes' constants, gathered in one numpy call per dtype: a round's cost is its
    number of numpy calls."""

    __slots__ = (*CONST_F, *CONST_I, "f", "i", "kd_min", "km_min")

    def __init__(self, f: np.ndarray, i: np.ndarray, k_min: tuple[int, int]) -> None:
        self.f, self.i = f, i
        self.km_min, self.kd_min = k_min  # each tier's shortest interval of all lanes
        for name, row in zip(CONST_F, f, strict=True):
            setattr(self, name, row)
        for name, row in zip(CONST_I, i, strict=True):
            setattr(self, name, row > 0 if name in ("mem_on", "survives") else row)

    if TYPE_CHECKING:  # the rows, by name

        def __getattr__(self, name: str) -> np.ndarray: ...


class _Run:
    """The lanes' constants and state (moved by goodput/rounds.py, or one lane at a time by
    goodput/scalar.py). A tier's per-lane arrays are laid end to end, memory then disk: the
    slot of lane i's tier j is i + j L, so that both tiers' retention is looked up at once."""

    # the optional modes' constants (_modes)
    repeat: np.ndarray
    recovers: np.ndarray
    stop_every: np.ndarray
    stop_window: np.ndarray
    stop_restart: np.ndarray
    sdc_rate: np.ndarray
    sdc_detect: np.ndarray
    any_repeat: bool
    any_sdc: bool
    any_recover: bool
    any_stops: bool

    def __init__(
        self, scenarios: list[Scenario], seeds: np.ndarray, seed: int, first: np.ndarray | None
    ) -> None:
        self.sc, self.seeds = scenarios, seeds
        self.L = L = int(seeds.sum())
        self.scen = np.repeat(np.arange(len(scenarios)), seeds)
        first = np.zeros(len(scenarios), np.int64) if first is None else first
        rows = range(int(first.min()), int((first + seeds).max()))  # the seeds drawn for
        self.seed = np.concatenate([np.arange(a, a + n) for a, n in zip(first, seeds, strict=True)])
        self.seed -= rows.start  # each lane's row of the draws
        self.base_s = _param(scenarios, seeds, lambda s: s.step_s)  # a step without stragglers
        self.step_s = self.base_s * _param(scenarios, seeds, lambda s: 1 + s.straggler)
        self.N = _param(scenarios, seeds, lambda s: s.steps, np.int64)
        self.lam = _param(scenarios, seeds, lambda s: 1 / s.mtbf_s)  # failures per running s
        self.rate = _param(scenarios, seeds, lambda s: s.spikes.per_1k_steps / 1000)
        self.tiers = {}
        rules: list[Retention | None] = []
        for name in ("memory", "disk"):
            t = [s.tier(name) for s in scenarios]
            self.tiers[name] = {
                "on": np.repeat([x is not None for x in t], seeds),
                "k": np.repeat([x.interval if x else NEVER for x in t], seeds).astype(np.int64),
                "stall": np.repeat(
                    [_stall(x, s) for x, s in zip(t, scenarios, strict=True)], seeds
                ),
                "restore": np.repeat([x.restore_s if x else 0.0 for x in t], seeds),
                "write": np.repeat([x.write_s if x else 0.0 for x in t], seeds),
                "survives": np.repeat([bool(x and x.replicas >= 2) for x in t], seeds),
            }
            per_scenario = [
                Retention(x.interval, x.retention, x.keep_last, x.max_kept) if x else None
                for x in t
            ]
            rules += [r for r, n in zip(per_scenario, seeds, strict=True) for _ in range(n)]
        self.held = LaneRetention(rules, max(s.steps for s in scenarios))  # by slot
        mem, disk = self.tiers["memory"], self.tiers["disk"]
        self.k_slot = np.concatenate([mem["k"], disk["k"]])
        self.k_min = int(mem["k"].min()), int(disk["k"].min())
        self.stall_sum = mem["stall"] + disk["stall"]
        self.rate_s = self.step_s + (mem["stall"] / mem["k"] + disk["stall"] / disk["k"])
        backs = [s.spikes.back_steps for s in scenarios]
        self.backs = np.zeros((len(scenarios), max(map(len, backs))), np.int64)
        for i, b in enumerate(backs):
            self.backs[i, : len(b)] = b
        self.n_backs = np.array([len(b) for b in backs])
        causes = scenarios[0].failures.causes
        self.cause_cum = np.cumsum([c.share for c in causes])
        self.cause_cum[-1] = 1.0
        self.host_lost = np.array([c.host_lost for c in causes])
        own = np.array([[np.nan if c.restart_s is None else c.restart_s for c in causes]])
        self.restart = np.where(
            np.isnan(own), _param(scenarios, seeds, lambda s: s.restart_s)[:, None], own
        )
        expected = max(max(map(expected_events, scenarios)), 1.0)
        if expected > MAX_EVENTS:
            raise ValueError(
                f"a run would meet about {expected:,.0f} failures and spikes: too many to "
                f"simulate (at most {MAX_EVENTS:,}); fewer GPUs, a lower rate or a shorter run"
            )
        for sc in scenarios:
            for tier in sc.tiers:
                if sc.steps // tier.interval > MAX_SAVES:
                    raise ValueError(
                        f"the {tier.name} tier would save {sc.steps // tier.interval:,} times "
                        f"(at most {MAX_SAVES:,}): lengthen its interval"
                    )
        n = int(expected * 1.3 + 10 * math.sqrt(expected) + 64)
        self._modes(scenarios, seeds)
        streams = [name for name, used in (("recover", self.any_recover),
                   ("repeat", self.any_repeat), ("sdc", self.any_sdc)) if used]  # fmt: skip
        self.draws = _Draws(rows, seed, n, ("fail", "spike", "cause", "back", *streams))
        self._causes = np.zeros((0, 0), np.int64)
        values = {"step_s": self.step_s, "base_s": self.base_s, "st_m": mem["stall"],
                  "st_d": disk["stall"], "stall": self.stall_sum, "rate_s": self.rate_s,
                  "restore_m": mem["restore"], "restore_d": disk["restore"],
                  "write_d": disk["write"], "lam": self.lam, "rate": self.rate,
                  "repeat": self.repeat, "lam_div": np.where(self.lam > 0, self.lam, 1.0),
                  "rate_div": np.where(self.rate > 0, self.rate, 1.0), "km": mem["k"],
                  "kd": disk["k"], "N": self.N,
                  "mem_on": mem["on"], "survives": mem["survives"], "seed": self.seed,
                  "scen": self.scen}  # fmt: skip
        self.f_at = np.stack([values[k] for k in CONST_F])
        self.i_at = np.stack([values[k] for k in CONST_I]).astype(np.int64)
        self._state(L)

    def _modes(self, scenarios: list[Scenario], seeds: np.ndarray) -> None:
        """The optional failure modes' per-lane constants (goodput/modes.py)."""

        def per_lane(get: Any, dtype: Any = np.float64) -> np.ndarray:
            return np.repeat(np.array([get(s) for s in scenarios], dtype=dtype), seeds)

        self.repeat = per_lane(lambda s: s.spikes.repeat)
        self.recovers = per_lane(lambda s: s.failures.during_recovery, bool)
        self.stop_every = per_lane(lambda s: s.maintenance.every_s or np.inf)
        self.stop_window = per_lane(lambda s: s.maintenance.window_s)
        self.stop_restart = per_lane(lambda s: s.restart_s)
        self.sdc_rate = per_lane(  # corruptions per trained step
            lambda s: s.corruption.per_gpu_day * s.gpus * s.step_s * (1 + s.straggler) / 86_400
        )
        self.sdc_detect = per_lane(lambda s: s.corruption.detect_steps, np.int64)
        self.any_repeat = bool((self.repeat > 0).any())
        self.any_sdc = bool((self.sdc_rate > 0).any())
        self.any_recover = bool(self.recovers.any())
        self.any_stops = bool(np.isfinite(self.stop_every).any())

    def _state(self, L: int) -> None:
        """The state matrices, and each row by name (views: the scalar loop reads these)."""
        self.F = np.zeros((len(FLOATS), L))
        self.I = np.zeros((len(INTS), L), np.int64)
        self.t, self.f_left, self.next_stop = self.F[:3]
        (self.P, self.H, self.s_left, self.i_fail, self.i_spike, self.lost, self.mem_floor,
         self.sdc_at, self.i_sdc, self.i_recover, self.c_left, self.d_left,
         self.stop_save) = self.I[:13]  # fmt: skip
        self.b = dict(zip(BUCKETS, self.F[3:], strict=True))
        self.count = dict(zip(COUNTS, self.I[13:], strict=True))
        self.sdc_at[:] = -1  # the step after which the state is wrong (-1: it is not)
        self.d_left[:] = NEVER  # trained steps to the detection of the current corruption
        self.next_stop[:] = self.stop_every
        everyone = self.at(np.arange(L))
        self.f_left[:] = gaps(self.draws.take("fail", self.seed, self.i_fail), self.lam)
        self.i_fail += 1
        self.s_left[:] = steps(self.draws.take("spike", self.seed, self.i_spike), everyone.rate)
        self.c_left[:] = NEVER  # trained steps to the next corruption
        if self.any_sdc:
            self.c_left[:] = steps(self.draws.take("sdc", self.seed, self.i_sdc), self.sdc_rate)
            self.i_sdc += 1
        # rollback targets, pinned: per slot, its steps (-1: a free slot)
        self.pins = np.full((2 * L, 4), -1, np.int64)
        self.n_pins = np.zeros(2 * L, np.int64)
        self.pin_max = np.zeros(2 * L, np.int64)  # each slot's newest pin (0: none)

    def causes(self) -> np.ndarray:
        """The cause of every failure draw (seed x index), as the draws now reach."""
        if self._causes.shape[1] != self.draws.n:
            u = self.draws.cols["cause"]
            cause = np.searchsorted(self.cause_cum, u)
            self._causes = np.minimum(cause, self.cause_cum.size - 1)
        return self._causes

    def at(self, ia: np.ndarray) -> _At:
        return _At(np.take(self.f_at, ia, axis=1), np.take(self.i_at, ia, axis=1), self.k_min)

    def lanes(self) -> Lanes:
        """What the report reads, per lane (copies)."""
        b = dict(self.b)
        b["productive"] = self.P * self.base_s  # the steps kept: all of them if it finished
        b["straggler_slowdown"] = (self.P + self.lost) * (self.step_s - self.base_s)
        return Lanes(
            offsets=np.concatenate([[0], np.cumsum(self.seeds)]),
            finished=self.P == self.N,
            wall_s=self.t.copy(),
            buckets=b,
            failures=self.count["failures"].copy(),
            spikes=self.count["spikes"].copy(),
            restores_from_memory=self.count["memory"].copy(),
            further_back=self.count["further"].copy(),
            further_steps=self.count["further_steps"].copy(),
            modes={k: self.count[k].copy() for k in MODE_COUNTS},
        )


class Block:
    """The lanes `ia` the rounds move (goodput/rounds.py): their columns of the state matrices
    (the matrices themselves while every lane is in it), and their constants. It is kept from
    round to round, and narrowed to the lanes still moving once a quarter of it has ended: a
    lane that ended stays in it, inert (no steps to train, no event to meet), until then."""

    __slots__ = ("F", "I", "full", "ia", "p", "run")

    def __init__(self, run: _Run, ia: np.ndarray) -> None:
        self.run, self.ia, self.full = run, ia, ia.size == run.L
        self.p = run.at(ia)
        self.F = run.F if self.full else np.take(run.F, ia, axis=1)
        self.I = run.I if self.full else np.take(run.I, ia, axis=1)

    def write_back(self) -> None:
        if not self.full:
            self.run.F[:, self.ia] = self.F
            self.run.I[:, self.ia] = self.I


def _stall(tier: Tier | None, sc: Scenario) -> float:
    """A save's stall, plus the wait for the last one's write when it outlasts the interval."""
    if tier is None:
        return 0.0
    return tier.stall_s + max(0.0, tier.write_s - tier.interval * sc.step_s)
