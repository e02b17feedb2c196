"""A quarantine's samples kept out of a run in any loop (issue 45, item 4;
trainer/core/blocklist.py): the Watch's `batches()` by (batch, row) and by id,
`spikewatch.without_blocked` for datasets a framework reads, and the two-run workflow: a run
names its poisoned rows, `spikewatch quarantine` writes them, the next run leaves them out and
meets no spike."""

from __future__ import annotations

import json

import pytest
import torch

from spikewatch import Watch, without_blocked
from spikewatch.trainer.cli import main as cli

from .conftest import POISON, STEPS, run_example

pytestmark = pytest.mark.e2e  # trains a model (tests/README.md)


def _write(path, lines: list[dict]) -> str:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return str(path)


def test_the_watch_leaves_out_listed_rows_by_batch_and_row_and_by_id(tmp_path) -> None:
    blocklist = _write(
        tmp_path / "bad.jsonl",
        [
            {"source": "rollback", "batch": 1, "row": 2, "id": None},
            {"source": "data-check", "id": "doc-3-5"},  # no batch: matched by its id
        ],
    )
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    watch = Watch(model, opt, run_dir=tmp_path / "r", db="none", max_steps=5, blocklist=blocklist)
    assert watch.cfg.blocklist == blocklist  # kept with the run's settings

    def batch_at(i: int) -> dict:
        return {"x": torch.full((8, 2), float(i)), "id": [f"doc-{i}-{r}" for r in range(8)]}

    seen = []
    for batch in watch.batches(batch_at):
        seen.append(batch["id"])
        loss = model(batch["x"]).sum()
        loss.backward()
        watch.step(loss)
    watch.close()
    assert "doc-1-2" not in seen[1] and "doc-3-5" not in seen[3]
    assert [len(ids) for ids in seen] == [8, 7, 8, 7, 8]


def test_without_blocked_filters_map_style_and_iterable_datasets(tmp_path) -> None:
    blocklist = _write(tmp_path / "bad.jsonl", [{"id": 3}, {"id": "7"}, {"id": None}])
    items = [{"id": i, "x": torch.tensor([float(i)])} for i in range(10)]
    kept = without_blocked(items, blocklist)
    assert len(kept) == 8 and [kept[i]["id"] for i in range(8)] == [0, 1, 2, 4, 5, 6, 8, 9]
    loader = torch.utils.data.DataLoader(kept, batch_size=4)  # batches keep their shape
    assert [len(b["id"]) for b in loader] == [4, 4]

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):  # noqa: ANN204
            return iter(items)

    assert [x["id"] for x in without_blocked(Stream(), blocklist)] == [0, 1, 2, 4, 5, 6, 8, 9]
    by_name = without_blocked(["a", "b", "c"], blocklist, id_of_item=lambda s: "abc".index(s) + 2)
    assert list(by_name) == ["a", "c"]  # "b" has id 3
    rows = _write(tmp_path / "rows.jsonl", [{"batch": 1, "row": 2, "id": None}])
    with pytest.raises(ValueError, match="or give position"):
        without_blocked(items, rows)
    by_place = without_blocked(items, rows, position=lambda batch, row: batch * 4 + row)
    assert [x["id"] for x in by_place] == [0, 1, 2, 3, 4, 5, 7, 8, 9]  # item 6: batch 1, row 2


def test_a_blocklist_that_names_nothing_is_refused(tmp_path) -> None:
    empty = _write(tmp_path / "empty.jsonl", [{"source": "rollback", "id": None}])
    with pytest.raises(ValueError, match="no sample in it has an id or a"):
        Watch(torch.nn.Linear(1, 1), torch.optim.SGD([torch.zeros(1)], lr=0), blocklist=empty)
    not_json = tmp_path / "bad.jsonl"
    not_json.write_text("{]\n")
    with pytest.raises(ValueError, match="bad.jsonl:1: not JSON"):
        without_blocked([1], str(not_json))


def test_the_second_run_leaves_the_quarantined_rows_out_and_meets_no_spike(tmp_path) -> None:
    db = f"sqlite:///{tmp_path / 'sw.db'}"
    rows = ("--poison-rows", "4")
    first = run_example("plain_loop", tmp_path / "first", *STEPS, *POISON, *rows, "--db", db)
    named = {(s["batch"], s["row"]) for i in first["interventions"] for s in i.get("samples", [])}
    assert named  # the first run named the poisoned rows it measured
    out = tmp_path / "bad.jsonl"
    assert cli(["quarantine", first["run_id"], "--db", db, "--out", str(out)]) == 0
    second = run_example(
        "plain_loop", tmp_path / "second", *STEPS, *POISON, *rows, "--db", db,
        "--blocklist", str(out),
    )  # fmt: skip

    def rollbacks(summary: dict) -> list[dict]:
        return [i for i in summary["interventions"] if i.get("to_step") is not None]

    assert rollbacks(first) and not rollbacks(second), second["interventions"]
    assert second["steps"] == first["steps"]
