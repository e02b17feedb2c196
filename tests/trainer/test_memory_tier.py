"""The host-memory tier: a rollback from RAM is bitwise the rollback from disk, the copy is
taken before the next update changes the weights, and the budget bounds the snapshots."""

from __future__ import annotations

import copy

import pytest
import torch

from spikewatch.trainer.builtin.loop import build_trainer, fit
from spikewatch.trainer.checkpoints.errors import CheckpointError
from spikewatch.trainer.checkpoints.format import Snapshot
from spikewatch.trainer.checkpoints.memory import MemoryTier, snapshot_bytes
from spikewatch.trainer.checkpoints.tiers import MEMORY

from .conftest import tiny_config

pytestmark = pytest.mark.e2e  # trains a model (tests/README.md)

FAULT = 'faults=[{kind="shifted_labels", start=40, length=6}]'
BASE = ("train.max_steps=70", "eval.interval=none", FAULT)


def test_a_rollback_from_memory_is_bitwise_the_rollback_from_disk(tmp_path) -> None:
    disk = fit(tiny_config(*BASE, "checkpoint.interval=5"), run_dir=tmp_path / "disk")
    mem = fit(tiny_config(*BASE, "checkpoint.memory_interval=5"), run_dir=tmp_path / "mem")
    (a,), (b,) = disk.interventions, mem.interventions
    assert (a["tier"], b["tier"]) == ("disk", "memory")
    assert a["to_step"] == b["to_step"] < a["onset_step"]
    assert mem.train_losses == disk.train_losses
    assert mem.final_val_loss == disk.final_val_loss


def test_a_snapshot_holds_the_weights_of_its_step(tmp_path) -> None:
    cfg = tiny_config("checkpoint.memory_interval=1000", "train.max_steps=30")
    tr = build_trainer(cfg, run_dir=tmp_path)
    core = tr.core
    core.start()
    for _ in range(5):
        tr._train_step()
    want = copy.deepcopy(tr.model.state_dict())
    want_m = copy.deepcopy({k: v["exp_avg"] for k, v in tr.optimizer.state_dict()["state"].items()})
    core.save([MEMORY])  # copied in the background while the next steps train
    for _ in range(5):
        tr._train_step()
    assert not torch.equal(tr.model.state_dict()["lm_head.weight"], want["lm_head.weight"])
    core.restore(core.checkpointer.read(5), resume=False)
    for k, v in tr.model.state_dict().items():
        assert torch.equal(v, want[k]), k
    for k, v in tr.optimizer.state_dict()["state"].items():
        assert torch.equal(v["exp_avg"], want_m[k])
    assert core.step_count == 5


def test_the_budget_bounds_the_snapshots_and_pins_stay_longest(tmp_path) -> None:
    probe = build_trainer(tiny_config("train.max_steps=3"), run_dir=tmp_path / "probe")
    probe.fit()
    per = snapshot_bytes(probe.model, probe.optimizer)
    budget_mb = 4.5 * per / 2**20  # room for four snapshots
    cfg = tiny_config(
        "checkpoint.memory_interval=1",
        f"checkpoint.memory_budget_mb={budget_mb}",
        "train.max_steps=40",
    )
    tr = build_trainer(cfg, run_dir=tmp_path / "run")
    memory = tr.core.checkpointer.memory
    assert memory is not None
    tr.core.start()
    held = []
    for step in range(1, 41):
        tr._train_step()
        tr.core.save_if_due()
        if step == 10:
            tr.core.checkpointer.pin(10, "pre-spike anchor")
        held.append(memory.steps())
    assert max(len(h) for h in held) <= 4
    assert all(h[-1] == s for s, h in enumerate(held, start=1))  # the newest is always there
    assert 10 in held[-1]  # the pin outlived its unpinned neighbours
    assert memory.bytes_held <= budget_mb * 2**20


