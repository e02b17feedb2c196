"""Per-sample attribution at a rollback (trainer/core/attribution.py): the rule on rows whose
truth is known, the built-in trainer naming exactly the spoilt rows of a fault that spoils only
some, the samples in the store and the blocklist, and the run itself left untouched."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from spikewatch.observatory.store.db import upgrade
from spikewatch.observatory.store.queries import session_factory
from spikewatch.observatory.store.sink import DbSink
from spikewatch.trainer.builtin.loop import fit
from spikewatch.trainer.cli import main
from spikewatch.trainer.core.attribution import RowStat, name_rows
from spikewatch.trainer.core.recorder import Recorder

from .conftest import tiny_config

pytestmark = pytest.mark.e2e  # trains a model (tests/README.md)

FAULT = 'faults=[{kind="shifted_labels", start=150, length=10, rows=3}]'
RUN = ("train.max_steps=200", "checkpoint.interval=10", "eval.interval=none", FAULT)
RUN += ("guard.same_step.enabled=false",)  # the rows must reach the rollback tier
BAD = {(b, r) for b in range(150, 160) for r in range(3)}


def _rows(n_batches: int, bad: set[tuple[int, int]], level: float, spread: float, seed: int):
    rng = random.Random(seed)
    return [
        RowStat(b, r, (2.4 if (b, r) in bad else 1.0) * level * math.exp(rng.gauss(0, spread)))
        for b in range(n_batches)
        for r in range(16)
    ]


def test_the_rule_names_the_outlying_rows_and_nothing_in_clean_batches() -> None:
    bad = {(b, r) for b in range(10) for r in (0, 5)}
    named = name_rows(_rows(14, bad, 2.5, 0.04, 0))
    assert {(s["batch"], s["row"]) for s in named["samples"]} == bad
    assert named["attribution"]["clear"] and named["attribution"]["gap"] > 2
    for seed in range(20):  # clean batches, spread as a real run's rows: nothing stands out
        clean = name_rows(_rows(14, set(), 2.5, 0.05, seed))
        assert clean["samples"] == [] and not clean["attribution"]["clear"]
    whole = name_rows(_rows(4, {(b, r) for b in range(4) for r in range(12)}, 2.5, 0.04, 1))
    assert whole["samples"] == []  # most rows high: the whole batch, not a few of its rows
    nan = [*_rows(4, set(), 2.5, 0.04, 2), RowStat(9, 3, math.nan)]
    assert [(s["batch"], s["row"]) for s in name_rows(nan)["samples"]] == [(9, 3)]


def test_a_rollback_names_exactly_the_spoilt_rows_and_leaves_the_run_alone(tmp_path) -> None:
    whole = "guard.skip_samples=false"  # measured and named, not acted on: the run must not move
    on = fit(tiny_config(*RUN, whole), run_dir=tmp_path / "on")
    off = fit(tiny_config(*RUN, "guard.attribute_samples=false"), run_dir=tmp_path / "off")
    rollback = next(i for i in on.interventions if i["kind"] == "rollback")
    lo, hi = rollback["skip_ranges"][0]
    want = {(b, r) for b, r in BAD if lo <= b < hi}
    got = {(s["batch"], s["row"]) for s in rollback["samples"]}
    assert got == want and len(want) >= 20  # every spoilt row it skips, and no clean row
    assert all(s["id"].startswith("text:") and s["preview"] for s in rollback["samples"])
    assert rollback["attribution"]["rows"] == (hi - lo) * 8  # every row of every skipped batch
    assert "samples" not in next(i for i in off.interventions if i["kind"] == "rollback")
    assert on.train_losses == off.train_losses  # weights, gradients and RNG left as they were


def test_the_named_samples_reach_the_store_and_the_blocklist(tmp_path, capsys) -> None:
    url = f"sqlite:///{tmp_path / 'x.db'}"
    upgrade(url)
    sink = DbSink(url, spool_dir=tmp_path / "spool", linger_s=0.01)
    result = fit(tiny_config(*RUN), run_dir=tmp_path / "run", callbacks=[Recorder(sink)])
    sink.close(timeout=30)
    rollback = next(i for i in result.interventions if i["kind"] == "rollback")
    assert main(["quarantine", result.run_id, "--db", url]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(x["batch"], x["row"], x["id"]) for x in lines] == [
        (s["batch"], s["row"], s["id"]) for s in rollback["samples"]
    ]
    assert {x["source"] for x in lines} == {"rollback"} and lines[0]["step"] == rollback["step"]
    with session_factory(url)() as session:  # the API's query, as the run page shows them
        from spikewatch.observatory import store

        assert len(store.samples(session, run_id=result.run_id)) == len(lines)


def test_a_rollback_skips_the_named_rows_alone_and_refills_them(tmp_path) -> None:
    from spikewatch.trainer.builtin.loop import build_trainer

    tr = build_trainer(tiny_config(*RUN), run_dir=tmp_path / "run")
    result = tr.fit()
    rollback = next(i for i in result.interventions if i["kind"] == "rollback")
    assert rollback["skip_ranges"] == [] and rollback["skipped_samples"] == 30
    assert tr.core.run.data.blocked == {(s["batch"], s["row"]) for s in rollback["samples"]}
    fault, plan = tr._batch(152, 200)  # batch 152 again: its 3 spoilt rows replaced
    raw, _ = tr.sampler.batch(152, 200)
    assert torch.equal(fault.x[3:], raw[3:]) and not torch.equal(fault.x[:3], raw[:3])
    spares = tr.sampler.spares(152, 200)[2]
    assert plan[:3] == spares[:3] and plan[3:] == tr.sampler.plan(152, 200)[3:]
    whole = fit(tiny_config(*RUN, "guard.skip_samples=false"), run_dir=tmp_path / "whole")
    assert next(i for i in whole.interventions if i["kind"] == "rollback")["skip_ranges"]
    assert result.final_val_loss < whole.final_val_loss + 0.01  # no worse than skipping batches


def test_the_left_out_rows_survive_a_resume(tmp_path) -> None:
    from spikewatch.trainer.builtin.loop import build_trainer

    straight = fit(tiny_config(*RUN), run_dir=tmp_path / "straight")
    fit(tiny_config(*RUN, "train.stop_after=170"), run_dir=tmp_path / "split")
    again = build_trainer(tiny_config(*RUN), run_dir=tmp_path / "split", resume=True)
    assert len(again.core.run.data.blocked) == 30
    assert again.fit().train_losses == straight.train_losses[170:]


def test_a_new_run_given_the_blocklist_never_draws_those_windows(tmp_path, capsys) -> None:
    url = f"sqlite:///{tmp_path / 'x.db'}"
    upgrade(url)
    sink = DbSink(url, spool_dir=tmp_path / "spool", linger_s=0.01)
    first = fit(tiny_config(*RUN), run_dir=tmp_path / "first", callbacks=[Recorder(sink)])
    sink.close(timeout=30)
    blocklist = tmp_path / "blocklist.jsonl"
    assert main(["quarantine", first.run_id, "--db", url, "--out", str(blocklist)]) == 0
    from spikewatch.trainer.builtin.loop import build_trainer

    cfg = tiny_config(*RUN, f"data.blocklist={blocklist}", "data.seq_len=32")
    sampler = build_trainer(cfg, run_dir=tmp_path / "second").sampler
    named = {
        (s["id"].split(":")[0], int(s["id"].split(":")[1]))
        for s in first.interventions[-1]["samples"]
    }  # noqa: E501
    T = 32
    for index in range(140, 170):  # the named windows sit here in the first run's order
        for name, start in sampler.plan(index, 150):
            assert all(not (b < start + T + 1 and start < b + T + 1) for n, b in named if n == name)
    same = {
        (name, start)
        for index in range(140, 170)
        for name, start in build_trainer(
            tiny_config(*RUN), run_dir=tmp_path / "third"
        ).sampler.plan(index, 150)
    }
    assert named <= same  # without the blocklist those windows are drawn again


def test_each_rank_takes_its_consecutive_share_of_a_global_batch() -> None:
    """Under torchrun the Watch and Lightning's cb.dataset hand rank k rows [k * n, (k + 1) * n)
    of the global batch (tensors, tuples and dicts alike, ids too), so the ranks' rows differ
    and together are the batch; a batch that does not divide is refused, saying what to do."""
    import pytest
    import torch

    from spikewatch.trainer.core.attribution import rank_share

    x = torch.arange(12).reshape(6, 2)
    batch = {"x": x, "id": [f"d{i}" for i in range(6)]}
    shares = [rank_share(batch, k, 3) for k in range(3)]
    assert [row0 for _, row0 in shares] == [0, 2, 4]
    assert torch.equal(torch.cat([s["x"] for s, _ in shares]), x)
    assert [i for s, _ in shares for i in s["id"]] == batch["id"]
    assert rank_share((x, x), 0, 1)[0][0] is x  # one process: the batch itself
    with pytest.raises(ValueError, match="6 rows does not divide among 4 ranks.*shard=False"):
        rank_share(batch, 0, 4)


def test_the_shrunk_batch_line_speaks_of_compiling_only_for_a_compiled_model(caplog) -> None:
    """'a compiled model compiles once more' was said for models never compiled."""
    import logging
    from types import SimpleNamespace

    import torch

    from spikewatch.trainer.core.attribution import leave_out

    batch = (torch.zeros(4, 3), torch.zeros(4, 3))
    plain = SimpleNamespace(model=torch.nn.Linear(3, 3))
    compiled = SimpleNamespace(model=torch.compile(torch.nn.Linear(3, 3)))
    with caplog.at_level(logging.WARNING):
        leave_out(batch, [0, 2], 7, plain)
        leave_out(batch, [0, 2], 8, compiled)
    lines = [r.getMessage() for r in caplog.records if "trains on" in r.getMessage()]
    assert len(lines) == 2
    assert "compile" not in lines[0] and "batch 7 trains on 2 of its 4 rows" in lines[0]
    assert "the compiled model compiles once more" in lines[1]


def test_a_batch_as_transformers_gives_it_is_taken_row_by_row_in_its_own_type() -> None:
    """A tokenizer's or a collator's `BatchEncoding` is a `UserDict`, not a dict: accelerate's
    own checkpointing loop feeds one (benchmarks/accelerate_public.py), and a rollback's row
    attribution stopped with "cannot attribute a batch that holds no tensor". Every rule that
    reads a dict batch takes any mapping, and one rebuilt keeps its type (`.to`, `**`)."""
    from transformers import BatchEncoding

    from spikewatch.trainer.core.attribution import (
        id_of,
        moved,
        row_of,
        rows_in,
        select_rows,
        tokens_in,
        tokens_of,
    )

    ids = torch.arange(12).reshape(3, 4)
    batch = BatchEncoding({"input_ids": ids, "labels": torch.tensor([0, 1, 0]), "id": [7, 8, 9]})
    assert rows_in(batch) == 3 and tokens_in(batch) == 12
    assert tokens_of(batch, 1) == [4, 5, 6, 7] and id_of(batch, 2) == "9"
    one = row_of(batch, 1)
    assert isinstance(one, BatchEncoding) and torch.equal(one["input_ids"], ids[1:2])
    two = select_rows(batch, [0, 2])
    assert isinstance(two, BatchEncoding) and two["id"] == [7, 9]
    assert torch.equal(two["labels"], torch.tensor([0, 0]))
    assert isinstance(moved(batch, "cpu"), BatchEncoding)
