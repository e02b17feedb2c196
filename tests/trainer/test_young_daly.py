from __future__ import annotations

import json
import math

import pytest

from spikewatch.observatory.goodput.young_daly import (
    daly,
    expected_overhead,
    overhead,
    parse_duration,
    young,
)
from spikewatch.trainer.cli import main


def test_llama3_numbers() -> None:
    """Llama 3: a failure every 3.1 h; a 5-minute save -> ~43 min (Young), ~40 min (Daly)."""
    m, c = parse_duration("3.1h"), parse_duration("5min")
    assert (m, c) == (3.1 * 3600, 300)
    assert young(c, m) / 60 == pytest.approx(43.1, abs=0.1)
    assert daly(c, m) / 60 == pytest.approx(39.9, abs=0.1)


def test_formulas() -> None:
    c, m = 30.0, 7200.0
    r = math.sqrt(2 * c * m)
    assert young(c, m) == pytest.approx(r)
    assert daly(c, m) == pytest.approx(r * (1 + math.sqrt(c / (2 * m)) / 3 + c / (18 * m)) - c)
    assert daly(5000, 100) == 100  # C >= 2M: checkpoint once per MTBF
    assert overhead(r, c, m) == pytest.approx(c / r + (r + c) / (2 * m))


def test_young_minimises_the_first_order_overhead() -> None:
    c, m = 60.0, 36000.0
    t = young(c, m)
    assert overhead(t, c, m) < overhead(0.7 * t, c, m)
    assert overhead(t, c, m) < overhead(1.4 * t, c, m)


@pytest.mark.parametrize("bad", ["", "5 parsecs", "-3h", "h"])
def test_parse_duration_rejects(bad: str) -> None:
    with pytest.raises(ValueError, match="not a duration"):
        parse_duration(bad)


def test_advise_prints_43_minutes(capsys) -> None:
    assert main(["advise", "--mtbf", "3.1h", "--save-cost", "5min"]) == 0
    out = capsys.readouterr().out
    assert "Young: checkpoint every 43.1 min" in out
    assert "Daly: checkpoint every 39.9 min" in out


def test_advise_says_how_far_the_simulation_differs(capsys) -> None:
    assert main(["advise", "--mtbf", "3.1h", "--save-cost", "5min", "--json"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[2].startswith("  Sim: checkpoint every") and "from Daly" in lines[2]
    out = json.loads(lines[-1])
    assert out["simulated_interval_s"] == pytest.approx(out["daly_interval_s"], rel=0.05)
    # the simulation loses what Daly's exact expectation says, not the first-order formula
    m, c, t = out["mtbf_s"], out["save_cost_s"], out["simulated_interval_s"]
    assert out["simulated_overhead"] == pytest.approx(expected_overhead(t, c, m), rel=0.03)
    assert out["young_overhead"] > 1.1 * out["simulated_overhead"]


def test_the_exact_overhead_meets_the_first_order_one_when_saves_are_cheap() -> None:
    c, m = 1.0, 1e6
    t = young(c, m)
    assert expected_overhead(t, c, m) == pytest.approx(overhead(t, c, m), rel=0.01)
    assert expected_overhead(t, 300.0, 3600.0) < overhead(t, 300.0, 3600.0)