def test_snapshot_blocks_are_pinned_ahead_off_the_loop(tmp_path, monkeypatch) -> None:
    """Each snapshot after the first takes a host block made (pinned, on CUDA) in a thread
    between snapshots, never in the training loop's own thread (issue 47: 1.35 s for the
    first block of a 1B model, then one per snapshot until retention evicts one); the
    snapshots hold the same bytes."""
    import threading

    from spikewatch.trainer.checkpoints import memory as memory_module

    made: list[str] = []
    block = memory_module.HostBlock

    class Traced(block):  # type: ignore[misc, valid-type]
        def __init__(self, like, pin):  # noqa: ANN001
            made.append(threading.current_thread().name)
            super().__init__(like, pin)

    monkeypatch.setattr(memory_module, "HostBlock", Traced)
    probe = build_trainer(tiny_config("train.max_steps=3"), run_dir=tmp_path / "probe")
    probe.fit()
    full = snapshot_bytes(probe.model, probe.optimizer)
    # room for two full snapshots and the smaller step-0 one (no optimizer state), as at 1B
    # on the H200 (two of 11.3 GB in 28 GB): the spare is counted in bytes
    budget_mb = 2.6 * full / 2**20
    cfg = tiny_config(
        "checkpoint.memory_interval=5",
        "train.max_steps=30",
        "eval.interval=none",
        f"checkpoint.memory_budget_mb={budget_mb}",
    )
    made.clear()
    tr = build_trainer(cfg, run_dir=tmp_path / "ahead")
    memory = tr.core.checkpointer.memory
    assert memory is not None
    memory.spare_ahead = True  # as on CUDA
    tr.fit()
    assert memory.steps()[-1] == 30 and len(made) >= 3
    assert memory.bytes_held <= budget_mb * 2**20
    loop = threading.current_thread().name
    assert made[0] == loop  # the step-0 anchor, before training: its shape was unknown
    assert loop not in made[1:]
    want = copy.deepcopy(tr.model.state_dict())
    tr.core.restore(memory.read(30), resume=False)
    for k, v in tr.model.state_dict().items():
        assert torch.equal(v, want[k]), k


def test_a_cpu_run_walks_its_tensors_once_per_shape_not_per_snapshot(tmp_path, monkeypatch) -> None:
    """The copy plan (which tensors, under which keys) is made by one walk of the model and
    the optimizer when their shape changes, not at every snapshot (a walk of ~450 tensors took
    8.7 ms of the loop a snapshot at 124M), and never between snapshots on a CPU (blocks are made
    ahead on CUDA only; 4.4 ms a step in torchtitan's debug model)."""
    import sys

    from spikewatch.trainer.checkpoints import memory as memory_module

    walks: list[str] = []
    plan = memory_module._Plan

    def traced(model, optimizer):  # noqa: ANN001, ANN202
        walks.append(sys._getframe(2).f_code.co_name)
        return plan(model, optimizer)

    monkeypatch.setattr(memory_module, "_Plan", traced)
    cfg = tiny_config("checkpoint.memory_interval=5", "train.max_steps=30", "eval.interval=none")
    tr = build_trainer(cfg, run_dir=tmp_path)
    tr.fit()
    memory = tr.core.checkpointer.memory
    assert memory is not None and memory.steps()[-1] == 30
    assert walks == ["save", "save"]  # step 0 (no optimizer state yet), then step 5's shape


