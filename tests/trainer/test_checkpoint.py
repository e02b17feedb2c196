from __future__ import annotations

import json

import pytest
import torch

from spikewatch.trainer.builtin.loop import build_trainer, fit
from spikewatch.trainer.checkpoints import format as ck
from spikewatch.trainer.config import ConfigError
from spikewatch.trainer.core.actions import Continue, Rollback
from spikewatch.trainer.core.callbacks import Callback, StepState
from spikewatch.trainer.core.recorder import Recorder

from .conftest import EventSink, tiny_config

pytestmark = pytest.mark.e2e  # trains a model (tests/README.md)

CK = ("checkpoint.interval=4",)


def _weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:  # tensors bitwise; host numbers (an optimizer's step count) equal
        same = torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k]
        assert same, k


def test_checkpoint_directory_is_complete(tmp_path) -> None:
    tr = build_trainer(tiny_config(*CK), run_dir=tmp_path)
    tr.fit()
    steps = ck.list_checkpoints(tmp_path / "checkpoints")
    assert 0 in steps and 12 in steps
    path = steps[12]
    assert path.name == "step00000012"
    meta = ck.verify_checkpoint(path)
    assert set(meta["files"]) == {
        "model.pt",
        "optimizer.pt",
        "optimizer.1.pt",
        "rng.pt",
        "trainer.json",
        "config.json",
    }
    assert meta["step"] == 12 and meta["loss"] == tr.core.run.history[-1][1]
    assert meta["data_state"] == {"batch_index": 12, "skip_ranges": []}
    loaded = ck.read_checkpoint(path)
    _assert_same(loaded["model.pt"], _weights(tr.model))
    assert loaded["config.json"] == tr.cfg.to_dict()
    state = loaded["trainer.json"]
    assert {"python", "numpy"} <= set(state["rng"]) and "torch" in loaded["rng.pt"]
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))


