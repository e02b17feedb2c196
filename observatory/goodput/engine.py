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

Three pieces carry the model out, and any of them gives the same outputs to the bit:
goodput/rounds.py moves many lanes at once, a round of numpy calls per event; goodput/scalar.py
moves one lane in plain Python (a single run, and the last lanes of a batch); goodput/parallel.py
splits the lanes over this machine's cores. goodput/lanes.py holds the lanes' constants, state
and draws.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from spikewatch.observatory.goodput.lanes import Lanes
from spikewatch.observatory.goodput.model import Scenario
from spikewatch.observatory.goodput.state import BUCKETS

__all__ = ["BUCKETS", "Lanes", "simulate"]


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
    from spikewatch.observatory.goodput.parallel import split  # the pool's modules only when asked

    return split(list(scenarios), counts, seed, workers)
