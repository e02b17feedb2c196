"""One lane of the engine at a time, in plain Python: the same model, event for event, as the
lane rounds of observatory/goodput/engine.py, for when few lanes are left.

Why a second executor: a round of the lane engine is about a hundred numpy calls, and a numpy
call costs a microsecond or more whatever its size, so one lane pays that for each of its ~500
events (a 54-day run); Python's own floats and ints cost tens of nanoseconds an operation. The
engine runs its rounds while many lanes share them and hands the last few lanes here (a single
run: from the start). The two must agree to the last bit: the same operations in the same order
(tests/observatory/test_goodput_engines.py runs every mode through both and compares every
output exactly), so a change to the model is made in both or that test fails.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from spikewatch.observatory.goodput.state import GIVE_UP

if TYPE_CHECKING:
    from spikewatch.observatory.goodput.lanes import _Run

__all__ = ["run_lane"]

_NEVER = (2**63 - 1) // 4  # engine._NEVER
_NEVER_F = float(_NEVER)  # what the lane engine's float gaps are clipped to


def run_lane(run: _Run, i: int) -> None:
    """Lane `i` of `run` from where the rounds left it to its end (or until it gives up); what
    the report reads (steps, wall time, buckets, counts) is written back into `run`."""
    lane = _Lane(run, i)
    lane.go()
    lane.write_back()


class _Lane:
    def __init__(self, run: _Run, i: int) -> None:
        self.run, self.i = run, i
        self.seed = int(run.seed[i])
        scen = int(run.scen[i])
        mem, disk = run.tiers["memory"], run.tiers["disk"]
        self.step_s, self.base_s = float(run.step_s[i]), float(run.base_s[i])
        self.N, self.lam, self.rate = int(run.N[i]), float(run.lam[i]), float(run.rate[i])
        self.mem_on = bool(mem["on"][i])
        self.km, self.kd = int(mem["k"][i]), int(disk["k"][i])
        self.st_m, self.st_d = float(mem["stall"][i]), float(disk["stall"][i])
        self.stall_sum, self.rate_s = float(run.stall_sum[i]), float(run.rate_s[i])
        self.restore_m, self.restore_d = float(mem["restore"][i]), float(disk["restore"][i])
        self.write_d, self.survives = float(disk["write"][i]), bool(mem["survives"][i])
        self.backs = run.backs[scen, : run.n_backs[scen]].tolist()
        self.cause_cum = run.cause_cum.tolist()
        self.host_lost = run.host_lost.tolist()
        self.restart = run.restart[i].tolist()
        self.held = run.held
        self.slot = {"memory": i, "disk": i + run.L}  # engine._Run's slots of the lane's tiers
        # the optional modes (a lane without one behaves as the rounds do with it off)
        self.repeat, self.recovers = float(run.repeat[i]), bool(run.recovers[i])
        self.stop_every, self.stop_window = float(run.stop_every[i]), float(run.stop_window[i])
        self.stop_restart = float(run.stop_restart[i])
        self.sdc_rate, self.sdc_detect = float(run.sdc_rate[i]), int(run.sdc_detect[i])
        self.any_sdc, self.any_stops = run.any_sdc, run.any_stops
        self.any_recover = run.any_recover
        # state
        self.t, self.P, self.H = float(run.t[i]), int(run.P[i]), int(run.H[i])
        self.mem_floor = int(run.mem_floor[i])
        self.i_fail, self.i_spike = int(run.i_fail[i]), int(run.i_spike[i])
        self.f_left, self.s_left = float(run.f_left[i]), int(run.s_left[i])
        self.pins = {
            name: run.pins[slot, : run.n_pins[slot]].tolist() for name, slot in self.slot.items()
        }
        self.b = {k: float(v[i]) for k, v in run.b.items()}
        self.count = {k: int(v[i]) for k, v in run.count.items()}
        self.lost = int(run.lost[i])
        self.next_stop, self.stop_save = float(run.next_stop[i]), int(run.stop_save[i])
        self.sdc_at, self.i_sdc = int(run.sdc_at[i]), int(run.i_sdc[i])
        self.i_recover = int(run.i_recover[i])
        self.c_left, self.d_left = int(run.c_left[i]), int(run.d_left[i])
        self.rows: dict[str, list[float]] = {}
        self.causes: list[int] = []

    def write_back(self) -> None:
        run, i = self.run, self.i
        run.t[i], run.P[i], run.H[i], run.lost[i] = self.t, self.P, self.H, self.lost
        for k, v in self.b.items():
            run.b[k][i] = v
        for k, n in self.count.items():
            run.count[k][i] = n

    # -- draws ---------------------------------------------------------------------------------

    def _u(self, name: str, idx: int) -> float:
        """The seed's `idx`-th draw of a stream (engine._Draws, extended as the rounds do)."""
        row = self.rows.get(name)
        if row is None or idx >= len(row):
            draws = self.run.draws
            while idx >= draws.n:
                draws._grow(draws.n)
            row = self.rows[name] = draws.cols[name][self.seed].tolist()
        return row[idx]

    def _fail_gap(self) -> float:
        e = self._u("fail", self.i_fail)
        self.i_fail += 1
        return e / self.lam if self.lam > 0 else math.inf

    def _spike_gap(self) -> int:
        return _steps(self._u("spike", self.i_spike), self.rate)

    def _sdc_gap(self) -> int:
        e = self._u("sdc", self.i_sdc)
        self.i_sdc += 1
        return _steps(e, self.sdc_rate)

    # -- time ----------------------------------------------------------------------------------

    def _wall(self, P: int, m: int) -> float:
        end, km, kd = P + m, self.km, self.kd
        stalls = self.st_m * (end // km - P // km) + self.st_d * (end // kd - P // kd)
        return m * self.step_s + stalls

    def _steps_within(self, P: int, tau: float, cap: int) -> int:
        """The rounds' steps_within for one lane: the same bracket, searched up from its
        bottom a step at a time while it is narrow, else halved."""
        s, km, kd, st_m, st_d = self.step_s, self.km, self.kd, self.st_m, self.st_d
        qm, rm = divmod(P, km)
        qd, rd = divmod(P, kd)
        x = (tau - (st_m * rm / km + st_d * rd / kd)) / self.rate_s
        lo = math.floor(x) - 1
        hi = math.floor(x + self.stall_sum / self.rate_s) + 1
        if lo > cap - 1:
            lo = cap - 1
        if lo < 0:
            lo = 0
        if hi > cap - 1:
            hi = cap - 1
        while lo < hi:
            mid = lo + 1 if hi - lo <= 4 else (lo + hi + 1) // 2
            end = P + mid
            if mid * s + (st_m * (end // km - qm) + st_d * (end // kd - qd)) <= tau:
                lo = mid
            elif mid == lo + 1:
                break
            else:
                hi = mid - 1
        return lo

    # -- the loop ------------------------------------------------------------------------------

    def go(self) -> None:
        give_up = GIVE_UP * self._wall(0, self.N)  # saves included
        while self.t < give_up:
            P = self.P
            to_end = self.N - P
            m = min(self.s_left, to_end)
            sdc = 0
            if self.any_sdc:
                sdc = self.d_left if self.sdc_at >= 0 else self.c_left
                m = min(m, sdc)
            wall = self._wall(P, m)
            fails = self.f_left < wall
            ok = not fails
            if self.any_stops:
                stop = self.next_stop - self.t
                fails = fails and self.f_left <= stop
                stops = not fails and stop < wall
                if stops:
                    self._maintain(P, m, stop)
                ok = not fails and not stops
            if fails:
                self._fail(P, m)
            if not ok:
                continue
            self._advance(P, m, wall)
            if m == to_end:
                return
            if self.s_left == 0:
                self._spike()
            elif self.any_sdc and m == sdc:
                self._corrupt()

    def _advance(self, P: int, m: int, wall: float) -> None:
        self.t += wall
        self.f_left -= wall
        self.s_left -= m
        if self.any_sdc:
            if self.sdc_at >= 0:
                self.d_left -= m
            else:
                self.c_left -= m
        self.b["unproductive_checkpoint_save_time"] += wall - m * self.step_s
        self.P = P = P + m
        if P > self.H:
            self.H = P

    def _fail(self, P: int, cap: int) -> None:
        """The rounds' failure for one lane (the time-critical path, written out)."""
        tau = self.f_left
        m = self._steps_within(P, tau, cap)
        km, kd = self.km, self.kd
        qm, qd = P // km, P // kd
        Pf = P + m
        done = m * self.step_s + (self.st_m * (Pf // km - qm) + self.st_d * (Pf // kd - qd))
        self._advance(P, m, done)
        i = self.i_fail
        cause = self.causes[i] if i < len(self.causes) else self._cause()
        restart = self.restart[cause]
        # the newest durable disk save: one still being written does not count
        S = (Pf // kd) * kd
        if S > P:
            stalls = self.st_m * (S // km - qm) + self.st_d * (S // kd - qd)
            if tau - ((S - P) * self.step_s + stalls) < self.write_d:
                S -= kd
        mem_ok = self.mem_on and (self.survives or not self.host_lost[cause])
        mem_step = (Pf // km) * km if mem_ok else -1
        if mem_step <= P:
            mem_step = -1  # older ones: looked up below
        if S <= P and mem_step < 0:  # before this stretch (a newer memory snapshot wins)
            S = self._retained("disk", S)
        if self.any_stops and self.stop_save <= Pf:
            S = max(S, self.stop_save)
        R = max(S, mem_step)
        if mem_ok and mem_step < 0:
            step = self._retained("memory", Pf)
            if step >= R:  # a tie restores from memory: it is faster
                R = mem_step = step
        from_mem = mem_ok and mem_step == R and R > 0
        restore = self.restore_m if from_mem else self.restore_d
        if self.mem_on and not mem_ok:
            self.mem_floor = R + 1
        elif R < self.mem_floor:
            self.mem_floor = R + 1
        again = self._recovery(restart + restore) if self.any_recover else 0.0
        b = self.b
        b["wasted_progress_from_disruption"] += (Pf - R) * self.base_s + (tau - done)
        b["infrastructure_recovery_from_disruption"] += restart + again
        b["unproductive_checkpoint_restore_time"] += restore
        self.t += (tau - done) + restart + restore + again
        self.lost += Pf - R
        if self.any_sdc:
            self._cure(R)
        self.P = R
        self.count["failures"] += 1
        if from_mem:
            self.count["memory"] += 1
        self.f_left = self._fail_gap()

    def _cause(self) -> int:
        """The cause of failure draw i_fail (engine._Run.causes), as far as the draws reach."""
        self._u("cause", self.i_fail)  # the draws reach it
        self.causes = self.run.causes()[self.seed].tolist()
        return self.causes[self.i_fail]

    def _spike(self) -> None:
        u = self._u("back", self.i_spike)
        self.i_spike += 1
        P, n = self.P, len(self.backs)
        back = self.backs[min(int(u * n), n - 1)]
        target = self._roll_back(max(P - back, 0), spike=True)
        self.count["spikes"] += 1
        gap = self._spike_gap()
        again = self.repeat > 0 and self._u("repeat", self.i_spike) < self.repeat
        self.count["repeats"] += again
        self.s_left = max(P - target, 1) if again else gap

    def _roll_back(self, limit: int, *, spike: bool) -> int:
        P = self.P
        target, from_mem, ideal = 0, False, 0
        for name, on, k in (("memory", self.mem_on, self.km), ("disk", True, self.kd)):
            if not on:
                continue
            step = self._retained(name, limit)
            if step > target or (step == target and name == "memory" and step > 0):
                target, from_mem = step, name == "memory"
            newest = (limit // k) * k
            if newest >= (self.mem_floor if name == "memory" else 0):
                ideal = max(ideal, newest)
        if spike and target < ideal:
            self.count["further"] += 1
            self.count["further_steps"] += ideal - target
        if target > 0:
            self.pins["memory" if from_mem else "disk"].append(target)
        restore = self.restore_m if from_mem else self.restore_d
        bucket = "spike_rollback" if spike else "corruption"
        self.b[f"wasted_progress_from_{bucket}"] += (P - target) * self.base_s
        self.b["unproductive_checkpoint_restore_time"] += restore
        self.t += restore
        self.lost += P - target
        self.P = target
        self.mem_floor = min(self.mem_floor, target + 1)
        if self.any_sdc:
            self._cure(target)
        return target

    def _retained(self, name: str, limit: int) -> int:
        """engine._Run._retained for one lane (its tier is on)."""
        k = self.km if name == "memory" else self.kd
        step = self.held.newest_one(self.slot[name], self.H // k, limit // k) * k
        for pin in self.pins[name]:
            if step < pin <= limit:
                step = pin
        if name == "memory":
            return step if step >= self.mem_floor else 0
        if self.any_stops and self.stop_save <= limit:
            return max(step, self.stop_save)
        return step

    # -- the optional modes (observatory/goodput/modes.py) --------------------------------------

    def _corrupt(self) -> None:
        if self.sdc_at < 0:
            self.sdc_at, self.d_left = self.P, self.sdc_detect
            self.count["corruptions"] += 1
        else:
            self.count["corruption_rollbacks"] += 1
            self._roll_back(self.sdc_at, spike=False)

    def _cure(self, restored: int) -> None:
        if 0 <= self.sdc_at and restored <= self.sdc_at:
            self.sdc_at, self.d_left = -1, _NEVER
            self.c_left = self._sdc_gap()

    def _recovery(self, duration: float) -> float:
        extra = 0.0
        if not (self.recovers and self.lam > 0):
            return extra
        while True:
            e = self._u("recover", self.i_recover)
            self.i_recover += 1
            gap = e / self.lam
            if not gap < duration:
                return extra
            extra += gap
            self.count["recovery_failures"] += 1

    def _maintain(self, P: int, cap: int, stop: float) -> None:
        stop = max(stop, 0.0)
        m = self._steps_within(P, stop, max(cap, 1))
        done = self._wall(P, m)
        self._advance(P, m, done)
        save = self.st_d + self.write_d
        restore = self.restore_d
        planned = (stop - done) + self.stop_window + self.stop_restart
        again = self._recovery(self.stop_restart + restore)
        self.b["unproductive_checkpoint_save_time"] += save
        self.b["planned_maintenance"] += planned
        self.b["infrastructure_recovery_from_disruption"] += again
        self.b["unproductive_checkpoint_restore_time"] += restore
        self.t += save + planned + again + restore
        self.stop_save = self.P
        self.mem_floor = self.P + 1
        every = self.stop_every
        self.next_stop = (math.floor(self.t / every) + 1) * every
        self.count["stops"] += 1


def _steps(e: float, rate: float) -> int:
    """A unit exponential draw as steps of a process at `rate` per step: the lane engine's
    ceil in float64, clipped to _NEVER as a float."""
    if not rate > 0:
        return _NEVER
    x = e / rate
    return math.ceil(x) if x < _NEVER_F else int(_NEVER_F)
