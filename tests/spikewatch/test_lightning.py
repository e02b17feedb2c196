"""spikewatch.lightning in a Lightning run (examples/lightning_module.py): detection, rollback
and recovery with the skip-aware stream, probes by module names, and Lightning's own resume
after SIGKILL."""

from __future__ import annotations

import pytest

pytest.importorskip("lightning", reason="the lightning extra is not installed")

from .conftest import (  # noqa: E402
    POISON,
    STEPS,
    assert_same_weights,
    final_weights,
    kill_when,
    launch,
    run_example,
    the_rollback,
)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    tmp = tmp_path_factory.mktemp("lightning")
    db = ("--db", "none")
    return {
        "clean": run_example("lightning_module", tmp / "clean", *STEPS, *db),
        "guarded": run_example("lightning_module", tmp / "guarded", *STEPS, *POISON, *db),
        "unguarded": run_example(
            "lightning_module", tmp / "unguarded", *STEPS, *POISON, "--no-rollback", *db
        ),
    }


def test_a_poisoned_region_is_rolled_back_and_the_run_recovers(runs) -> None:
    clean, guarded, unguarded = runs["clean"], runs["guarded"], runs["unguarded"]
    rb = the_rollback(guarded)
    assert 100 < rb["onset_step"] <= 106
    assert rb["to_step"] < rb["onset_step"]
    (start, end), *_ = rb["skip_ranges"]
    assert start <= 100 < end
    assert guarded["steps"] == clean["steps"] == 150
    assert not unguarded["interventions"]
    assert guarded["final_val_loss"] <= clean["final_val_loss"] * 1.02
    assert unguarded["final_val_loss"] >= clean["final_val_loss"] * 1.02


def test_probes_use_the_models_module_names(runs) -> None:
    names = set(runs["guarded"]["metric_names"])
    assert {"layer/0/head/3/attn_max", "layer/1/attn_max"} <= names
    assert {"layer/0/self_attn/grad_norm", "layer/1/mlp/grad_norm"} <= names


def test_sigkill_then_lightning_resume_equals_an_uninterrupted_run(tmp_path) -> None:
    args = ("--steps", "60", "--save-every", "10", "--db", "none", "--poison-at", "30")
    args = (*args, "--poison-len", "14")
    args = (*args, "--output-dir", "out")
    whole = run_example("lightning_module", tmp_path / "whole", *args)
    killed = tmp_path / "killed"
    saved = killed / "out" / "checkpoints"
    proc = launch("lightning_module", killed, *args)
    kill_when(proc, (saved / "step=40.ckpt").exists)
    for ckpt in saved.glob("step=*.ckpt"):  # Lightning writes in place: 40 may be torn
        if int(ckpt.stem.split("=")[1]) > 30:
            ckpt.unlink()
    resumed = run_example("lightning_module", killed, *args, "--resume")
    (run,) = (killed / "out" / "spikewatch").iterdir()
    assert resumed["run_id"] == run.name
    assert resumed["final_train_loss"] == whole["final_train_loss"]
    assert resumed["final_val_loss"] == whole["final_val_loss"]
    assert [i["to_step"] for i in resumed["interventions"]] == [
        i["to_step"] for i in whole["interventions"]
    ]
    assert_same_weights(
        final_weights(killed / resumed["run_dir"]),
        final_weights(tmp_path / "whole" / whole["run_dir"]),
    )
