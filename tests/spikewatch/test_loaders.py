"""`watch.batches(loader)`: the loop's own DataLoader, IterableDataset or generator as it is
(trainer/watch_loader.py), epoch after epoch with its own reshuffle, its position in the Watch's
checkpoints, and after a rollback nothing bad fed again."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from spikewatch import AdamW, Watch
from spikewatch.corpus import text_corpus
from spikewatch.trainer.core.cause import NotAtHand
from spikewatch.trainer.core.data_state import DataState
from spikewatch.trainer.watch_loader import LoaderStream

from .conftest import example, run_example

SEQ = 16


def _windows(n: int = 48) -> Any:
    return example("dataloader_loop").Windows(torch.arange(n * SEQ + 1) % 256, SEQ)


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = example("plain_loop").GPT(16, 1, 2, SEQ)
    return model, AdamW(model.parameters(), lr=1e-3)


class _Crash(Exception):
    pass


def _train(loader: Any, run_dir: Any, steps: int, crash_at: int | None = None,
           **batches: Any) -> tuple[list[list[int]], Watch]:  # fmt: skip
    """The loop over `watch.batches(loader)`; the window ids of each step's batch. `crash_at`:
    an exception at that step (a crash: the run fails, no final checkpoint)."""
    model, opt = _model()
    settings = {"checkpoint": {"memory_interval": None, "interval": 10, "async_save": False}}
    watch = Watch(model, opt, run_dir=run_dir, db="none", max_steps=steps, settings=settings,
                  resume="auto")  # fmt: skip
    fed: list[list[int]] = []
    try:
        with watch:
            for x, y, ids in watch.batches(loader, **batches):
                if crash_at is not None and watch.step_count == crash_at:
                    raise _Crash
                fed.append(ids.tolist())
                watch.step(model(x, y))
    except _Crash:
        pass
    return fed, watch


def test_a_shuffled_loader_runs_epoch_after_epoch_with_its_own_reshuffle(tmp_path) -> None:
    """A DistributedSampler reshuffles only through set_epoch: each pass is the loader's own
    order for that epoch, as `for epoch: sampler.set_epoch(epoch); for batch in loader` gives."""
    sampler = DistributedSampler(_windows(), num_replicas=1, rank=0, shuffle=True, seed=3)
    loader = DataLoader(_windows(), batch_size=4, sampler=sampler)
    fed, watch = _train(loader, tmp_path / "a", steps=30)  # 12 batches a pass: 2.5 passes
    expected = []
    for epoch in range(3):
        sampler.set_epoch(epoch)
        expected += [ids.tolist() for _, _, ids in loader]
    assert fed == expected[:30] and watch.step_count == 30
    assert fed[:12] != fed[12:24]  # reshuffled
    assert sorted(sum(fed[12:24], [])) == list(range(48))


def test_an_unseeded_shuffle_resumes_after_a_crash_in_the_uninterrupted_order(
    tmp_path, caplog
) -> None:
    """shuffle=True without a generator draws each pass's order from torch's global RNG when the
    pass begins: the resume begins the pass again from that RNG state and fast-forwards, so the
    data and the weights come out as if nothing had happened."""
    loader = DataLoader(_windows(), batch_size=4, shuffle=True)
    torch.manual_seed(0)
    clean, watch = _train(loader, tmp_path / "clean", steps=30)
    torch.manual_seed(0)
    before, _ = _train(loader, tmp_path / "killed", steps=30, crash_at=25)
    torch.manual_seed(123)  # the new process's RNG is its own: the checkpoint's is restored
    with caplog.at_level(logging.INFO, logger="spikewatch"):
        after, resumed = _train(loader, tmp_path / "killed", steps=30)
    assert before == clean[:25]
    assert resumed.step_count == 30 and after == clean[20:]  # from the checkpoint at 20
    assert "fast-forwarded past 8 batches of epoch 1 to batch 20" in caplog.text
    for a, b in zip(watch.model.parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(a, b)


class _Stateful:
    """A loader that keeps its own position (as torchdata's StatefulDataLoader does)."""

    def __init__(self, batches: list[Any]) -> None:
        self.batches, self.pos = batches, 0
        self.loaded: list[dict[str, int]] = []

    def __iter__(self) -> Iterator[Any]:
        while self.pos < len(self.batches):
            self.pos += 1
            yield self.batches[self.pos - 1]
        self.pos = 0

    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.loaded.append(dict(state))
        self.pos = state["pos"]


def test_a_loader_with_state_dict_resumes_from_its_own_state(tmp_path, caplog) -> None:
    batches = list(DataLoader(_windows(), batch_size=4))  # 12 a pass
    clean, _ = _train(_Stateful(batches), tmp_path / "clean", steps=30)
    _train(_Stateful(batches), tmp_path / "killed", steps=30, crash_at=25)
    loader = _Stateful(batches)
    with caplog.at_level(logging.INFO, logger="spikewatch"):
        after, _ = _train(loader, tmp_path / "killed", steps=30)
    assert loader.loaded == [{"pos": 8}]  # the pass of epoch 1 had given 8 at step 20
    assert after == clean[20:]
    assert "the loader's own state restored at batch 20 (epoch 1)" in caplog.text


def test_a_generator_is_one_pass_and_ends_the_run(tmp_path) -> None:
    def gen() -> Iterator[Any]:
        yield from DataLoader(_windows(), batch_size=4)  # 12 batches

    model, opt = _model()
    with Watch(model, opt, run_dir=tmp_path, db="none") as watch:
        n = sum(1 for x, y, _ in watch.batches(gen()) if watch.step(model(x, y)))
    assert n == 12 and watch.step_count == 12


def test_batches_says_what_it_takes(tmp_path) -> None:
    model, opt = _model()
    with Watch(model, opt, run_dir=tmp_path, db="none") as watch:
        with pytest.raises(TypeError, match=r"takes the loop's loader .* or batch_at\(index\)"):
            next(iter(watch.batches(42)))  # type: ignore[arg-type]


def test_held_batches_are_bounded_and_an_older_one_is_not_at_hand() -> None:
    data = DataState()
    data.add_skip(3, 5)
    stream = LoaderStream(iter(range(100)), data, hold=4, epochs=None)
    got = [stream.draw() for _ in range(8)]
    assert [g[0] for g in got if g] == [0, 1, 2, 5, 6, 7, 8, 9]  # 3 and 4 drawn and dropped
    assert list(stream.held) == [6, 7, 8, 9] and stream.batch_at(9) == 9
    with pytest.raises(NotAtHand, match="batch 5 is no longer held"):
        stream.batch_at(5)


def _poisoned(fed_file: Any, first: int, n: int) -> list[int]:
    """The fed list's positions (iterations) that fed a window of the stream's batches
    first..first+n-1 (the example's Stream, 8 windows of 64 a batch)."""
    order = example("dataloader_loop").Stream(text_corpus()[0], 64, 8, range(0)).order
    spoilt = set(order[first * 8 : (first + n) * 8].tolist())
    fed = [set(map(int, line.split())) for line in fed_file.open()]
    return [k for k, f in enumerate(fed) if f & spoilt]


@pytest.mark.e2e  # trains a model
def test_a_poisoned_stretch_of_a_stream_is_not_fed_again(tmp_path, caplog) -> None:
    """examples/dataloader_loop.py --stream: an IterableDataset whose batches 120..129 (then
    120..159) have spoilt labels. 10: one rollback; no window fed twice, no poisoned batch after
    the rollback, the clean batches passed over counted in the rollback's line. 40: the stretch
    outlasts the first skip, and the stream gives its rest after the skip range: on the weights
    just restored, the same-step tier refuses each of those batches (their loss 1.7-1.9x) and
    the guard takes them for the data's, so one rollback, no LR cut, and no poisoned batch
    trained after it (it rolled back a second time, and trained the one at 1.74x that slipped
    under the tier's usual floor). The 10 end as well as the clean run; the 40 as well as a
    clean run of as many updates (a refused step is a step without one)."""
    args = ("--stream", "--steps", "300", "--db", "none", "--fed", "fed.txt")
    clean = run_example("dataloader_loop", tmp_path / "clean", *args)
    with caplog.at_level(logging.WARNING, logger="spikewatch"):
        hit = run_example("dataloader_loop", tmp_path / "hit", *args,
                          "--poison-at", "120", "--poison-len", "10")  # fmt: skip
    fed = [list(map(int, line.split())) for line in (tmp_path / "hit/fed.txt").open()]
    ids = [i for f in fed for i in f]
    assert len(ids) == len(set(ids))  # nothing fed twice
    (rollback,) = [i for i in hit["interventions"] if i["kind"] == "rollback"]
    at = _poisoned(tmp_path / "hit/fed.txt", 120, 10)
    assert at and max(at) < rollback["from_step"]  # fed before the detection only
    lo, hi = rollback["skip_ranges"][0]
    assert lo <= 120 and hi >= 130
    assert rollback["passed_over"] == lo - rollback["to_step"] > 0  # batch i was step i + 1's
    story = f"{rollback['passed_over']} clean batches since the restored step passed over"
    assert story in rollback["skipped"] and story in caplog.text
    assert hit["steps"] == clean["steps"] == 300
    assert hit["final_val_loss"] <= clean["final_val_loss"] + 0.01, (hit, clean)
    assert hit["val_losses"][-1]["step"] == 300  # the final evaluation, after the block

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="spikewatch"):
        long = run_example("dataloader_loop", tmp_path / "long", *args,
                           "--poison-at", "120", "--poison-len", "40")  # fmt: skip
    (rollback,) = [i for i in long["interventions"] if i["kind"] == "rollback"]
    assert long["steps"] == 300 and rollback["lr_scale_after"] == 1.0
    assert rollback["skip_ranges"]  # whole batches: the rest are not drawn yet
    k = long["interventions"].index(rollback)
    refused = [i for i in long["interventions"][k + 1 :] if i["kind"] == "skip_update"]
    after = [p for p in _poisoned(tmp_path / "long/fed.txt", 120, 40) if p >= rollback["from_step"]]
    assert after and len(refused) == len(after)  # each fed after the rollback: refused
    assert all("right after a rollback" in r["reason"] for r in refused)
    said = [m for r in caplog.records if "refused" in (m := r.getMessage()) and "right af" in m]
    first, last = refused[0]["step"], refused[-1]["step"]  # the first in full, then one line
    assert said == [
        f"step {first}: skip_update ({refused[0]['reason']})",
        f"steps {first + 1}-{last}: {len(refused) - 1} more updates refused right after the "
        "rollback, the bad stretch going on (each in the run's record)",
    ]
    # each refused step is a step of the run without an update (27 of 300 here): a clean run
    # of 273 steps ended at 2.5617 where this one ends at 2.5659 and the clean 300 at 2.5419
    assert long["final_val_loss"] <= clean["final_val_loss"] + 0.03, (long, clean)
    fed = [i for line in (tmp_path / "long/fed.txt").open() for i in line.split()]
    assert len(fed) == len(set(fed))


