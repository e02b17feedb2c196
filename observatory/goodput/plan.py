"""Planning on top of the simulation: a report of one plan, the best interval of one tier (the
simulated counterpart of Young/Daly), a grid search over intervals and tiers, and a scenario's
measured inputs taken from a run in the store."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from spikewatch.observatory.goodput.engine import BUCKETS, Lanes, simulate
from spikewatch.observatory.goodput.model import Scenario, Spikes, Tier
from spikewatch.observatory.goodput.young_daly import daly, overhead, young

__all__ = [
    "Best",
    "best_interval",
    "interval_grid",
    "pick_interval",
    "measure",
    "optimize",
    "report",
    "simulated_optimum",
    "young_daly",
]


def report(scenario: Scenario, lanes: Lanes, i: int = 0) -> dict[str, Any]:
    """One scenario's figures over its seeds: goodput (mean and spread), badput by bucket as
    fractions of wall time, and what happened."""
    s = lanes.of(i)
    g = lanes.goodput[s]
    wall = lanes.wall_s[s]
    rollbacks = lanes.spikes[s].sum()
    return {
        "goodput": float(g.mean()),
        "goodput_p5": float(np.percentile(g, 5)),
        "goodput_p50": float(np.percentile(g, 50)),
        "goodput_p95": float(np.percentile(g, 95)),
        "seeds": int(g.size),
        "unfinished": float(1 - lanes.finished[s].mean()),
        "wall_days": float(wall.mean() / 86_400),
        "badput": {k: float((lanes.buckets[k][s] / wall).mean()) for k in BUCKETS[1:]},
        "failures": float(lanes.failures[s].mean()),
        "spike_rollbacks": float(lanes.spikes[s].mean()),
        "restores_from_memory": float(lanes.restores_from_memory[s].mean()),
        "rollbacks_further_back": float(lanes.further_back[s].sum() / max(rollbacks, 1)),
        "further_back_steps": float(
            lanes.further_steps[s].sum() / max(lanes.further_back[s].sum(), 1)
        ),
        "batches_skipped": float(lanes.spikes[s].mean() * scenario.spikes.skip),
        "modes": {k: float(v[s].mean()) for k, v in lanes.modes.items()},
    }


@dataclasses.dataclass(frozen=True)
class Best:
    tier: str
    interval: int  # steps
    goodput: float
    intervals: list[int]
    goodputs: list[float]

    @property
    def edge(self) -> str | None:
        """'longest' or 'shortest' when the best is the grid's end: the optimum may lie past
        it (with a memory tier that survives failures, the disk interval hardly matters and
        the longest tried wins), so it is a bound, not an optimum."""
        i = self.goodputs.index(max(self.goodputs))
        return "longest" if i == len(self.goodputs) - 1 else "shortest" if i == 0 else None


# The memory tier a plan tries when the scenario has none: Gemini-style, replicated on a peer.
MEMORY = Tier("memory", 50, stall_s=1.0, restore_s=30.0, replicas=2)


def young_grid(sc: Scenario, stall_s: float, low: float, high: float, points: int) -> list[int]:
    """Intervals in steps, log-spaced from `low` to `high` times Young's for a save of
    `stall_s` at the scenario's failure rate."""
    centre = young(max(stall_s, 1e-3), min(sc.mtbf_s, 1e12)) / sc.step_s
    return sorted({max(1, round(x)) for x in np.geomspace(centre * low, centre * high, points)})


def best_interval(
    scenario: Scenario, tier: str = "disk", *, seeds: int = 40, points: int = 17, seed: int = 0
) -> Best:
    """The interval of `tier` with the best mean goodput, the other tiers as they are: a grid
    from a quarter to four times Young's interval (in log steps), then the vertex of a parabola
    through the best point and its neighbours in log interval (the curve is flat at the top)."""
    grid, plans = interval_grid(scenario, tier, points)
    return pick_interval(tier, grid, simulate(plans, seeds, seed))


def interval_grid(scenario: Scenario, tier: str = "disk", points: int = 17) -> tuple[Any, list]:
    """`best_interval`'s grid and its plans (to simulate with others in one pass)."""
    t = scenario.tier(tier)
    if t is None:
        raise ValueError(f"the scenario has no {tier} tier")
    grid = np.array(young_grid(scenario, t.stall_s, 1 / 4, 4, points))
    return grid, [scenario.with_tier(tier, interval=int(k)) for k in grid]


