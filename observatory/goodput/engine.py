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

import bisect
import dataclasses
import functools
import math
from collections.abc import Sequence

import numpy as np

from observatory.goodput.model import Scenario, Tier
from observatory.retention import keep

__all__ = ["BUCKETS", "Lanes", "simulate"]

BUCKETS = (
    "productive",
    "wasted_progress_from_disruption",
    "wasted_progress_from_spike_rollback",
    "unproductive_checkpoint_save_time",
    "unproductive_checkpoint_restore_time",
    "infrastructure_recovery_from_disruption",
)
_NEVER = np.iinfo(np.int64).max // 4
MAX_EVENTS = 1_000_000  # failures and spikes a run is expected to meet
MAX_SAVES = 300_000  # saves of one tier in one run (retention is kept per save)
GIVE_UP = 20  # a lane stops after this many times its failure-free time (saves included)


@dataclasses.dataclass
class Lanes:
    """Per lane (scenario-major: lane = scenario * seeds + seed): wall seconds by bucket and
    counts of what happened."""

    seeds: int
    finished: np.ndarray  # False: gave up after GIVE_UP times the failure-free time
    wall_s: np.ndarray
    buckets: dict[str, np.ndarray]
    failures: np.ndarray
    spikes: np.ndarray
    restores_from_memory: np.ndarray
    further_back: np.ndarray  # rollbacks whose newest pre-onset save was no longer retained
    further_steps: np.ndarray  # and how many steps further back they had to go

    @property
    def goodput(self) -> np.ndarray:
        return self.buckets["productive"] / self.wall_s

    def of(self, scenario: int) -> slice:
        return slice(scenario * self.seeds, (scenario + 1) * self.seeds)


def simulate(scenarios: Sequence[Scenario], seeds: int = 100, seed: int = 0) -> Lanes:
    """Every scenario under seeds `seed`, ..., `seed + seeds - 1`."""
    if seeds < 1 or not scenarios:
        raise ValueError("simulate needs at least one scenario and one seed")
    causes = scenarios[0].failures.causes
    if any(s.failures.causes != causes for s in scenarios):
        raise ValueError("the scenarios of one simulation share their failure causes")
    return _Run(list(scenarios), seeds, seed).go()