def test_a_snapshot_copies_a_tensor_put_in_place_of_another(tmp_path) -> None:
    """The plan reads each tensor through the dict that holds it: a buffer reassigned, or a
    parameter's data swapped, between snapshots is the one the next snapshot copies."""
    model = torch.nn.Linear(3, 2)
    model.register_buffer("scale", torch.ones(2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tier = MemoryTier(model, opt, interval=1, budget_bytes=1 << 20)
    snap = Snapshot(step=0, torch_files={}, json_files={"trainer.json": {}}, meta={})
    tier.save(0, snap, set())
    model.scale = torch.full((2,), 7.0)  # reassigned
    with torch.no_grad():
        model.weight.data = torch.full((2, 3), 3.0)  # the Parameter keeps, its data swaps
    tier.save(1, snap, set())
    tier.before_mutation()
    bufs = tier.slots[1].buffers
    assert torch.equal(bufs["b/scale"], torch.full((2,), 7.0))
    assert torch.equal(bufs["p/weight"], torch.full((2, 3), 3.0))


def test_a_warning_pins_the_newest_snapshot_of_each_tier(tmp_path) -> None:
    """A leading signal pins a pre-spike anchor: the newest host-memory snapshot (step 15) and
    the newest disk checkpoint (step 10) too, since memory may soon drop its newest and a
    rollback may have to go further back than it holds."""
    cfg = tiny_config(
        "checkpoint.memory_interval=5", "checkpoint.interval=10", "train.max_steps=30"
    )
    tr = build_trainer(cfg, run_dir=tmp_path)
    core = tr.core
    core.start()
    for _ in range(17):
        tr._train_step()
        core.save_if_due()
    core.checkpointer.wait()
    core.pin_newest("attention logits growing")
    pins = core.checkpointer.pins
    assert {s for s, why in pins.items() if "attention logits growing" in why} == {10, 15}
    assert core.checkpointer.memory.slots[15].pins and core.checkpointer.disk.pins[10]


def test_only_the_newest_warnings_keep_their_anchors(tmp_path) -> None:
    """A long run warns again and again: each warning's anchors would hold a snapshot for
    ever. The newest MAX_ANCHORS (4) warnings keep theirs, in both tiers; an older warning's go
    back to retention (its disk checkpoint's meta.json loses the pin), and a pin of another
    kind (a rollback target) stays."""
    from spikewatch.trainer.checkpoints import format as ck
    from spikewatch.trainer.checkpoints.tiers import ANCHOR, MAX_ANCHORS

    cfg = tiny_config("checkpoint.memory_interval=1", "checkpoint.interval=3", "train.max_steps=40")
    tr = build_trainer(cfg, run_dir=tmp_path)
    core = tr.core
    core.start()
    warned = {}
    for step in range(1, 19):
        tr._train_step()
        core.save_if_due()
        if step % 3 == 2:  # a warning at steps 2, 5, ..., 17: six of them
            core.checkpointer.wait()
            core.pin_newest(f"{ANCHOR}: warning {step}")
            warned[step] = f"{ANCHOR}: warning {step}"
            if step == 2:
                core.checkpointer.pin(2, "rollback target")
    core.checkpointer.wait()
    pins = core.checkpointer.pins
    reasons = {r for why in pins.values() for r in why if r.startswith(ANCHOR)}
    assert reasons == {warned[s] for s in sorted(warned)[-MAX_ANCHORS:]}
    assert pins[2] == {"rollback target"}  # its anchor went, the other pin stayed
    disk = core.checkpointer.disk
    first_disk = max(s for s in ck.list_checkpoints(tmp_path / "checkpoints") if s <= 2)
    meta = ck.read_meta(ck.list_checkpoints(tmp_path / "checkpoints")[first_disk])
    assert not any(r.startswith(ANCHOR) for r in meta.get("pins", [])), meta
    assert not any(r.startswith(ANCHOR) for why in disk.pins.values() for r in why
                   if r in (warned[2], warned[5]))  # fmt: skip


def test_a_rollback_from_host_memory_restores_the_lr_schedule(tmp_path) -> None:
    """A host-memory snapshot copies the weights and the optimizer's tensors itself, and keeps
    the rest of the checkpoint: the LR scheduler comes back to the target step's."""
    from spikewatch import Watch
    from spikewatch.trainer.core.actions import Action, Continue, Rollback
    from spikewatch.trainer.core.callbacks import Callback, StepState

    class Once(Callback):
        done = False

        def on_step(self, state: StepState) -> Action:
            if state.step == 17 and not self.done:
                self.done = True
                return Rollback(to_step=10, reason="test")
            return Continue()

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    settings = {"checkpoint": {"memory_interval": 5, "interval": None}}
    watch = Watch(model, opt, sched, run_dir=tmp_path, db="none", settings=settings,
                  callbacks=[Once()])  # fmt: skip
    seen = {}
    with watch:
        for i in range(20):
            watch.begin_step(i)
            out = watch.step(model(torch.ones(2, 4)).square().mean())
            if out == "rolled_back":
                seen = {"step": watch.step_count, "last_epoch": sched.last_epoch}
    (rb,) = watch.interventions
    assert rb["tier"] == "memory" and seen == {"step": 10, "last_epoch": 10}


def test_a_snapshot_that_fails_its_check_is_not_restored(tmp_path) -> None:
    """A host-memory snapshot carries its block's sums, taken once it landed; a rollback checks
    them before it restores. One byte of the step-30 snapshot changed in memory: the rollback to
    30 falls back to the step-20 snapshot, says so in its record, and restores step 20's weights
    exactly (compared with a copy taken here at step 20)."""
    from spikewatch import Watch
    from spikewatch.trainer.core.actions import Action, Continue, Rollback
    from spikewatch.trainer.core.callbacks import Callback, StepState

    class Corrupt(Callback):
        core = None
        at_20: list[torch.Tensor] = []

        def post_step(self, state: StepState) -> None:
            if state.step == 20:
                self.at_20 = [p.detach().clone() for p in model.parameters()]

        def on_step(self, state: StepState) -> Action:
            if state.step == 34:
                mem = self.core.checkpointer.memory
                slot = mem.slots[30]
                slot.sealed.wait()  # its sums are taken: now a byte changes under them
                weight = slot.buffers["p/weight"]
                weight.view(-1)[3] += 1.0
                return Rollback(to_step=30, reason="test")
            return Continue()

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    cb = Corrupt()
    settings = {"checkpoint": {"memory_interval": 10, "interval": None}}
    watch = Watch(model, opt, run_dir=tmp_path, db="none", settings=settings, callbacks=[cb])
    cb.core = watch.open()
    with watch:
        for i in range(40):
            watch.begin_step(i)
            out = watch.step(model(torch.ones(2, 4) * (1 + i % 3)).square().mean())
            if out == "rolled_back":
                assert watch.step_count == 20
                for p, q in zip(model.parameters(), cb.at_20, strict=True):
                    assert torch.equal(p.detach(), q)
    (rb,) = watch.interventions
    assert rb["tier"] == "memory" and rb["to_step"] == 20
    (fell,) = rb["restore_fallbacks"]
    assert fell["step"] == 30 and "1 of" in fell["why"] and "changed" in fell["why"]


def test_a_restore_that_does_not_reproduce_the_next_steps_loss_takes_the_next_older_target(
    tmp_path, monkeypatch
) -> None:
    """The second proof of a restore (issue: a restore that is checked): the step after the
    target, replayed on the restored state, must give the loss the run recorded for it. Here
    the restore of step 30 puts back a weight other than the one saved (the snapshot's block is
    intact, its sums pass: what a wrong copy plan or a stray write after the copy would do), so
    step 31's loss does not come back; the rollback takes step 20, whose step 21 does, and the
    record says both. Without the proof the run trains on from the wrong state."""
    from spikewatch.trainer.core.actions import Action, Continue, Rollback
    from spikewatch.trainer.core.callbacks import Callback, StepState

    class Ask(Callback):
        asked = False

        def on_step(self, state: StepState) -> Action:
            if state.step == 34 and not self.asked:
                self.asked = True
                return Rollback(to_step=30, reason="test")
            return Continue()

    load, loads = MemoryTier.load_tensors, []

    def wrong_first(self: MemoryTier, step: int) -> None:
        load(self, step)
        loads.append(step)
        if len(loads) == 1:  # the first restore: one weight is not what was saved
            with torch.no_grad():
                list(self.model.parameters())[-1].mul_(1.5)

    monkeypatch.setattr(MemoryTier, "load_tensors", wrong_first)
    cfg = tiny_config("train.max_steps=40", "eval.interval=none", "checkpoint.memory_interval=10",
                      "guard.rollback=false")  # fmt: skip
    r = fit(cfg, run_dir=tmp_path, callbacks=[Ask()])
    (rb,) = [i for i in r.interventions if i["kind"] == "rollback"]
    assert (rb["tier"], rb["to_step"]) == ("memory", 20)
    (fell,) = rb["restore_fallbacks"]
    assert fell["step"] == 30 and "does not reproduce step 31's loss" in fell["why"]
    proof = rb["replay_proof"]
    assert proof["step"] == 21 and proof["reproduced"] and proof["loss"] == proof["recorded"]
    assert loads[0] == 30 and 20 in loads[1:]


def test_a_replay_that_reproduces_no_target_keeps_the_newest_and_turns_the_proof_off(
    tmp_path, caplog
) -> None:
    """Where the replay gives another loss than the loop recorded on every target (a `loss_fn`
    that is not the loop's own loss, a run that is not deterministic), the proof cannot tell a
    bad restore: after two targets that do not reproduce, the newest stands (not the oldest
    the run keeps), the proof is off for the rest of the run, and the log says why."""
    from dataclasses import replace

    from spikewatch.trainer.core.actions import Action, Continue, Rollback
    from spikewatch.trainer.core.callbacks import Callback, StepState

    class Ask(Callback):
        asked: set[int] = set()

        def on_step(self, state: StepState) -> Action:
            if state.step in (34, 44) and state.step not in self.asked:
                self.asked.add(state.step)
                return Rollback(to_step=state.step - 4, reason="test")
            return Continue()

    cfg = tiny_config("train.max_steps=50", "eval.interval=none", "checkpoint.memory_interval=10",
                      "guard.rollback=false")  # fmt: skip
    trainer = build_trainer(cfg, run_dir=tmp_path, callbacks=[Ask()])
    replay = trainer.core.replay

    calls: list[int] = []

    def scaled(step: int, index: int):  # noqa: ANN202
        calls.append(step)
        t, apply = replay(step, index)
        return replace(t, loss=t.loss * 1.01), apply  # not the loss the loop records

    trainer.core.replay = scaled
    with caplog.at_level("WARNING"):
        r = trainer.fit()
    first, second = [i for i in r.interventions if i["kind"] == "rollback"]
    assert (first["tier"], first["to_step"]) == ("memory", 30)  # the newest, not 20 or 0
    assert first["replay_proof"]["kept"].startswith("the replay proves nothing")
    assert "restore_fallbacks" not in first
    assert second["to_step"] == 40 and "replay_proof" not in second  # off from then on
    assert calls == [31, 21]  # two targets tried, not every one the run keeps
    assert sum("the replay cannot prove this run's restores" in m for m in caplog.messages) == 1


def test_an_intact_snapshot_passes_its_check(tmp_path) -> None:
    """The sums of a snapshot, taken again, are the ones taken when it landed; a changed word
    anywhere in the block is found."""
    from spikewatch.trainer.checkpoints.memory import block_sums

    torch.manual_seed(0)
    model = torch.nn.Linear(300, 200)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 300)).sum().backward()
    opt.step()
    tier = MemoryTier(model, opt, interval=1, budget_bytes=1 << 30)
    tier.save(1, Snapshot(step=1, torch_files={}, json_files={"trainer.json": {}}, meta={}), set())
    tier.before_mutation()
    tier.verify(1)  # intact: no error
    slot = tier.slots[1]
    assert slot.checksum is not None and torch.equal(block_sums(slot.buffers), slot.checksum)
    slot.buffers["o/0/exp_avg_sq"].view(-1)[-1] *= 2
    with pytest.raises(CheckpointError, match="failed its check: 1 of"):
        tier.verify(1)


