"""spikewatch in torchtitan (issue 48): its Llama 3 debug model trained by torchtitan's own
entry point, `python -m torchtitan.train --module ... --config ...`, on a CPU through the tests'
shim (tests/spikewatch/titan_cpu.py: a byte tokenizer, a loader of corpus windows with a
poisoned region, causal SDPA for FlexAttention, gloo's SUM), in one process and on 2 gloo ranks
with FSDP2: one agreed rollback from host memory before the onset, the loader's batches in the
spike skipped, the run's updates all made, one run in the store naming the rank, every probe
recorded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.orm import Session

pytest.importorskip("torchtitan", reason="the torchtitan extra is not installed")

from spikewatch.observatory import store  # noqa: E402
from spikewatch.observatory.store.db import make_engine  # noqa: E402

from .conftest import REPO  # noqa: E402

pytestmark = pytest.mark.e2e  # trains a model (tests/README.md)

TIMEOUT_S = 600


def _command(cwd: Path, ranks: int, *args: str) -> tuple[list[str], dict[str, str]]:
    db = f"sqlite:///{cwd / 'x.db'}"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc_per_node={ranks}", "-m", "torchtitan.train",
        "--module", "tests.spikewatch.titan_cpu", "--config", "debug_cpu",
        "--dump_folder", str(cwd / "out"), "--spikewatch.db", db,
        "--spikewatch.summary_json", str(cwd / "s.json"), *args,
    ]  # fmt: skip
    return cmd, {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


def _titan(cwd: Path, ranks: int, *args: str) -> dict[str, Any]:
    """torchtitan's own entry point under torchrun; returns the summary and the store's URL."""
    cwd.mkdir(parents=True, exist_ok=True)
    cmd, env = _command(cwd, ranks, *args)
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, (done.stdout + done.stderr)[-5000:]
    return {"summary": json.loads((cwd / "s.json").read_text()), "db": f"sqlite:///{cwd / 'x.db'}"}


def _losses(db: str) -> dict[int, float]:
    with Session(make_engine(db)) as session:
        (run,) = store.list_runs(session)
        (series,) = store.series(session, run_id=run.run_id, metric="train/loss")
        return {b.start: b.max_value for b in series.buckets}


def _one_rollback(summary: dict[str, Any], tier: str = "memory") -> dict[str, Any]:
    (rb,) = [i for i in summary["interventions"] if i["kind"] == "rollback"]
    assert rb["to_step"] < rb["onset_step"] <= rb["step"], rb
    assert rb["tier"] == tier
    (skip,) = rb["skip_ranges"]  # the loader flowed on past the poisoned batches
    assert skip[0] <= rb["onset_step"] and skip[1] > rb["step"], rb
    return rb


def _stored(db: str, run_id: str) -> tuple[list[str], list[Any]]:
    with Session(make_engine(db)) as session:
        runs = store.list_runs(session)
        assert [r.run_id for r in runs] == [run_id] and runs[0].status == "completed"
        return store.metric_names(session, run_id=run_id), store.events(session, run_id=run_id)


def test_one_process_rolls_back_tells_the_cause_names_the_rows_and_records_every_probe(
    tmp_path,
) -> None:
    """Row 2 of batches 80-85 poisoned: one rollback from host memory before the onset; the
    replay of the kept batches reproduces the spike to the bit (the data's cause), and the
    rows named are the poisoned ones, by the loader's own ids."""
    out = _titan(
        tmp_path, 1, "--training.steps", "100", "--dataloader.poison_at", "80",
        "--dataloader.poison_len", "6", "--dataloader.poison_row", "2", "--dataloader.ids",
    )  # fmt: skip
    s = out["summary"]
    rb = _one_rollback(s)
    assert 80 <= rb["onset_step"] <= 83 and rb["to_step"] == 75  # host memory every 25 steps
    assert s["steps"] == s["framework_step"] == 100  # torchtitan's step follows the Watch's
    # the live branch's tokens: a rolled-back step's go with it, a skipped batch's are not
    # trained (they leaked into the next step's count before)
    assert s["tokens"] == 100 * 4 * 64
    assert rb["cause"] == "data_x_state" and rb["control_peak_loss"] < rb["pre_spike_loss"] * 2
    assert rb["replay_peak_loss"] == rb["peak_loss"]  # the same batches, the same state
    from spikewatch.corpus import text_corpus

    from .titan_data import window_start

    n = len(text_corpus(source="code")[0])
    named = rb["samples"]
    assert named and {x["row"] for x in named} == {2}, named
    for x in named:  # batch b's row 2 is the loader's row 4 b + 2: its window, its id
        assert 80 <= x["batch"] < 86 and x["id"] == str(
            window_start(4 * x["batch"] + 2, 0, 1, n, 64)
        )
    names, events = _stored(out["db"], s["run_id"])
    assert [e.kind for e in events if e.kind == "rollback"] == ["rollback"]
    # torchtitan's model, probed in its own module names: per-layer gradient norms, per-head
    # attention maxima of its inner attention (6 layers, 16 heads), Adam's moments
    for name in ("grad_norm", "update_ratio", "adam_m_norm", "adam_v_tiny_frac"):
        assert f"layer/*/attention/{name}" in names and f"layer/*/feed_forward/{name}" in names
    assert "layer/*/head/*/attn_max" in names, names


@pytest.mark.slow  # 3 min on 2 cores; FSDP2 on 2 ranks is in make test by test_distributed.py
@pytest.mark.distributed
def test_two_gloo_ranks_with_fsdp2_agree_one_rollback_naming_rank_1(tmp_path) -> None:
    """The issue's 'must show': torchrun on 2 gloo ranks, FSDP2, rank 1's shard poisoned; and
    torchtitan's torch.compile of each block with the probes inside (Inductor on a CPU)."""
    out = _titan(
        tmp_path, 2, "--dataloader.poison_at", "80", "--dataloader.poison_len", "8",
        "--dataloader.poison_rank", "1", "--compile.enable",
    )  # fmt: skip
    s = out["summary"]
    rb = _one_rollback(s)
    assert rb["ranks"] == [1] and rb["to_step"] == 75
    steps = [step for step, _ in rb["rank_losses"]]
    assert steps and all(rb["to_step"] < t <= rb["step"] for t in steps)
    assert s["steps"] == 120
    names, events = _stored(out["db"], s["run_id"])  # rank 0 alone wrote: one run
    rollbacks = [e for e in events if e.kind == "rollback"]
    assert len(rollbacks) == 1 and rollbacks[0].data["ranks"] == [1]
    assert "rank/*/loss" in names and "layer/*/head/*/attn_max" in names


# slow tier: make test keeps torchtitan's rollback in one process (the test above); this one
# adds its own checkpoints kept exponentially (~55 s)
@pytest.mark.slow
def test_rollback_from_torchtitans_checkpoints_kept_exponentially(tmp_path) -> None:
    """Host memory off: the rollback restores torchtitan's own DCP checkpoint from before the
    onset (in place: the loader flows on), replays the spike from it, pins it and drops the
    abandoned step-40 one; retention keeps the newest 2, one per power-of-two age, the pin."""
    args = ("--training.steps", "60", "--checkpoint.enable", "--checkpoint.interval", "5",
            "--checkpoint.keep_latest_k", "2", "--dataloader.poison_at", "40",
            "--dataloader.poison_len", "6",
            "--spikewatch.settings", '{"checkpoint": {"memory_interval": null}}')  # fmt: skip
    s = _titan(tmp_path, 1, *args)["summary"]
    rb = _one_rollback(s, tier="disk")
    assert rb["to_step"] == 35 and rb["dropped_checkpoints"] == [40], rb
    assert rb["cause"] == "data_x_state"
    folder = tmp_path / "out" / "checkpoint"
    held = sorted(int(p.name[5:]) for p in folder.glob("step-*"))
    # pruned at the step-55 save (torchtitan's last-step save does not prune): 55 and 50 the
    # newest, 45 (age 10), 35 pinned, 25 (age 30), 5 (age 50); then the final step 60
    assert held == [5, 25, 35, 45, 50, 55, 60], held
    assert json.loads((folder / "spikewatch-pins.json").read_text()) == {"35": ["rollback target"]}


def test_selected_with_one_flag_or_one_line() -> None:
    """`--module spikewatch.torchtitan --config NAME` is torchtitan's config NAME with
    spikewatch on; `with_spikewatch(config)` does it in a user's own config module."""
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    import spikewatch.torchtitan as titan

    config = titan.llama3_debugmodel()
    assert isinstance(config, titan.SpikewatchTrainer.Config)
    plain = llama3_debugmodel()
    assert config.training.steps == plain.training.steps
    assert config.model_spec.flavor == plain.model_spec.flavor
    mine = titan.with_spikewatch(plain, db="sqlite:///x.db", attn_max=False)
    assert mine.spikewatch.db == "sqlite:///x.db" and not mine.spikewatch.attn_max
    with pytest.raises(AttributeError, match="no_such_config"):
        titan.no_such_config  # noqa: B018


def test_cuda_graphs_and_pipeline_parallelism_are_refused_in_one_line(monkeypatch) -> None:
    import spikewatch.torchtitan as titan

    config = titan.llama3_debugmodel()
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    config.training.disable_cuda_graphs = False
    with pytest.raises(ValueError, match="--training.disable_cuda_graphs"):
        titan._refuse_unsupported(config)
    config.training.disable_cuda_graphs = True
    titan._refuse_unsupported(config)
    config.parallelism.pipeline_parallel_degree = 2
    with pytest.raises(ValueError, match="pipeline parallelism"):
        titan._refuse_unsupported(config)


@pytest.mark.slow  # 2 min on 2 cores: four torchtitan starts
def test_a_job_killed_after_a_rollback_and_after_a_checkpoint_resumes_on_the_same_weights(
    tmp_path,
) -> None:
    """torchtitan's own DCP checkpoints carry the Watch (its guard, the run, the data
    position). The spike at batch 30 rolls back to host memory's step 25; the worker is
    SIGKILLed at batch 36, before its next checkpoint (step 40): the rollback wrote step 25
    again with what the run learned, so the restarted job goes on past the poisoned batches
    (from step 20, as torchtitan alone would, it trains them again); it is killed once more at
    batch 60, after torchtitan's step-40 checkpoint, and the third start ends on the
    uninterrupted twin's losses, to the bit."""
    args = ("--training.steps", "60", "--checkpoint.enable", "--checkpoint.interval", "20",
            "--dataloader.poison_at", "30", "--dataloader.poison_len", "6")  # fmt: skip
    twin = _titan(tmp_path / "twin", 1, *args)
    a = twin["summary"]
    assert [(i["kind"], i["to_step"], i["tier"]) for i in a["interventions"]] == [
        ("rollback", 25, "memory")
    ]
    killed = tmp_path / "killed"
    killed.mkdir()
    cmd, env = _command(killed, 1, *args, "--dataloader.die_at", "36,60")
    folder = killed / "out" / "checkpoint"
    for died, newest in ((36, 25), (60, 40)):
        done = subprocess.run(cmd, cwd=killed, env=env, capture_output=True, timeout=TIMEOUT_S)
        assert done.returncode != 0 and (killed / f"died-{died}").exists()
        held = sorted(int(p.name[5:]) for p in folder.glob("step-*"))
        assert held[-1] == newest, held  # the rewritten step 25; then torchtitan's step 40
        assert not (killed / "s.json").exists()
    resumed = _titan(killed, 1, *args, "--dataloader.die_at", "36,60")
    b = resumed["summary"]
    assert b["steps"] == 60 and b["final_train_loss"] == a["final_train_loss"]  # to the bit
    assert b["skipped_batches"] == a["skipped_batches"] and b["tokens"] == a["tokens"]
    assert [i["step"] for i in b["interventions"]] == [i["step"] for i in a["interventions"]]
    after = {s: v for s, v in _losses(resumed["db"]).items() if s > 25}
    assert after and after == {s: v for s, v in _losses(twin["db"]).items() if s > 25}


def test_the_watchs_disk_tier_is_refused_and_settings_are_checked() -> None:
    """torchtitan's checkpoints are the disk tier; the Watch's own would fail mid-run (DCP
    cannot name the fused modules' parameters), so it is refused at start, in one line."""
    from spikewatch.torchtitan import SpikewatchOptions, watch_settings

    ok = watch_settings(SpikewatchOptions(settings='{"guard": {"rollback": false}}'))
    assert ok["checkpoint"] == {"interval": None, "memory_interval": "auto"}  # 25 off a GPU
    assert ok["guard"] == {"rollback": False}
    with pytest.raises(ValueError, match="its own --checkpoint"):
        watch_settings(SpikewatchOptions(settings='{"checkpoint": {"interval": 10}}'))
    with pytest.raises(ValueError, match="not JSON"):
        watch_settings(SpikewatchOptions(settings="{guard"))


def test_the_gpu_checks_torchtitan_job_is_a_compiled_llama_of_8_blocks() -> None:
    """The GPU check's job (benchmarks/gpu/_gpu_titan.py, run only on a device) as built here: a
    torchtitan Llama 3 of 8 blocks (1B's: d=2048, grouped-query attention), compiled, spikewatch
    on, every block's inner attention where the probes hook it; its model built on `meta`."""
    import importlib.util

    import torch

    from spikewatch.torchtitan import SpikewatchTrainer

    spec = importlib.util.spec_from_file_location(
        "_gpu_titan", REPO / "benchmarks/gpu/_gpu_titan.py"
    )
    assert spec is not None and spec.loader is not None
    gpu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu)
    config = gpu.gpu_llama()
    assert isinstance(config, SpikewatchTrainer.Config) and config.compile.enable
    assert config.training.disable_cuda_graphs and not config.checkpoint.enable
    model = config.model_spec.model
    assert (len(model.layers), model.dim, model.vocab_size) == (8, 2048, 2048)
    with torch.device("meta"):
        built = model.build()
    hooked = [n for n, _ in built.named_modules() if n.endswith("attention.inner_attention")]
    assert len(hooked) == 8
    assert 0.45e9 < sum(p.numel() for p in built.parameters()) < 0.55e9