@pytest.mark.parametrize("new_loader_each_epoch", [False, True])
def test_the_loops_own_epoch_loop_calls_batches_each_epoch(tmp_path, new_loader_each_epoch) -> None:
    """`for epoch ...: for batch in watch.batches(loader)` (no max_steps: one pass a call): each
    call is the loader's next pass, in its own order for that epoch, the index going on (a
    second call used to fast-forward a new stream through the first pass and feed nothing)."""

    def loader_of() -> DataLoader:
        sampler = DistributedSampler(_windows(), num_replicas=1, rank=0, shuffle=True, seed=3)
        return DataLoader(_windows(), batch_size=4, sampler=sampler)

    model, opt = _model()
    loader = loader_of()
    fed: list[list[int]] = []
    with Watch(model, opt, run_dir=tmp_path, db="none") as watch:
        for _ in range(3):
            loader = loader_of() if new_loader_each_epoch else loader
            for x, y, ids in watch.batches(loader):
                fed.append(ids.tolist())
                watch.step(model(x, y))
    expected = []
    reference = loader_of()
    for epoch in range(3):
        reference.sampler.set_epoch(epoch)  # type: ignore[attr-defined]
        expected += [ids.tolist() for _, _, ids in reference]
    assert fed == expected and watch.step_count == 36 and watch.index == 35