def test_what_a_long_run_keeps_alive_grows_with_its_snapshots_tensors_alone(tmp_path) -> None:
    """A full garbage collection walks every live container; the run's pauses grow with what
    it keeps alive. Over 1,000 steps with a snapshot every 5 (retention keeps a few more as
    the run doubles), the objects the collector tracks grow by the snapshots' tensors and a
    few objects each, not by their state's JSON (~600 objects a snapshot when it was kept as
    dicts), and by nothing a step."""
    import gc

    from spikewatch import AdamW, Watch
    from spikewatch.corpus import text_corpus, windows

    from ..spikewatch.conftest import example

    torch.manual_seed(0)
    model = example("plain_loop").GPT(32, 2, 4, 32)
    opt = AdamW(model.parameters(), lr=3e-3)
    settings = {"probes": {"read": "next_step"},
                "checkpoint": {"memory_interval": 5, "interval": None}}  # fmt: skip
    watch = Watch(model, opt, run_dir=tmp_path, db="none", max_steps=1000, settings=settings)
    model.use_recorder(watch.attn)
    train, _ = text_corpus()
    seen: dict[int, tuple[int, int]] = {}
    with watch:
        for x, y in watch.batches(lambda i: windows(train, i, 8, 32)):
            loss = model(x, y)
            loss.backward()
            watch.step(loss)
            if watch.step_count in (100, 1000):
                gc.collect()
                objs = gc.get_objects()
                tensors = sum(1 for o in objs if isinstance(o, torch.Tensor))
                seen[watch.step_count] = (len(objs) - tensors, len(watch.checkpointer.memory.slots))
    (before, slots_before), (after, slots_after) = seen[100], seen[1000]
    assert slots_after > slots_before  # retention kept more snapshots: the case in question
    assert after - before < 200 * (slots_after - slots_before), (before, after)  # was ~2,100


