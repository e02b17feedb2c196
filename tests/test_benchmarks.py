"""Every benchmark and study under benchmarks/ (its folders too) imports against today's code,
and runs at tiny sizes as a script does (`SMOKE`; the slow tier takes the ones that need more than
~15 s, the rest are end-to-end). A product rename one of them reached for (`DbSink._q`,
`Watch.decide`, `spikewatch.hf.max_logits`: each broke one once, unseen) fails here, not the next
time someone measures."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

SCRIPT = """
import importlib.util, sys, pathlib
failed = []
for f in sorted(pathlib.Path(sys.argv[1]).rglob("*.py")):
    spec = importlib.util.spec_from_file_location(f"bench_{f.parent.name}_{f.stem}", f)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    try:
        spec.loader.exec_module(mod)
    except BaseException as e:
        failed.append(f"{f.name}: {e!r}")
print("\\n".join(failed))
sys.exit(1 if failed else 0)
"""


def test_every_benchmark_imports() -> None:
    names = sorted(p.name for p in (REPO / "benchmarks").rglob("*.py"))
    assert len(names) > 40  # the folder as it is: a glob that found nothing proves nothing
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(REPO / "benchmarks")], env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]


# Each benchmark and study at tiny sizes, seconds each, as a script is run: a change in the
# product that one of them reaches for (a renamed method: `Watch.decide`, `spikewatch.hf.
# max_logits`) fails here. The ones with a test of their own are there: host_cost
# (tests/trainer/test_host_cost.py), loader_loop and accelerate_public (test_accelerate.py),
# nano_gpt_public (test_nano_gpt.py), store and store_scale (test_store_benchmark.py),
# genuine_spikes (test_genuine_spikes.py), the GPU check's torchtitan job (test_torchtitan.py).
# Longer than ~15 s here: the slow tier.
SMOKE: dict[str, tuple[str, ...]] = {
    "checkpoint": ("--d-model", "32", "--layers", "1", "--reps", "1"),
    "compiled_step": (
        "--steps",
        "12",
        "--batch-size",
        "2",
        "--seq-len",
        "16",
        "--d-model",
        "32",
        "--layers",
        "1",
        "--modes",
        "eager",
    ),  # fmt: skip
    "dashboard": (
        "--points",
        "200",
        "--layers",
        "2",
        "--heat-steps",
        "20",
        "--heads",
        "13",
        "--reps",
        "1",
    ),  # fmt: skip
    "data_check": ("--mb", "1"),
    "ddp_overhead": (
        "--reps",
        "1",
        "--steps",
        "12",
        "--d-model",
        "32",
        "--layers",
        "1",
        "--seq-len",
        "16",
        "--batch-size",
        "4",
    ),  # fmt: skip
    "deferred_read": ("--steps", "30"),
    "detection": ("--curves", "2", "--steps", "700", "--no-real"),
    "device_or_data": ("--faults", "1"),
    "distributed": (
        "--steps",
        "12",
        "--reps",
        "1",
        "--d-model",
        "32",
        "--layers",
        "1",
        "--batch",
        "4",
        "--seq-len",
        "16",
        "--ckpt-d-model",
        "32",
        "--ckpt-layers",
        "1",
    ),  # fmt: skip
    "false_refusals": ("--configs", "tiny_cpu", "--steps", "40", "--seeds", "1"),
    "framework_parts": ("--steps", "24", "--batch-size", "2"),
    "gc_pauses": ("--steps", "50"),
    "goodput_page": ("--reps", "1"),
    "integrations": (
        "--reps",
        "1",
        "--steps",
        "24",
        "--d-model",
        "32",
        "--layers",
        "1",
        "--seq-len",
        "16",
        "--batch-sizes",
        "2",
        "--only",
        "loop",
    ),  # fmt: skip
    "nanogpt_loop": ("--iters", "10", "--rounds", "1"),
    "overhead_parts": ("--steps", "30", "--batch-size", "2"),
    "probe_overhead": ("--reps", "1", "--steps", "30", "--wide-steps", "12"),
    "rollback_defaults": (
        "--config",
        "tiny_cpu",
        "--margins",
        "1",
        "--extras",
        "10",
        "--jobs",
        "1",
    ),  # fmt: skip
    "sample_skip": ("--steps", "60", "--at", "40", "--rows", "2", "--jobs", "1", "--seeds", "0"),
    "simulate": ("--seeds", "2", "--reps", "1"),
    "snapshot": (
        "--reps",
        "1",
        "--layers",
        "1",
        "--d-model",
        "64",
        "--batch-size",
        "2",
        "--seq-len",
        "16",
    ),  # fmt: skip
    "stalls": ("--hang", "1.5"),
    "step_ops": (),
    "store_faults": ("--faults", "sqlite_locked", "--clients", "watch"),
    "sweep": ("--steps", "40"),
    "throughput": ("--steps", "12", "--reps", "1", "--configs", "tiny_cpu"),
    "torchtitan_overhead": ("--reps", "1", "--steps", "30", "--seq-len", "32"),
    "two_tier": ("--steps", "60", "--at", "40", "--jobs", "1"),
    "watch": ("--seconds", "2", "--scalars", "2"),
    "studies/early_warning": ("--root", "{tmp}", "--smoke", "--jobs", "1"),
    "studies/ngram_ablation": ("--steps", "30", "--seeds", "1", "--bursts", "1"),
    "studies/page_faults": ("--steps", "6", "--batch-size", "2", "--only", "loop"),
    "studies/spike_search": ("--root", "{tmp}", "--steps", "40", "--arms", "noclip", "--jobs", "1"),
}
# longer than ~15 s each on 2 cores: the slow tier (make test-slow)
SLOW = {"dashboard", "ddp_overhead", "device_or_data", "distributed", "framework_parts",
        "goodput_page", "probe_overhead", "rollback_defaults", "stalls", "sweep",
        "store_faults", "torchtitan_overhead", "two_tier", "studies/early_warning",
        "studies/page_faults"}  # fmt: skip
OWN_TESTS = {"host_cost", "loader_loop", "accelerate_public", "nano_gpt_public", "store",
             "store_scale", "studies/genuine_spikes", "gpu/gpu_check"}  # fmt: skip


def test_every_benchmark_has_a_smoke_run() -> None:
    where = REPO / "benchmarks"
    found = {str(p.relative_to(where).with_suffix(""))
             for p in where.rglob("*.py") if not p.name.startswith("_")}  # fmt: skip
    assert found == set(SMOKE) | OWN_TESTS


@pytest.mark.e2e
@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in sorted(SMOKE)]
)
def test_smoke_run(name: str, tmp_path: Path) -> None:
    args = [a.format(tmp=tmp_path) for a in SMOKE[name]]
    env = {**os.environ, "PYTHONPATH": str(REPO)}  # its store: runs/ in tmp_path
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / f"{name}.py"), *args],
                          env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-3000:])
    assert done.stdout.strip(), done.stderr[-2000:]
