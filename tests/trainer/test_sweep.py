"""`spikewatch sweep` end to end: a tiny grid into SQLite, resumed, reported."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from spikewatch.observatory import store
from spikewatch.observatory.reports.sweeps import sweep_report
from spikewatch.trainer.builtin.sweep import parse_floats, run_sweep
from spikewatch.trainer.cli import main
from spikewatch.trainer.config import ConfigError

pytestmark = pytest.mark.e2e  # trains a model (tests/README.md)

TINY = ["train.max_steps=20", "schedule.warmup_steps=5", "eval.interval=10", "eval.batches=2"]
GRID = dict(variants=["baseline", "qk_norm"], lrs=[1e-2, 1e-1], overrides=TINY)


@pytest.fixture(scope="module")
def swept(tmp_path_factory) -> tuple[Path, str, str]:
    root = tmp_path_factory.mktemp("sweep")
    db = f"sqlite:///{root / 'sw.db'}"
    result = run_sweep("tiny_cpu", root=root, db_url=db, hypothesis="QK-norm helps", **GRID)
    assert result.failed == [] and set(result.cells.values()) == {"ok"}
    return root, db, result.group


def test_every_cell_is_a_tagged_run_of_the_group(swept) -> None:
    root, db, group = swept
    with store.session_factory(db)() as s:
        runs = store.list_runs(s, sweep_group=group)
    assert len(runs) == 4 and {r.status for r in runs} == {"completed"}
    cells = {(t[0], t[1]) for t in (sorted(r.tags) for r in runs)}
    assert ("lr=0.01", "seed=0") in cells
    by_tag = {next(t for t in r.tags if t.startswith("variant=")): r for r in runs}
    assert set(by_tag) == {"variant=baseline", "variant=qk_norm"}
    qk = [r for r in runs if "variant=qk_norm" in r.tags]
    assert all(r.config["model"]["qk_norm"] is True for r in qk)
    assert {r.config["optim"]["lr"] for r in runs} == {1e-2, 1e-1}
    assert all(r.config["train"]["max_steps"] == 20 for r in runs)


def test_the_report_equals_the_store_and_the_run_summaries(swept) -> None:
    root, db, group = swept
    with store.session_factory(db)() as s:
        report = sweep_report(s, group)
        assert report.hypothesis == "QK-norm helps"
        for c in report.cells:
            summary = json.loads(
                (root / group / f"{group}-{c.variant}-lr{c.lr:g}-s0" / "summary.json").read_text()
            )
            assert c.run_id == summary["run_id"]
            assert c.final_val == pytest.approx(summary["final_val_loss"], rel=1e-6)
            assert c.final_train == pytest.approx(summary["final_train_loss"], rel=1e-6)
            heads = store.layer_matrix(s, run_id=c.run_id, metric="layer/*/attn_max", buckets=1)
            assert c.peak_attn == max(v for row in heads.max_value for v in row if v is not None)
    for v in report.variants:
        assert v.done == v.total == 2
        assert v.lr_sensitivity == pytest.approx(sum(v.val_by_lr) / 2 - min(v.val_by_lr))
        assert math.log(256) - 0.3 < v.init_loss < math.log(256) + 0.3  # bytes, at init


def test_sweep_report_cli_prints_the_tables(swept, capsys) -> None:
    root, db, group = swept
    assert main(["sweep-report", group, "--db", db, "--markdown"]) == 0
    out = capsys.readouterr().out
    assert f"# Sweep {group}" in out and "| variant | lr 0.01 | lr 0.1 |" in out
    assert "QK-norm helps" in out and "| qk_norm |" in out
    assert main(["sweep-report", group, "--db", db, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [v["variant"] for v in data["variants"]] == ["baseline", "qk_norm"]
    assert main(["sweep-report", "no-such-group", "--db", db]) == 2
    assert "| variant | lr | runs | steps | loss spikes | gradient spikes | non-finite steps" in out
    for v in ("baseline", "qk_norm"):
        for lr in ("0.01", "0.1"):
            assert f"| {v} | {lr} | 1 | 20 |" in out


def test_two_groups_in_one_store_keep_their_own_runs(swept, tmp_path) -> None:
    """Cells of different groups share names (baseline-lr0.01-s0); their run ids must not, or
    the second group's run would be written into the first one's (and its points dropped)."""
    root, db, group = swept
    other = run_sweep(
        "tiny_cpu", root=root, db_url=db, group="other", variants=["baseline"], lrs=[1e-2],
        overrides=[*TINY, "train.max_steps=12"],
    )  # fmt: skip
    assert other.cells == {"baseline-lr0.01-s0": "ok"}
    with store.session_factory(db)() as s:
        mine = sweep_report(s, group).cells
        theirs = sweep_report(s, "other").cells
        assert len(theirs) == 1 and theirs[0].run_id not in {c.run_id for c in mine}
        assert theirs[0].last_step == 12 and theirs[0].census.steps == 12
        assert {c.last_step for c in mine} == {20}
        losses = store.series(s, run_id=theirs[0].run_id, metric="train/loss", buckets=100)
        assert sum(b.n for b in losses[0].buckets) == 12  # its own 12 steps, nothing merged


def test_resuming_runs_only_the_unfinished_cells(swept) -> None:
    root, db, group = swept
    again = run_sweep("tiny_cpu", root=root, db_url=db, **GRID)
    assert again.group == group and set(again.cells.values()) == {"done"}
    lost = root / group / f"{group}-qk_norm-lr0.1-s0" / "summary.json"
    lost.unlink()  # as if that cell had been killed before it finished
    third = run_sweep("tiny_cpu", root=root, db_url=db, **GRID)
    assert third.cells == {
        "baseline-lr0.01-s0": "done",
        "baseline-lr0.1-s0": "done",
        "qk_norm-lr0.01-s0": "done",
        "qk_norm-lr0.1-s0": "ok",
    }
    with store.session_factory(db)() as s:
        report = sweep_report(s, group)
    assert len(report.cells) == 4  # the retry stands for its cell
    with pytest.raises(ValueError, match="another grid"):
        run_sweep("tiny_cpu", root=root, db_url=db, group=group, **{**GRID, "lrs": [1e-3]})


def test_bad_arguments_are_refused_before_anything_runs(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown variant"):
        run_sweep("tiny_cpu", variants=["qknorm"], lrs=[1e-2], root=tmp_path)
    with pytest.raises(ConfigError, match="--lr"):
        parse_floats("1e-2,abc", "--lr")
    with pytest.raises(ConfigError, match="positive"):
        parse_floats("0,1e-2", "--lr")
    with pytest.raises(ConfigError, match="unknown key 'optim.lrr'"):
        run_sweep(
            "tiny_cpu", variants=["baseline"], lrs=[1e-2], overrides=["optim.lrr=1"], root=tmp_path
        )
    assert not any(tmp_path.iterdir())


def test_the_same_grid_into_a_new_store_runs_again(tmp_path) -> None:
    """The group name is derived from the grid, so a new database meets the old run
    directories: they are set aside (kept) and every cell runs into the new store."""
    db = f"sqlite:///{tmp_path / 'new.db'}"
    small = dict(variants=["baseline"], lrs=[1e-2], overrides=TINY)
    first = run_sweep(
        "tiny_cpu", root=tmp_path / "r", db_url=f"sqlite:///{tmp_path / 'a.db'}", **small
    )
    again = run_sweep("tiny_cpu", root=tmp_path / "r", db_url=db, **small)
    assert again.group == first.group and again.cells == {"baseline-lr0.01-s0": "ok"}
    aside = f"{first.group}-baseline-lr0.01-s0.other-store-1"
    assert (tmp_path / "r" / first.group / aside).is_dir()
    with store.session_factory(db)() as s:
        report = sweep_report(s, again.group)
    assert [c.final_val is not None for c in report.cells] == [True]


def test_a_cell_run_before_run_ids_carried_the_group_keeps_its_directory(tmp_path) -> None:
    """Sweeps run before the group was in the run id resume in their old directories."""
    from spikewatch.trainer.builtin.sweep import CellSpec, _Runner

    runner = _Runner("cfg.toml", [], tmp_path / "g", "g", "sqlite://", 1)
    cell = CellSpec("baseline", 0.01, 0)
    assert runner._run_dir(cell, set()) == tmp_path / "g" / "g-baseline-lr0.01-s0"
    (tmp_path / "g" / "baseline-lr0.01-s0").mkdir(parents=True)
    assert runner._run_dir(cell, {"baseline-lr0.01-s0"}) == tmp_path / "g" / "baseline-lr0.01-s0"
    assert runner._run_dir(cell, set()) == tmp_path / "g" / "g-baseline-lr0.01-s0"  # not ours