def test_a_snapshot_keeps_an_optimizer_setting_that_does_not_pickle() -> None:
    """A snapshot's non-tensor state is kept as one pickle; a function kept in a param group
    does not pickle, and the snapshot keeps a deep copy instead: restored as it was."""
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt.param_groups[0]["schedule"] = lambda step: 0.5 * step  # (not picklable)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    tier = MemoryTier(model, opt, interval=1, budget_bytes=1 << 20)
    snap = Snapshot(step=1, torch_files={}, json_files={"trainer.json": {"k": [1]}}, meta={})
    tier.save(1, snap, set())
    tier.before_mutation()
    weight = model.weight.detach().clone()
    opt.param_groups[0]["lr"] = 0.01
    with torch.no_grad():
        model.weight.zero_()
    got = tier.read(1)
    tier.load_tensors(1)
    assert got["trainer.json"] == {"k": [1]}
    assert torch.equal(model.weight, weight) and opt.param_groups[0]["lr"] == 0.1
    assert opt.param_groups[0]["schedule"](4) == 2.0


@pytest.mark.parametrize(("cost_s", "every"), [(0.0042, 9), (1e-5, 5), (1.0, 25)])
def test_auto_snapshots_as_often_as_their_measured_cost_allows(
    tmp_path, monkeypatch, cost_s, every
) -> None:
    """memory_interval 'auto' (CheckFreq; on a GPU, forced here): the first snapshot after the
    start's anchor at the lower bound, 5; then every k steps, the fewest that keep a
    snapshot's cost to the loop (set here: its stall) within 0.5% of the time the steps take
    (100 ms a step here), between 5 and 25; said once, and recorded with each snapshot. A
    cost of 4.2 ms against 0.5 ms of budget a step: every 9."""
    from spikewatch import Watch
    from spikewatch.observatory import metric_names as M
    from spikewatch.trainer.checkpoints import memory as memory_mod
    from spikewatch.trainer.core.callbacks import Callback
    from spikewatch.trainer.core.step_core import StepCore

    monkeypatch.setattr(memory_mod, "AUTO_OFF_GPU", True)
    measured = MemoryTier.measured

    def costed(tier) -> None:  # noqa: ANN001
        measured(tier)
        if tier.cost_s is not None:
            tier.cost_s = cost_s  # what a snapshot held the loop, as if measured so

    monkeypatch.setattr(MemoryTier, "measured", costed)
    monkeypatch.setattr(StepCore, "seconds_per_step", property(lambda core: 0.1))
    said: list[str] = []
    monkeypatch.setattr(
        "spikewatch.trainer.core.step_core.say", lambda _log, message: said.append(message)
    )

    class Intervals(Callback):
        def __init__(self) -> None:
            self.seen: dict[int, float] = {}

        def on_update_metrics(self, step: int, metrics: dict) -> None:
            if M.CKPT_MEMORY_INTERVAL in metrics:
                self.seen[step] = metrics[M.CKPT_MEMORY_INTERVAL]

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    seen = Intervals()
    settings = {"checkpoint": {"interval": None, "memory_interval": "auto"}}
    watch = Watch(model, torch.optim.SGD(model.parameters(), lr=0.01), run_dir=tmp_path,
                  db="none", max_steps=60, settings=settings, callbacks=[seen])  # fmt: skip
    with watch:
        while not watch.should_stop:
            watch.begin_step()
            watch.step(model(torch.ones(2, 4)).square().mean())
    steps = sorted(seen.seen)
    assert steps[:3] == [0, 5, 5 + every], steps
    assert all(b - a == every for a, b in zip(steps[1:], steps[2:], strict=False))
    assert [m for m in said if "host-memory snapshots every" in m] == [
        m for m in said if f"every {every} steps" in m
    ] and len([m for m in said if "host-memory snapshots every" in m]) == 1


