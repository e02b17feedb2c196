"""What a simulated lane holds: the buckets its wall time splits into, its counters, and the
rows of the engine's two state matrices (floats and ints) by name."""

from __future__ import annotations

import numpy as np

__all__ = [
    "BUCKETS",
    "COUNTS",
    "FLOATS",
    "GIVE_UP",
    "INTS",
    "MODE_COUNTS",
    "NEVER",
    "R",
    "gaps",
    "steps",
]

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
MODE_COUNTS = ("recovery_failures", "stops", "corruptions", "corruption_rollbacks", "repeats")
COUNTS = ("failures", "spikes", "memory", "further", "further_steps", *MODE_COUNTS)
FLOATS = ("t", "f_left", "next_stop", *BUCKETS)
INTS = ("P", "H", "s_left", "i_fail", "i_spike", "lost", "mem_floor", "sdc_at", "i_sdc",
        "i_recover", "c_left", "d_left", "stop_save", *COUNTS)  # fmt: skip
NEVER = np.iinfo(np.int64).max // 4  # steps to an event that does not come
GIVE_UP = 20  # a lane stops after this many times its failure-free time (saves included)


class R:
    """The rows of the state matrices: F (floats) and I (ints)."""

    # F: wall seconds so far, running seconds to the next failure, the next planned stop
    t, f_left, next_stop = 0, 1, 2
    # F: the buckets, in BUCKETS' order
    productive, disruption, spike_rollback, save, restore = 3, 4, 5, 6, 7
    infra, corruption, maintenance, straggler = 8, 9, 10, 11
    # I: the step, the furthest step saved at, trained steps to the next spike, the draws
    # used, steps thrown away, memory's oldest restorable step, the corruption (the step after
    # which the state is wrong, -1: none), steps to the next corruption or to its detection,
    # the last planned stop's disk save
    P, H, s_left, i_fail, i_spike, lost, mem_floor = 0, 1, 2, 3, 4, 5, 6
    sdc_at, i_sdc, i_recover, c_left, d_left, stop_save = 7, 8, 9, 10, 11, 12
    # I: the counters, in COUNTS' order
    failures, spikes, memory, further, further_steps = 13, 14, 15, 16, 17
    recovery_failures, stops, corruptions, corruption_rollbacks, repeats = 18, 19, 20, 21, 22


assert all(getattr(R, n) == i for i, n in enumerate(FLOATS[:3])) and R.straggler == len(FLOATS) - 1
assert all(getattr(R, n) == i for i, n in enumerate(INTS[:13] + COUNTS))


def gaps(e: np.ndarray, lam: np.ndarray) -> np.ndarray:
    """Unit exponential draws as the running seconds to the next failure, at `lam` per s."""
    with np.errstate(divide="ignore"):
        return np.where(lam > 0, e / lam, np.inf)


def steps(e: np.ndarray, rate: np.ndarray) -> np.ndarray:
    """Unit exponential draws as the trained steps to the next event of a process at `rate`
    per step (NEVER when it has none)."""
    with np.errstate(divide="ignore"):
        out = np.where(rate > 0, np.ceil(e / rate), NEVER)
    return np.minimum(out, NEVER).astype(np.int64)