def pick_interval(tier: str, grid: Any, lanes: Lanes, first: int = 0) -> Best:
    """The best of a simulated grid (plans `first`, `first + 1`, ... of `lanes`)."""
    g = np.array([lanes.goodput[lanes.of(first + i)].mean() for i in range(grid.size)])
    i = int(g.argmax())
    best = float(grid[i])
    if 2 <= i <= grid.size - 3:
        x, y = np.log(grid[i - 2 : i + 3]), 1 / g[i - 2 : i + 3]
        a, b, _ = np.polyfit(x, y, 2)
        if a > 0:
            best = float(np.clip(np.exp(-b / (2 * a)), grid[i - 1], grid[i + 1]))
    return Best(tier, round(best), float(g[i]), grid.tolist(), g.tolist())


def simulated_optimum(save_s: float, mtbf_s: float, *, seeds: int = 40) -> tuple[float, float]:
    """Young/Daly's own setting simulated: failures at 1/MTBF, a blocking save, no restart, no
    restore, no spikes, one disk tier; a run of 200 MTBFs in steps of 1/200 of Young's interval.
    The best interval (seconds) and the wall-time fraction lost there."""
    from spikewatch.observatory.goodput.model import Cause, Failures

    step_s = young(save_s, mtbf_s) / 200
    sc = Scenario(
        gpus=1,
        step_s=step_s,
        steps=round(200 * mtbf_s / step_s),
        restart_s=0.0,
        failures=Failures(86_400 / mtbf_s, (Cause("any", 1.0),)),
        spikes=Spikes(per_1k_steps=0.0),
        tiers=(Tier("disk", 200, stall_s=save_s, restore_s=0.0),),
    )
    best = best_interval(sc, seeds=seeds)
    return best.interval * step_s, 1 - best.goodput


def young_daly(scenario: Scenario, best: Best | None = None) -> dict[str, Any]:
    """Young/Daly's closed forms for the disk tier (its stall as the save cost, the failure
    rate as 1/MTBF), beside the simulated best interval when given."""
    disk = scenario.tier("disk")
    assert disk is not None
    m, c = scenario.mtbf_s, disk.stall_s
    out: dict[str, Any] = {"mtbf_s": m, "save_cost_s": c}
    if not (math.isfinite(m) and c > 0):
        out["note"] = "no failures or a free save: Young/Daly have no optimum"
        return out
    out |= {
        "young_interval_s": young(c, m),
        "daly_interval_s": daly(c, m),
        "young_overhead": overhead(young(c, m), c, m),
    }
    if best is not None:
        sim = best.interval * scenario.step_s
        out |= {
            "simulated_best_interval_s": sim,
            "simulated_vs_daly": sim / daly(c, m) - 1,
            "simulated_best_at_edge": best.edge,  # None: within the grid
        }
    return out


