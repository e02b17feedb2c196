from __future__ import annotations

import pytest
import torch

from spikewatch.trainer.builtin.faults import apply_faults
from spikewatch.trainer.builtin.loop import build_trainer, fit
from spikewatch.trainer.config import ConfigError, FaultConfig

from .conftest import tiny_config

pytestmark = pytest.mark.e2e  # trains a model (tests/README.md)


def _batch():
    x = torch.randint(0, 200, (2, 8), generator=torch.Generator().manual_seed(0))
    return x, x.roll(-1, 1)


def test_faults_touch_only_their_batch_indices() -> None:
    x, y = _batch()
    faults = [FaultConfig(kind="shifted_labels", start=5, length=2)]
    assert torch.equal(apply_faults(faults, 4, x, y).y, y)
    assert torch.equal(apply_faults(faults, 5, x, y).y, (y + 1) % 256)
    assert torch.equal(apply_faults(faults, 6, x, y).x, x)
    assert torch.equal(apply_faults(faults, 7, x, y).y, y)
    rep = apply_faults([FaultConfig(kind="repeated_bytes", start=0)], 0, x, y)
    assert rep.x.unique().tolist() == [ord("a")]
    rnd = apply_faults([FaultConfig(kind="random_bytes", start=0)], 0, x, y)
    assert torch.equal(rnd.x[:, 1:], rnd.y[:, :-1]) and not torch.equal(rnd.x, x)
    lr = apply_faults([FaultConfig(kind="lr_scale", start=0, factor=30)], 0, x, y)
    assert lr.lr_factor == 30 and lr.kinds == ("lr_scale",)
    ramp = [FaultConfig(kind="lr_ramp", start=10, length=4, factor=16)]
    factors = [apply_faults(ramp, i, x, y).lr_factor for i in range(9, 15)]
    assert factors == pytest.approx([1, 2, 4, 8, 16, 1])  # 16^(1/4) per batch, then over


def test_a_fault_makes_a_real_spike_and_lasting_harm(tmp_path) -> None:
    base = ("train.max_steps=60", "optim.lr=0.01", "eval.interval=none", "eval.batches=4")
    clean = fit(tiny_config(*base), run_dir=tmp_path / "clean")
    hurt = fit(
        tiny_config(*base, 'faults=[{kind="lr_scale", start=30, length=3, factor=30}]'),
        run_dir=tmp_path / "hurt",
    )
    assert hurt.train_losses[:30] == clean.train_losses[:30]
    assert max(hurt.train_losses[30:36]) > clean.train_losses[30] + 1.0
    assert hurt.final_val_loss > clean.final_val_loss * 1.05


def test_skipping_the_faulty_region_removes_the_fault(tmp_path) -> None:
    fault = 'faults=[{kind="shifted_labels", start=5, length=3}]'
    tr = build_trainer(tiny_config(fault), run_dir=tmp_path / "a")
    tr.core.run.data.add_skip(5, 8)
    skipped = tr.fit()
    tr2 = build_trainer(tiny_config(), run_dir=tmp_path / "b")
    tr2.core.run.data.add_skip(5, 8)
    assert skipped.train_losses == tr2.fit().train_losses


def test_nan_fault_is_refused(tmp_path) -> None:
    r = fit(tiny_config('faults=[{kind="nan_loss", start=3, length=2}]'), run_dir=tmp_path)
    assert [i["step"] for i in r.interventions] == [4, 5]
    assert all(i["kind"] == "skip_update" for i in r.interventions)
    assert torch.isfinite(torch.tensor(r.final_val_loss))


def test_bad_fault_config_is_an_error() -> None:
    with pytest.raises(ConfigError, match="faults.0.kind"):
        tiny_config('faults=[{kind="meteor", start=3}]')


def test_a_rank_restricted_fault_touches_only_that_ranks_shard() -> None:
    x, y = _batch()
    faults = [FaultConfig(kind="shifted_labels", start=5, rank=1)]
    assert torch.equal(apply_faults(faults, 5, x, y, rank=0).y, y)
    assert torch.equal(apply_faults(faults, 5, x, y, rank=1).y, (y + 1) % 256)
    with pytest.raises(ConfigError, match="rank applies to data faults only"):
        tiny_config('faults=[{kind="lr_scale", start=3, rank=1}]')
