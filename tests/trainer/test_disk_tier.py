"""The disk tier's save of a step still in flight (read late), on its own: the tensors are
copied at the save, the file is written only once the step is decided (`complete`), never for
a refused step (`drop`, the next step due instead) or an abandoned one (`drop_after`); pins
placed meanwhile are kept, or moved to the save before a dropped one."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from spikewatch.trainer.checkpoints import format as ck
from spikewatch.trainer.checkpoints.disk import Checkpointer
from spikewatch.trainer.checkpoints.staging import Stager, to_host
from spikewatch.trainer.config import CheckpointConfig


def _disk(tmp: Path) -> Checkpointer:
    cfg = CheckpointConfig(interval=10, async_save=True, fsync=False, keep_last=10)
    disk = Checkpointer(tmp / "checkpoints", cfg)
    disk.open()
    return disk


def _build(w: torch.Tensor, step: int) -> Any:
    def build(stage: Stager | None) -> ck.Snapshot:
        return ck.Snapshot(
            step=step,
            torch_files={"model.pt": to_host({"w": w}, stage)},
            json_files={"trainer.json": {"step": step}},  # the decided keys left out
            meta={"loss": None},
        )

    return build


def test_the_file_is_written_once_the_step_is_decided_with_its_decided_state(tmp_path) -> None:
    disk, w = _disk(tmp_path), torch.zeros(4)
    w.fill_(1.0)
    disk.save(10, _build(w, 10), awaiting=True)
    disk.before_mutation()  # the loop's next update waits for the copy, then changes w
    w.fill_(2.0)
    disk.wait()
    assert not disk.has(10) and disk.last_saved == 10  # copied, not written: undecided
    disk.pin(10, "onset anchor")  # a pin placed while the step is in flight
    disk.complete(10, {"lr_scale": 0.5}, {"loss": 3.25})
    disk.wait()
    got = ck.read_checkpoint(ck.step_dir(disk.root, 10))
    assert torch.equal(got["model.pt"]["w"], torch.ones(4))  # the step's tensors, not later
    assert got["trainer.json"] == {"step": 10, "lr_scale": 0.5}
    assert got["meta"]["loss"] == 3.25 and got["meta"]["pins"] == ["onset anchor"]
    assert not disk.due(11, 1.0)


def test_a_refused_step_is_never_written_and_the_next_step_is_due(tmp_path) -> None:
    disk, w = _disk(tmp_path), torch.ones(4)
    disk.save(10, _build(w, 10), awaiting=False)
    disk.wait()
    disk.save(20, _build(w, 20), awaiting=True)
    disk.pin(20, "onset anchor")
    disk.drop(20)
    disk.wait()
    assert sorted(ck.list_checkpoints(disk.root)) == [10]
    assert disk.last_saved == 10 and disk.due(21, 1.0)  # retaken a step later
    assert ck.read_meta(ck.step_dir(disk.root, 10))["pins"] == ["onset anchor"]  # moved back
    disk.save(21, _build(w, 21))
    disk.wait()
    assert not disk.due(22, 1.0) and sorted(ck.list_checkpoints(disk.root)) == [10, 21]


def test_a_rollback_abandons_an_undecided_save(tmp_path) -> None:
    disk, w = _disk(tmp_path), torch.ones(4)
    disk.save(10, _build(w, 10))
    disk.save(20, _build(w, 20), awaiting=True)
    assert disk.latest() is not None and disk.latest()[0] == 10  # no wait for a decision
    disk.drop_after(10)
    disk.complete(20, {}, {})  # too late: nothing is written
    disk.wait()
    assert sorted(ck.list_checkpoints(disk.root)) == [10] and disk.last_saved == 10
    assert not disk.due(11, 1.0)


EXIT_SCRIPT = """
import sys, torch
from spikewatch import Watch
model = torch.nn.Linear(4, 1)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
settings = {"checkpoint": {"interval": 7, "memory_interval": None},
            "probes": {"read": "next_step"}}
w = Watch(model, opt, run_dir=sys.argv[1], db="none", max_steps=100, settings=settings)
for i in range(7):
    w.begin_step()
    w.step(model(torch.ones(2, 4)).square().mean())
