"""The failure modes a run can switch on beyond failures and spikes, as the engine's
rounds carry them on a block of lanes (goodput/rounds.py; goodput/scalar.py carries them for one
lane; their per-lane constants are set in goodput/lanes.py; docs/goodput.md gives each default's
source):

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

from typing import TYPE_CHECKING

import numpy as np

from spikewatch.observatory.goodput.state import NEVER, R, steps

if TYPE_CHECKING:
    from spikewatch.observatory.goodput.lanes import Block

__all__ = ["corrupt", "cure", "maintain", "recovery"]


# -- on a round's block of lanes (goodput/rounds.py), at positions `at` of it --------------------


def recovery(b: Block, at: np.ndarray, duration: np.ndarray) -> np.ndarray:
    """The time lost to failed recovery attempts before one of `duration` succeeds."""
    run = b.run
    extra = np.zeros(at.size)
    lanes = b.ia[at]
    todo = np.flatnonzero(run.recovers[lanes] & (run.lam[lanes] > 0))
    while todo.size:
        pos, lane = at[todo], lanes[todo]
        e = run.draws.take("recover", run.seed[lane], b.I[R.i_recover, pos])
        b.I[R.i_recover, pos] += 1
        gap = e / run.lam[lane]
        failed = gap < duration[todo]
        extra[todo[failed]] += gap[failed]
        b.I[R.recovery_failures, pos[failed]] += 1
        todo = todo[failed]
    return extra


def maintain(b: Block, at: np.ndarray, stop: np.ndarray, done: np.ndarray) -> None:
    """Lanes whose planned stop came `stop` seconds into their stretch, after the steps that
    fit (`done` seconds): a disk save and its write, the window, a restart and a restore from
    that save."""
    run, p = b.run, b.p
    lanes = b.ia[at]
    save = p.st_d[at] + p.write_d[at]
    restore = p.restore_d[at]
    planned = (stop - done) + run.stop_window[lanes] + run.stop_restart[lanes]
    again = recovery(b, at, run.stop_restart[lanes] + restore)
    F = b.F
    F[R.save, at] += save
    F[R.maintenance, at] += planned
    F[R.infra, at] += again
    F[R.restore, at] += restore
    F[R.t, at] += save + planned + again + restore
    P = b.I[R.P, at]
    b.I[R.stop_save, at] = P
    b.I[R.mem_floor, at] = P + 1  # the hosts were serviced: memory is gone
    every = run.stop_every[lanes]
    F[R.next_stop, at] = (np.floor(F[R.t, at] / every) + 1) * every
    b.I[R.stops, at] += 1


def corrupt(b: Block, at: np.ndarray) -> None:
    """Lanes whose trained steps reached a corruption: from here on their state is wrong."""
    I = b.I  # noqa: E741
    I[R.sdc_at, at] = I[R.P, at]
    I[R.d_left, at] = b.run.sdc_detect[b.ia[at]]
    I[R.corruptions, at] += 1


def cure(b: Block, restored: np.ndarray, mask: np.ndarray) -> None:
    """Lanes of `mask` restored to before their corruption leave it behind."""
    I, run = b.I, b.run  # noqa: E741
    at = np.flatnonzero(mask & (I[R.sdc_at] >= 0) & (restored <= I[R.sdc_at]))
    if at.size:
        I[R.sdc_at, at] = -1
        I[R.d_left, at] = NEVER
        lanes = b.ia[at]
        e = run.draws.take("sdc", run.seed[lanes], I[R.i_sdc, at])
        I[R.i_sdc, at] += 1
        I[R.c_left, at] = steps(e, run.sdc_rate[lanes])
