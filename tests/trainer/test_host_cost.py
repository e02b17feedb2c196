"""benchmarks/host_cost.py at a tiny shape (its smoke run, so that it cannot rot unseen): the
Watch on `meta` as the GPU, read late; its snapshots and steps make the host wait for nothing,
and the figures the issue names are printed."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e  # trains a model (tests/README.md)

REPO = Path(__file__).resolve().parents[2]
KEYS = (
    "host_ms_per_step",
    "max_event_ms",
    "max_disk_event_ms",
    "waits_per_step",
    "waits_per_snapshot",
    "kernels_per_step",
    "flops_ratio",
    "bytes_ratio",
    "predicted_h200_ratio",
)


def test_host_cost_smoke_run_counts_no_wait_at_a_step_or_a_snapshot(capsys) -> None:
    spec = importlib.util.spec_from_file_location("host_cost", REPO / "benchmarks/host_cost.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["host_cost"] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    out = mod.main(["--smoke"])
    assert all(k in out for k in KEYS)
    assert out["waits_per_step"] == 0 and out["waits_per_snapshot"] == 0
    assert out["events"]["memory"]["steps"] >= 1  # a snapshot was taken and counted
    assert out["table_launches_per_step"] == 2  # the fused max pass, one a layer
    # and the one-pass Adam statistics, one launch a state step (steps 10 and 20 of 25)
    assert out["triton_launches_per_step"] == 2.08
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("{")


def _host_cost():
    spec = importlib.util.spec_from_file_location("host_cost", REPO / "benchmarks/host_cost.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["host_cost"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_a_disk_checkpoint_waits_for_nothing_and_the_maxima_go_into_the_table() -> None:
    """A disk checkpoint of the step in flight makes no host wait: its tensors are copied as
    the step runs and its file is written once the step is read at the next step's end (it
    drained the step in flight, one wait, before). The waiting update statistics' copy is
    enqueued at the save and read with the step: no wait either. The plain-loop GPT reserves
    its maxima's table, so each layer's maxima are one launch into it: the form a compiled
    graph launches from its own code."""
    mod = _host_cost()
    # a file every 101 steps: the state step at 100 is still on its way when it is saved
    ckpt = {"interval": 101, "memory_interval": 30}
    h = mod.Harness("smoke", 102, disk=True, settings={"checkpoint": ckpt})
    rows = h.run()
    disk = [r for r in rows if "disk" in r.events and r.step > 1]  # (step 1: the first file)
    assert [r.step for r in disk] == [101] and "state" in rows[99].events
    assert [r.waits for r in rows] == [0] * len(rows)
    counted = mod.Harness("smoke", 3, disk=False)
    crows = counted.run(count_every=1)
    assert [r.table for r in crows] == [2, 2, 2]  # two layers, one launch each into the table
    assert [r.triton for r in crows] == [2, 2, 2]  # and no other Triton launch


def test_a_state_step_never_falls_on_a_checkpoints_step() -> None:
    """Each is a few ms of the loop thread's time; on one step they added up to the run's
    longest step. A state step due at a snapshot's or a file's step is taken two steps on."""
    h = _host_cost().Harness("smoke", 102, disk=True)
    rows = h.run()
    both = [r.step for r in rows if "state" in r.events and r.events & {"memory", "disk"}]
    assert both == []
    state = [r.step for r in rows if "state" in r.events]
    assert state == [10, 20, 30, 40, 52, 60, 70, 80, 90, 102]  # snapshots at 25, 50, 75, 100


def test_the_one_pass_plan_is_built_on_a_plain_step_not_on_the_first_state_step() -> None:
    """What the state pass builds once (its chunk plan: ~5 ms of host at 124M on meta) is built
    on the first step that is not a state step once the optimizer's state exists, so the first
    state step carries only its own work, as every later one does."""
    from spikewatch.trainer.model.kernels.adam_state import AdamState

    mod = _host_cost()
    h = mod.Harness("smoke", 12, disk=False)
    built: list[int] = []
    plan_for = AdamState._plan_for

    def recording(self, device, ps=None):  # noqa: ANN001, ANN202
        before = self._shape
        out = plan_for(self, device, ps)
        if self._shape != before:
            built.append(h.step)
        return out

    AdamState._plan_for = recording
    try:
        rows = h.run()
    finally:
        AdamState._plan_for = plan_for
    assert [r.step for r in rows if "state" in r.events] == [10]
    assert built == [1]  # right after step 1's update made the optimizer's state


def test_a_fused_adamws_refusal_flag_comes_with_the_factor_no_op_makes_it() -> None:
    """Read late, the same-step factor is one device op; torch's fused AdamW is refused through
    its `found_inf` flag, which `(factor == 0).float()` made on the loop thread every step (two
    more kernels and two dispatches). The factor's op returns the flag with the factor: a plain
    step dispatches no `eq` (the bare step has none) and one copy fewer."""
    h = _host_cost().Harness("smoke", 4, disk=False)
    rows = h.run(count_every=1)
    assert [r.by_op.get("eq", 0) for r in rows[1:]] == [0, 0, 0]
    # (the step's transfer to the host is a `copy_` into a host buffer, as on CUDA)
    assert [r.by_op.get("_to_copy", 0) for r in rows[1:]] == [1, 1, 1]
