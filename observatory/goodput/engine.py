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
    scenarios: Sequence[Scenario], seeds: int | Sequence[int] = 100, seed: int = 0
) -> Lanes:
    """Every scenario under seeds `seed`, ..., `seed + seeds - 1` (`seeds`: one count for all,
    or one per scenario: plans of one question share one pass of the loop)."""
    counts = np.broadcast_to(np.asarray(seeds, dtype=np.int64), (len(scenarios),))
    if not scenarios or counts.min() < 1:
        raise ValueError("simulate needs at least one scenario and one seed")
    causes = scenarios[0].failures.causes
    if any(s.failures.causes != causes for s in scenarios):
        raise ValueError("the scenarios of one simulation share their failure causes")
    return _Run(list(scenarios), counts, seed).go()


class _Draws:
    """Per seed, the same unit draws in every scenario, extended on demand: each stream of
    each seed has its own generator, so what a seed draws does not depend on the batch."""

    STREAMS = ("fail", "spike", "cause", "back", "recover", "repeat", "sdc")

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


class _Run(Modes):
    def __init__(self, scenarios: list[Scenario], seeds: np.ndarray, seed: int) -> None:
        self.sc, self.seeds = scenarios, seeds
        L = int(seeds.sum())
        self.scen = np.repeat(np.arange(len(scenarios)), seeds)
        self.seed = np.concatenate([np.arange(n) for n in seeds])
        self.base_s = _param(scenarios, seeds, lambda s: s.step_s)  # a step without stragglers
        self.step_s = self.base_s * _param(scenarios, seeds, lambda s: 1 + s.straggler)
        self.N = _param(scenarios, seeds, lambda s: s.steps).astype(np.int64)
        self.lam = _param(scenarios, seeds, lambda s: 1 / s.mtbf_s)  # failures per running s
        self.rate = _param(scenarios, seeds, lambda s: s.spikes.per_1k_steps / 1000)
        self.tiers = {}
        self.held: dict[str, LaneRetention] = {}
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
            rules = [
                Retention(x.interval, x.retention, x.keep_last, x.max_kept) if x else None
                for x in t
            ]
            horizon = max(s.steps for s in scenarios)
            lanes = [r for r, n in zip(rules, seeds, strict=True) for _ in range(n)]
            self.held[name] = LaneRetention(lanes, horizon)
        self.k2 = np.stack([self.tiers[n]["k"] for n in ("memory", "disk")])
        self.stall2 = np.stack([self.tiers[n]["stall"] for n in ("memory", "disk")])
        self.stall_sum = self.stall2.sum(axis=0)
        self.k_mem, self.k_disk = self.k2
        self.st_mem, self.st_disk = self.stall2
        self.rate_s = self.step_s + (self.stall2 / self.k2).sum(axis=0)  # a step with its saves
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
        self.draws = _Draws(int(seeds.max()), seed, n)
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
        # rollback targets, pinned: per tier, each lane's steps (-1: a free slot)
        self.pins = {name: np.full((L, 4), -1, np.int64) for name in ("memory", "disk")}
        self.n_pins = {name: np.zeros(L, np.int64) for name in ("memory", "disk")}
        self.b = {k: np.zeros(L) for k in BUCKETS}
        self.count = {
            k: np.zeros(L, dtype=np.int64)
            for k in ("failures", "spikes", "memory", "further", "further_steps", *MODE_COUNTS)
        }
        self.lost = np.zeros(L, dtype=np.int64)  # steps trained and thrown away
        self.init_modes(scenarios, seeds)

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

    def _stalls(self, ia: np.ndarray, P: np.ndarray, m: np.ndarray) -> np.ndarray:
        """The seconds the saves of steps P + 1 .. P + m stall, both tiers."""
        km, kd = self.k_mem[ia], self.k_disk[ia]
        end = P + m
        return self.st_mem[ia] * (end // km - P // km) + self.st_disk[ia] * (end // kd - P // kd)

    def _wall(self, ia: np.ndarray, P: np.ndarray, m: np.ndarray) -> np.ndarray:
        return m * self.step_s[ia] + self._stalls(ia, P, m)

    def _steps_within(
        self, ia: np.ndarray, P: np.ndarray, tau: np.ndarray, cap: np.ndarray
    ) -> np.ndarray:
        """The most steps (with their saves) that end by `tau` seconds, below `cap`: bisection
        between tau / (step + every stall) and tau / step."""
        s = self.step_s[ia]
        # m steps save between m/k - 1 and m/k + 1 times per tier: wall(m) = m r -+ stall
        stall, rate = self.stall_sum[ia], self.rate_s[ia]
        lo = np.maximum(np.floor(tau / (s + stall)), np.floor((tau - stall) / rate) - 1)
        hi = np.minimum(np.floor(tau / s), np.floor((tau + stall) / rate) + 1)
        lo = np.minimum(np.maximum(lo, 0), cap - 1).astype(np.int64)
        hi = np.maximum(np.minimum(hi, cap - 1), lo).astype(np.int64)
        while (open_ := lo < hi).any():
            mid = (lo + hi + 1) // 2
            ok = mid * s + self._stalls(ia, P, mid) <= tau
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
            if ia.size <= ONE_BY_ONE:
                for i in ia.tolist():
                    run_lane(self, i)
                break
            P = self.P[ia]
            to_end = self.N[ia] - P
            m = np.minimum(self.s_left[ia], to_end)
            if self.any_sdc:
                sdc = self.sdc_left(ia)  # steps to a corruption, or to its detection
                m = np.minimum(m, sdc)
            wall = self._wall(ia, P, m)
            fails = self.f_left[ia] < wall
            ok = ~fails
            if self.any_stops:
                stop = self.next_stop[ia] - self.t[ia]
                fails &= self.f_left[ia] <= stop
                stops = ~fails & (stop < wall)  # a planned stop comes first
                self.maintain(ia[stops], P[stops], m[stops], stop[stops])
                ok = ~fails & ~stops
            if fails.any():
                self._fail(ia[fails], P[fails], m[fails])
            if not ok.any():
                continue
            self._advance(ia[ok], P[ok], m[ok], wall[ok])
            ends = ok & (m == to_end)  # the end comes first (or with a spike at the last step)
            active[ia[ends]] = False
            spikes = ok & ~ends & (self.s_left[ia] == 0)  # its counter ran out
            self._spike(ia[spikes])
            if self.any_sdc:
                self.corrupt(ia[ok & ~ends & ~spikes & (m == sdc)])
        return self._lanes()

    def _advance(self, ia: np.ndarray, P: np.ndarray, m: np.ndarray, wall: np.ndarray) -> None:
        self.t[ia] += wall
        self.f_left[ia] -= wall
        self.s_left[ia] -= m
        if self.any_sdc:
            self.count_down(ia, m)
        self.b["unproductive_checkpoint_save_time"][ia] += wall - m * self.step_s[ia]
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
        older = np.flatnonzero(mem_ok & (mem_step < 0))
        if older.size:
            step = self._retained(ia[older], "memory", Pf[older])
            newer = step >= R[older]  # a tie restores from memory: it is faster
            R[older] = np.where(newer, step, R[older])
            mem_step[older] = np.where(newer, step, mem_step[older])
        from_mem = mem_ok & (mem_step == R) & (R > 0)  # step 0 is the start, not a snapshot
        restore = np.where(from_mem, mem["restore"][ia], self.tiers["disk"]["restore"][ia])
        lost_mem = mem["on"][ia] & ~mem_ok
        # memory holds nothing from before a loss; a restore below the floor starts a lineage
        # whose new snapshots it holds
        self.mem_floor[ia] = np.where(lost_mem, R + 1, np.minimum(self.mem_floor[ia], R + 1))
        again = self.recovery(ia, restart + restore) if self.any_recover else 0.0
        self.b["wasted_progress_from_disruption"][ia] += (Pf - R) * self.base_s[ia] + (tau - done)
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

    def _newest_durable(
        self, ia: np.ndarray, P: np.ndarray, Pf: np.ndarray, tau: np.ndarray
    ) -> np.ndarray:
        d = self.tiers["disk"]
        k = d["k"][ia]
        S = (Pf // k) * k
        written = tau - self._wall(ia, P, np.maximum(S - P, 0))
        S = np.where((S > P) & (written < d["write"][ia]), S - k, S)
        out = S.copy()
        old = np.flatnonzero(S <= P)  # made before this stretch: retention decides (not the
        if old.size:  # unwritten one above)
            out[old] = self._retained(ia[old], "disk", S[old])
        if not self.any_stops:
            return out
        stop = self.stop_save[ia]  # a planned stop's save, durable before the stop
        return np.maximum(out, np.where(stop <= Pf, stop, 0))

    def _spike(self, ia: np.ndarray) -> None:
        """Each lane of `ia` rolls back to its newest retained checkpoint at least its drawn
        distance before the detection; the spike may come back there (`Spikes.repeat`)."""
        if not ia.size:
            return
        u = self.draws.take("back", self.seed[ia], self.i_spike[ia])
        self.i_spike[ia] += 1
        scen, P = self.scen[ia], self.P[ia]
        pick = np.minimum((u * self.n_backs[scen]).astype(np.int64), self.n_backs[scen] - 1)
        target = self.roll_back(ia, np.maximum(P - self.backs[scen, pick], 0), spike=True)
        self.count["spikes"][ia] += 1
        gap = self._spike_gap(ia)
        again = self.draws.take("repeat", self.seed[ia], self.i_spike[ia]) < self.repeat[ia]
        self.count["repeats"][ia] += again
        self.s_left[ia] = np.where(again, np.maximum(P - target, 1), gap)

    def roll_back(self, ia: np.ndarray, limit: np.ndarray, *, spike: bool) -> np.ndarray:
        """Each lane of `ia` back to its newest retained checkpoint at or before `limit`
        (memory on a tie: faster), pinned there; returns the targets."""
        P = self.P[ia]
        target = np.zeros_like(P)
        from_mem = np.zeros(ia.size, dtype=bool)
        ideal = np.zeros_like(P)
        for name in ("memory", "disk"):
            t = self.tiers[name]
            on = t["on"][ia]
            step = np.where(on, self._retained(ia, name, limit), 0)
            better = on & ((step > target) | ((step == target) & (name == "memory") & (step > 0)))
            target = np.where(better, step, target)
            from_mem = np.where(better, name == "memory", from_mem)
            newest = (limit // t["k"][ia]) * t["k"][ia]
            floor = self.mem_floor[ia] if name == "memory" else 0
            ideal = np.where(on & (newest >= floor), np.maximum(ideal, newest), ideal)
        if spike:
            further = target < ideal
            self.count["further"][ia] += further
            self.count["further_steps"][ia] += np.where(further, ideal - target, 0)
        for name, mine in (("memory", from_mem), ("disk", ~from_mem)):
            self._pin(ia[mine & (target > 0)], name, target[mine & (target > 0)])
        restore = np.where(from_mem, self.tiers["memory"]["restore"][ia], 0.0)
        restore = np.where(from_mem, restore, self.tiers["disk"]["restore"][ia])
        bucket = "spike_rollback" if spike else "corruption"
        self.b[f"wasted_progress_from_{bucket}"][ia] += (P - target) * self.base_s[ia]
        self.b["unproductive_checkpoint_restore_time"][ia] += restore
        self.t[ia] += restore
        self.lost[ia] += P - target
        self.P[ia] = target
        self.mem_floor[ia] = np.minimum(self.mem_floor[ia], target + 1)
        if self.any_sdc:
            self.cure(ia, target)
        return target

    def _pin(self, ia: np.ndarray, name: str, steps: np.ndarray) -> None:
        pins, n = self.pins[name], self.n_pins[name]
        if ia.size and n[ia].max() >= pins.shape[1]:
            self.pins[name] = pins = np.concatenate([pins, np.full_like(pins, -1)], axis=1)
        pins[ia, n[ia]] = steps
        n[ia] += 1

    def _retained(self, ia: np.ndarray, name: str, limit: np.ndarray) -> np.ndarray:
        """Per lane of `ia`, the newest checkpoint of a tier at or before `limit` that retention
        still holds, or that a rollback pinned there (0 if none: the run's start is always
        there). Lanes without the tier get 0."""
        on = self.tiers[name]["on"][ia]
        if not on.any():
            return np.zeros(ia.size, np.int64)
        k = self.tiers[name]["k"][ia]
        held = self.held[name].newest(ia, self.H[ia] // k, limit // k) * k
        pins = self.pins[name][ia]
        pinned = np.where(pins <= limit[:, None], pins, 0).max(axis=1, initial=0)
        step = np.maximum(held, pinned)
        if name == "memory":
            step = np.where(step >= self.mem_floor[ia], step, 0)
        elif self.any_stops:  # a planned stop's save
            step = np.maximum(step, np.where(self.stop_save[ia] <= limit, self.stop_save[ia], 0))
        return np.where(on, step, 0)

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
