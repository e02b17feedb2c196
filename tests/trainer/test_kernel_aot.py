"""The Triton attention as a GPU would compile it, on a CPU (issue 49): every launch the
launcher makes, for the head dims and dtypes the backends select, compiled ahead of time for
sm_80 and sm_90 with Triton's bundled ptxas (tests/trainer/kernel_aot.py). The interpreter the
other kernel tests use upcasts to fp32 and would hide each of these defects."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e  # trains a model (tests/README.md)

pytest.importorskip("triton")

SCRIPT = Path(__file__).with_name("kernel_aot.py")


def _run(cases: list[list], *flags: str) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run(
        [sys.executable, str(SCRIPT), json.dumps(cases), *flags],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    return json.loads(out.stdout.splitlines()[-1])


@pytest.fixture(scope="module")
def compiled() -> list[dict]:
    # the smallest and largest head dims the backends select, the fp32 worst cases of shared
    # memory, and mixed dtypes (HF Llama's RoPE, the built-in qk_norm under bf16 autocast)
    cases = [[1, 2, 64, d, "bf16", "bf16", "bf16", True] for d in (16, 128)]
    cases += [[1, 2, 64, d, "fp32", "fp32", "fp32", True] for d in (64, 128)]
    cases.append([1, 2, 64, 64, "fp32", "fp32", "bf16", True])
    return _run(cases)


def test_every_launch_compiles_for_sm80_and_sm90_within_shared_memory(compiled) -> None:
    assert {r["arch"] for r in compiled} == {80, 90}
    # the attention's 3 kernels x 5 head dim / dtype cases, the max's 2 forms (per block, and
    # per head by atomic max) x 4 (it casts k to q's dtype: the mixed case is the fp32 one),
    # each for 2 targets; the probes' one-pass Adam statistics, 2 targets
    assert len(compiled) == 48
    assert [r["ok"] for r in compiled if r["kernel"] == "_adam_state_kernel"] == [True, True]
    assert {r["constexprs"]["HEADS"] for r in compiled if r["kernel"] == "_max_kernel"} == {
        True,
        False,
    }
    assert {r["kernel"] for r in compiled} >= {"_fwd_kernel", "_max_kernel"}
    failed = [
        (r["kernel"], r["arch"], r["constexprs"], r.get("error")) for r in compiled if not r["ok"]
    ]
    assert not failed
    over = [
        (r["kernel"], r["arch"], r["constexprs"]["D"], r["pointer_dtypes"], r["shared"])
        for r in compiled
        if r["shared"] > r["limit"]
    ]
    assert not over  # fp32 at D=128 once took 197,120 bytes on sm_80 (limit 166,912)


def test_q_k_and_v_reach_the_kernel_in_one_dtype(compiled) -> None:
    """fp32 q, k beside a bf16 v fail in tl.dot on a GPU: the entry casts q and k to v's."""
    mixed = [r for r in compiled if len(set(r["qkv"])) != 1]
    assert not mixed


def test_fp32_dots_are_ieee_not_tf32(compiled) -> None:
    fp32 = [r for r in compiled if r["pointer_dtypes"] == ["*fp32"]]
    assert fp32 and all(r["constexprs"]["PRECISION"] == "ieee" for r in fp32)
    assert not [r for r in fp32 if r["tf32"]]


def test_batch_times_heads_goes_on_the_grids_long_axis() -> None:
    """B * H = 70,000 programs do not fit the 65,535 of a grid's second axis."""
    grids = _run([[70000, 1, 16, 16, "bf16", "bf16", "bf16", True]], "--grids")
    grids = [g for g in grids if g["kernel"] != "_adam_state_kernel"]  # (not a B * H grid)
    assert len(grids) == 5  # the attention's 3 launches and the max's 2 forms
    assert all(g["grid"][0] == 70000 and g["grid"][1] <= 65535 for g in grids)
