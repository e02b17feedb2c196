"""A discrete-event simulation of training runs, many at once (numpy lanes, one per scenario and
seed), with common random numbers: seed i draws the same failure gaps, spike gaps, causes and
rollback distances in every scenario, so that two plans are compared on the same misfortunes.

A lane moves from event to event: the next failure (a Poisson process in running wall time),
the next spike (a Poisson process in trained steps, replays included) or the end. Between events
it trains, and every `interval` steps each tier saves (the stall blocks; a disk save is durable
`write_s` later). A failure loses everything since the newest durable checkpoint that survived it,
plus the cause's restart and the tier's restore. A spike rolls back to the newest retained
checkpoint at least `back` steps before its detection (the disk tier's retention rule, evaluated
at the run's furthest save; rollback targets are pinned; step 0 is always there).

Wall time splits exactly into buckets, named after Google's `ml-goodput-measurement` where one
fits: productive (the final lineage's steps), wasted progress from disruption (steps lost to
failures, and the part-step in flight), wasted progress from spike rollbacks, checkpoint save
(stalls), checkpoint restore, and infrastructure recovery (detection, scheduling,
initialisation, warm-up: the restart).
Failures strike only while the job runs, not during its restart or restore. A lane whose
spikes or failures come faster than it can progress stops at GIVE_UP times its failure-free
time, unfinished; its productive time is then the steps it kept.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from observatory.goodput.held import LaneRetention, Retention
from observatory.goodput.model import Scenario, Tier
from observatory.goodput.modes import MODE_COUNTS, Modes, expected_events
from observatory.goodput.scalar import run_lane

__all__ = ["BUCKETS", "Lanes", "simulate"]

BUCKETS = (
    "productive",
    "wasted_progress_from_disruption",
    "wasted_progress_from_spike_rollback",
    "unproductive_checkpoint_save_time",
    "unproductive_checkpoint_restore_time",
    "infrastructure_recovery_from_disruption",
    "wasted_progress_from_corruption",  # steps back to before a silent data corruption
    "planned_maintenance",  # a planned stop's window and restart
    "straggler_slowdown",  # what a slow rank added to every step trained
)
_NEVER = np.iinfo(np.int64).max // 4
MAX_EVENTS = 1_000_000  # failures and spikes a run is expected to meet
MAX_SAVES = 300_000  # saves of one tier in one run (retention is kept per save)
GIVE_UP = 20  # a lane stops after this many times its failure-free time (saves included)
# when this few lanes are left, each runs on alone in plain Python (goodput/scalar.py): a round
# of numpy calls costs more than that many lanes' events one by one
ONE_BY_ONE = 8
_CANDIDATES = 16  # a failure's step: every candidate at once up to this many, else bisection
_UP_TO = np.arange(1, _CANDIDATES + 1)


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


def simulate(
    scenarios: Sequence[Scenario],
    seeds: int | Sequence[int] = 100,
    seed: int = 0,
    *,
    workers: int | None = None,
) -> Lanes:
    """Every scenario under seeds `seed`, ..., `seed + seeds - 1` (`seeds`: one count for all,
    or one per scenario: plans of one question share one pass of the loop). Many lanes are
    split over `workers` processes (None: this machine's cores, or
    $SPIKEWATCH_SIMULATE_WORKERS; goodput/parallel.py); the outputs do not depend on it."""
    counts = np.broadcast_to(np.asarray(seeds, dtype=np.int64), (len(scenarios),))
    if not scenarios or counts.min() < 1:
        raise ValueError("simulate needs at least one scenario and one seed")
    causes = scenarios[0].failures.causes
    if any(s.failures.causes != causes for s in scenarios):
        raise ValueError("the scenarios of one simulation share their failure causes")
    from observatory.goodput.parallel import split

    return split(list(scenarios), counts, seed, workers)


def run_part(
    scenarios: list[Scenario], seeds: np.ndarray, seed: int, first: np.ndarray | None = None
) -> Lanes:
    """Scenario i's seeds `seed + first[i]`, ..., `seed + first[i] + seeds[i] - 1`, in this
    process (first: 0 for every scenario)."""
    return _Run(scenarios, seeds, seed, first).go()


class _Draws:
    """Per seed, the same unit draws in every scenario, extended on demand: each stream of
    each seed has its own generator, so what a seed draws does not depend on the batch."""

    STREAMS = ("fail", "spike", "cause", "back", "recover", "repeat", "sdc")

    def __init__(self, seeds: range, seed: int, n: int) -> None:
        """Rows for seeds `seed + i`, i in `seeds`."""
        self.rngs = {
            name: [np.random.default_rng([seed + i, 0x5EED, j]) for i in seeds]
            for j, name in enumerate(self.STREAMS)
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


def _param(scenarios: list[Scenario], seeds: np.ndarray, get) -> np.ndarray:  # noqa: ANN001
    return np.repeat(np.array([get(s) for s in scenarios], dtype=np.float64), seeds)


class _At:
    """A set of lanes' constants, gathered in two numpy calls (one per dtype) rather than one
    call each: a round's cost is its number of numpy calls."""

    __slots__ = ("N", "base_s", "kd", "km", "mem_on", "rate_s", "restore_d", "restore_m",
                 "st_d", "st_m", "stall", "step_s", "survives", "write_d")  # fmt: skip

    def __init__(self, f: np.ndarray, i: np.ndarray) -> None:
        (self.step_s, self.base_s, self.st_m, self.st_d, self.stall, self.rate_s,
         self.restore_m, self.restore_d, self.write_d) = f  # fmt: skip
        self.km, self.kd, self.N, mem_on, survives = i
        self.mem_on, self.survives = mem_on > 0, survives > 0