def optimize(
    scenario: Scenario,
    *,
    seeds: int = 30,
    points: int = 9,
    seed: int = 0,
    budget: int | None = None,
) -> dict[str, Any]:
    """The best plan over a grid of disk interval x memory interval (a quarter to eight times
    Young's interval for each tier's stall) x the memory tier's retention, and disk alone, with
    the memory tier holding at most `budget` snapshots (its host memory over one snapshot's
    size; None: as the scenario's tier allows). Exponential retention holds K + log2(saves) + 1
    at most, so under a budget its K is what fits; keep-last holds the budget. Returns the best
    plan's report, the plan as given for comparison, the grid's goodputs and its size."""
    disk = scenario.tier("disk")
    mem = scenario.tier("memory")
    assert disk is not None
    disk_grid = young_grid(scenario, disk.stall_s, 1 / 4, 8, points)
    mem_tier = mem or MEMORY
    mem_grid = young_grid(scenario, mem_tier.stall_s, 1 / 4, 8, points)
    alone = scenario.replace(tiers=(disk,))
    candidates: list[tuple[Scenario, dict[str, Any]]] = [
        (alone.with_tier("disk", interval=k), {"memory_interval": None, "disk_interval": k})
        for k in disk_grid
    ]
    for km in mem_grid:
        for rule, keep in _retentions(scenario.steps // km, km, budget, mem_tier):
            tier = dataclasses.replace(
                mem_tier, interval=km, retention=rule, keep_last=keep, max_kept=None
            )
            for kd in disk_grid:
                if kd >= km:
                    sc = scenario.replace(tiers=(tier, dataclasses.replace(disk, interval=kd)))
                    plan = {"memory_interval": km, "disk_interval": kd}
                    candidates.append((sc, plan | {"memory_retention": f"{rule}:{keep}"}))
    lanes = simulate([scenario, *(sc for sc, _ in candidates)], seeds, seed)
    g = [float(lanes.goodput[lanes.of(i + 1)].mean()) for i in range(len(candidates))]
    i = int(np.argmax(g))
    given = report(scenario, lanes, 0)
    best = report(candidates[i][0], lanes, i + 1)
    return {
        "best": candidates[i][1] | best,
        "given": given,
        "gain": best["goodput"] - given["goodput"],
        "grid": [plan | {"goodput": x} for (_, plan), x in zip(candidates, g, strict=True)],
        "configurations": len(candidates),
        "budget": budget,
        "seeds": seeds,
        "scenario": candidates[i][0],
    }


def _retentions(saves: int, k: int, budget: int | None, tier: Tier) -> list[tuple[str, int]]:
    """The memory retentions a plan of `saves` saves every `k` steps may use within `budget`
    snapshots: keep-last-budget, and exponential with the largest K whose newest K and one
    save per level (ages whose age in steps has one bit length: goodput/held.py) fit."""
    if budget is None:
        return [("exponential", tier.keep_last), ("last", tier.keep_last)]
    out = [("last", budget)]
    for K in range(budget - 1, 0, -1):
        levels = (max(saves, 1) * k).bit_length() - (K * k).bit_length() + 1
        if K + levels <= budget:
            out.append(("exponential", K))
            break
    return out


def measure(session: Any, run_id: str) -> dict[str, Any]:
    """What a stored run measured for a plan: its step time (wall time less checkpoint stalls,
    per trained step), each tier's median stall, its spike rate, and each spike's distance from
    detection back to before its onset."""
    from spikewatch.observatory import metric_names as M
    from spikewatch.observatory.store import queries as q

    try:
        run = q.get_run(session, run_id=run_id)
    except q.NotFoundError as e:
        raise ValueError(f"{e} in the store (spikewatch serve lists the runs)") from None
    steps = _trained_steps(session, run_id)
    if steps < 2:
        raise ValueError(f"run {run_id} has {steps} stored steps: too few to measure")
    end = run.ended_at or run.updated_at
    stalls = {t: _values(session, run_id, M.checkpoint_stall(t)) for t in ("memory", "disk")}
    stall_total = sum(float(v.sum()) for v in stalls.values())
    spikes = q.events(session, run_id=run_id, kinds=["spike"])
    measured: dict[str, Any] = {
        "run_id": run_id,
        "trained_steps": steps,
        "step_s": max((end - run.created_at).total_seconds() - stall_total, 1e-6) / steps,
        "spikes": len(spikes),
        "spikes_per_1k_steps": 1000 * len(spikes) / steps,
        "back_steps": sorted(
            max(int(e.step) - int(e.data["onset_step"]) + 1, 1)
            for e in spikes
            if e.step is not None and e.data.get("onset_step") is not None
        ),
    }
    for tier, values in stalls.items():
        if values.size:
            measured[f"{tier}_stall_s"] = float(np.median(values))
    return measured


def _trained_steps(session: Any, run_id: str) -> int:
    """Steps trained on every branch (replays after a rollback included)."""
    from spikewatch.observatory import metric_names as M
    from spikewatch.observatory.store import queries as q

    try:
        parts = q.series(session, run_id=run_id, metric=M.LOSS, branch="all", buckets=1)
    except q.NotFoundError:
        return 0
    return sum(b.n for s in parts for b in s.buckets)


def _values(session: Any, run_id: str, metric: str) -> np.ndarray:
    """A sparse metric's values (a save's stall: one per save), exact while each bucket holds
    at most one value; an absent metric gives none."""
    from spikewatch.observatory.store import queries as q

    try:
        parts = q.series(session, run_id=run_id, metric=metric, branch="all", buckets=q.MAX_BUCKETS)
    except q.NotFoundError:
        return np.zeros(0)
    vals = [
        (b.min_value + b.max_value) / 2
        for s in parts
        for b in s.buckets
        for _ in range(b.n - b.n_nan)
        if b.min_value is not None and b.max_value is not None
    ]
    return np.array(vals, dtype=np.float64)
