"""spikewatch.lightning beyond test_examples.py: gradient accumulation makes the same steps (the
same losses and weights) as one batch of the same rows; an epoch-based run keeps its planned
updates after a rollback; the user's own loader is warned about; the validation metric's name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch", reason="the lightning extra is not installed")

from spikewatch.lightning import SpikewatchCallback  # noqa: E402
from spikewatch.trainer.core.actions import Action, Continue, Rollback  # noqa: E402
from spikewatch.trainer.core.callbacks import Callback, StepState  # noqa: E402

pytestmark = pytest.mark.e2e  # trains a model (tests/README.md)


class Bigram(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(256, 32)
        self.out = torch.nn.Linear(32, 256)

    def training_step(self, batch: torch.Tensor, idx: int) -> torch.Tensor:
        logits = self.out(self.emb(batch[:, :-1]))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _fit(tmp_path, rows: int, accumulate: int) -> tuple[dict, dict]:
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 256, (48, 17), generator=g)
    batches = list(data.split(rows))
    cb = SpikewatchCallback(db="none", checkpoint_every=2)
    module = Bigram()
    trainer = pl.Trainer(
        max_steps=6,
        accumulate_grad_batches=accumulate,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path / f"a{accumulate}"),
        callbacks=[cb],
    )
    trainer.fit(module, torch.utils.data.DataLoader(batches, batch_size=None))
    assert cb.summary is not None
    return cb.summary, module.state_dict()


def test_gradient_accumulation_makes_the_same_steps(tmp_path) -> None:
    one, w1 = _fit(tmp_path, rows=8, accumulate=1)
    two, w2 = _fit(tmp_path, rows=4, accumulate=2)
    assert one["steps"] == two["steps"] == 6
    assert two["final_train_loss"] == pytest.approx(one["final_train_loss"], rel=1e-5)
    for k in w1:
        torch.testing.assert_close(w1[k], w2[k], rtol=1e-3, atol=1e-4)  # Adam amplifies rounding


class _RollbackOnce(Callback):
    """The user's own callback: one rollback, of at least 8 steps, at step `at`."""

    priority = 10

    def __init__(self, at: int) -> None:
        self.at, self.done = at, False

    def pre_update(self, state: StepState) -> Action:
        if state.step == self.at and not self.done:
            self.done = True
            return Rollback(to_step=self.at - 8, reason="the test asked")
        return Continue()


class _Validated(Bigram):
    def validation_step(self, batch: torch.Tensor, idx: int) -> None:
        self.log("my_val", self.training_step(batch, idx))


def test_an_epoch_based_run_that_rolls_back_still_makes_its_planned_updates(
    tmp_path, caplog
) -> None:
    g = torch.Generator().manual_seed(0)
    batches = list(torch.randint(0, 256, (80, 17), generator=g).split(8))  # 10 per epoch
    cb = SpikewatchCallback(
        db="none",
        callbacks=[_RollbackOnce(at=14)],
        val_metric="my_val",
        settings={"checkpoint": {"interval": None, "memory_interval": 2}},
    )
    trainer = pl.Trainer(
        max_epochs=3,  # 30 updates planned; the rollback discards 8 (14 -> 6)
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=str(tmp_path),
        callbacks=[cb],
    )
    loader = torch.utils.data.DataLoader(batches, batch_size=None)
    with caplog.at_level("WARNING", logger="spikewatch"):
        trainer.fit(_Validated(), loader, val_dataloaders=loader)
    assert cb.summary is not None
    (rollback,) = cb.summary["interventions"]
    lag = 14 - rollback["to_step"]  # the retained target at or before step 6 (exponential)
    assert lag >= 8
    assert cb.summary["steps"] == 30  # the plan, made up with more epochs
    assert trainer.global_step == 30 + lag and trainer.current_epoch > 3
    assert "not bit-exactly" in caplog.text  # the user's own loader, said at start
    assert cb.summary["val_losses"], "the validation metric named my_val was read"


def test_a_stop_every_rank_agreed_on_ends_the_fit_after_that_step(tmp_path) -> None:
    """A SIGTERM under torchrun is a stop every rank agrees on at one step's all-reduce
    (tests/spikewatch/test_rank_faults.py): the fit ends after that step (`trainer.should_stop`)
    and the run reads "stopped" there. In one process `request_stop` is agreed at once."""
    data = torch.randint(0, 256, (80, 17), generator=torch.Generator().manual_seed(0))
    cb = SpikewatchCallback(db="none")

    class Signalled(pl.Callback):
        def on_train_batch_end(self, trainer, *args):  # noqa: ANN001, ANN002
            if trainer.global_step == 4:  # as the signal's handler does, mid-run
                cb.watch.core.request_stop()

    trainer = pl.Trainer(max_steps=20, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=str(tmp_path), callbacks=[cb, Signalled()])  # fmt: skip
    trainer.fit(Bigram(), torch.utils.data.DataLoader(list(data.split(4)), batch_size=None))
    assert trainer.global_step == 5  # the stop asked during step 4 ends step 5
    assert cb.summary is not None and cb.summary["steps"] == 5
    ended = json.loads((Path(cb.summary["run_dir"]) / "ended.json").read_text())
    assert ended["status"] == "stopped"
