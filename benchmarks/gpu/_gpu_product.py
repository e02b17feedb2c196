"""The product end to end, as users run it, for the GPU check (benchmarks/gpu/gpu_check.py; issue
49): each section runs one of spikewatch's commands (the demo, the examples, a resume, the
built-in trainer with a fault) and reads its summary back; `ok` says whether it rolled back to
before its onset and finished. A helper of gpu_check.py, not a script."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from spikewatch.trainer.builtin.loop import build_trainer
from spikewatch.trainer.config import load_config

CUDA = torch.cuda.is_available()


def gpt_overrides(layers: int, d: int, heads: int, T: int, batch: int, steps: int) -> list[str]:
    return [
        f"model.n_layer={layers}",
        f"model.d_model={d}",
        f"model.n_head={heads}",
        f"model.max_seq_len={T}",
        f"data.seq_len={T}",
        f"data.batch_size={batch}",
        f"train.dtype={'bfloat16' if CUDA else 'float32'}",
        f"train.device={'cuda' if CUDA else 'cpu'}",
        "train.progress=false",
        f"train.max_steps={steps}",
        "schedule.warmup_steps=5",
        "eval.interval=none",
        "eval.batches=1",
    ]


# -- 0. the product end to end ----------------------------------------------------------------
REPO = Path(__file__).resolve().parents[2]


def _subprocess(cmd: list[str], cwd: Path, timeout: float) -> dict:
    """Run one of the product's commands; its exit code, wall time and the tail of its log."""
    cwd.mkdir(parents=True, exist_ok=True)
    path = os.pathsep.join(x for x in (str(REPO), os.environ.get("PYTHONPATH")) if x)
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    try:
        done = subprocess.run(
            cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
        )
        rc, log = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as e:
        rc, log = 124, f"timed out after {timeout} s: {(e.stderr or b'')[-2000:]!r}"
    (cwd / "log.txt").write_text(log)
    return {"rc": rc, "wall_s": time.perf_counter() - t0, "log_tail": log[-1500:] if rc else ""}


def _outcome(out: dict, summary: Path, planned: int) -> dict:
    """What a run's summary says: its rollbacks, named rows, steps; `ok` = rolled back to before
    its onset and finished."""
    if not summary.is_file():
        return {**out, "ok": False}
    s = json.loads(summary.read_text())
    rollbacks = [i for i in s["interventions"] if i.get("kind") == "rollback"]
    out.update(
        rollbacks=[[i.get("onset_step"), i.get("from_step"), i.get("to_step")] for i in rollbacks],
        rows=sorted({x["row"] for i in rollbacks for x in i.get("samples") or []}),
        tiers=[i.get("tier") for i in rollbacks],
        steps=s["steps"],
        final_val_loss=s["final_val_loss"],
        halted=s["halted"],
    )
    out["ok"] = (
        out["rc"] == 0
        and bool(rollbacks)
        and all(i["to_step"] < i["onset_step"] for i in rollbacks)
        and s["steps"] >= planned
        and not s["halted"]
    )
    return out


def _example(name: str, smoke: bool, out_dir: Path, *extra: str) -> dict:
    steps, poison = ("150", "100") if smoke else ("300", "200")
    where = out_dir / f"{name}{'_'.join(extra).replace('--', '_')}"
    cmd = [sys.executable, str(REPO / "examples" / f"{name}.py"), "--steps", steps]
    cmd += ["--poison-at", poison, "--poison-len", "14", "--db", f"sqlite:///{where}/sw.db"]
    cmd += ["--summary-json", "summary.json", *extra]
    if smoke:  # the test suite's small size (tests/spikewatch/conftest.py)
        cmd += ["--d-model", "64", "--seq-len", "64", "--batch-size", "8"]
    return _outcome(_subprocess(cmd, where, 150), where / "summary.json", int(steps))


def demo_check(smoke: bool, out_dir: Path) -> dict:
    where = out_dir / "demo"
    cmd = [sys.executable, "-m", "spikewatch", "demo", "--no-serve"]
    cmd += ["--db", f"sqlite:///{where}/sw.db", "--summary-json", "summary.json"]
    cmd += ["--run-dir", str(where / "run")]
    return _outcome(_subprocess(cmd, where, 150), where / "summary.json", 400)


# rows 0-1 of each poisoned batch (named by the rollback); at the smoke's small size two rows of
# eight are too weak a fault to spike, so whole batches there
ROWS = ("--poison-rows", "2")


