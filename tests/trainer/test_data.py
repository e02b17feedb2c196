from __future__ import annotations

import math

import pytest
import torch

from spikewatch.trainer.builtin.data import (
    DataState,
    build_sampler,
    load_corpora,
    stage_at,
    unigram_entropy,
)
from spikewatch.trainer.config import DataConfig, MixtureStage


def _cfg(**kw) -> DataConfig:
    return DataConfig(seq_len=32, batch_size=8, **kw)


MIXED = [
    MixtureStage(until_step=100, weights={"text": 0.9, "code": 0.1}),
    MixtureStage(weights={"text": 0.6, "code": 0.4}),
]


def test_batch_is_a_pure_function_of_seed_index_step() -> None:
    a, b = build_sampler(_cfg(), seed=3), build_sampler(_cfg(), seed=3)
    x1, y1 = a.batch(17, step=5)
    x2, y2 = b.batch(17, step=5)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert x1.shape == (8, 32) and x1.dtype == torch.int64
    assert not torch.equal(a.batch(18, step=5)[0], x1)
    assert not torch.equal(build_sampler(_cfg(), seed=4).batch(17, step=5)[0], x1)


def test_targets_are_inputs_shifted_by_one() -> None:
    x, y = build_sampler(_cfg(), seed=0).batch(0, step=1)
    assert torch.equal(x[:, 1:], y[:, :-1])


def test_batches_are_real_text() -> None:
    x, _ = build_sampler(_cfg(), seed=0).batch(0, step=1)
    text = bytes(x[0].tolist()).decode("latin-1")
    assert text.isprintable() or "\n" in text


def test_document_split_is_disjoint_and_nonempty() -> None:
    corpora = load_corpora(0.1, DataConfig().code_max_bytes, ("code", "text"))
    for c in corpora.values():
        assert c.train_docs and c.val_docs
        assert not set(c.train_docs) & set(c.val_docs)
        assert len(c.train) > len(c.val) > 0
    assert all(d.endswith("_gut.txt") for d in corpora["text"].train_docs)
    assert all(d.endswith(".py") for d in corpora["code"].val_docs)


def test_stage_is_a_pure_function_of_step() -> None:
    assert stage_at(MIXED, 1) is MIXED[0]
    assert stage_at(MIXED, 99) is MIXED[0]
    assert stage_at(MIXED, 100) is MIXED[1]
    assert stage_at(MIXED, 10**9) is MIXED[1]


def test_mixture_weights_are_respected_per_stage() -> None:
    s = build_sampler(_cfg(stages=MIXED, code_max_bytes=200_000), seed=0)

    def code_share(step: int) -> float:
        rows = [name for i in range(200) for name, _ in s.plan(i, step)]
        return rows.count("code") / len(rows)

    assert code_share(10) == pytest.approx(0.1, abs=0.03)
    assert code_share(150) == pytest.approx(0.4, abs=0.04)


def test_validation_batches_are_fixed_and_from_the_val_split() -> None:
    s = build_sampler(_cfg(), seed=0)
    assert torch.equal(s.val_batch(2, 4)[0], s.val_batch(2, 4)[0])
    x, _ = s.val_batch(0, 4)
    val = bytes(s.corpora["text"].val.tolist())
    assert bytes(x[0].tolist()) in val


def test_data_state_skips_ranges() -> None:
    st = DataState()
    st.add_skip(3, 5)
    st.add_skip(5, 7)
    st.add_skip(9, 10)
    assert [st.take() for _ in range(6)] == [0, 1, 2, 7, 8, 10]
    assert st.batch_index == 11


def test_data_state_round_trips_and_rejects_empty_ranges() -> None:
    st = DataState(batch_index=42, skip_ranges=[(10, 20)])
    assert DataState.from_dict(st.to_dict()) == st
    with pytest.raises(ValueError, match="empty"):
        st.add_skip(5, 5)


def test_unigram_entropy() -> None:
    uniform = torch.arange(256, dtype=torch.uint8).repeat(4)
    assert unigram_entropy(uniform) == pytest.approx(math.log(256))
    assert unigram_entropy(torch.zeros(10, dtype=torch.uint8)) == pytest.approx(0.0)