def test_a_disk_checkpoint_on_a_snapshot_step_writes_host_memorys_copy(
    tmp_path, monkeypatch
) -> None:
    """A background disk checkpoint due on a step host memory snapshots takes the weights and
    the optimizer state from that snapshot (`MemoryTier.lend`): the loop thread builds no
    state dict for it and copies nothing twice, and the files hold the step's state as torch's
    own state dicts give it (taken here, at the step), its learning rate included. A disk
    step off host memory's own interval snapshots too, for the file to take."""
    import threading

    from spikewatch.trainer.checkpoints import format as ck
    from spikewatch.trainer.core.state import join_optimizer
    from spikewatch.trainer.watch import Watch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16),
                                torch.nn.Linear(16, 1))  # fmt: skip
    model.register_buffer("seen", torch.zeros(2, dtype=torch.int64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    ckpt = {"interval": 10, "memory_interval": 7, "async_save": True, "fsync": False}
    watch = Watch(model, opt, scheduler=sched, max_steps=20, run_dir=tmp_path, db="none",
                  settings={"checkpoint": ckpt})  # fmt: skip
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    built: list[str] = []  # the state dicts built, by thread

    def step() -> None:
        loss = (model(x) - y).square().mean()
        loss.backward()
        watch.step(loss)

    for _ in range(9):
        step()
    for owner in (torch.nn.Module, torch.optim.Optimizer):
        real = owner.state_dict

        def traced(self, *a, _real=real, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
            built.append(threading.current_thread().name)
            return _real(self, *a, **kw)

        monkeypatch.setattr(owner, "state_dict", traced)
    step()  # step 10: a snapshot and a file
    core = watch.core
    assert core is not None and core.step_count == 10
    assert {7, 10} <= set(core.checkpointer.memory.slots)  # 10: for the file
    assert built == []  # neither on the loop thread nor in the writer's
    monkeypatch.undo()
    want_model = copy.deepcopy(model.state_dict())
    want_opt = copy.deepcopy(opt.state_dict())
    for _ in range(3):
        step()  # the weights move on while the file is written
    core.checkpointer.disk.wait()
    got = ck.read_checkpoint(ck.step_dir(core.checkpointer.root, 10))
    assert list(got["model.pt"]) == list(want_model)
    for k, v in want_model.items():
        assert torch.equal(got["model.pt"][k], v) and got["model.pt"][k].dtype == v.dtype, k
    opt_file = join_optimizer(got)
    assert opt_file["param_groups"] == want_opt["param_groups"]  # the step's lr, every setting
    assert sorted(opt_file["state"]) == sorted(want_opt["state"])
    for i, st in want_opt["state"].items():
        assert sorted(opt_file["state"][i]) == sorted(st), i
        for k, v in st.items():
            assert torch.equal(opt_file["state"][i][k], v), (i, k)
    assert core.checkpointer.memory.slots[10].unheld.is_set()  # the loan was given back
    watch.close()


def test_a_lent_snapshot_is_not_reused_until_the_file_has_copied_it(tmp_path) -> None:
    """Host memory does not hand a lent snapshot's buffers to the next snapshot (a rollback's
    drop, retention's eviction) until the disk tier has copied them, and a save that fails
    before its writer runs gives the loan back."""
    import threading

    from spikewatch.trainer.checkpoints.disk import Checkpointer
    from spikewatch.trainer.config import CheckpointConfig

    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    tier = MemoryTier(model, opt, interval=1, budget_bytes=1 << 20)
    snap = Snapshot(step=0, torch_files={}, json_files={"trainer.json": {}}, meta={})
    tier.save(1, snap, set())
    lent = tier.lend(1)
    assert lent is not None
    files = lent.files()
    assert torch.equal(files["model.pt"]["weight"], model.weight.detach())
    dropped = threading.Thread(target=tier.drop, args=(1,))
    dropped.start()
    dropped.join(0.3)
    assert dropped.is_alive() and not tier.free  # held: not reused
    lent.release()
    dropped.join(5)
    assert not dropped.is_alive() and len(tier.free) == 1

    tier.save(2, snap, set())
    lent = tier.lend(2)
    assert lent is not None
    disk = Checkpointer(tmp_path, CheckpointConfig(interval=1, async_save=True))
    disk._error = OSError("disk full")  # its last write failed: this save raises at once
    with pytest.raises(RuntimeError, match="disk full"):
        disk.save(2, lambda stage: snap, lent=lent)
    assert tier.slots[2].unheld.is_set()


class _Averaging(torch.optim.SGD):
    """SGD with momentum that counts its steps in each parameter's state (a number) and, from
    its `avg_from`-th step, keeps an average of the weights there too (a tensor entry that
    appears while the number of parameters with state stays the same), which pulls the
    weights a little towards it."""

    def __init__(self, params, avg_from: int = 3, **kw) -> None:  # noqa: ANN001, ANN003
        super().__init__(params, **kw)
        self.avg_from = avg_from

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001, ANN201
        super().step(closure)
        for p in self.param_groups[0]["params"]:
            st = self.state[p]
            st["count"] = st.get("count", 0) + 1
            if st["count"] >= self.avg_from:
                avg = st.setdefault("avg", p.detach().clone())
                avg.mul_(0.5).add_(p, alpha=0.5)
                p.add_(avg - p, alpha=0.1)


@pytest.mark.parametrize("optimizer", ["sgd", "averaging"])
def test_a_resume_from_a_file_host_memory_lent_is_the_uninterrupted_run(
    tmp_path, optimizer
) -> None:
    """A user's own loop (a GRU, SGD with momentum) with background files every 10 steps beside
    host memory every 4: each file is written from host memory's snapshot of its step (10 and
    30 off memory's interval: a snapshot made for the file). Resumed from the file of step 10,
    the run goes on exactly as the one never stopped. `averaging`: the optimizer's state gains
    an entry at its 6th step, after the snapshots' copy plan was made (the file held none of
    it when the plan was not made again)."""
    from spikewatch.trainer.watch import Watch

    def run(run_dir, until: int, resume: bool | str) -> dict[int, float]:  # noqa: ANN001
        torch.manual_seed(0)
        gru, head = torch.nn.GRU(8, 16, batch_first=True), torch.nn.Linear(16, 1)
        model = torch.nn.ModuleDict({"gru": gru, "head": head})
        if optimizer == "sgd":
            opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        else:
            opt = _Averaging(model.parameters(), avg_from=6, lr=0.05, momentum=0.9)
        ckpt = {"interval": 10, "memory_interval": 4, "async_save": True, "fsync": False}
        losses = {}

        def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
            g = torch.Generator().manual_seed(i)
            return torch.randn(4, 5, 8, generator=g), torch.randn(4, 1, generator=g)

        with Watch(model, opt, max_steps=24, run_dir=run_dir, db="none", resume=resume,
                   settings={"checkpoint": ckpt, "probes": {"attn_max": False}}) as w:  # fmt: skip
            for x, y in w.batches(batch):
                out, _ = gru(x)
                loss = (head(out[:, -1]) - y).square().mean()
                loss.backward()
                w.step(loss)
                losses[w.step_count] = loss.item()
                if w.step_count >= until:
                    break
        return losses

    full = run(tmp_path / "full", 24, False)
    run(tmp_path / "cut", 15, False)
    kept = sorted(p.name for p in (tmp_path / "cut" / "checkpoints").iterdir())
    assert kept == ["step00000000", "step00000010", "step00000015"]
    import shutil

    shutil.rmtree(tmp_path / "cut" / "checkpoints" / "step00000015")  # the one made at close
    rest = run(tmp_path / "cut", 24, "auto")
    assert min(rest) == 11
    assert all(rest[s] == full[s] for s in rest), [(s, rest[s], full[s]) for s in rest]


def test_a_snapshot_holds_optimizer_state_that_appears_after_its_plan() -> None:
    """The copy plan reads the optimizer's state through its dicts, made once: an entry that
    a parameter's state gains later (a tensor, here from the optimizer's third step, with no
    parameter newly holding state) is in the next snapshot, and the numbers kept beside the
    tensors are the step's; a restore brings both back."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = _Averaging(model.parameters(), lr=0.1, momentum=0.9)
    tier = MemoryTier(model, opt, interval=1, budget_bytes=1 << 20)
    x = torch.randn(4, 3)
    for step in range(1, 6):
        model(x).square().sum().backward()
        opt.step()
        opt.zero_grad()
        snap = Snapshot(step=step, torch_files={}, json_files={"trainer.json": {}}, meta={})
        tier.save(step, snap, set())
    tier.before_mutation()
    want = {k: v.clone() if torch.is_tensor(v) else v for k, v in opt.state[model.weight].items()}
    weight = model.weight.detach().clone()
    for _ in range(2):  # on past the snapshot
        model(x).square().sum().backward()
        opt.step()
        opt.zero_grad()
    tier.read(5)
    tier.load_tensors(5)
    got = opt.state[model.weight]
    assert sorted(got) == ["avg", "count", "momentum_buffer"] and got["count"] == 5
    assert torch.equal(got["avg"], want["avg"]) and torch.equal(model.weight, weight)
    assert torch.equal(got["momentum_buffer"], want["momentum_buffer"])


def test_a_snapshots_small_tensors_come_back_as_they_were() -> None:
    """The small state beside the weights (RNG states, a scheduler's or a user's tensors) is
    kept as bytes: every dtype, shape and stride comes back equal, as a tensor of its own, and
    what is no plain host tensor (a tensor that needs grad, a subclass) still comes back."""
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tier = MemoryTier(model, opt, interval=1, budget_bytes=1 << 20)
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    small = {
        "torch": torch.get_rng_state(),
        "bf16": torch.tensor([1.5, -2.25], dtype=torch.bfloat16),
        "flags": torch.tensor([True, False, True]),
        "zero_dim": torch.tensor(7, dtype=torch.int64),
        "empty": torch.empty(0, 5),
        "strided": base.t(),  # not contiguous
        "complex": torch.tensor([1 + 2j]).conj(),
        "grad": torch.ones(2, requires_grad=True),
        "param": torch.nn.Parameter(torch.full((2,), 3.0)),
    }
    want = {k: v.detach().clone() for k, v in small.items()}
    snap = Snapshot(step=0, torch_files={"rng.pt": small}, json_files={"trainer.json": {}}, meta={})
    tier.save(0, snap, set())
    for v in small.values():  # the live objects change after the snapshot
        if not v.requires_grad and not v.is_conj():
            v.zero_()
    got = tier.read(0)["rng.pt"]
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        assert torch.equal(got[k].resolve_conj(), v.resolve_conj()), k
    assert got["grad"].requires_grad and isinstance(got["param"], torch.nn.Parameter)
    assert got["torch"].data_ptr() != small["torch"].data_ptr()


def test_a_snapshot_copies_a_parameters_state_dict_put_in_place_of_another() -> None:
    """A parameter's optimizer state replaced by a new dict of the same entries between
    snapshots (`opt.state[p] = {...}`, as code that resets or reloads one parameter's state
    does) is the one the next snapshot copies."""
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    tier = MemoryTier(model, opt, interval=1, budget_bytes=1 << 20)
    snap = Snapshot(step=1, torch_files={}, json_files={"trainer.json": {}}, meta={})
    tier.save(1, snap, set())
    opt.state[model.weight] = {"momentum_buffer": torch.full((2, 3), 5.0)}
    tier.save(2, snap, set())
    tier.before_mutation()
    assert torch.equal(tier.slots[2].buffers["o/0/momentum_buffer"], torch.full((2, 3), 5.0))


def test_a_rollback_host_memory_serves_reads_no_file_to_check_it(tmp_path, monkeypatch) -> None:
    """Memory at 5, 10, 15, disk at 10: a rollback to 15 or 12 is host memory's (it wins a
    tie), and no disk checkpoint is read to verify its checksums (a read of every byte of the
    files: ~12 GB at 1B with AdamW, seconds on the loop a rollback, for a file that loses).
    A target only the disk holds newer than memory's is still verified and taken."""
    from spikewatch.trainer.checkpoints import format as ck_format

    cfg = tiny_config(
        "checkpoint.memory_interval=5", "checkpoint.interval=10", "train.max_steps=40"
    )
    tr = build_trainer(cfg, run_dir=tmp_path)
    core = tr.core
    core.start()
    for _ in range(17):
        tr._train_step()
        core.save_if_due()
    ck = core.checkpointer
    ck.wait()
    assert ck.memory.steps()[-2:] == [10, 15] and ck.disk.retained()[-1] == 10
    checked: list[str] = []
    real = ck_format.verify_checkpoint
    monkeypatch.setattr(ck_format, "verify_checkpoint", lambda p: checked.append(p.name) or real(p))
    assert ck.rollback_point(15)[:2] == (15, 15)
    assert ck.rollback_point(12)[:2] == (10, 10)  # the tie: host memory's
    assert ck.latest(14) == (10, 10)
    assert checked == []
    ck.memory.drop(10)
    ck.memory.drop(5)
    step, where, _ = ck.rollback_point(12)  # the disk's alone now: checked
    assert step == 10 and str(where) == ck.path_of(10, "disk") and checked == [where.name]
    loaded = ck.read(where)  # just verified: not read a second time to check it
    assert loaded["meta"]["step"] == 10 and checked == [where.name]
    ck.read(where)  # not just after `latest`: checked
    assert checked == [where.name] * 2
