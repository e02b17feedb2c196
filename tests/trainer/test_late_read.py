"""Read late (issue 47, `probes.read = "next_step"`, the GPU default): a step's values are read
at the next step's end, while the device computes that step, so the host waits only on copies
enqueued a step earlier; checkpoints and the run's end wait for their own step. On a CPU the
copies are host memory already, so the order is what is tested: which step's transfer each host
read takes, against the step being computed. The outcomes are those of the read at the step's
end, the rollback one step later."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from spikewatch import AdamW, Watch
from spikewatch.corpus import shift_labels, text_corpus, windows
from spikewatch.observatory import metric_names as M
from spikewatch.trainer.builtin.loop import build_trainer
from spikewatch.trainer.checkpoints import format as ck
from spikewatch.trainer.checkpoints.tiers import Tiers
from spikewatch.trainer.config import FaultConfig, load_config
from spikewatch.trainer.core import step_core, transfer
from spikewatch.trainer.core.callbacks import Callback, StepState
from spikewatch.trainer.core.probes import Probes

from ..spikewatch.conftest import example
from .conftest import tiny_config

pytestmark = pytest.mark.e2e  # trains a model (tests/README.md)


class Trace:
    """Each host read of a step's transfer: (the step being computed, the step whose transfer
    it is, read inside a drain); the steps checkpointed."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.reads: list[tuple[int, int, bool]] = []
        self.saved: list[int] = []
        self.rolled_back: list[int] = []  # the steps at whose end a rollback happened
        self.gates = 0
        now = {"step": 0, "draining": False}
        gate, start, fetch = (
            step_core.StepCore.gate,
            transfer.HostTransfer.start,
            transfer.HostTransfer.fetch,
        )
        drain, save = step_core.StepCore.read_in_flight, Tiers.save
        rollback = step_core.StepCore.rollback

        def traced_gate(core, *a: Any, **k: Any):  # noqa: ANN001, ANN202
            now["step"] = core.step_count + 1
            self.gates += 1
            return gate(core, *a, **k)

        def traced_start(xfer) -> None:  # noqa: ANN001
            xfer.born = now["step"]
            start(xfer)

        def traced_fetch(xfer):  # noqa: ANN001, ANN202
            if M.LOSS in xfer.names:  # a step's transfer (not the update statistics' copy)
                self.reads.append((now["step"], xfer.born, now["draining"]))
            return fetch(xfer)

        def traced_drain(core):  # noqa: ANN001, ANN202
            now["draining"] = True
            try:
                return drain(core)
            finally:
                now["draining"] = False

        def traced_rollback(core, action):  # noqa: ANN001, ANN202
            self.rolled_back.append(core.step_count)
            return rollback(core, action)

        def traced_save(tiers, step, *a: Any, **k: Any):  # noqa: ANN001, ANN202
            self.saved.append(step)
            return save(tiers, step, *a, **k)

        monkeypatch.setattr(step_core.StepCore, "gate", traced_gate)
        monkeypatch.setattr(transfer.HostTransfer, "start", traced_start)
        monkeypatch.setattr(transfer.HostTransfer, "fetch", traced_fetch)
        monkeypatch.setattr(step_core.StepCore, "read_in_flight", traced_drain)
        monkeypatch.setattr(Tiers, "save", traced_save)
        monkeypatch.setattr(step_core.StepCore, "rollback", traced_rollback)

    def check_late(self, last: int) -> None:
        """Every step read once; outside a drain, only transfers of an earlier step, but for
        the step in flight when a rollback discards it; drains only where a checkpoint is
        taken, or at the end."""
        assert len(self.reads) == self.gates
        outside = [(now, born) for now, born, drained in self.reads if not drained]
        own = [(now, born) for now, born in outside if born > now - 1]
        assert len(outside) > 100 and [now for now, _ in own] == self.rolled_back
        assert all(born == now for now, born in own)
        drained = {now for now, born, d in self.reads if d}
        assert drained <= set(self.saved) | {last}, drained - set(self.saved)


