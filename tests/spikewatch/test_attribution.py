"""Per-sample attribution in the user's own loop (`Watch.batches(batch_at, loss_fn)`): the plain-
loop example with only the first rows of each poisoned batch spoilt names exactly those rows,
with their text, in its summary and in the store's blocklist; and in a Hugging Face or
Lightning run, the rows the framework fed."""

from __future__ import annotations

import json

import pytest

from spikewatch.trainer.cli import main

from .conftest import STEPS, run_example, the_rollback

pytestmark = pytest.mark.e2e  # trains a model (tests/README.md)


def test_the_watch_names_the_poisoned_rows_and_no_clean_one(tmp_path, capsys) -> None:
    db = f"sqlite:///{tmp_path / 'x.db'}"
    poison = ("--poison-at", "100", "--poison-len", "14", "--poison-rows", "3")
    summary = run_example("plain_loop", tmp_path, *STEPS, *poison, "--db", db)
    rollback = the_rollback(summary)
    lo, hi = (rollback.get("batches_kept") or rollback["skip_ranges"])[0]
    spoilt = {(b, r) for b in range(max(lo, 100), min(hi, 114)) for r in range(3)}
    named = {(s["batch"], s["row"]) for s in rollback["samples"]}
    assert named == spoilt and len(spoilt) >= 30
    assert rollback["skip_ranges"] == [] and rollback["skipped_samples"] == len(named)
    assert all(s["preview"] and s["loss"] > rollback["attribution"]["median_loss"] for s in
               rollback["samples"])  # fmt: skip
    capsys.readouterr()
    assert main(["quarantine", summary["run_id"], "--db", db]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert {(x["batch"], x["row"]) for x in lines if x["step"] == rollback["step"]} == spoilt
    # one story of what was skipped (issue 45): the record, its reason, the summary, the logbook
    story = f"skipping {len(named)} named samples of batches [{lo}, {hi}) (the other rows train)"
    passed = rollback["passed_over"]  # the loop's data flowed on: counted, not fed again
    assert passed == lo - rollback["to_step"] > 0  # batches [to_step, lo) were clean
    story += f"; {passed} clean batches since the restored step passed over"
    assert rollback["skipped"] == story and rollback["reason"].endswith(", " + story)
    assert sorted(map(tuple, rollback["skipped_rows"])) == sorted(named)
    assert summary["skipped_batches"] == [] and summary["skipped_samples"] == sorted(
        [b, r] for b, r in named
    )
    assert main(["logbook", summary["run_id"], "--db", db]) == 0
    book = capsys.readouterr().out
    assert f"to the checkpoint of step {rollback['to_step']}, {story}, LR x" in book
    # the tokens trained: every step's 8 rows of 64, less the named rows left out of the batches
    # trained after the rollback (the loop's data flows on from the batch it had reached)
    left_out = sum(1 for b, _ in named if b >= rollback["resumed_at_batch"])
    assert left_out and summary["tokens"] == (summary["steps"] * 8 - left_out) * 64


@pytest.mark.parametrize(  # Lightning (35 s) in the slow tier
    "example", ["hf_trainer", pytest.param("lightning_module", marks=pytest.mark.slow)]
)
def test_a_framework_callback_names_the_rows_it_fed(example: str, tmp_path) -> None:
    """A framework's batches are not the callback's to draw again, but it keeps the ones it fed
    (two micro-batches a step in the HF run): the rollback names their spoilt rows and no clean
    one, and skips whole batches (the framework's data flows on)."""
    pytest.importorskip("transformers", reason="the hf extra is not installed")
    if example == "lightning_module":
        pytest.importorskip("lightning", reason="the lightning extra is not installed")
    poison = ("--poison-at", "100", "--poison-len", "14", "--poison-rows", "4")
    # the small Lightning run warns early and rolls back to step 25, where a clean row and a
    # shifted one are alike to the model: its default size rolls back to 75, as the HF run does
    accum = ("--grad-accum", "2") if example == "hf_trainer" else ("--d-model", "128")
    accum += () if example == "hf_trainer" else ("--seq-len", "128", "--batch-size", "16")
    summary = run_example(example, tmp_path, *STEPS, *poison, *accum, "--db", "none",
                          "--output-dir", "out")  # fmt: skip
    rollback = the_rollback(summary)
    named = {(s["batch"], s["row"]) for s in rollback["samples"]}
    fed = {b for b, _ in named}  # the batches trained before the rollback: onset to detection
    assert fed and min(fed) == 100 and max(fed) < rollback["from_step"]  # (read late: step + 1)
    assert named == {(b, r) for b in fed for r in range(4)}
    assert rollback["skip_ranges"] and "skipped_samples" not in rollback
    assert all(s["rank"] == 0 and s["grad_norm"] > 0 for s in rollback["samples"])
    # the tokens trained, counted in every client (issue 45: the summary's count was 0 here):
    # every step made, and the ones the rollback abandoned, of 16 rows of 128 / 8 rows of 64
    rows, seq = (8, 64) if example == "hf_trainer" else (16, 128)
    made = summary["tokens"] // (rows * seq)
    assert summary["tokens"] == made * rows * seq and made >= summary["steps"], summary["tokens"]
    if example == "hf_trainer":  # the rows' own ids, kept by the collator, reach the record
        from spikewatch.corpus import text_corpus, window_starts

        size = len(text_corpus()[0])
        for s in rollback["samples"]:
            assert s["id"] == f"text:{window_starts(size, s['batch'], 8, 64, 0)[s['row']]}", s
    assert summary["steps"] == summary.get("framework_step", 150) == 150


def test_a_batch_with_samples_left_out_is_marked_dynamic_once_said(tmp_path, caplog) -> None:
    """Issue 45, item 6: the Watch leaves the named rows out of their batches (the loop's data
    is its own: nothing refills them), so the batch shrinks. Its batch dimension is marked
    dynamic, so that a compiled model compiles once more for the smaller batch and not once
    per size (with automatic dynamic shapes off too), and the Watch says why, once."""
    import logging

    import torch

    from spikewatch import Watch

    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    watch = Watch(model, opt, run_dir=tmp_path / "run", db="none", max_steps=6)
    core = watch.open()
    core.run.data.block([(2, 0), (2, 5), (4, 1)])  # batch 2 loses 2 rows, batch 4 one
    graphs = []

    def backend(gm, example_inputs):  # noqa: ANN001, ANN202
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    fn = torch.compile(lambda x: (x * 2).sum(), backend=backend)
    sizes = []
    with (
        caplog.at_level(logging.WARNING),
        torch._dynamo.config.patch(automatic_dynamic_shapes=False),
    ):
        for (x,) in watch.batches(lambda i: (torch.full((16, 4), float(i)),)):
            sizes.append(x.size(0))
            loss = fn(x) * model.weight.sum()
            loss.backward()
            watch.step(loss)
    watch.close()
    assert sizes == [16, 16, 14, 16, 15, 16]
    assert len(graphs) == 2  # 16, then one dynamic graph for 14 and 15
    said = [r for r in caplog.records if "rows (the named samples are left out" in r.message]
    assert len(said) == 1 and "batch 2 trains on 14 of its 16 rows" in said[0].message
