"""The failure modes a run can switch on beyond failures and spikes (issue 40), as the engine's
lanes carry them (observatory/goodput/engine.py; docs/goodput.md gives each default's source):

- failures while restarting and restoring: a recovery is exposed to the job's failure rate, and
  one that fails loses its time so far and starts over (`Failures.during_recovery`);
- planned maintenance (`Maintenance`): the job saves to disk, waits for the write, stops for the
  window, restarts and restores from that save; host memory does not survive it;
- silent data corruption (`Corruption`): from a corruption on, every checkpoint is poisoned
  until its detection `detect_steps` later, when the run goes back to the newest retained
  checkpoint from before it; a failure or rollback that restores to before it cures it;
- spikes that come back (`Spikes.repeat`): after a rollback the spike comes back, with that
  chance, when the run reaches its step again;
- stragglers (`Scenario.straggler`): every step slower by that fraction; the time it adds to
  every trained step is its own bucket.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from observatory.goodput.model import Scenario

__all__ = ["MODE_COUNTS", "Modes", "expected_events"]

MODE_COUNTS = ("recovery_failures", "stops", "corruptions", "corruption_rollbacks", "repeats")
_NEVER = np.iinfo(np.int64).max // 4


def expected_events(sc: Scenario) -> float:
    """Failures, spikes, planned stops and corruptions a run is expected to meet."""
    run_s = sc.steps * sc.step_s * (1 + sc.straggler)
    stops = run_s * 1.5 / sc.maintenance.every_s if sc.maintenance.every_s else 0.0
    sdc = sc.corruption.per_gpu_day * sc.gpus * run_s / 86_400
    spikes = sc.steps * sc.spikes.per_1k_steps / 1000 / (1 - sc.spikes.repeat)
    return run_s * 1.5 / sc.mtbf_s + spikes + stops + 2 * sdc


class Modes:
    """The engine's side of the optional failure modes (a mixin of its `_Run`)."""

    if TYPE_CHECKING:  # the engine's
        draws: Any  # the engine's common random numbers (engine._Draws)
        seed: np.ndarray
        t: np.ndarray
        P: np.ndarray
        lam: np.ndarray
        mem_floor: np.ndarray
        b: dict[str, np.ndarray]
        count: dict[str, np.ndarray]
        tiers: dict[str, dict[str, np.ndarray]]

        def at(self, ia: Any) -> Any: ...
        def _steps_within(self, p: Any, P: Any, tau: Any, cap: Any) -> np.ndarray: ...
        def _wall(self, p: Any, P: Any, m: Any) -> np.ndarray: ...
        def _advance(self, ia: Any, step_s: Any, P: Any, m: Any, wall: Any) -> None: ...
        def roll_back(self, ia: Any, limit: Any, *, spike: bool) -> np.ndarray: ...

    def init_modes(self, scenarios: list[Scenario], seeds: np.ndarray) -> None:
        def per_lane(get: Any, dtype: Any = np.float64) -> np.ndarray:
            return np.repeat(np.array([get(s) for s in scenarios], dtype=dtype), seeds)

        L = int(seeds.sum())
        self.repeat = per_lane(lambda s: s.spikes.repeat)
        self.any_repeat = bool((self.repeat > 0).any())
        self.recovers = per_lane(lambda s: s.failures.during_recovery, bool)
        self.stop_every = per_lane(lambda s: s.maintenance.every_s or np.inf)
        self.stop_window = per_lane(lambda s: s.maintenance.window_s)
        self.stop_restart = per_lane(lambda s: s.restart_s)
        self.next_stop = self.stop_every.copy()
        # the last planned stop's save (a disk step), per slot of the engine (memory's: none)
        self.stop_slot = np.zeros(2 * L, np.int64)
        self.stop_save = self.stop_slot[L:]
        self.sdc_rate = per_lane(  # corruptions per trained step
            lambda s: s.corruption.per_gpu_day * s.gpus * s.step_s * (1 + s.straggler) / 86_400
        )
        self.sdc_detect = per_lane(lambda s: s.corruption.detect_steps, np.int64)
        self.sdc_at = np.full(L, -1, np.int64)  # the step after which the state is wrong
        self.i_sdc = np.zeros(L, np.int64)
        self.i_recover = np.zeros(L, np.int64)
        self.c_left = self._sdc_gap(np.arange(L))  # trained steps to the next corruption
        self.d_left = np.full(L, _NEVER, np.int64)  # ... to the detection of the current one
        self.any_sdc = bool((self.sdc_rate > 0).any())
        self.any_recover = bool(self.recovers.any())
        self.any_stops = bool(np.isfinite(self.stop_every).any())

    def _sdc_gap(self, ia: np.ndarray) -> np.ndarray:
        e = self.draws.take("sdc", self.seed[ia], self.i_sdc[ia])
        self.i_sdc[ia] += 1
        with np.errstate(divide="ignore"):
            steps = np.where(self.sdc_rate[ia] > 0, np.ceil(e / self.sdc_rate[ia]), _NEVER)
        return np.minimum(steps, _NEVER).astype(np.int64)

    # -- silent data corruption ----------------------------------------------------------------
    def sdc_left(self, ia: np.ndarray) -> np.ndarray:
        """Trained steps to the next corruption, or to the detection of the current one."""
        return np.where(self.sdc_at[ia] >= 0, self.d_left[ia], self.c_left[ia])

    def count_down(self, ia: np.ndarray, m: np.ndarray) -> None:
        active = self.sdc_at[ia] >= 0
        self.c_left[ia] -= np.where(active, 0, m)
        self.d_left[ia] -= np.where(active, m, 0)

    def corrupt(self, ia: np.ndarray) -> None:
        """Lanes whose corruption counter ran out: a corruption begins, or is detected (and
        the run goes back to before it)."""
        if not ia.size:
            return
        begins = self.sdc_at[ia] < 0
        new = ia[begins]
        self.sdc_at[new] = self.P[new]
        self.d_left[new] = self.sdc_detect[new]
        self.count["corruptions"][new] += 1
        found = ia[~begins]
        if found.size:
            self.count["corruption_rollbacks"][found] += 1
            self.roll_back(found, self.sdc_at[found], spike=False)  # cures it

    def cure(self, ia: np.ndarray, restored: np.ndarray) -> None:
        """A restore to before the corruption leaves it behind."""
        gone = ia[(self.sdc_at[ia] >= 0) & (restored <= self.sdc_at[ia])]
        if gone.size:
            self.sdc_at[gone] = -1
            self.d_left[gone] = _NEVER
            self.c_left[gone] = self._sdc_gap(gone)

    # -- recovery that fails --------------------------------------------------------------------
    def recovery(self, ia: np.ndarray, duration: np.ndarray) -> np.ndarray:
        """The time lost to failed recovery attempts before one of `duration` succeeds."""
        extra = np.zeros(ia.size)
        todo = np.flatnonzero(self.recovers[ia] & (self.lam[ia] > 0))
        while todo.size:
            lanes = ia[todo]
            e = self.draws.take("recover", self.seed[lanes], self.i_recover[lanes])
            self.i_recover[lanes] += 1
            gap = e / self.lam[lanes]
            failed = gap < duration[todo]
            extra[todo[failed]] += gap[failed]
            self.count["recovery_failures"][lanes[failed]] += 1
            todo = todo[failed]
        return extra

    # -- planned stops ----------------------------------------------------------------------------
    def maintain(self, ia: np.ndarray, P: np.ndarray, cap: np.ndarray, stop: np.ndarray) -> None:
        """Lanes whose planned stop comes `stop` seconds into their stretch: the steps that fit,
        a disk save and its write, the window, a restart and a restore from that save."""
        if not ia.size:
            return
        stop = np.maximum(stop, 0.0)
        p = self.at(ia)
        m = self._steps_within(p, P, stop, np.maximum(cap, 1))
        done = self._wall(p, P, m)
        self._advance(ia, p.step_s, P, m, done)
        disk = self.tiers["disk"]
        save = p.st_d + disk["write"][ia]
        restore = p.restore_d
        planned = (stop - done) + self.stop_window[ia] + self.stop_restart[ia]
        again = self.recovery(ia, self.stop_restart[ia] + restore)
        self.b["unproductive_checkpoint_save_time"][ia] += save
        self.b["planned_maintenance"][ia] += planned
        self.b["infrastructure_recovery_from_disruption"][ia] += again
        self.b["unproductive_checkpoint_restore_time"][ia] += restore
        self.t[ia] += save + planned + again + restore
        self.stop_save[ia] = self.P[ia]
        self.mem_floor[ia] = self.P[ia] + 1  # the hosts were serviced: memory is gone
        every = self.stop_every[ia]
        self.next_stop[ia] = (np.floor(self.t[ia] / every) + 1) * every
        self.count["stops"][ia] += 1
