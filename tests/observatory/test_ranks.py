"""Which ranks departed at a spike: the rank whose own loss rose, or all of them."""

from __future__ import annotations

from spikewatch.observatory.ranks import departed_ranks


def _losses(spike: dict[int, float], ranks: int = 4) -> dict[int, list[float]]:
    out = {}
    for s in range(60):
        base = [2.0 + 0.01 * ((s * 7 + r) % 5) for r in range(ranks)]
        if s >= 50:
            base = [v * spike.get(r, 1.0) for r, v in enumerate(base)]
        out[s] = base
    return out


def test_a_poisoned_shard_names_its_rank_alone() -> None:
    assert departed_ranks(_losses({1: 3.0}), onset_step=50, detect_step=53) == [1]


def test_a_fault_every_rank_shares_names_them_all() -> None:
    assert departed_ranks(_losses({0: 2.5, 1: 2.6, 2: 2.4, 3: 2.5}), 50, 53) == [0, 1, 2, 3]


def test_noise_names_none_and_no_losses_name_none() -> None:
    assert departed_ranks(_losses({}), 50, 53) == []
    assert departed_ranks({}, 50, 53) == []


def test_a_nonfinite_loss_departs() -> None:
    losses = _losses({})
    losses[51][2] = float("nan")
    assert departed_ranks(losses, 50, 53) == [2]