# no close: the interpreter's exit closes the run
"""


def test_a_run_closed_by_the_interpreters_exit_still_writes_its_last_checkpoint(tmp_path) -> None:
    """Step 7's file is taken while the step is in flight and written once it is decided,
    here by the exit handler that closes the run: after the checkpoint threads have shut down
    for the interpreter's exit (the job runs on the closing thread then)."""
    import subprocess
    import sys

    (tmp_path / "loop.py").write_text(EXIT_SCRIPT)
    done = subprocess.run([sys.executable, str(tmp_path / "loop.py"), str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0 and "failed" not in done.stderr, done.stderr[-2000:]
    assert sorted(ck.list_checkpoints(tmp_path / "run" / "checkpoints")) == [0, 7]


def _generation(step: int, generation: int) -> Any:
    build = _build(torch.ones(4), step)

    def with_generation(stage: Stager | None) -> ck.Snapshot:
        snap = build(stage)
        snap.meta["generation"] = generation
        return snap

    return with_generation


def test_a_rollbacks_abandoned_files_go_once_its_target_is_written_again(tmp_path) -> None:
    """A rollback to 10 saves 10 again as the next generation and drops 20 and 30 in the
    background: the loop does not wait for that write (a whole file: seconds at 1B); the
    writer deletes 20 and 30 only after it, so that at every moment on disk a resume finds
    the target (the newest generation) or the old files, never an abandoned step alone."""
    disk = _disk(tmp_path)
    for s in (10, 20, 30):
        disk.save(s, _build(torch.ones(4), s))
    disk.wait()
    disk.pin(20, "onset anchor")
    gate = threading.Event()
    seen: list[list[int]] = []  # what is on disk when the target's file is committed
    disk.before_commit = lambda: (
        gate.wait(10),
        seen.append(sorted(ck.list_checkpoints(disk.root))),
    )
    disk.save(10, _generation(10, 1))
    assert disk.drop_after(10, background=True) == []  # returned with the write held
    assert sorted(ck.list_checkpoints(disk.root)) == [10, 20, 30] and 20 not in disk.pins
    gate.set()
    disk.wait()
    assert seen == [[10, 20, 30]]  # the abandoned files were still there at the commit
    assert sorted(ck.list_checkpoints(disk.root)) == [10]
    assert ck.find_intact(disk.root) == (10, ck.step_dir(disk.root, 10))
    assert ck.read_meta(ck.step_dir(disk.root, 10))["generation"] == 1
    changes = [(s, status) for s, _, status in disk.take_changes()]
    assert changes[-3:] == [(10, "ok"), (20, "deleted"), (30, "deleted")]


def test_a_rollbacks_abandoned_files_stay_when_its_target_fails_to_be_written(tmp_path) -> None:
    """The target's new generation failed to be written: the abandoned files stay (deleting
    them would leave no file of the decided state and none after it), and the loop hears of
    the failure at its next wait."""
    disk = _disk(tmp_path)
    for s in (10, 20):
        disk.save(s, _build(torch.ones(4), s))
    disk.wait()

    def fail() -> None:
        raise OSError("disk full")

    disk.before_commit = fail
    disk.save(10, _generation(10, 1))
    disk.drop_after(10, background=True)
    with pytest.raises(RuntimeError, match="disk full"):
        disk.wait()
    assert sorted(ck.list_checkpoints(disk.root)) == [10, 20]


def test_the_disk_defers_to_host_memory_in_the_order_a_resume_would_choose(tmp_path) -> None:
    """`find_intact(above=)` keeps the newest-generation-first order: a file of the newest
    generation no newer than host memory's step comes first, so host memory wins and no file
    is checked; an older generation's newer step (a branch a rollback abandoned, left by a
    crash before its deletion) is not taken in its place."""
    disk = _disk(tmp_path)
    disk.save(20, _generation(20, 0))
    disk.save(10, _generation(10, 1))
    disk.wait()
    assert ck.find_intact(disk.root) == (10, ck.step_dir(disk.root, 10))  # the newest generation
    assert ck.find_intact(disk.root, above=15) is None  # host memory's 15 wins
    assert ck.find_intact(disk.root, above=5) == (10, ck.step_dir(disk.root, 10))