class _Run(Modes):
    """The lanes' constants and state, and the rounds that move every lane from its event to
    its next one. A tier's per-lane arrays are laid end to end, memory then disk: the slot of
    lane i's tier j is i + j L, so that both tiers' retention is looked up in one call."""

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
        self.N = _param(scenarios, seeds, lambda s: s.steps).astype(np.int64)
        self.lam = _param(scenarios, seeds, lambda s: 1 / s.mtbf_s)  # failures per running s
        self.rate = _param(scenarios, seeds, lambda s: s.spikes.per_1k_steps / 1000)
        self.tiers = {}
        rules: list[Retention | None] = []
        for name in ("memory", "disk"):
            t = [s.tier(name) for s in scenarios]
            self.tiers[name] = {
                "on": np.repeat([x is not None for x in t], seeds),
                "k": np.repeat([x.interval if x else _NEVER for x in t], seeds).astype(np.int64),
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
        self.stall_sum = mem["stall"] + disk["stall"]
        self.rate_s = self.step_s + (mem["stall"] / mem["k"] + disk["stall"] / disk["k"])
        f = (self.step_s, self.base_s, mem["stall"], disk["stall"], self.stall_sum, self.rate_s,
             mem["restore"], disk["restore"], disk["write"])  # fmt: skip
        self.f_at = np.stack(f)
        self.i_at = np.stack([mem["k"], disk["k"], self.N, mem["on"], mem["survives"]])
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
        self.draws = _Draws(rows, seed, n)
        # state
        self.t = np.zeros(L)
        self.P = np.zeros(L, dtype=np.int64)
        self.H = np.zeros(L, dtype=np.int64)
        # per slot, the oldest step a tier may restore: memory holds nothing from before a lost
        # host; the disk tier's stays 0
        self.floor = np.zeros(2 * L, dtype=np.int64)
        self.mem_floor = self.floor[:L]
        self.i_fail = np.zeros(L, dtype=np.int64)
        self.i_spike = np.zeros(L, dtype=np.int64)
        all_lanes = np.arange(L)
        self.f_left = self._fail_gap(all_lanes)
        self.s_left = self._spike_gap(all_lanes)
        # rollback targets, pinned: per slot, its steps (-1: a free slot)
        self.pins = np.full((2 * L, 4), -1, np.int64)
        self.n_pins = np.zeros(2 * L, np.int64)
        self.pin_max = np.zeros(2 * L, np.int64)  # each slot's newest pin (0: none)
        self.b = {k: np.zeros(L) for k in BUCKETS}
        self.count = {
            k: np.zeros(L, dtype=np.int64)
            for k in ("failures", "spikes", "memory", "further", "further_steps", *MODE_COUNTS)
        }
        self.lost = np.zeros(L, dtype=np.int64)  # steps trained and thrown away
        self.init_modes(scenarios, seeds)

    def at(self, ia: np.ndarray) -> _At:
        return _At(np.take(self.f_at, ia, axis=1), np.take(self.i_at, ia, axis=1))

    # -- draws -------------------------------------------------------------------------------

    def _fail_gap(self, ia: np.ndarray) -> np.ndarray:
        e = self.draws.take("fail", self.seed[ia], self.i_fail[ia])
        self.i_fail[ia] += 1
        with np.errstate(divide="ignore"):
            return np.where(self.lam[ia] > 0, e / self.lam[ia], np.inf)

    def _spike_gap(self, ia: np.ndarray) -> np.ndarray:
        e = self.draws.take("spike", self.seed[ia], self.i_spike[ia])
        with np.errstate(divide="ignore"):
            steps = np.where(self.rate[ia] > 0, np.ceil(e / self.rate[ia]), _NEVER)
        return np.minimum(steps, _NEVER).astype(np.int64)

    # -- time ----------------------------------------------------------------------------------

    @staticmethod
    def _wall(p: _At, P: np.ndarray, m: np.ndarray) -> np.ndarray:
        """The seconds steps P + 1 .. P + m take, with the stalls of both tiers' saves."""
        end, km, kd = P + m, p.km, p.kd
        return m * p.step_s + (p.st_m * (end // km - P // km) + p.st_d * (end // kd - P // kd))

    def _steps_within(self, p: _At, P: np.ndarray, tau: np.ndarray, cap: np.ndarray) -> np.ndarray:
        """The most steps (with their saves) that end by `tau` seconds, below `cap`: within a
        bracket about stall / rate steps wide, every candidate at once when that is a few steps
        (as it is unless saves stall far longer than a step), else by bisection."""
        s, stall, rate = p.step_s, p.stall, p.rate_s
        # wall(m) lies in (m rate + c - stall, m rate + c]: rate is a step with its saves'
        # shares, c the shares the current interval of each tier has accrued by step P
        c = p.st_m * (P % p.km) / p.km + p.st_d * (P % p.kd) / p.kd
        lo = np.floor((tau - c) / rate) - 1
        hi = np.floor((tau - c + stall) / rate) + 1
        lo = np.minimum(np.maximum(lo, 0), cap - 1).astype(np.int64)
        hi = np.maximum(np.minimum(hi, cap - 1), lo).astype(np.int64)
        width = int((hi - lo).max(initial=0))
        if width <= _CANDIDATES:  # wall(m) grows with m: the candidates that fit come first
            j = _UP_TO[:width]  # m = lo + j, (n, width)
            m = lo[:, None] + j
            base = P + lo
            stalls = [
                st[:, None] * self._saves(base, P, k, j)
                for st, k in ((p.st_m, p.km), (p.st_d, p.kd))
            ]
            fit = (m * s[:, None] + (stalls[0] + stalls[1]) <= tau[:, None]) & (m <= hi[:, None])
            return lo + fit.sum(axis=1)
        while (open_ := lo < hi).any():
            mid = (lo + hi + 1) // 2
            ok = self._wall(p, P, mid) <= tau
            lo = np.where(open_ & ok, mid, lo)
            hi = np.where(open_ & ~ok, mid - 1, hi)
        return lo

    @staticmethod
    def _saves(base: np.ndarray, P: np.ndarray, k: np.ndarray, j: np.ndarray) -> np.ndarray:
        """A tier's saves in steps P + 1 .. base + j, per lane and j (`base` >= P): those up to
        `base`, and then one more once base + j reaches the next, when j stays below the
        interval (no division over the candidates)."""
        if j.size and j[-1] >= k.min():
            return (base[:, None] + j) // k[:, None] - (P // k)[:, None]
        return (base // k - P // k)[:, None] + (j >= (k - base % k)[:, None])

    # -- the loop ------------------------------------------------------------------------------

    def go(self) -> Lanes:
        L = self.L
        active = np.ones(L, dtype=bool)
        everyone = self.at(np.arange(L))
        give_up = GIVE_UP * self._wall(everyone, np.zeros(L, np.int64), self.N)  # saves too
        while True:
            active &= self.t < give_up  # spikes or failures faster than the run can progress
            ia = np.flatnonzero(active)
            if ia.size <= ONE_BY_ONE:
                for i in ia.tolist():
                    run_lane(self, i)
                return self._lanes()
            p = self.at(ia)
            P = self.P[ia]
            to_end = p.N - P
            s_left = self.s_left[ia]
            m = np.minimum(s_left, to_end)
            if self.any_sdc:
                sdc = self.sdc_left(ia)  # steps to a corruption, or to its detection
                m = np.minimum(m, sdc)
            wall = self._wall(p, P, m)
            f_left = self.f_left[ia]
            fails = f_left < wall
            ok = ~fails
            if self.any_stops:
                stop = self.next_stop[ia] - self.t[ia]
                fails &= f_left <= stop
                stops = ~fails & (stop < wall)  # a planned stop comes first
                self.maintain(ia[stops], P[stops], m[stops], stop[stops])
                ok = ~fails & ~stops
            if fails.any():
                self._fail(ia[fails], P[fails], m[fails])
            if not ok.any():
                continue
            self._advance(ia[ok], p.step_s[ok], P[ok], m[ok], wall[ok])
            ends = ok & (m == to_end)  # the end comes first (or with a spike at the last step)
            active[ia[ends]] = False
            spikes = ok & ~ends & (s_left == m)  # its counter ran out
            if spikes.any():
                self._spike(ia[spikes])
            if self.any_sdc:
                self.corrupt(ia[ok & ~ends & ~spikes & (m == sdc)])

    def _advance(
        self, ia: np.ndarray, step_s: np.ndarray, P: np.ndarray, m: np.ndarray, wall: np.ndarray
    ) -> None:
        self.t[ia] += wall
        self.f_left[ia] -= wall
        self.s_left[ia] -= m
        if self.any_sdc:
            self.count_down(ia, m)
        self.b["unproductive_checkpoint_save_time"][ia] += wall - m * step_s
        self.P[ia] = P + m
        self.H[ia] = np.maximum(self.H[ia], P + m)

    def _fail(self, ia: np.ndarray, P: np.ndarray, cap: np.ndarray) -> None:
        p = self.at(ia)
        tau = self.f_left[ia]
        m = self._steps_within(p, P, tau, cap)
        done = self._wall(p, P, m)
        self._advance(ia, p.step_s, P, m, done)
        Pf = P + m
        u = self.draws.take("cause", self.seed[ia], self.i_fail[ia])
        cause = np.minimum(np.searchsorted(self.cause_cum, u), self.cause_cum.size - 1)
        restart = self.restart[ia, cause]
        # the newest durable disk save: one still being written does not count
        kd = p.kd
        disk = (Pf // kd) * kd
        written = tau - self._wall(p, P, np.maximum(disk - P, 0))
        disk = np.where((disk > P) & (written < p.write_d), disk - kd, disk)
        # host memory's newest, if it survived the failure
        mem_ok = p.mem_on & (p.survives | ~self.host_lost[cause])
        mem_step = np.where(mem_ok, (Pf // p.km) * p.km, -1)
        mem_step = np.where(mem_step > P, mem_step, -1)
        # either tier's saves from before this stretch: retention decides, one lookup for both
        old_d = np.flatnonzero(disk <= P)
        old_m = np.flatnonzero(mem_ok & (mem_step < 0))
        n_d = old_d.size
        if n_d or old_m.size:
            lanes = np.concatenate([ia[old_d], ia[old_m]])
            slots = lanes + np.concatenate([np.full(n_d, self.L), np.zeros(old_m.size, int)])
            got = self._retained(lanes, slots, np.concatenate([disk[old_d], Pf[old_m]]))
            disk[old_d] = got[:n_d]
        if self.any_stops:  # a planned stop's save, durable before the stop
            stop = self.stop_save[ia]
            disk = np.maximum(disk, np.where(stop <= Pf, stop, 0))
        R = np.maximum(disk, mem_step)
        if old_m.size:
            step = got[n_d:]
            newer = step >= R[old_m]  # a tie restores from memory: it is faster
            R[old_m] = np.where(newer, step, R[old_m])
            mem_step[old_m] = np.where(newer, step, mem_step[old_m])
        from_mem = mem_ok & (mem_step == R) & (R > 0)  # step 0 is the start, not a snapshot
        restore = np.where(from_mem, p.restore_m, p.restore_d)
        lost_mem = p.mem_on & ~mem_ok
        # memory holds nothing from before a loss; a restore below the floor starts a lineage
        # whose new snapshots it holds
        self.mem_floor[ia] = np.where(lost_mem, R + 1, np.minimum(self.mem_floor[ia], R + 1))
        again = self.recovery(ia, restart + restore) if self.any_recover else 0.0
        self.b["wasted_progress_from_disruption"][ia] += (Pf - R) * p.base_s + (tau - done)
        self.b["infrastructure_recovery_from_disruption"][ia] += restart + again
        self.b["unproductive_checkpoint_restore_time"][ia] += restore
        self.t[ia] += (tau - done) + restart + restore + again
        self.lost[ia] += Pf - R
        if self.any_sdc:
            self.cure(ia, R)
        self.P[ia] = R
        self.count["failures"][ia] += 1
        self.count["memory"][ia] += from_mem
        self.f_left[ia] = self._fail_gap(ia)

    def _spike(self, ia: np.ndarray) -> None:
        """Each lane of `ia` rolls back to its newest retained checkpoint at least its drawn
        distance before the detection; the spike may come back there (`Spikes.repeat`)."""
        u = self.draws.take("back", self.seed[ia], self.i_spike[ia])
        self.i_spike[ia] += 1
        scen, P = self.scen[ia], self.P[ia]
        n = self.n_backs[scen]
        pick = np.minimum((u * n).astype(np.int64), n - 1)
        target = self.roll_back(ia, np.maximum(P - self.backs[scen, pick], 0), spike=True)
        self.count["spikes"][ia] += 1
        gap = self._spike_gap(ia)
        if not self.any_repeat:
            self.s_left[ia] = gap
            return
        again = self.draws.take("repeat", self.seed[ia], self.i_spike[ia]) < self.repeat[ia]
        self.count["repeats"][ia] += again
        self.s_left[ia] = np.where(again, np.maximum(P - target, 1), gap)

    def roll_back(self, ia: np.ndarray, limit: np.ndarray, *, spike: bool) -> np.ndarray:
        """Each lane of `ia` back to its newest retained checkpoint at or before `limit`
        (memory on a tie: faster), pinned there; returns the targets."""
        p, n = self.at(ia), ia.size
        P = self.P[ia]
        both = np.concatenate([ia, ia])
        got = self._retained(both, both + np.repeat([0, self.L], n), np.concatenate([limit] * 2))
        mem, disk = got[:n], got[n:]
        from_mem = p.mem_on & (mem > 0) & (mem >= disk)
        target = np.where(from_mem, mem, disk)
        if spike:  # the newest save at or before the limit, had retention kept everything
            newest = (limit // p.km) * p.km
            newest = np.where(p.mem_on & (newest >= self.mem_floor[ia]), newest, 0)
            ideal = np.maximum(newest, (limit // p.kd) * p.kd)
            further = target < ideal
            self.count["further"][ia] += further
            self.count["further_steps"][ia] += np.where(further, ideal - target, 0)
        pinned = target > 0
        self._pin(np.where(from_mem, ia, ia + self.L)[pinned], target[pinned])
        restore = np.where(from_mem, p.restore_m, p.restore_d)
        bucket = "spike_rollback" if spike else "corruption"
        self.b[f"wasted_progress_from_{bucket}"][ia] += (P - target) * p.base_s
        self.b["unproductive_checkpoint_restore_time"][ia] += restore
        self.t[ia] += restore
        self.lost[ia] += P - target
        self.P[ia] = target
        self.mem_floor[ia] = np.minimum(self.mem_floor[ia], target + 1)
        if self.any_sdc:
            self.cure(ia, target)
        return target

    def _pin(self, slots: np.ndarray, steps: np.ndarray) -> None:
        pins, n = self.pins, self.n_pins
        if slots.size and n[slots].max() >= pins.shape[1]:
            self.pins = pins = np.concatenate([pins, np.full_like(pins, -1)], axis=1)
        pins[slots, n[slots]] = steps
        n[slots] += 1
        self.pin_max[slots] = np.maximum(self.pin_max[slots], steps)

    def _retained(self, lanes: np.ndarray, slots: np.ndarray, limit: np.ndarray) -> np.ndarray:
        """Per slot (a lane's tier), the newest checkpoint at or before `limit` that retention
        still holds, or that a rollback pinned there (0 if none: the run's start is always
        there). A tier a lane does not have gives 0."""
        k = self.k_slot[slots]
        held = self.held.newest(slots, self.H[lanes] // k, limit // k) * k
        newest = self.pin_max[slots]
        pinned = np.where(newest <= limit, newest, 0)
        past = np.flatnonzero(newest > limit)  # a pin newer than the limit: all pins decide
        if past.size:
            pins = self.pins[slots[past]]
            pinned[past] = np.where(pins <= limit[past, None], pins, 0).max(axis=1, initial=0)
        step = np.maximum(held, pinned)
        step = np.where(step >= self.floor[slots], step, 0)
        if self.any_stops:  # a planned stop's save (the memory slots' is never one)
            stop = self.stop_slot[slots]
            step = np.maximum(step, np.where(stop <= limit, stop, 0))
        return step

    def _lanes(self) -> Lanes:
        self.b["productive"] = self.P * self.base_s  # the steps kept: all of them if it finished
        self.b["straggler_slowdown"] = (self.P + self.lost) * (self.step_s - self.base_s)
        return Lanes(
            offsets=np.concatenate([[0], np.cumsum(self.seeds)]),
            finished=self.P == self.N,
            wall_s=self.t,
            buckets=self.b,
            failures=self.count["failures"],
            spikes=self.count["spikes"],
            restores_from_memory=self.count["memory"],
            further_back=self.count["further"],
            further_steps=self.count["further_steps"],
            modes={k: self.count[k] for k in MODE_COUNTS},
        )


def _stall(tier: Tier | None, sc: Scenario) -> float:
    """A save's stall, plus the wait for the last one's write when it outlasts the interval."""
    if tier is None:
        return 0.0
    return tier.stall_s + max(0.0, tier.write_s - tier.interval * sc.step_s)