@pytest.mark.parametrize(
    "name", ["model.pt", "optimizer.pt", "optimizer.1.pt", "rng.pt", "trainer.json", "config.json"]
)
@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_corruption_is_detected_and_resume_falls_back(tmp_path, name, damage) -> None:
    fit(tiny_config(*CK, "train.stop_after=8"), run_dir=tmp_path)
    victim = tmp_path / "checkpoints" / "step00000008" / name
    data = bytearray(victim.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x01
    else:
        del data[len(data) // 3 :]
    victim.write_bytes(bytes(data))
    with pytest.raises(ck.CheckpointError, match=f"step00000008.*{name}"):
        ck.verify_checkpoint(victim.parent)
    tr = build_trainer(tiny_config(*CK), run_dir=tmp_path, resume=True)
    assert tr.step_count == 4


def test_missing_meta_is_not_a_checkpoint(tmp_path) -> None:
    fit(tiny_config(*CK, "train.stop_after=8"), run_dir=tmp_path)
    (tmp_path / "checkpoints" / "step00000008" / "meta.json").unlink()
    assert 8 not in ck.list_checkpoints(tmp_path / "checkpoints")
    assert build_trainer(tiny_config(*CK), run_dir=tmp_path, resume=True).step_count == 4


@pytest.mark.parametrize("async_save", [False, True])
def test_resume_is_bitwise_equal_to_an_uninterrupted_run(tmp_path, async_save) -> None:
    extra = (*CK, f"checkpoint.async_save={str(async_save).lower()}", "train.max_steps=16")
    straight = build_trainer(tiny_config(*extra), run_dir=tmp_path / "straight")
    r_straight = straight.fit()
    first = fit(tiny_config(*extra, "train.stop_after=7"), run_dir=tmp_path / "split")
    assert first.steps == 7
    again = build_trainer(tiny_config(*extra), run_dir=tmp_path / "split", resume=True)
    assert again.step_count == 7  # the clean stop saved a checkpoint
    r_again = again.fit()
    assert r_again.train_losses == r_straight.train_losses[7:]
    assert r_again.final_val_loss == r_straight.final_val_loss
    assert r_again.tokens == r_straight.tokens
    _assert_same(_weights(again.model), _weights(straight.model))
    opt_a, opt_s = again.optimizer.state_dict()["state"], straight.optimizer.state_dict()["state"]
    for i in opt_s:
        _assert_same(opt_a[i], opt_s[i])


def test_async_save_writes_the_same_checkpoints_as_sync(tmp_path, monkeypatch) -> None:
    """Every checkpoint, not only the last: an async save copies the weights while the next
    step already runs. The copy is slowed down here, so that an update that did not wait for
    it would land in the middle checkpoints."""
    import time

    from spikewatch.trainer.checkpoints import disk as checkpointer

    real = checkpointer.stage_tensors

    def slow(*args, **kwargs):
        time.sleep(0.2)
        return real(*args, **kwargs)

    monkeypatch.setattr(checkpointer, "stage_tensors", slow)
    keep = ("checkpoint.keep_last=20",)
    fit(tiny_config(*CK, *keep), run_dir=tmp_path / "sync")
    fit(tiny_config(*CK, *keep, "checkpoint.async_save=true"), run_dir=tmp_path / "async")
    sync = ck.list_checkpoints(tmp_path / "sync" / "checkpoints")
    both = ck.list_checkpoints(tmp_path / "async" / "checkpoints")
    assert list(sync) == list(both) == [0, 4, 8, 12]
    for step in sync:
        a, b = ck.read_checkpoint(sync[step]), ck.read_checkpoint(both[step])
        _assert_same(a["model.pt"], b["model.pt"])
        for pid, moments in a["optimizer.pt"]["state"].items():
            _assert_same(moments, b["optimizer.pt"]["state"][pid])
        assert a["trainer.json"]["data_state"] == b["trainer.json"]["data_state"]


def test_resume_refuses_a_changed_config(tmp_path) -> None:
    fit(tiny_config(*CK, "train.stop_after=4"), run_dir=tmp_path)
    with pytest.raises(ConfigError, match=r"optim\.betas.*may change .*optim\.lr"):
        build_trainer(tiny_config(*CK, "optim.betas=[0.9,0.99]"), run_dir=tmp_path, resume=True)


class _Notes(Callback):
    def __init__(self) -> None:
        self.changes: list[tuple[int, dict]] = []
        self.lrs: dict[int, float] = {}

    def on_config_change(self, step, changes) -> None:  # noqa: ANN001
        self.changes.append((step, dict(changes)))

    def post_step(self, state: StepState) -> None:
        self.lrs[state.step] = state.lr


def test_a_resume_may_lower_the_lr_and_says_so(tmp_path) -> None:
    """What a halt advises: resume with a lower peak LR. The new LR applies from the resumed
    step on (the optimizer state kept the old one), and the change is reported to the
    callbacks (the Recorder stores it as an event)."""
    full = _Notes()
    ref = build_trainer(tiny_config(*CK), run_dir=tmp_path / "full", callbacks=[full])
    ref.fit()
    fit(tiny_config(*CK, "train.stop_after=4"), run_dir=tmp_path / "run")
    half, sink = _Notes(), EventSink()
    lower = tiny_config(*CK, "optim.lr=0.0015", "guard.policy.margin=3")
    tr = build_trainer(
        lower, run_dir=tmp_path / "run", resume=True, callbacks=[half, Recorder(sink)]
    )
    tr.fit()
    ((kind, step, data),) = [e for e in sink.events if e[2].get("kind") == "config_change"]
    assert (kind, step, data["changes"]["optim.lr"]) == ("note", 4, [0.003, 0.0015])
    assert half.changes == [
        (4, {"optim.lr": [0.003, 0.0015], "guard.policy.margin": [1, 3]}),
    ]
    for step in range(5, 13):
        assert half.lrs[step] == pytest.approx(full.lrs[step] / 2, rel=1e-9), step
    used = [g["lr"] for g in tr.optimizer.param_groups]  # what the last update was made with
    assert used == pytest.approx([g["lr"] / 2 for g in ref.optimizer.param_groups], rel=1e-9)


def test_resume_without_checkpoints_is_a_clear_error(tmp_path) -> None:
    with pytest.raises(ck.CheckpointError, match="no intact checkpoint"):
        build_trainer(tiny_config(*CK), run_dir=tmp_path, resume=True)


def test_pins_survive_retention_and_restarts(tmp_path) -> None:
    cfg = tiny_config("checkpoint.interval=1", "train.max_steps=40", "train.stop_after=10")
    tr = build_trainer(cfg, run_dir=tmp_path)
    tr.fit()
    anchor = min(s for s in ck.list_checkpoints(tmp_path / "checkpoints") if s > 0)
    tr.core.checkpointer.pin(anchor, "pre-spike anchor")
    tr.cfg = tiny_config("checkpoint.interval=1", "train.max_steps=40")
    tr.fit()
    steps = ck.list_checkpoints(tmp_path / "checkpoints")
    assert anchor in steps
    assert ck.read_meta(steps[anchor])["pins"] == ["pre-spike anchor"]
    assert sorted(steps) == [0, anchor, 20, 28, 36, 38, 39, 40]  # the schedule's, and the pin
    again = build_trainer(tr.cfg, run_dir=tmp_path, resume=True)
    assert again.core.checkpointer.pins == {anchor: {"pre-spike anchor"}}


def test_pinning_a_deleted_checkpoint_is_an_error(tmp_path) -> None:
    tr = build_trainer(
        tiny_config("checkpoint.interval=1", "train.stop_after=10"), run_dir=tmp_path
    )
    tr.fit()
    gone = min(set(range(11)) - set(ck.list_checkpoints(tmp_path / "checkpoints")))
    with pytest.raises(ck.CheckpointError, match=f"step {gone}"):
        tr.core.checkpointer.pin(gone, "too late")


def test_200_steps_every_step_leaves_log_many(tmp_path) -> None:
    cfg = tiny_config(
        "checkpoint.interval=1",
        "train.max_steps=200",
        "eval.interval=none",
        "model.d_model=16",
        "model.n_head=2",
        "data.seq_len=8",
        "data.batch_size=2",
    )
    fit(cfg, run_dir=tmp_path)
    n = len([p for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith("step")])
    assert n <= 2 * 7.64 + 2  # ~2 log2(200) + K


def test_auto_interval_uses_the_measured_save_cost(tmp_path) -> None:
    cfg = tiny_config(
        "checkpoint.interval=auto", "checkpoint.mtbf_hours=0.0001", "train.max_steps=30"
    )
    tr = build_trainer(cfg, run_dir=tmp_path)
    tr.fit()
    cp = tr.core.checkpointer.disk
    assert cp.save_seconds is not None and cp.auto_interval is not None
    cp.save_seconds = 2.0  # Daly(2 s, 0.36 s MTBF) = MTBF, since C >= 2M
    assert cp.interval_for(seconds_per_step=0.01) == 36
    cp.cfg = cp.cfg.model_copy(update={"mtbf_hours": 1.0})
    from spikewatch.observatory.goodput.young_daly import daly

    assert cp.interval_for(seconds_per_step=0.5) == round(daly(2.0, 3600.0) / 0.5)


class _RollbackAt(Callback):
    """Asks for a rollback once, then captures the weights the loop continues from."""

    def __init__(self, trainer_ref: list, at: int, to: int, skip: tuple[int, int]) -> None:
        self.ref, self.at, self.to, self.skip = trainer_ref, at, to, skip
        self.fired = False
        self.weights_after: dict | None = None

    def pre_update(self, state: StepState):
        if self.fired and self.weights_after is None:
            self.weights_after = _weights(self.ref[0].model)
        if state.step == self.at and not self.fired:
            self.fired = True
            return Rollback(to_step=self.to, skip_ranges=(self.skip,), reason="test")
        return Continue()


def test_in_process_rollback_restores_the_checkpoint_and_skips(tmp_path) -> None:
    ref: list = []
    cb = _RollbackAt(ref, at=10, to=8, skip=(8, 11))
    tr = build_trainer(
        tiny_config(*CK, "train.max_steps=20"), run_dir=tmp_path / "rb", callbacks=[cb]
    )
    ref.append(tr)
    result = tr.fit()
    saved = ck.read_checkpoint(tmp_path / "rb" / "checkpoints" / "step00000008")
    _assert_same(cb.weights_after, saved["model.pt"])
    assert ck.read_meta(tmp_path / "rb" / "checkpoints" / "step00000008")["pins"] == [
        "rollback target"
    ]
    iv = result.interventions[-1]
    assert iv["kind"] == "rollback" and iv["from_step"] == 10 and iv["to_step"] == 8
    assert iv["skip_ranges"] == [[8, 11]]
    assert tr.core.run.data.skip_ranges == [(8, 11)]
    # the continued run equals one that skipped that range from the start
    clean = build_trainer(tiny_config(*CK, "train.max_steps=20"), run_dir=tmp_path / "clean")
    clean.core.run.data.add_skip(8, 11)
    r_clean = clean.fit()
    assert result.train_losses == r_clean.train_losses
    _assert_same(_weights(tr.model), _weights(clean.model))
    assert json.loads(json.dumps(result.summary()))["interventions"][0]["to_step"] == 8


def test_rollback_without_checkpoints_is_a_clear_error(tmp_path) -> None:
    ref: list = []
    tr = build_trainer(
        tiny_config(), run_dir=tmp_path, callbacks=[_RollbackAt(ref, at=3, to=1, skip=(1, 3))]
    )
    ref.append(tr)
    with pytest.raises(RuntimeError, match="needs checkpoints"):
        tr.fit()


def test_auto_interval_keeps_saving_after_a_resume(tmp_path) -> None:
    cfg = ("checkpoint.interval=auto", "checkpoint.mtbf_hours=0.00001", "train.max_steps=40")
    fit(tiny_config(*cfg, "train.stop_after=20"), run_dir=tmp_path)
    tr = build_trainer(tiny_config(*cfg), run_dir=tmp_path, resume=True)
    tr.fit()
    assert max(s for s in ck.list_checkpoints(tmp_path / "checkpoints") if s < 40) > 20


def test_a_fresh_run_refuses_a_directory_with_checkpoints(tmp_path) -> None:
    fit(tiny_config(*CK, "train.stop_after=4"), run_dir=tmp_path)
    before = (tmp_path / "config.json").read_text()
    with pytest.raises(ConfigError, match="already holds checkpoints"):
        build_trainer(tiny_config(*CK), run_dir=tmp_path)
    with pytest.raises(ConfigError, match=r"model\.d_model"):
        build_trainer(tiny_config(*CK, "model.d_model=48"), run_dir=tmp_path, resume=True)
    assert (tmp_path / "config.json").read_text() == before  # a refused resume changes nothing


def test_a_replaced_checkpoint_is_never_missing(tmp_path) -> None:
    fit(tiny_config(*CK, "train.stop_after=8"), run_dir=tmp_path)
    root = tmp_path / "checkpoints"
    # a crash between the two renames of a replacement leaves only the old copy aside
    (root / "step00000008").rename(root / ".old-step00000008")
    ck.clean_temporaries(root)
    assert 8 in ck.list_checkpoints(root)
    ck.verify_checkpoint(root / "step00000008")


def test_the_progress_bar_of_a_resumed_run_shows_its_last_evaluation(tmp_path) -> None:
    """A resume's progress bar read "val nan" until the next evaluation, where the run's log
    had said the last one; the run's last evaluation (restored with it) is its start."""
    from io import StringIO

    from rich.console import Console

    from spikewatch.trainer.builtin.progress import ProgressBar

    cfg = ("train.max_steps=12", "eval.interval=4", "eval.batches=2", *CK)
    first = fit(tiny_config(*cfg, "train.stop_after=8"), run_dir=tmp_path / "run")
    assert first.val_losses[-1][0] == 8
    bar, seen = ProgressBar(Console(file=StringIO())), []
    start = bar.on_fit_start

    def at_start(state) -> None:  # noqa: ANN001
        start(state)
        seen.append(bar.val)

    bar.on_fit_start = at_start  # type: ignore[method-assign]
    build_trainer(tiny_config(*cfg), run_dir=tmp_path / "run", resume=True, callbacks=[bar]).fit()
    assert seen == [first.val_losses[-1][1]]