def _builtin(tmp: Path, read: str, monkeypatch: pytest.MonkeyPatch) -> tuple[Trace, Any]:
    cfg = load_config(
        "tiny_cpu", [f"probes.read={read}", "train.max_steps=160", "checkpoint.memory_interval=10"]
    )
    cfg.faults = [FaultConfig(kind="shifted_labels", start=100, length=10)]
    trace = Trace(monkeypatch)
    tr = build_trainer(cfg, run_dir=tmp / read)
    tr.fit()
    monkeypatch.undo()
    return trace, tr


def _rollbacks(summary: dict) -> list[tuple]:
    return [
        (i["onset_step"], i["to_step"], i["from_step"], i["skipped"])
        for i in summary["interventions"]
        if i.get("to_step") is not None
    ]


def test_the_builtin_trainer_reads_a_step_late_and_ends_where_the_same_step_read_does(
    tmp_path, monkeypatch
) -> None:
    late, tr_late = _builtin(tmp_path, "next_step", monkeypatch)
    now, tr_now = _builtin(tmp_path, "same_step", monkeypatch)
    assert tr_late.core.reads_late and not tr_now.core.reads_late
    late.check_late(160)
    assert all(born == step for step, born, _ in now.reads)  # the contrast: its own step
    a, b = _rollbacks(tr_late.core.summary()), _rollbacks(tr_now.core.summary())
    assert b and [r[:2] + r[3:] for r in a] == [r[:2] + r[3:] for r in b]  # onset, target, skips
    assert [r[2] for r in a] == [r[2] + 1 for r in b]  # rolled back one step later
    for p, q in zip(tr_late.model.parameters(), tr_now.model.parameters(), strict=True):
        assert torch.equal(p, q)  # the discarded step is discarded: the same weights


def _watched(tmp: Path, read: str, monkeypatch: pytest.MonkeyPatch, fused: bool) -> tuple:
    """The plain-loop example's GPT in a loop of our own, 8 batches poisoned."""
    ex = example("plain_loop")
    torch.manual_seed(0)
    model = ex.GPT(32, 2, 4, 32)
    if fused:  # torch's fused kernel, refused through its found_inf flag
        opt: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)
    else:  # spikewatch's, with its host step counts
        opt = AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95))
    trace = Trace(monkeypatch)
    settings = {"probes": {"read": read}, "checkpoint": {"memory_interval": 10}}
    watch = Watch(model, opt, run_dir=tmp / f"{read}{fused}", db="none", max_steps=150,
                  settings=settings)  # fmt: skip
    model.use_recorder(watch.attn)
    train, _ = text_corpus()

    def batch_at(i: int):
        x, y = windows(train, i, 8, 32)
        return x, shift_labels(y) if 100 <= i < 108 else y

    with watch:
        for x, y in watch.batches(batch_at):
            loss = model(x, y)
            loss.backward()
            watch.step(loss)
    monkeypatch.undo()
    return trace, watch, model


@pytest.mark.parametrize("fused", [True, False])
def test_a_watched_loop_reads_a_step_late_and_ends_where_the_same_step_read_does(
    tmp_path, monkeypatch, fused
) -> None:
    late, w_late, m_late = _watched(tmp_path, "next_step", monkeypatch, fused)
    now, w_now, m_now = _watched(tmp_path, "same_step", monkeypatch, fused)
    assert w_late.core.reads_late and not w_now.core.reads_late
    late.check_late(150)
    assert all(born == step for step, born, _ in now.reads)
    a, b = _rollbacks(w_late.core.summary()), _rollbacks(w_now.core.summary())
    assert b and [r[:2] + r[3:] for r in a] == [r[:2] + r[3:] for r in b]
    assert [r[2] for r in a] == [r[2] + 1 for r in b]
    for p, q in zip(m_late.parameters(), m_now.parameters(), strict=True):
        assert torch.equal(p, q)


# -- host-memory snapshots read late: no wait, completed once decided, dropped if refused --------
class _Seen(Callback):
    """What the run's callbacks hear of the host-memory snapshots, and the same-step tier's
    state right after each step is decided."""

    def __init__(self) -> None:
        self.changes: list[tuple[int, str]] = []
        self.tier_after: dict[int, dict] = {}
        self.core: Any = None

    def on_checkpoint_change(self, step: int, path: str, status: str, pinned: bool) -> None:
        if path.startswith("memory://"):
            self.changes.append((step, status))

    def post_step(self, state: StepState) -> None:
        self.tier_after[state.step] = self.core.same_step.state_dict()


