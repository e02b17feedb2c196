"""Golden losses: 50 steps of tiny_cpu.toml must reproduce tests/assets/golden_tiny_cpu.txt.

Regenerate only on purpose, after a change that is meant to alter the numbers:
`make golden` (pytest tests/trainer/test_golden.py --regen-golden).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from spikewatch.trainer.builtin.loop import fit
from spikewatch.trainer.config import load_config

pytestmark = pytest.mark.e2e  # trains a model (tests/README.md)

GOLDEN = Path(__file__).parents[1] / "assets" / "golden_tiny_cpu.txt"
STEPS = 50


def test_tiny_cpu_losses_match_golden(tmp_path, regen_golden: bool) -> None:
    cfg = load_config("tiny_cpu", [f"train.stop_after={STEPS}", "train.progress=false"])
    losses = fit(cfg, run_dir=tmp_path).train_losses
    if regen_golden:
        GOLDEN.write_text("".join(f"{i + 1} {v!r}\n" for i, v in enumerate(losses)))
        pytest.skip(f"regenerated {GOLDEN}")
    rows = [line.split() for line in GOLDEN.read_text().splitlines() if line.strip()]
    golden = {int(s): float(v) for s, v in rows}
    assert sorted(golden) == list(range(1, STEPS + 1))
    for i, v in enumerate(losses):
        assert v == pytest.approx(golden[i + 1], rel=1e-5, abs=1e-6), f"step {i + 1}"
