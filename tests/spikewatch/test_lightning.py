"""spikewatch.lightning beyond test_examples.py: gradient accumulation makes the same steps (the
same losses and weights) as one batch of the same rows."""

from __future__ import annotations

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch", reason="the lightning extra is not installed")

from spikewatch.lightning import SpikewatchCallback  # noqa: E402


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