def plain_loop_check(smoke: bool, out_dir: Path) -> dict:
    return _example("plain_loop", smoke, out_dir, "--compile", *(() if smoke else ROWS))


def plain_loop_fp16_check(smoke: bool, out_dir: Path) -> dict:
    extra = ("--precision", "fp16") if smoke else ("--compile", "--precision", "fp16", *ROWS)
    return _example("plain_loop", smoke, out_dir, *extra)


def hf_check(smoke: bool, out_dir: Path) -> dict:
    return _example("hf_trainer", smoke, out_dir)


def hf_fp16_check(smoke: bool, out_dir: Path) -> dict:
    if not CUDA:  # the Trainer's fp16 needs a GPU
        return {"skipped": "fp16 in the HF Trainer needs CUDA"}
    return _example("hf_trainer", smoke, out_dir, "--precision", "fp16")


def lightning_check(smoke: bool, out_dir: Path) -> dict:
    return _example("lightning_module", smoke, out_dir)


def lightning_fp16_check(smoke: bool, out_dir: Path) -> dict:
    return _example("lightning_module", smoke, out_dir, "--precision", "fp16")


def resume_check(smoke: bool, out_dir: Path) -> dict:
    """The demo's run (its poisoned region at 280) stopped at 150 and resumed, against the same
    run uninterrupted: both roll back and finish, the resumed one on the same losses."""
    where = out_dir / "resume"
    base = [sys.executable, "-m", "spikewatch", "train", "demo", "--no-db"]
    sets = ["train.max_steps=330"]  # eager: the resume is the point, and three compiles cost
    over = [a for kv in sets for a in ("--set", kv)]
    runs = [
        [*over, "--run-dir", str(where / "whole"), "--summary-json", "whole.json"],
        [*over, "--set", "train.stop_after=150", "--run-dir", str(where / "split")],
        [*over, "--resume", str(where / "split"), "--summary-json", "split.json"],
    ]
    done = [_subprocess([*base, *args], where, 150) for args in runs]
    out: dict = {"rc": max(d["rc"] for d in done)}
    if not ((where / "whole.json").is_file() and (where / "split.json").is_file()):
        return {**out, "ok": False, "logs": [d["log_tail"] for d in done]}
    a, b = (json.loads((where / f).read_text()) for f in ("whole.json", "split.json"))
    out = _outcome(out, where / "split.json", 330)
    out.update(
        whole_rollbacks=[[i.get("onset_step"), i.get("to_step")] for i in a["interventions"]],
        final_train_loss=[a["final_train_loss"], b["final_train_loss"]],
        final_val_loss=[a["final_val_loss"], b["final_val_loss"]],
        bitwise_equal=a["final_train_loss"] == b["final_train_loss"],
    )
    return out


def builtin_fault_check(smoke: bool, out_dir: Path) -> dict:
    """The built-in trainer at GPT-2-small shape, compiled, with a shifted-labels fault: the
    spike is found, rolled back (host-memory tier) and the run finishes."""
    shape = (2, 64, 4, 64, 4) if smoke else (12, 768, 12, 1024, 16)
    steps = 120
    over = [
        *gpt_overrides(*shape, steps),
        "train.compile=true",
        "checkpoint.memory_interval=10",
        "checkpoint.interval=none",
        "optim.lr=3e-3" if smoke else "optim.lr=6e-4",
    ]
    cfg = load_config("tiny_cpu", over).model_copy(update={"faults": _fault(80, 10)})
    with tempfile.TemporaryDirectory() as tmp:
        tr = build_trainer(cfg, run_dir=Path(tmp) / "fault")
        t0 = time.perf_counter()
        tr.fit()
        wall = time.perf_counter() - t0
        s = tr.core.summary()
    rollbacks = [i for i in s["interventions"] if i.get("kind") == "rollback"]
    return {
        "ok": bool(rollbacks) and s["steps"] >= steps and not s["halted"],
        "rollbacks": [
            [i.get("onset_step"), i.get("from_step"), i.get("to_step")] for i in rollbacks
        ],
        "tiers": [i.get("tier") for i in rollbacks],
        "steps": s["steps"],
        "wall_s": wall,
    }


def _fault(start: int, length: int) -> list:
    from spikewatch.trainer.config.sections import FaultConfig

    return [FaultConfig(kind="shifted_labels", start=start, length=length)]
