"""A crash in the middle of a rollback (after the decision, around the rewrite of the target
checkpoint and the deletion of the abandoned steps) resumes from the target with what the
rollback decided: its skip range, its record, the policy's memory. Then the run ends exactly
as an uninterrupted one."""

from __future__ import annotations

import pytest
import torch

from spikewatch.trainer.builtin.loop import build_trainer
from spikewatch.trainer.checkpoints import format as ck
from spikewatch.trainer.checkpoints.disk import Checkpointer
from spikewatch.trainer.config import load_config

pytestmark = pytest.mark.e2e  # trains a model (tests/README.md)

BASE = [  # the rollback tier alone: the kinds of the interventions are the rollback's
    "guard.same_step.enabled=false",
    "train.progress=false",
    "checkpoint.interval=10",
    "train.max_steps=200",
    "eval.interval=none",
    "eval.batches=2",
    "guard.classify_cause=false",
    'faults=[{kind="shifted_labels", start=150, length=10}]',
]


class Crash(BaseException):
    """The process dies here (BaseException: nothing on the way catches it)."""


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tr = build_trainer(load_config("tiny_cpu", BASE), run_dir=tmp_path_factory.mktemp("ref"))
    result = tr.fit()
    (rollback,) = [i for i in result.interventions if i["kind"] == "rollback"]
    return tr.model.state_dict(), rollback


def _crash_in_rollback(monkeypatch, run_dir, where: str) -> None:
    """Train until the rollback, dying at `where`: 'drop' (the target rewritten, the abandoned
    steps still on disk) or 'save' (before the target is rewritten)."""
    real = getattr(Checkpointer, "drop_after" if where == "drop" else "save")

    def dying(self, step, *args, **kwargs):
        newer = [s for s in ck.list_checkpoints(self.root) if s > step]
        if newer:  # only a rollback saves or drops below the newest step
            raise Crash(f"killed in {where}")
        return real(self, step, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(Checkpointer, "drop_after" if where == "drop" else "save", dying)
        with pytest.raises(Crash):
            build_trainer(load_config("tiny_cpu", BASE), run_dir=run_dir).fit()


def _same(a: dict, b: dict) -> None:
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_killed_after_the_target_was_rewritten(reference, tmp_path, monkeypatch) -> None:
    weights, rollback = reference
    _crash_in_rollback(monkeypatch, tmp_path, "drop")
    tr = build_trainer(load_config("tiny_cpu", BASE), run_dir=tmp_path, resume=True)
    assert tr.step_count == rollback["to_step"]  # not the newest step: that branch was abandoned
    assert [list(r) for r in tr.core.run.data.skip_ranges] == rollback["skip_ranges"]
    assert [i.kind for i in tr.core.run.interventions] == ["rollback"]
    result = tr.fit()
    assert [i["kind"] for i in result.interventions] == ["rollback"]  # not a second time
    _same(tr.model.state_dict(), weights)


def test_killed_before_the_target_was_rewritten(reference, tmp_path, monkeypatch) -> None:
    """Nothing of the rollback reached the disk: the run resumes before it and, deterministic,
    meets the same spike and takes the same rollback."""
    weights, rollback = reference
    _crash_in_rollback(monkeypatch, tmp_path, "save")
    tr = build_trainer(load_config("tiny_cpu", BASE), run_dir=tmp_path, resume=True)
    assert tr.step_count > rollback["to_step"] and not tr.core.run.interventions
    result = tr.fit()
    assert [(i["kind"], i["to_step"]) for i in result.interventions] == [
        ("rollback", rollback["to_step"])
    ]
    _same(tr.model.state_dict(), weights)