def _snapshotting(tmp: Path, monkeypatch: pytest.MonkeyPatch, nan_at: int | None) -> tuple:
    ex = example("plain_loop")
    torch.manual_seed(0)
    model = ex.GPT(32, 2, 4, 32)
    opt = AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95))
    trace, seen = Trace(monkeypatch), _Seen()
    flushes = []
    take = Probes.take_pending_metrics

    def counted(probes, *a: Any):  # noqa: ANN001, ANN202
        out = take(probes, *a)
        if out is not None:
            flushes.append(out[0])
        return out

    monkeypatch.setattr(Probes, "take_pending_metrics", counted)
    settings = {
        "probes": {"read": "next_step"},
        "checkpoint": {"memory_interval": 5, "interval": None},
        "guard": {"rollback": False},
    }
    watch = Watch(model, opt, run_dir=tmp, db="none", max_steps=40, settings=settings,
                  callbacks=[seen])  # fmt: skip
    seen.core = watch.open()
    model.use_recorder(watch.attn)
    train, _ = text_corpus()
    with watch:
        for x, y in watch.batches(lambda i: windows(train, i, 8, 32)):
            loss = model(x, y)
            if watch.step_count + 1 == nan_at:
                loss = loss * float("nan")
            loss.backward()
            watch.step(loss)
    monkeypatch.undo()
    return trace, seen, watch, flushes


def test_a_host_memory_snapshot_read_late_makes_the_host_wait_for_nothing(
    tmp_path, monkeypatch
) -> None:
    trace, seen, watch, flushes = _snapshotting(tmp_path, monkeypatch, None)
    assert {s for s, status in seen.changes if status == "ok"} >= {5, 10, 35, 40}
    drained = {now for now, _, d in trace.reads if d}
    assert drained <= {40}  # only the run's end reads the step in flight
    assert all(born < now for now, born, d in trace.reads if not d)  # every read one step late
    assert flushes == [40] or flushes == []  # no update statistics read apart at a snapshot
    # each snapshot holds the same-step tier as it was once its step was decided
    mem = watch.checkpointer.memory
    for step in mem.steps():
        if step:
            assert mem.read(step)["trainer.json"]["same_step"] == seen.tier_after[step]


def test_a_refused_steps_host_memory_snapshot_is_dropped(tmp_path, monkeypatch) -> None:
    _, seen, watch, _ = _snapshotting(tmp_path, monkeypatch, nan_at=15)
    assert watch.interventions[0]["step"] == 15 and watch.interventions[0]["kind"] == "skip_update"
    ok = {s for s, status in seen.changes if status == "ok"}
    assert 15 not in ok and {10, 20} <= ok  # taken in flight, dropped once read as refused
    assert 15 not in watch.checkpointer.memory.slots


