from __future__ import annotations

import json
import math
import random

import pytest

from spikewatch.observatory.readers.scan import ScanError, scan_path
from spikewatch.trainer.cli import main


def _curve(n=1200, seed=0):
    rng = random.Random(seed)
    vals = [2 + 3 * math.exp(-s / 300) + 0.03 * rng.gauss(0, 1) for s in range(1, n + 1)]
    for s in range(700, 712):
        vals[s - 1] *= 2.0
    return vals


def test_scan_csv_finds_the_spike_at_its_onset(tmp_path, capsys) -> None:
    p = tmp_path / "log.csv"
    p.write_text("step,loss,lr\n" + "".join(f"{i + 1},{v},0.1\n" for i, v in enumerate(_curve())))
    assert main(["scan", str(p), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [s["onset_step"] for s in out["spikes"]] == [700]
    (spike,) = out["spikes"]
    assert spike["kind"] == "spike" and 700 <= spike["peak_step"] < 712
    assert spike["end_step"] is not None and spike["end_step"] >= 712
    assert out["detector"]["threshold"] == 8.0 and out["metric"] == "loss"


def test_scan_tensorboard_logdir(tmp_path) -> None:
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(tmp_path / "tb") as w:
        for i, v in enumerate(_curve()):
            w.add_scalar("train/loss", v, i + 1)
            w.add_scalar("optim/lr", 0.1, i + 1)
    out = scan_path(tmp_path / "tb")
    assert out["metric"] == "train/loss" and out["points"] == 1200
    assert [s["onset_step"] for s in out["spikes"]] == [700]
    with pytest.raises(ScanError, match="tags: optim/lr, train/loss"):
        scan_path(tmp_path / "tb", "nope")


def test_nan_is_reported_as_nonfinite(tmp_path) -> None:
    vals = _curve()[:600]
    vals[400] = math.nan
    p = tmp_path / "nan.csv"
    p.write_text("step,loss\n" + "".join(f"{i + 1},{v}\n" for i, v in enumerate(vals)))
    out = scan_path(p)
    assert [(s["kind"], s["onset_step"]) for s in out["spikes"]] == [("nonfinite", 401)]


def test_bad_inputs_are_clear_errors(tmp_path, capsys) -> None:
    p = tmp_path / "bad.csv"
    p.write_text("step,loss\n1,2.0\n2,abc\n")
    assert main(["scan", str(p)]) == 2
    assert "bad.csv:3: not a number" in capsys.readouterr().err
    p.write_text("loss\n2.0\n")
    with pytest.raises(ScanError, match="header"):
        scan_path(p)
    with pytest.raises(ScanError, match="no such file"):
        scan_path(tmp_path / "missing.csv")
    with pytest.raises(ScanError, match="no TensorBoard event files"):
        scan_path(tmp_path)