class _Draws:
    """Per seed, the same unit draws in every scenario, extended on demand: each stream of
    each seed has its own generator, so what a seed draws does not depend on the batch."""

    STREAMS = ("fail", "spike", "cause", "back")

    def __init__(self, seeds: int, seed: int, n: int) -> None:
        self.rngs = {
            name: [np.random.default_rng([seed + i, 0x5EED, j]) for i in range(seeds)]
            for j, name in enumerate(self.STREAMS)
        }
        self.cols: dict[str, np.ndarray] = {}
        self.n = 0
        self._grow(n)

    def _grow(self, n: int) -> None:
        for name, rngs in self.rngs.items():
            draw = [
                r.random(n) if name in ("cause", "back") else r.standard_exponential(n)
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


def _param(scenarios: list[Scenario], seeds: int, get) -> np.ndarray:  # noqa: ANN001
    return np.repeat(np.array([get(s) for s in scenarios], dtype=np.float64), seeds)


class _Run:
    def __init__(self, scenarios: list[Scenario], seeds: int, seed: int) -> None:
        self.sc, self.seeds = scenarios, seeds
        L = len(scenarios) * seeds
        self.scen = np.repeat(np.arange(len(scenarios)), seeds)
        self.seed = np.tile(np.arange(seeds), len(scenarios))
        self.step_s = _param(scenarios, seeds, lambda s: s.step_s)
        self.N = _param(scenarios, seeds, lambda s: s.steps).astype(np.int64)
        self.lam = _param(scenarios, seeds, lambda s: 1 / s.mtbf_s)  # failures per running s
        self.rate = _param(scenarios, seeds, lambda s: s.spikes.per_1k_steps / 1000)
        self.tiers = {}
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
        causes = scenarios[0].failures.causes
        self.cause_cum = np.cumsum([c.share for c in causes])
        self.cause_cum[-1] = 1.0
        self.host_lost = np.array([c.host_lost for c in causes])
        own = np.array([[np.nan if c.restart_s is None else c.restart_s for c in causes]])
        self.restart = np.where(
            np.isnan(own), _param(scenarios, seeds, lambda s: s.restart_s)[:, None], own
        )
        expected = max(
            max(
                s.steps * s.step_s * 1.5 / s.mtbf_s + s.steps * s.spikes.per_1k_steps / 1000
                for s in scenarios
            ),
            1.0,
        )
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
        self.draws = _Draws(seeds, seed, int(expected * 1.3 + 10 * math.sqrt(expected) + 64))
        # state
        self.t = np.zeros(L)
        self.P = np.zeros(L, dtype=np.int64)
        self.H = np.zeros(L, dtype=np.int64)
        self.mem_floor = np.zeros(L, dtype=np.int64)
        self.i_fail = np.zeros(L, dtype=np.int64)
        self.i_spike = np.zeros(L, dtype=np.int64)
        all_lanes = np.arange(L)
        self.f_left = self._fail_gap(all_lanes)
        self.s_left = self._spike_gap(all_lanes)
        self.pins: list[dict[str, set[int]]] = [{"memory": set(), "disk": set()} for _ in range(L)]
        self.b = {k: np.zeros(L) for k in BUCKETS}
        self.count = {
            k: np.zeros(L, dtype=np.int64)
            for k in ("failures", "spikes", "memory", "further", "further_steps")
        }

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

    def _saves(self, name: str, ia: np.ndarray, P: np.ndarray, m: np.ndarray) -> np.ndarray:
        k = self.tiers[name]["k"][ia]
        return (P + m) // k - P // k

    def _wall(self, ia: np.ndarray, P: np.ndarray, m: np.ndarray) -> np.ndarray:
        w = m * self.step_s[ia]
        for name, t in self.tiers.items():
            w = w + t["stall"][ia] * self._saves(name, ia, P, m)
        return w

    def _steps_within(
        self, ia: np.ndarray, P: np.ndarray, tau: np.ndarray, cap: np.ndarray
    ) -> np.ndarray:
        """The most steps (with their saves) that end by `tau` seconds, below `cap`: bisection
        between tau / (step + every stall) and tau / step."""
        s = self.step_s[ia]
        most = s + sum(t["stall"][ia] for t in self.tiers.values())
        lo = np.minimum(np.floor(tau / most), cap - 1).astype(np.int64)
        hi = np.minimum(np.floor(tau / s), cap - 1).astype(np.int64)
        while (open_ := lo < hi).any():
            mid = (lo + hi + 1) // 2
            ok = self._wall(ia, P, mid) <= tau
            lo = np.where(open_ & ok, mid, lo)
            hi = np.where(open_ & ~ok, mid - 1, hi)
        return lo

    # -- the loop ------------------------------------------------------------------------------

    def go(self) -> Lanes:
        active = np.ones(self.P.size, dtype=bool)
        lanes = np.arange(self.P.size)
        give_up = GIVE_UP * self._wall(lanes, np.zeros_like(self.P), self.N)  # saves included
        while active.any():
            active &= self.t < give_up  # spikes or failures faster than the run can progress
            ia = np.flatnonzero(active)
            P = self.P[ia]
            to_end = self.N[ia] - P
            m = np.minimum(self.s_left[ia], to_end)
            wall = self._wall(ia, P, m)
            fails = self.f_left[ia] < wall
            self._fail(ia[fails], P[fails], m[fails])
            ok = ~fails
            self._advance(ia[ok], P[ok], m[ok], wall[ok])
            ends = ok & (m == to_end)  # the end comes first (or with a spike at the last step)
            active[ia[ends]] = False
            spikes = ok & ~ends
            for lane in ia[spikes]:
                self._spike(int(lane))
        return self._lanes()

    def _advance(self, ia: np.ndarray, P: np.ndarray, m: np.ndarray, wall: np.ndarray) -> None:
        self.t[ia] += wall
        self.f_left[ia] -= wall
        self.s_left[ia] -= m
        for name, t in self.tiers.items():
            self.b["unproductive_checkpoint_save_time"][ia] += t["stall"][ia] * self._saves(
                name, ia, P, m
            )
        self.P[ia] = P + m
        self.H[ia] = np.maximum(self.H[ia], P + m)

    def _fail(self, ia: np.ndarray, P: np.ndarray, cap: np.ndarray) -> None:
        if not ia.size:
            return
        tau = self.f_left[ia]
        m = self._steps_within(ia, P, tau, cap)
        done = self._wall(ia, P, m)
        self._advance(ia, P, m, done)
        Pf = P + m
        cause = np.searchsorted(
            self.cause_cum, self.draws.take("cause", self.seed[ia], self.i_fail[ia])
        )
        cause = np.minimum(cause, self.cause_cum.size - 1)
        restart = self.restart[ia, cause]
        disk = self._newest_durable(ia, P, Pf, tau)
        mem = self.tiers["memory"]
        mem_ok = mem["on"][ia] & (mem["survives"][ia] | ~self.host_lost[cause])
        mem_step = np.where(mem_ok, (Pf // mem["k"][ia]) * mem["k"][ia], -1)
        mem_step = np.where(mem_step > P, mem_step, -1)  # older ones: looked up below
        R = np.maximum(disk, mem_step)
        for j, lane in enumerate(ia):
            if mem_ok[j] and mem_step[j] < 0:
                step = self._retained(int(lane), "memory", int(Pf[j]))
                if step >= R[j]:  # a tie restores from memory: it is faster
                    R[j], mem_step[j] = step, step
        from_mem = mem_ok & (mem_step == R) & (R > 0)  # step 0 is the start, not a snapshot
        restore = np.where(from_mem, mem["restore"][ia], self.tiers["disk"]["restore"][ia])
        lost_mem = mem["on"][ia] & ~mem_ok
        # memory holds nothing from before a loss; a restore below the floor starts a lineage
        # whose new snapshots it holds
        self.mem_floor[ia] = np.where(lost_mem, R + 1, np.minimum(self.mem_floor[ia], R + 1))
        self.b["wasted_progress_from_disruption"][ia] += (Pf - R) * self.step_s[ia] + (tau - done)
        self.b["infrastructure_recovery_from_disruption"][ia] += restart
        self.b["unproductive_checkpoint_restore_time"][ia] += restore
        self.t[ia] += (tau - done) + restart + restore
        self.P[ia] = R
        self.count["failures"][ia] += 1
        self.count["memory"][ia] += from_mem
        self.f_left[ia] = self._fail_gap(ia)

    def _newest_durable(
        self, ia: np.ndarray, P: np.ndarray, Pf: np.ndarray, tau: np.ndarray
    ) -> np.ndarray:
        d = self.tiers["disk"]
        k = d["k"][ia]
        S = (Pf // k) * k
        written = tau - self._wall(ia, P, np.maximum(S - P, 0))
        S = np.where((S > P) & (written < d["write"][ia]), S - k, S)
        out = S.copy()
        for j in np.flatnonzero(S <= P):  # made before this stretch: retention decides (not
            out[j] = self._retained(int(ia[j]), "disk", int(S[j]))  # the unwritten one above)
        return out

    def _spike(self, lane: int) -> None:
        sc = self.sc[self.scen[lane]]
        backs = sc.spikes.back_steps
        u = self.draws.take("back", self.seed[lane : lane + 1], self.i_spike[lane : lane + 1])[0]
        self.i_spike[lane] += 1
        limit = max(int(self.P[lane]) - backs[min(int(u * len(backs)), len(backs) - 1)], 0)
        target, tier = 0, "disk"
        ideal = 0
        for name in ("memory", "disk"):
            if not self.tiers[name]["on"][lane]:
                continue
            step = self._retained(lane, name, limit)
            if step > target or (step == target and name == "memory" and step > 0):
                target, tier = step, name
            k = int(self.tiers[name]["k"][lane])
            floor = int(self.mem_floor[lane]) if name == "memory" else 0
            if (limit // k) * k >= floor:
                ideal = max(ideal, (limit // k) * k)
        if target < ideal:
            self.count["further"][lane] += 1
            self.count["further_steps"][lane] += ideal - target
        if target > 0:
            self.pins[lane][tier].add(target)
        restore = float(self.tiers[tier]["restore"][lane])
        self.b["wasted_progress_from_spike_rollback"][lane] += (
            self.P[lane] - target
        ) * self.step_s[lane]
        self.b["unproductive_checkpoint_restore_time"][lane] += restore
        self.t[lane] += restore
        self.P[lane] = target
        self.mem_floor[lane] = min(self.mem_floor[lane], target + 1)
        self.count["spikes"][lane] += 1
        self.s_left[lane] = self._spike_gap(np.array([lane]))[0]

    def _retained(self, lane: int, name: str, limit: int) -> int:
        """The newest checkpoint of a tier at or before `limit` that retention still holds, or
        that a rollback pinned there (0 if none: the run's start is always there)."""
        sc = self.sc[self.scen[lane]]
        tier = sc.tier(name)
        assert tier is not None
        n = int(self.H[lane]) // tier.interval
        held = _held(tier.interval, tier.retention, tier.keep_last, tier.max_kept, n)
        i = bisect.bisect_right(held, limit // tier.interval) - 1
        step = held[i] * tier.interval if i >= 0 else 0
        step = max([step, *(p for p in self.pins[lane][name] if p <= limit)])
        floor = int(self.mem_floor[lane]) if name == "memory" else 0
        return step if step >= floor else 0

    def _lanes(self) -> Lanes:
        self.b["productive"] = self.P * self.step_s  # the steps kept: all of them if it finished
        return Lanes(
            seeds=self.seeds,
            finished=self.P == self.N,
            wall_s=self.t,
            buckets=self.b,
            failures=self.count["failures"],
            spikes=self.count["spikes"],
            restores_from_memory=self.count["memory"],
            further_back=self.count["further"],
            further_steps=self.count["further_steps"],
        )


def _stall(tier: Tier | None, sc: Scenario) -> float:
    """A save's stall, plus the wait for the last one's write when it outlasts the interval."""
    if tier is None:
        return 0.0
    return tier.stall_s + max(0.0, tier.write_s - tier.interval * sc.step_s)


def _held(
    interval: int, retention: str, keep_last: int, max_kept: int | None, n: int
) -> tuple[int, ...]:
    """Save indices (step / interval) a tier holds after its n-th save, sorted."""
    if retention == "last":
        cap = keep_last if max_kept is None else min(keep_last, max_kept)
        return tuple(range(max(n - cap + 1, 1), n + 1))
    return _exponential(interval, keep_last, max_kept)[n]


@functools.lru_cache(maxsize=1024)  # one per (interval, keep_last, cap): a grid has hundreds
def _exponential(interval: int, keep_last: int, max_kept: int | None) -> _Growing:
    return _Growing(interval, keep_last, max_kept)


class _Growing:
    """The exponential rule applied at every save, as the tiers apply it (not once at the end:
    the two differ), computed once per (interval, keep_last, cap) as far as a query reaches."""

    def __init__(self, interval: int, keep_last: int, max_kept: int | None) -> None:
        self.k, self.keep_last, self.cap = interval, keep_last, max_kept
        self.sets: list[tuple[int, ...]] = [()]
        self.kept: set[int] = set()

    def __getitem__(self, n: int) -> tuple[int, ...]:
        while len(self.sets) <= n:
            j = len(self.sets)
            steps = keep({*self.kept, j * self.k}, j * self.k, keep_last=self.keep_last)
            if self.cap is not None and len(steps) > self.cap:
                steps = set(sorted(steps)[-self.cap :])
            self.kept = steps
            self.sets.append(tuple(sorted(s // self.k for s in steps)))
        return self.sets[n]