# -- disk checkpoints read late: no drain, written once decided, retaken if refused ---------------
class _Order(Callback):
    """The order in which update statistics and disk checkpoints reach the record, and the
    weights and decided state right after each step."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int]] = []
        self.tier_after: dict[int, dict] = {}
        self.core: Any = None

    def on_update_metrics(self, step: int, metrics: dict) -> None:
        if any(k.endswith(M.STAT_UPDATE_NORM) for k in metrics):
            self.events.append(("stats", step))

    def on_checkpoint_change(self, step: int, path: str, status: str, pinned: bool) -> None:
        if not path.startswith("memory://") and status == "ok":
            self.events.append(("file", step))

    def post_step(self, state: StepState) -> None:
        self.tier_after[state.step] = self.core.same_step.state_dict()


def _disk_saving(tmp: Path, monkeypatch: pytest.MonkeyPatch, nan_at: int | None) -> tuple:
    ex = example("plain_loop")
    torch.manual_seed(0)
    model = ex.GPT(32, 2, 4, 32)
    opt = AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95))
    trace, order = Trace(monkeypatch), _Order()
    settings = {
        "probes": {"read": "next_step"},
        "checkpoint": {"interval": 10, "memory_interval": None, "async_save": True,
                       "keep_last": 10},
        "guard": {"rollback": False},
    }  # fmt: skip
    watch = Watch(model, opt, run_dir=tmp, db="none", max_steps=40, settings=settings,
                  callbacks=[order])  # fmt: skip
    order.core = watch.open()
    model.use_recorder(watch.attn)
    train, _ = text_corpus()
    weights: dict[int, dict[str, torch.Tensor]] = {}
    with watch:
        for x, y in watch.batches(lambda i: windows(train, i, 8, 32)):
            loss = model(x, y)
            if watch.step_count + 1 == nan_at:
                loss = loss * float("nan")
            loss.backward()
            watch.step(loss)
            weights[watch.step_count] = {k: v.clone() for k, v in model.state_dict().items()}
    monkeypatch.undo()
    return trace, order, watch, weights


def test_a_disk_checkpoint_read_late_drains_nothing_and_is_written_as_decided(
    tmp_path, monkeypatch
) -> None:
    """The file of a step saved while in flight: its tensors are the step's, its decided
    state (the same-step tier's window) as once the step was read, its loss the step's. The
    state step due at a checkpoint's step is taken two steps on (the two costs never add up
    on one step), and the file says so: a resume from it takes the state step there too."""
    trace, order, watch, weights = _disk_saving(tmp_path, monkeypatch, None)
    drained = {now for now, _, d in trace.reads if d}
    assert drained <= {40}  # only the run's end reads the step in flight
    root = watch.checkpointer.disk.root
    files = ck.list_checkpoints(root)
    assert {10, 20, 30, 40} <= set(files)
    history = dict(watch.core.run.history)
    for step in (10, 20, 30):
        got = ck.read_checkpoint(files[step])
        state = got["trainer.json"]
        assert state["step"] == step
        assert state["same_step"] == order.tier_after[step]
        assert got["meta"]["loss"] == pytest.approx(history[step])
        model = got["model.pt"]
        for k, v in weights[step].items():
            assert torch.equal(model[k], v), (step, k)
        assert ("stats", step) not in order.events and ("stats", step + 2) in order.events
        assert state["state_moved"] == [step, step + 2]


def test_a_refused_steps_disk_checkpoint_is_retaken_at_the_next_step(tmp_path, monkeypatch) -> None:
    trace, order, watch, weights = _disk_saving(tmp_path, monkeypatch, nan_at=20)
    assert watch.interventions[0]["step"] == 20 and watch.interventions[0]["kind"] == "skip_update"
    files = ck.list_checkpoints(watch.checkpointer.disk.root)
    assert 20 not in files and {10, 21, 30, 40} <= set(files)
    assert {now for now, _, d in trace.reads if d} <= {40}
    model = ck.read_checkpoint(files[21])["model.pt"]
    assert all(torch.equal(model[k], v) for k, v in weights[21].items())


def test_a_resume_from_a_file_written_in_flight_ends_as_the_uninterrupted_run(tmp_path) -> None:
    """The file of step 10, saved while step 10 was on the device and written once it was
    read, resumes to the same end as a run that was never stopped (bitwise)."""
    extra = ["probes.read=next_step", "checkpoint.interval=5", "checkpoint.async_save=true",
             "checkpoint.memory_interval=null", "train.max_steps=16"]  # fmt: skip
    straight = build_trainer(tiny_config(*extra), run_dir=tmp_path / "straight")
    assert straight.core.reads_late
    straight.fit()
    cut = build_trainer(tiny_config(*extra), run_dir=tmp_path / "cut")
    cut.fit()
    root = tmp_path / "cut" / "checkpoints"
    for step, path in ck.list_checkpoints(root).items():
        if step != 10:  # as if the process had died before its next file
            shutil.rmtree(path)
    again = build_trainer(tiny_config(*extra), run_dir=tmp_path / "cut", resume=True)
    assert again.step_count == 10
    again.fit()
    for p, q in zip(again.model.parameters(), straight.model.parameters(), strict=True):
        assert torch.equal(p, q)
    a, s = again.optimizer.state_dict()["state"], straight.optimizer.state_dict()["state"]
    for i in s:
        for k in s[i]:
            assert torch.equal(torch.as_tensor(a[i][k]), torch.as_tensor(s[i][k])), (i, k)
