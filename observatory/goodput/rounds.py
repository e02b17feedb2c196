"""The lane engine's rounds: every active lane moves from its event to its next one at once.

A round is one fixed sequence of numpy calls over the active lanes' columns, each update masked
by what the lane met (a failure, a planned stop, a spike, a corruption or its detection, the
end), rather than a sequence per kind of event over that kind's lanes: a numpy call costs about
a microsecond whatever its size, and with many lanes every kind comes up in every round. The
retention lookups, which are dear per lane, are made for the lanes that need one, both tiers
and every kind of event in one call. The lanes' state is gathered once a round (two matrices)
and written back once; with every lane active it is used in place. When few lanes are left,
each finishes alone in plain Python (goodput/scalar.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from spikewatch.observatory.goodput.lanes import Block, Lanes, _At, _Run
from spikewatch.observatory.goodput.modes import corrupt, cure, maintain, recovery
from spikewatch.observatory.goodput.scalar import run_lane
from spikewatch.observatory.goodput.state import GIVE_UP, NEVER, R

if TYPE_CHECKING:
    from spikewatch.observatory.goodput.model import Scenario

__all__ = ["go", "run_part"]

# when this few lanes are left, each runs on alone in plain Python (goodput/scalar.py): a round
# of numpy calls costs more than that many lanes' events one by one
ONE_BY_ONE = 32
_CANDIDATES = 16  # a failure's step: every candidate at once up to this many, else bisection
_UP_TO = np.arange(1, _CANDIDATES + 1)


def run_part(
    scenarios: list[Scenario], seeds: np.ndarray, seed: int, first: np.ndarray | None = None
) -> Lanes:
    """Scenario i's seeds `seed + first[i]`, ..., `seed + first[i] + seeds[i] - 1`, in this
    process (first: 0 for every scenario)."""
    run = _Run(scenarios, seeds, seed, first)
    go(run)
    return run.lanes()


def go(run: _Run) -> None:
    """Every lane of `run` to its end (or until it gives up)."""
    b = Block(run, np.arange(run.L))
    give_up = GIVE_UP * wall(b.p, np.zeros(run.L, np.int64), run.N)  # saves included
    ended = np.zeros(run.L, dtype=bool)
    rounds = 0
    while True:
        moving = ~ended & (b.F[R.t] < give_up)  # spikes or failures faster than progress stop
        n = np.count_nonzero(moving)
        if n <= ONE_BY_ONE:
            b.write_back()
            for i in b.ia[moving].tolist():
                run_lane(run, i)
            return
        if n < b.ia.size and (n <= 0.75 * b.ia.size or np.count_nonzero(~ended & ~moving)):
            keep = moving.nonzero()[0]  # a lane that gave up is not inert: it leaves now
            b.write_back()
            b, give_up, ended = Block(run, b.ia[keep]), give_up[keep], ended[keep]
        # a lane draws at most one failure, cause, spike, distance and repeat a round
        rounds += 1
        run.draws.reach(rounds + 2)
        met_end = _round(b)
        if np.count_nonzero(met_end):
            ended |= met_end
            b.F[R.next_stop, met_end] = np.inf  # no planned stop for a lane that ended


def _round(b: Block) -> np.ndarray:
    """Each lane of `b` to its next event, and through it; returns the lanes that ended."""
    run, p, F, I = b.run, b.p, b.F, b.I  # noqa: E741
    P = I[R.P].copy()
    s_left, f_left = I[R.s_left], F[R.f_left]  # views: updated in place below
    # the stretch to the next event counted in steps: a spike, a corruption, the end
    to_end = p.N - P
    m = np.minimum(s_left, to_end)
    if run.any_sdc:  # steps to a corruption, or to its detection
        sdc = np.where(I[R.sdc_at] >= 0, I[R.d_left], I[R.c_left])
        m = np.minimum(m, sdc)
    q = P // p.km, P // p.kd  # each tier's saves up to P
    w = wall(p, P, m, q)
    fail = f_left < w  # a failure comes first
    stops: np.ndarray | None = None
    stop = f_left
    if run.any_stops:
        stop = F[R.next_stop] - F[R.t]
        fail &= f_left <= stop
        stops = ~fail & (stop < w)  # a planned stop comes first
        if not np.count_nonzero(stops):
            stops = None
    event = fail if stops is None else fail | stops
    tau = f_left  # the seconds into the stretch that the event comes
    if np.count_nonzero(event):  # the steps that fit before it
        if stops is None:
            tau, cap = np.where(fail, f_left, 0.0), m
        else:
            tau = np.where(fail, f_left, np.where(stops, np.maximum(stop, 0.0), 0.0))
            cap = np.where(stops, np.maximum(m, 1), m)
        m = np.where(event, steps_within(p, P, tau, cap, q), m)
        w = wall(p, P, m, q)
    # every lane trains its steps
    t = F[R.t]
    t += w
    f_left -= w
    s_left -= m
    if run.any_sdc:
        wrong = I[R.sdc_at] >= 0
        d_left, c_left = I[R.d_left], I[R.c_left]
        d_left -= np.where(wrong, m, 0)
        c_left -= np.where(wrong, 0, m)
    save = F[R.save]
    save += w - m * p.step_s
    P1 = P + m
    I[R.P] = P1
    H = I[R.H]
    np.maximum(H, P1, out=H)
    if stops is not None:
        at = stops.nonzero()[0]
        maintain(b, at, tau[at], w[at])
    # what each lane met
    trained = ~event
    ended = trained & (m == to_end)  # the end comes first (or with a spike at the last step)
    spike = trained & ~ended & (s_left == 0)  # its counter ran out
    found = None
    if run.any_sdc:
        hit = trained & ~ended & ~spike & (m == sdc)
        begins = hit & (I[R.sdc_at] < 0)
        if np.count_nonzero(begins):
            corrupt(b, begins.nonzero()[0])
        found = hit & ~begins  # detected: back to before it
        if not np.count_nonzero(found):
            found = None
    back = spike if found is None else spike | found
    failed = fail if np.count_nonzero(fail) else None
    spiked = bool(np.count_nonzero(spike))
    rolled = back if spiked or found is not None else None
    if failed is not None or rolled is not None:
        _restore(b, P, P1, failed, spike if spiked else None, found, rolled, tau, w, q)
    return ended


def _restore(
    b: Block,
    P: np.ndarray,
    P1: np.ndarray,
    fail: np.ndarray | None,
    spike: np.ndarray | None,
    found: np.ndarray | None,
    back: np.ndarray | None,
    tau: np.ndarray,
    w: np.ndarray,
    q: tuple[np.ndarray, np.ndarray],
) -> None:
    """Lanes that failed (`fail`) restore the newest durable checkpoint that survived; lanes
    that met a spike or found a corruption (`back`) roll back to the newest retained one at or
    before a limit, pinned there. P: each lane's step when its stretch began, P1 now."""
    run, p, F, I = b.run, b.p, b.F, b.I  # noqa: E741
    n, km, kd = P.size, p.km, p.kd
    cols = run.draws.cols
    floor = I[R.mem_floor]
    if fail is not None:
        cause = run.causes()[p.seed, I[R.i_fail]]
        restart = run.restart[b.ia, cause]
        # host memory's newest, if it survived the failure
        mem_ok = p.mem_on & (p.survives | ~run.host_lost[cause])
        mem_step = np.where(mem_ok, (P1 // km) * km, -1)
        mem_step = np.where(mem_step > P, mem_step, -1)
        # the newest durable disk save: one still being written does not count (asked only
        # where it could be newer than memory's)
        S = (P1 // kd) * kd
        if np.count_nonzero(fail & (S > P) & (S > mem_step)):
            written = tau - wall(p, P, np.maximum(S - P, 0), q)
            S = np.where((S > P) & (written < p.write_d), S - kd, S)
        # saves from before this stretch: retention decides (a disk save only matters when no
        # memory snapshot of this stretch is newer)
        old_d = fail & (S <= P) & (mem_step < 0)
        old_m = fail & mem_ok & (mem_step < 0)
    if back is not None:
        i_spike = I[R.i_spike]
        u = cols["back"][p.seed, i_spike]
        if spike is not None:
            i_spike += spike
        n_backs = run.n_backs[p.scen]
        pick = np.minimum((u * n_backs).astype(np.int64), n_backs - 1)
        limit = np.maximum(P1 - run.backs[p.scen, pick], 0)
        if found is not None:
            limit = np.where(found, I[R.sdc_at], limit)
    # one lookup for every lane and tier that needs one
    if fail is None:
        d_at = m_at = back.nonzero()[0]  # type: ignore[union-attr]
        m_at = m_at[p.mem_on[m_at]]
        limits = [limit[d_at], limit[m_at]]
    elif back is None:
        d_at, m_at = old_d.nonzero()[0], old_m.nonzero()[0]
        limits = [S[d_at], P1[m_at]]
    else:
        d_at, m_at = (back | old_d).nonzero()[0], ((back & p.mem_on) | old_m).nonzero()[0]
        limits = [np.where(back, limit, S)[d_at], np.where(back, limit, P1)[m_at]]
    nd = d_at.size
    got = retained(b, np.concatenate([d_at, m_at]), nd, np.concatenate(limits))
    ret_d, ret_m = np.zeros(n, np.int64), np.zeros(n, np.int64)
    ret_d[d_at], ret_m[m_at] = got[:nd], got[nd:]
    new_P, new_floor = P1, floor
    restore: np.ndarray | float = 0.0
    dt: np.ndarray | float = 0.0
    if back is not None:
        from_mem = p.mem_on & (ret_m > 0) & (ret_m >= ret_d)  # memory on a tie: faster
        target = np.where(from_mem, ret_m, ret_d)
        thrown = (P1 - target) * p.base_s
        if spike is not None:  # the newest save at or before the limit, had retention kept all
            newest = (limit // km) * km
            newest = np.where(p.mem_on & (newest >= floor), newest, 0)
            ideal = np.maximum(newest, (limit // kd) * kd)
            further = spike & (target < ideal)
            I[R.further] += further
            I[R.further_steps] += np.where(further, ideal - target, 0)
            F[R.spike_rollback] += np.where(spike, thrown, 0.0)
            I[R.spikes] += spike
        at = (back & (target > 0)).nonzero()[0]
        pin(run, b.ia[at] + run.L * ~from_mem[at], target[at])
        new_P = np.where(back, target, new_P)
        restore = dt = np.where(back, np.where(from_mem, p.restore_m, p.restore_d), 0.0)
        if found is not None:
            F[R.corruption] += np.where(found, thrown, 0.0)
            I[R.corruption_rollbacks] += found
        new_floor = np.where(back, np.minimum(floor, target + 1), floor)
    if fail is not None:
        disk = np.where(old_d, ret_d, S)
        if run.any_stops:  # a planned stop's save, durable before the stop
            stop = I[R.stop_save]
            disk = np.maximum(disk, np.where(stop <= P1, stop, 0))
        to = np.maximum(disk, mem_step)
        newer = old_m & (ret_m >= to)  # a tie restores from memory: it is faster
        to = np.where(newer, ret_m, to)
        mem_step = np.where(newer, ret_m, mem_step)
        from_mem = mem_ok & (mem_step == to) & (to > 0)  # step 0 is the start, not a snapshot
        restore_f = np.where(from_mem, p.restore_m, p.restore_d)
        again: np.ndarray | float = 0.0
        if run.any_recover:
            at = fail.nonzero()[0]
            again = np.zeros(n)
            again[at] = recovery(b, at, (restart + restore_f)[at])
        inflight = tau - w  # the part-step the failure interrupted
        F[R.disruption] += np.where(fail, (P1 - to) * p.base_s + inflight, 0.0)
        F[R.infra] += np.where(fail, restart + again, 0.0)
        restore = np.where(fail, restore_f, restore)
        dt = np.where(fail, inflight + restart + restore_f + again, dt)
        new_P = np.where(fail, to, new_P)
        # memory holds nothing from before a loss; a restore below the floor starts a lineage
        # whose new snapshots it holds
        new_floor = np.where(fail, np.minimum(floor, to + 1), new_floor)
        new_floor = np.where(fail & p.mem_on & ~mem_ok, to + 1, new_floor)
        I[R.failures] += fail
        I[R.memory] += fail & from_mem
    F[R.restore] += restore
    F[R.t] += dt
    I[R.lost] += P1 - new_P
    I[R.mem_floor] = new_floor
    I[R.P] = new_P
    if run.any_sdc:
        moved = [x for x in (fail, back) if x is not None]
        cure(b, new_P, np.logical_or.reduce(moved))
    if fail is not None:  # the next failure
        i_fail, f_left = I[R.i_fail], F[R.f_left]
        e = cols["fail"][p.seed, i_fail]
        F[R.f_left] = np.where(fail, np.where(p.lam > 0, e / p.lam_div, np.inf), f_left)
        i_fail += fail
    if spike is not None:  # the next spike; or this one again
        i_spike = I[R.i_spike]
        e = np.ceil(cols["spike"][p.seed, i_spike] / p.rate_div)
        gap = np.where(p.rate > 0, np.minimum(e, NEVER), NEVER).astype(np.int64)
        if run.any_repeat:
            again_ = spike & (cols["repeat"][p.seed, i_spike] < p.repeat)
            I[R.repeats] += again_
            gap = np.where(again_, np.maximum(P1 - target, 1), gap)
        I[R.s_left] = np.where(spike, gap, I[R.s_left])


def retained(b: Block, at: np.ndarray, nd: int, limit: np.ndarray) -> np.ndarray:
    """Per lane `at` of the block, its disk tier for the first `nd` and its memory tier for the
    rest, the newest checkpoint at or before `limit` that retention still holds, or that a
    rollback pinned there (0 if none: the run's start is always there). A tier a lane does not
    have gives 0."""
    run = b.run
    slots = b.ia[at]
    slots[:nd] += run.L
    k = run.k_slot[slots]
    held = run.held.newest(slots, b.I[R.H, at] // k, limit // k) * k
    newest = run.pin_max[slots]
    pinned = np.where(newest <= limit, newest, 0)
    past = (newest > limit).nonzero()[0]  # a pin newer than the limit: all pins decide
    if past.size:
        pins = run.pins[slots[past]]
        pinned[past] = np.where(pins <= limit[past, None], pins, 0).max(axis=1, initial=0)
    step = np.maximum(held, pinned)
    floor = b.I[R.mem_floor, at]
    floor[:nd] = 0  # memory's (the disk tier has none)
    step = np.where(step >= floor, step, 0)
    if run.any_stops:  # a planned stop's save (a disk save)
        stop = b.I[R.stop_save, at]
        stop[nd:] = 0
        step = np.maximum(step, np.where(stop <= limit, stop, 0))
    return step


def pin(run: _Run, slots: np.ndarray, steps: np.ndarray) -> None:
    pins, n = run.pins, run.n_pins
    if slots.size and n[slots].max() >= pins.shape[1]:
        run.pins = pins = np.concatenate([pins, np.full_like(pins, -1)], axis=1)
    pins[slots, n[slots]] = steps
    n[slots] += 1
    run.pin_max[slots] = np.maximum(run.pin_max[slots], steps)


def wall(
    p: _At, P: np.ndarray, m: np.ndarray, q: tuple[np.ndarray, np.ndarray] | None = None
) -> np.ndarray:
    """The seconds steps P + 1 .. P + m take, with the stalls of both tiers' saves (q: each
    tier's saves up to P, P // interval, if known)."""
    end, km, kd = P + m, p.km, p.kd
    qm, qd = (P // km, P // kd) if q is None else q
    return m * p.step_s + (p.st_m * (end // km - qm) + p.st_d * (end // kd - qd))


def steps_within(
    p: _At, P: np.ndarray, tau: np.ndarray, cap: np.ndarray, q: tuple[np.ndarray, np.ndarray]
) -> np.ndarray:
    """The most steps (with their saves) that end by `tau` seconds, below `cap`: within a
    bracket about stall / rate steps wide, every candidate at once when that is a few steps
    (as it is unless saves stall far longer than a step), else by bisection. q: each tier's
    saves up to P."""
    # wall(m) lies in (m rate + c - stall, m rate + c]: rate is a step with its saves'
    # shares, c the shares the current interval of each tier has accrued by step P
    rm, rd = P - q[0] * p.km, P - q[1] * p.kd
    c = p.st_m * rm / p.km + p.st_d * rd / p.kd
    lo = np.floor((tau - c) / p.rate_s) - 1
    hi = np.floor((tau - c + p.stall) / p.rate_s) + 1
    lo = np.minimum(np.maximum(lo, 0), cap - 1).astype(np.int64)
    hi = np.maximum(np.minimum(hi, cap - 1), lo).astype(np.int64)
    width = int((hi - lo).max(initial=0))
    if width <= _CANDIDATES:  # wall(m) grows with m: the candidates that fit come first
        j = _UP_TO[:width]  # m = lo + j, (n, width)
        m = lo[:, None] + j
        stalls = [
            st[:, None] * _saves(P + lo, qk, k, j, kmin)
            for st, qk, k, kmin in ((p.st_m, q[0], p.km, p.km_min), (p.st_d, q[1], p.kd, p.kd_min))
        ]
        fit = (m * p.step_s[:, None] + (stalls[0] + stalls[1]) <= tau[:, None]) & (m <= hi[:, None])
        return lo + fit.sum(axis=1)
    while np.count_nonzero(open_ := lo < hi):
        mid = (lo + hi + 1) // 2
        ok = wall(p, P, mid, q) <= tau
        lo = np.where(open_ & ok, mid, lo)
        hi = np.where(open_ & ~ok, mid - 1, hi)
    return lo


def _saves(base: np.ndarray, q: np.ndarray, k: np.ndarray, j: np.ndarray, kmin: int) -> np.ndarray:
    """A tier's saves after P (q = P // k of them before it) up to step base + j, per lane and
    j (`base` >= P): those up to `base`, then one more once base + j reaches the next, when j
    stays below every lane's interval (no division over the candidates)."""
    if j.size and j[-1] >= kmin:
        return (base[:, None] + j) // k[:, None] - q[:, None]
    return (base // k - q)[:, None] + (j >= (k - base % k)[:, None])
