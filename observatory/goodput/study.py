"""What the dashboard's goodput page draws, computed in one simulation: goodput against the
checkpoint interval of each tier (disk alone; memory with the disk tier as set), and badput by
bucket for three plans (disk alone at Daly's interval, the plan as set, the best interval found
for the memory tier)."""

from __future__ import annotations

import collections
import dataclasses
import threading
from typing import Any

import numpy as np

from spikewatch.observatory.goodput.engine import BUCKETS, Lanes, simulate
from spikewatch.observatory.goodput.model import Scenario
from spikewatch.observatory.goodput.plan import MEMORY, report, young_daly, young_grid

__all__ = ["PlanCache", "study"]


class PlanCache:
    """Each plan's lanes, kept by (plan, seeds, seed), the newest `size` of them: a page whose
    one control changed simulates only the plans that control changes (the disk-alone curve,
    say, does not move with the memory interval). A plan's lanes do not depend on the plans
    simulated beside it, so a plan from here equals a plan simulated afresh."""

    def __init__(self, size: int = 512) -> None:
        self.size = size
        self._plans: collections.OrderedDict[tuple, Lanes] = collections.OrderedDict()
        self._lock = threading.Lock()

    def simulate(self, plans: list[Scenario], seeds: int, seed: int) -> Lanes:
        with self._lock:
            missing = [p for p in dict.fromkeys(plans) if (p, seeds, seed) not in self._plans]
        if missing:
            got = simulate(missing, seeds, seed)
            with self._lock:
                for i, plan in enumerate(missing):
                    self._plans[(plan, seeds, seed)] = got.pick(i)
        with self._lock:
            parts = []
            for plan in plans:
                self._plans.move_to_end((plan, seeds, seed))
                parts.append(self._plans[(plan, seeds, seed)])
            while len(self._plans) > self.size:
                self._plans.popitem(last=False)
        return Lanes.join(parts)


def study(
    sc: Scenario,
    *,
    seeds: int = 30,
    points: int = 11,
    seed: int = 0,
    cache: PlanCache | None = None,
) -> dict[str, Any]:
    disk = sc.tier("disk")
    assert disk is not None
    mem = sc.tier("memory") or MEMORY
    disk_grid = young_grid(sc, disk.stall_s, 1 / 8, 8, points)
    mem_grid = young_grid(sc, mem.stall_s, 1 / 8, 8, points)
    alone = sc.replace(tiers=(disk,))
    yd = young_daly(alone)
    daly_steps = max(1, round(yd.get("daly_interval_s", disk.interval * sc.step_s) / sc.step_s))
    plans = [alone.with_tier("disk", interval=k) for k in disk_grid]
    plans += [sc.replace(tiers=(dataclasses.replace(mem, interval=k), disk)) for k in mem_grid]
    plans += [alone.with_tier("disk", interval=daly_steps), sc]
    lanes = cache.simulate(plans, seeds, seed) if cache else simulate(plans, seeds, seed)

    def curve(first: int, grid: list[int]) -> dict[str, list[float]]:
        g = [lanes.goodput[lanes.of(first + i)] for i in range(len(grid))]
        return {
            "interval_s": [k * sc.step_s for k in grid],
            "goodput": [float(x.mean()) for x in g],
            "p5": [float(np.percentile(x, 5)) for x in g],
            "p95": [float(np.percentile(x, 95)) for x in g],
        }

    curves = {"disk": curve(0, disk_grid), "memory": curve(len(disk_grid), mem_grid)}
    best_mem = int(np.argmax(curves["memory"]["goodput"]))
    named = {
        f"disk alone, Daly's {daly_steps * sc.step_s / 60:.0f} min": len(plans) - 2,
        "as set": len(plans) - 1,
        f"memory every {mem_grid[best_mem] * sc.step_s / 60:.1f} min (best) + disk": len(disk_grid)
        + best_mem,
    }
    reports = {name: report(plans[i], lanes, i) for name, i in named.items()}
    return {
        "curves": curves,
        "plans": reports,
        # the five every run has, and a failure mode's only when it is on
        "buckets": [
            k
            for k in BUCKETS[1:]
            if k in BUCKETS[1:6] or any(r["badput"][k] > 0 for r in reports.values())
        ],
        "young_daly": yd,
        "seeds": seeds,
        "runs": len(plans) * seeds,
    }
