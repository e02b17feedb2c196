"""The three ways in (examples/plain_loop.py, hf_trainer.py, lightning_module.py), each at a
tiny size: a poisoned region is detected, rolled back to a checkpoint from before its onset and
skipped, and the run ends within 2% of the clean run's validation loss while the same run
without the rollback ends clearly worse; probes carry the model's module names; a run killed
with SIGKILL and resumed (from the Watch's checkpoints, or the framework's own) ends exactly as
an uninterrupted one."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from .conftest import (
    POISON,
    STEPS,
    assert_same_weights,
    final_weights,
    kill_when,
    launch,
    run_example,
    the_rollback,
)

pytestmark = pytest.mark.e2e  # trains a model (tests/README.md)


@dataclass(frozen=True)
class Way:
    example: str
    attn: str  # the model's name for a block's attention module
    embed: str  # the probe layer of the token embedding
    save: tuple[str, ...]  # arguments that make it save, in a place `killed_at` looks
    resume: tuple[str, ...]

    def killed_at(self, cwd: Path, step: int) -> Path:
        """A file that exists once the checkpoint of `step` is complete."""
        return {
            "plain_loop": cwd / "run" / "checkpoints" / f"step{step:08d}" / "meta.json",
            "hf_trainer": cwd / "out" / f"checkpoint-{step}" / "spikewatch.json",
            "lightning_module": cwd / "out" / "checkpoints" / f"step={step}.ckpt",
        }[self.example]


WAYS = [
    # resume="auto": the plain loop's restart is its first command line again
    Way("plain_loop", "attn", "wte", ("--run-dir", "run"), ()),
    Way("hf_trainer", "self_attn", "model.embed_tokens", ("--output-dir", "out"), ("--resume",)),
    Way(
        "lightning_module",
        "self_attn",
        "model.model.embed_tokens",
        ("--output-dir", "out"),
        ("--resume",),
    ),
]


@pytest.fixture(scope="module", params=WAYS, ids=lambda w: w.example)
def runs(request, tmp_path_factory) -> tuple[Way, dict[str, dict]]:
    way: Way = request.param
    if way.example != "plain_loop":
        pytest.importorskip("transformers", reason="the hf extra is not installed")
    if way.example == "lightning_module":
        pytest.importorskip("lightning", reason="the lightning extra is not installed")
    tmp = tmp_path_factory.mktemp(way.example)
    db = ("--db", "none")
    return way, {
        "clean": run_example(way.example, tmp / "clean", *STEPS, *db),
        "guarded": run_example(way.example, tmp / "guarded", *STEPS, *POISON, *db),
        "unguarded": run_example(
            way.example, tmp / "unguarded", *STEPS, *POISON, "--no-rollback", *db
        ),
    }


def test_a_poisoned_region_is_rolled_back_and_the_run_recovers(runs) -> None:
    _, r = runs
    clean, guarded, unguarded = r["clean"], r["guarded"], r["unguarded"]
    rb = the_rollback(guarded)
    assert 100 < rb["onset_step"] <= 106  # batch 100 is trained as step 101
    assert rb["to_step"] < rb["onset_step"]
    (start, end), *_ = rb["skip_ranges"]
    assert start <= 100 < end
    assert guarded["steps"] == clean["steps"] == 150  # the lag was made up
    if "framework_step" in guarded:  # the Trainer's step is the updates, its cadence held
        assert guarded["framework_step"] == 150
        assert [v["step"] for v in guarded["val_losses"]][:3] == [50, 100, 150]
    assert not unguarded["interventions"]
    assert guarded["final_val_loss"] <= clean["final_val_loss"] * 1.02
    assert unguarded["final_val_loss"] >= clean["final_val_loss"] * 1.02


def test_probes_carry_the_models_module_names(runs) -> None:
    way, r = runs
    names = set(r["guarded"]["metric_names"])
    assert {"layer/0/head/3/attn_max", "layer/1/attn_max", "train/loss"} <= names
    assert {f"layer/0/{way.attn}/grad_norm", "layer/1/mlp/grad_norm"} <= names
    assert f"layer/{way.embed}/grad_norm" in names
    assert {f"layer/0/{way.attn}/update_ratio", f"layer/0/{way.attn}/adam_sqrt_v_max"} <= names


@pytest.mark.parametrize("way", WAYS, ids=lambda w: w.example)
def test_sigkill_then_resume_equals_an_uninterrupted_run(way: Way, tmp_path) -> None:
    if way.example != "plain_loop":
        pytest.importorskip("transformers", reason="the hf extra is not installed")
    args = ("--steps", "60", "--db", "none", "--poison-at", "30", "--poison-len", "14")
    args = (*args, "--checkpoint-every", "5", "--save-every", "10", *way.save)
    if way.example == "plain_loop":
        args = tuple(a for a in args if a not in ("--save-every", "10"))
    whole = run_example(way.example, tmp_path / "whole", *args)
    killed = tmp_path / "killed"
    kill_when(launch(way.example, killed, *args), way.killed_at(killed, 40).exists)
    if way.example == "lightning_module":  # Lightning writes in place: 40 may be torn
        for ckpt in (killed / "out" / "checkpoints").glob("step=*.ckpt"):
            if int(ckpt.stem.split("=")[1]) > 30:
                ckpt.unlink()
    resumed = run_example(way.example, killed, *args, *way.resume)
    assert Path(resumed["run_dir"]).parent == Path(whole["run_dir"]).parent
    assert (killed / resumed["run_dir"]).is_dir()  # the same run went on
    assert resumed["final_train_loss"] == whole["final_train_loss"]
    assert resumed["final_val_loss"] == whole["final_val_loss"]
    assert [i["to_step"] for i in resumed["interventions"]] == [
        i["to_step"] for i in whole["interventions"]
    ]
    assert resumed["interventions"], "the rollback before the kill is remembered"
    assert_same_weights(
        final_weights(killed / resumed["run_dir"]),
        final_weights(tmp_path / "whole" / whole["run_dir"]),
    )
