"""The goodput page's study with its plan cache: a control changed simulates only the plans it
changes, and what comes from the cache equals what a fresh simulation gives."""

from __future__ import annotations

import json

from spikewatch.observatory.goodput import Scenario, engine, study
from spikewatch.observatory.goodput.study import PlanCache

SMALL = Scenario(gpus=2048, steps=20_000)  # Llama 3's mix and tiers, a shorter run


def _simulated(monkeypatch) -> list[int]:  # noqa: ANN001
    """How many plans each simulation was given (study's calls)."""
    sizes: list[int] = []
    real = study.simulate

    def counted(plans, seeds, seed=0, **kw):  # noqa: ANN001, ANN202
        sizes.append(len(plans))
        return real(plans, seeds, seed, **kw)

    monkeypatch.setattr(study, "simulate", counted)
    return sizes


def test_a_changed_control_simulates_only_the_plans_it_changes(monkeypatch) -> None:
    sizes = _simulated(monkeypatch)
    cache = PlanCache()
    first = study.study(SMALL, seeds=4, seed=2, cache=cache)
    wider = SMALL.with_tier("disk", interval=700)
    second = study.study(wider, seeds=4, seed=2, cache=cache)
    # the disk-alone curve and Daly's plan do not move with the disk interval as set; the
    # memory curve (its plans carry the disk tier as set) and the plan itself do
    assert sizes == [24, 12]
    fresh = study.study(wider, seeds=4, seed=2)
    assert json.dumps(second, sort_keys=True) == json.dumps(fresh, sort_keys=True)
    assert first["curves"]["disk"] == second["curves"]["disk"]
    assert first["curves"]["memory"] != second["curves"]["memory"]
    again = study.study(wider, seeds=4, seed=2, cache=cache)
    assert sizes == [24, 12, 24] and json.dumps(again, sort_keys=True) == json.dumps(
        fresh, sort_keys=True
    )  # the third call (no cache) simulated all; the fourth nothing


def test_the_cache_keeps_its_newest_plans_only() -> None:
    cache = PlanCache(size=5)
    plans = [SMALL.with_tier("disk", interval=k) for k in (300, 400, 500, 600, 700, 800)]
    got = cache.simulate(plans, 2, 0)
    assert len(cache._plans) == 5
    want = engine.simulate(plans, 2, 0, workers=1)
    assert (got.wall_s == want.wall_s).all() and (got.offsets == want.offsets).all()
