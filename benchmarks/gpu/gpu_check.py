"""One prepared H200 check (about 8 minutes), for the day a device is lent (issues 38, 49).
Writes OUT_DIR/gpu_check.json (and prints it last); each section is timed, and a failing
section is reported without stopping the others. The product end to end first, then its cost.

The product, as users run it (each must roll back and finish; subprocesses, their summaries
read back; `ok` says whether it did):
- `demo`: `spikewatch demo --no-serve` (on a CPU: onset 281, back to 270).
- `plain_loop`: examples/plain_loop.py compiled, a poisoned region on rows 0-1 (the rollback
  names them); `plain_loop_fp16`: the same under fp16 autocast with a GradScaler.
- `resume`: the demo's run stopped (train.stop_after) before its spike and resumed, against
  the same run uninterrupted (both roll back; on a CPU the two are bitwise equal).
- `hf`, `lightning`: the examples with a poisoned region; `hf_fp16`, `lightning_fp16`: with
  fp16 (accelerate's GradScaler, Lightning's "16-mixed").
- `builtin_fault`: the built-in trainer at GPT-2-small shape, compiled, bf16, a shifted-labels
  fault, rollbacks from the host-memory tier.
- `torchtitan`: torchtitan's own trainer with `spikewatch.torchtitan`, 8 Llama 3 1B blocks
  compiled, bf16, a poisoned region (benchmarks/gpu/_gpu_titan.py); and its tokens per second
  with and without spikewatch (`ratio`, goal >= 0.97).

Its cost:
1. `syncs`: host synchronisations per step of the built-in trainer (GPT-2-small shape, bf16,
   compiled, every probe on, the same-step tier armed) over 50 steps, counted with
   `torch.cuda.set_sync_debug_mode("warn")`: those between the end of backward and the start
   of the optimizer step (goal 0) and all of them, with where they come from.
2. `mfu`: the examples/plain_loop.py GPT at GPT-2-small shape (12 x 768, T=1024, B=16, bf16,
   torch.compile, torch's fused AdamW) without the Watch and with it, the Watch's probes
   switched on one by one in alternating blocks of 10 steps (`breakdown`: grad norms, +
   attention maxima, + optimizer-state and update statistics, + a host-memory snapshot every
   25 steps); MFU from 6N + 12 L T d FLOPs a token over the H200's 989 TFLOP/s (goal: with /
   without >= 0.97, MFU >= 40%).
3. `attention`: the fused Triton attention against SDPA flash (bf16, B=8, H=12, T in {1024,
   4096}, D in {64, 128}): max abs error of output and max logit, gradients' relative errors,
   forward+backward time against SDPA flash.
4. `memory_tier`: a ~1B-parameter GPT with AdamW (bf16 autocast, fp32 master weights): the
   loop's stall per host-memory snapshot (pinned buffers, asynchronous copies) against the
   step time (goal <= 5%).

    bash benchmarks/gpu_check.sh [OUT_DIR]            # on the device
    python benchmarks/gpu/gpu_check.py --smoke OUT_DIR  # tiny shapes, any device: its logic
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/_common
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _gpu_product import (  # noqa: E402
    CUDA,
    builtin_fault_check,
    demo_check,
    gpt_overrides,
    hf_check,
    hf_fp16_check,
    lightning_check,
    lightning_fp16_check,
    plain_loop_check,
    plain_loop_fp16_check,
    resume_check,
)
from _gpu_titan import titan_check  # noqa: E402

from spikewatch.observatory import metric_names as M  # noqa: E402
from spikewatch.trainer.builtin.loop import build_trainer  # noqa: E402
from spikewatch.trainer.config import load_config  # noqa: E402
from spikewatch.trainer.core.callbacks import Callback  # noqa: E402
from spikewatch.trainer.model.attention import max_logits  # noqa: E402

PEAK_BF16 = 989e12  # H200 dense bf16


def _sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


# -- 1. host syncs ------------------------------------------------------------------------------
class _Window:
    """Counts CUDA sync warnings, and those between a backward's end and the optimizer step."""

    def __init__(self) -> None:
        self.open = False
        self.step = 0
        self.in_window: Counter[str] = Counter()
        self.total: Counter[str] = Counter()
        self.per_step: Counter[int] = Counter()

    def showwarning(self, message, category, filename, lineno, *rest) -> None:  # noqa: ANN001
        if "synchroniz" not in str(message):
            return
        where = f"{Path(filename).name}:{lineno}"
        self.total[where] += 1
        self.per_step[self.step] += 1
        if self.open:
            self.in_window[where] += 1


def sync_check(smoke: bool) -> dict:
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    shape = (2, 64, 4, 64, 4) if smoke else (12, 768, 12, 1024, 16)
    steps = 12 if smoke else 50
    over = [*gpt_overrides(*shape, steps), "train.compile=true", "guard.same_step.min_history=8"]
    cfg = load_config("tiny_cpu", over)
    window = _Window()

    class Steps(Callback):
        def post_step(self, state) -> None:  # noqa: ANN001
            window.step = state.step

    backward = torch.Tensor.backward

    def after_backward(t, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
        out = backward(t, *a, **k)
        window.open = True
        return out

    def at_step(*_: object) -> None:
        window.open = False

    with tempfile.TemporaryDirectory() as tmp:
        tr = build_trainer(cfg, run_dir=Path(tmp) / "syncs", callbacks=[Steps()])
        hook = register_optimizer_step_pre_hook(at_step)
        torch.Tensor.backward = after_backward  # type: ignore[method-assign]
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("always")
                warnings.showwarning = window.showwarning  # counted as they happen
                if CUDA:
                    torch.cuda.set_sync_debug_mode("warn")
                t0 = time.perf_counter()
                tr.fit()
                wall = time.perf_counter() - t0
        finally:
            if CUDA:
                torch.cuda.set_sync_debug_mode(0)
            torch.Tensor.backward = backward  # type: ignore[method-assign]
            hook.remove()
    steady = [window.per_step.get(s, 0) for s in range(10, steps + 1)]
    return {
        "steps": steps,
        "host_path": tr.core.host_path,
        "syncs_between_backward_and_update": sum(window.in_window.values()),
        "syncs_between_backward_and_update_where": dict(window.in_window.most_common(5)),
        "syncs_total": sum(window.total.values()),
        "syncs_per_step_after_10": statistics.mean(steady) if steady else 0.0,
        "syncs_where": dict(window.total.most_common(8)),
        "wall_s": wall,
    }


# -- 2. MFU with and without spikewatch ---------------------------------------------------------
# The Watch's probes switched on one by one (each adds to the one before); "none" is the same
# model compiled without the Watch.
BREAKDOWN: dict[str, dict[str, bool]] = {
    "grad_norms": {"grad_norms": True},
    "attn_max": {"grad_norms": True, "attn_max": True},
    "state": {"grad_norms": True, "attn_max": True, "optimizer_state": True, "update_norms": True},
    "memory_tier": {
        "grad_norms": True,
        "attn_max": True,
        "optimizer_state": True,
        "update_norms": True,
        "memory": True,
    },
    # everything on, but each step's values read at its own end (the pre-issue-47 order)
    "same_step": {
        "grad_norms": True,
        "attn_max": True,
        "optimizer_state": True,
        "update_norms": True,
        "memory": True,
        "same_step": True,
    },
}
PROBE_FLAGS = ("grad_norms", "attn_max", "optimizer_state", "update_norms")


def _switch(watch, variant: str) -> None:  # noqa: ANN001
    """The watched run's probes and memory tier as `variant` has them (live: no recompile;
    the attention maxima are read when the compiled graph runs)."""
    flags = BREAKDOWN[variant]
    cfg = watch.core.probes.cfg
    for name in PROBE_FLAGS:
        setattr(cfg, name, flags.get(name, False))
    memory = watch.checkpointer.memory
    if memory is not None:
        memory.interval = 25 if flags.get("memory") else 10**9
    core = watch.core
    core.read_in_flight()  # the step read late, before the order changes
    core.reads_late = not flags.get("same_step") and core.probes.device.type == "cuda"


def mfu_check(smoke: bool) -> dict:
    import importlib.util
    import math

    from spikewatch import Watch

    spec = importlib.util.spec_from_file_location(
        "plain_loop", Path(__file__).resolve().parents[2] / "examples/plain_loop.py"
    )
    assert spec is not None and spec.loader is not None
    ex = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ex)
    L, d, H, T, B = (2, 64, 4, 64, 4) if smoke else (12, 768, 12, 1024, 16)
    rounds, block = (2, 4) if smoke else (6, 10)
    variants = ["none", *BREAKDOWN]
    device = torch.device("cuda" if CUDA else "cpu")
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 256, (16, B, T + 1), generator=g).to(device)
    runs: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for watched in (False, True):
            torch.manual_seed(0)
            gpt = ex.GPT(d, L, H, T).to(device)
            model = torch.compile(gpt)
            opt = torch.optim.AdamW(gpt.parameters(), lr=3e-4, betas=(0.9, 0.95), fused=CUDA)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
            watch = None
            if watched:
                tiers = {"checkpoint": {"memory_interval": 25, "interval": None}}
                watch = Watch(gpt, opt, sched, grad_clip=1.0, run_dir=Path(tmp) / "run",
                              db=f"sqlite:///{tmp}/mfu.db", settings=tiers)  # fmt: skip
                watch.open()
                gpt.use_recorder(watch.attn)
            runs["watched" if watched else "none"] = dict(
                model=model, opt=opt, sched=sched, watch=watch, i=0
            )

        def one(run: dict) -> None:
            i = run["i"] = run["i"] + 1
            x, y = data[i % len(data), :, :-1], data[i % len(data), :, 1:]
            if run["watch"] is not None:
                run["watch"].begin_step(i)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=CUDA):
                loss = run["model"](x, y)
            loss.backward()
            if run["watch"] is not None:
                run["watch"].step(loss)
            else:
                torch.nn.utils.clip_grad_norm_(run["model"].parameters(), 1.0)
                run["opt"].step()
                run["sched"].step()
                run["opt"].zero_grad(set_to_none=True)

        compile_s = {}
        for name, run in runs.items():
            t0 = time.perf_counter()
            for _ in range(3):
                one(run)
            _sync()
            compile_s[name] = time.perf_counter() - t0
        times: dict[str, list[float]] = {v: [] for v in variants}
        for r in range(rounds):
            order = variants[r % len(variants) :] + variants[: r % len(variants)]
            for variant in order:  # interleaved, each round from another start
                run = runs["none" if variant == "none" else "watched"]
                if variant != "none":
                    _switch(run["watch"], variant)
                _sync()
                t0 = time.perf_counter()
                for _ in range(block):
                    one(run)
                _sync()
                times[variant].append((time.perf_counter() - t0) / block)
        watch = runs["watched"]["watch"]
        host_path = watch.core.host_path
        _switch(watch, "memory_tier")
        per_event = _per_event(runs, one, 30 if smoke else 110)
        per_part = _per_part(runs["watched"], one, 30 if smoke else 110)
        host = _host_split(runs["watched"], one, 4 if smoke else 20)
        _profile(runs, one, 2 if smoke else 6)
        watch.close()
    params = sum(p.numel() for p in runs["none"]["model"].parameters())
    flops = (6 * params + 12 * L * T * d) * B * T
    step = {v: statistics.median(t) for v, t in times.items()}
    off, on = step["none"], step["memory_tier"]  # with the Watch: every default on
    return {
        "params": params,
        "step_s_without": off,
        "step_s_with": on,
        "with_over_without_throughput": off / on,
        "mfu_without": flops / off / PEAK_BF16,
        "mfu_with": flops / on / PEAK_BF16,
        "breakdown_step_s": step,
        "breakdown_cost_over_none": {v: step[v] / off - 1 for v in variants},
        "compile_s": compile_s,
        "watch_host_path": host_path,
        "per_event": per_event,
        "per_part": per_part,
        "watch_host_split_ms": host,
        "nan_free": all(math.isfinite(t) for ts in times.values() for t in ts),
    }


OUT_DIR: Path | None = None  # where the profiles go (main sets it)


def _mark() -> Any:
    """A CUDA event recorded on the current stream now (None on a CPU)."""
    if not CUDA:
        return None
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


@contextlib.contextmanager
def _tiers_saved() -> Iterator[list[str]]:
    """The tiers each `Tiers.save` saved to, gathered in the list it gives (cleared by the
    caller a step)."""
    from spikewatch.trainer.checkpoints.tiers import Tiers

    saved: list[str] = []
    tiers_save = Tiers.save

    def save(tiers, step, build, which=None, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        out = tiers_save(tiers, step, build, which, **kw)
        saved.extend(out)
        return out

    Tiers.save = save  # type: ignore[method-assign]
    try:
        yield saved
    finally:
        Tiers.save = tiers_save  # type: ignore[method-assign]


def _kind(saved: list[str], state: bool) -> str:
    """What happened in a step: a disk checkpoint, a snapshot, a state step, or nothing."""
    return "disk" if "disk" in saved else "memory" if saved else "state" if state else "plain"


def _per_event(runs: dict, one: Callable[[dict], None], steps: int) -> dict:
    """Each step of the bare run and of the watched one (every default on) timed alone: its
    device time between CUDA events at the step's boundaries and its host time on the loop
    thread. The watched steps are sorted by what happened in them (a state step, a host-memory
    snapshot, a disk checkpoint, nothing), and each kind is given over the bare step's: the
    cost of each event where it happens, not cumulative variants over blocks that the 10- and
    25-step cadences do not line up with. Beside each, benchmarks/host_cost.py's prediction
    when OUT_DIR holds its JSON line (host_cost.json)."""
    core = runs["watched"]["watch"].core
    rows: dict[str, list[tuple[Any, Any, float, str]]] = {"none": [], "watched": []}
    with _tiers_saved() as saved:
        for name in ("none", "watched"):
            run = runs[name]
            _sync()
            for _ in range(steps):
                state = name == "watched" and core.probes.state_active(core.step_count + 1)
                saved.clear()
                start, t0 = _mark(), time.perf_counter()
                one(run)
                host = time.perf_counter() - t0
                rows[name].append((start, _mark(), host, _kind(saved, state)))
            _sync()

    def ms(start: Any, end: Any, host: float) -> tuple[float, float]:
        return (start.elapsed_time(end) if CUDA else 1e3 * host), 1e3 * host

    bare = [ms(a, b, h) for a, b, h, _ in rows["none"][2:]]
    base_dev = statistics.median(d for d, _ in bare)
    base_host = statistics.median(h for _, h in bare)
    out: dict[str, Any] = {"steps": steps, "bare_device_ms": base_dev, "bare_host_ms": base_host}
    watched = rows["watched"][2:]
    total = 0.0
    for kind in ("plain", "state", "memory", "disk"):
        got = [ms(a, b, h) for a, b, h, k in watched if k == kind]
        if not got:
            continue
        dev = statistics.mean(d for d, _ in got)
        out[kind] = {
            "steps": len(got),
            "device_ms": dev,
            "host_ms": statistics.mean(h for _, h in got),
            "over_bare_ms": dev - base_dev,
        }
        total += len(got) * (dev - base_dev)
    out["amortised_over_bare_ms"] = total / max(len(watched), 1)
    out["with_over_without_throughput"] = base_dev / (base_dev + out["amortised_over_bare_ms"])
    predicted = (OUT_DIR / "host_cost.json") if OUT_DIR is not None else None
    if predicted is not None and predicted.is_file():
        lines = predicted.read_text().strip().splitlines()
        pred = json.loads(lines[-1])
        out["predicted"] = {
            "h200_ratio": pred.get("predicted_h200_ratio"),
            "meta_host_ms_per_step": pred.get("host_ms_per_step"),
            "meta_host_ms_by_event": {
                k: v.get("host_ms") for k, v in pred.get("events", {}).items()
            },
        }
    return out


# the Watch's parts of a step, one after the other (none inside another): the attention
# maxima (in the forward, a layer each), then the core's gate, conclude and checkpoint check
PARTS = {
    "maxima": ("spikewatch.trainer.model.attn_max", "AttnMax", "record_logits"),
    "gate": ("spikewatch.trainer.core.step_core", "StepCore", "gate"),
    "conclude": ("spikewatch.trainer.core.step_core", "StepCore", "conclude"),
    "save_if_due": ("spikewatch.trainer.core.step_core", "StepCore", "save_if_due"),
}


def _per_part(run: dict, one: Callable[[dict], None], steps: int) -> dict:
    """Each part of the watched step (PARTS) between CUDA events recorded at its entry and
    exit, and its host time, summed over the step, by kind of step (as `_per_event` sorts
    them): where on the device and on the host each event's cost lies. Its own pass, after
    `_per_event`'s, so that the events recorded here add nothing to those figures."""
    import importlib

    core = run["watch"].core
    found: list[tuple[str, Any, Any, float]] = []  # this step's (part, start, end, host s)
    undo: list[Callable[[], None]] = []

    def timed(part: str, owner: Any, name: str) -> None:
        fn = getattr(owner, name)

        def wrapper(*a, **k):  # noqa: ANN002, ANN003, ANN202
            start, t0 = _mark(), time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                found.append((part, start, _mark(), time.perf_counter() - t0))

        setattr(owner, name, wrapper)
        undo.append(lambda: setattr(owner, name, fn))

    for part, (module, cls, name) in PARTS.items():
        timed(part, getattr(importlib.import_module(module), cls), name)
    rows: list[tuple[str, list[tuple[str, Any, Any, float]]]] = []
    try:
        with _tiers_saved() as saved:
            _sync()
            for _ in range(steps):
                state = core.probes.state_active(core.step_count + 1)
                found.clear()
                saved.clear()
                one(run)
                rows.append((_kind(saved, state), list(found)))
            _sync()
    finally:
        for u in undo:
            u()
    out: dict[str, Any] = {}
    for kind in ("plain", "state", "memory", "disk"):
        got = [parts for k, parts in rows[2:] if k == kind]
        if not got:
            continue
        dev: Counter[str] = Counter()
        host: Counter[str] = Counter()
        calls: Counter[str] = Counter()
        for parts in got:
            for part, a, b, h in parts:
                dev[part] += a.elapsed_time(b) if CUDA else 1e3 * h
                host[part] += 1e3 * h
                calls[part] += 1
        n = len(got)
        out[kind] = {"steps": n} | {
            p: {"device_ms": dev[p] / n, "host_ms": host[p] / n, "calls": calls[p] / n}
            for p in PARTS
        }
    return out


def _host_split(run: dict, one: Callable[[dict], None], steps: int) -> dict:
    """Where a watched step's wall time goes on the host (ms a step): waiting for the step's
    copy (`HostTransfer.fetch`), the core's gate and conclude, and the rest (the client's
    forward/backward launches and the optimizer)."""
    from spikewatch.trainer.core import step_core, transfer

    spent: Counter[str] = Counter()

    def timed(owner, name: str, key: str) -> Callable[[], None]:  # noqa: ANN001
        fn = getattr(owner, name)

        def wrapper(*a, **k):  # noqa: ANN002, ANN003, ANN202
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[key] += time.perf_counter() - t0

        setattr(owner, name, wrapper)
        return lambda: setattr(owner, name, fn)

    undo = [
        timed(transfer.HostTransfer, "fetch", "fetch_wait"),
        timed(step_core.StepCore, "gate", "gate"),
        timed(step_core.StepCore, "conclude", "conclude"),
        timed(step_core.StepCore, "save_if_due", "save_if_due"),
    ]
    try:
        _sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            one(run)
        _sync()
        wall = time.perf_counter() - t0
    finally:
        for u in undo:
            u()
    out = {k: 1e3 * v / steps for k, v in spent.items()}
    out["conclude_without_wait"] = out.get("conclude", 0.0) - out.get("fetch_wait", 0.0)
    out["step"] = 1e3 * wall / steps
    return out


def _profile(runs: dict, one: Callable[[dict], None], steps: int) -> None:
    """torch.profiler over a few steps with and without the Watch: the kernels and host calls
    that take the time, to OUT_DIR/profile_{none,watched}.txt."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if CUDA else [])
    for name, run in runs.items():
        _sync()
        with profile(activities=acts) as prof:
            for _ in range(steps):
                one(run)
            _sync()
        if OUT_DIR is not None and CUDA:  # the trace kept: host and device timelines
            prof.export_chrome_trace(str(OUT_DIR / f"trace_{name}.json"))
        table = prof.key_averages()
        text = [f"{steps} steps, {name}"]
        for key in (["self_cuda_time_total"] if CUDA else []) + ["self_cpu_time_total"]:
            text.append(table.table(sort_by=key, row_limit=40, max_name_column_width=70))
        if OUT_DIR is not None:
            (OUT_DIR / f"profile_{name}.txt").write_text("\n".join(text))


# -- 3. the Triton attention --------------------------------------------------------------------
def _bench(fn: Callable[[], None], reps: int = 20) -> float:
    for _ in range(3):
        fn()
    _sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def attention_check(smoke: bool) -> list[dict]:
    from spikewatch.trainer.model.kernels.attention import flash_attention
    from spikewatch.trainer.model.kernels.max_logits import fused_max_logits

    out = []
    shapes = [(64, 32)] if smoke else [(1024, 64), (1024, 128), (4096, 64), (4096, 128)]
    B, H = (1, 2) if smoke else (8, 12)
    dtype = torch.bfloat16 if CUDA else torch.float32
    device = "cuda" if CUDA else "cpu"
    for T, D in shapes:
        g = torch.Generator(device=device).manual_seed(T + D)
        q, k, v = (
            torch.randn(B, H, T, D, device=device, dtype=dtype, generator=g).requires_grad_()
            for _ in range(3)
        )
        do = torch.randn_like(q)
        o, mx = flash_attention(q, k, v, causal=True)
        grads = torch.autograd.grad(o, (q, k, v), do)
        ro = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        rgrads = torch.autograd.grad(ro, (q, k, v), do)
        rmx = max_logits(q.detach().float(), k.detach().float(), chunk=512, fused=False)
        row = {
            "T": T,
            "D": D,
            "out_max_abs_err": (o.float() - ro.float()).abs().max().item(),
            "max_logit_max_abs_err": (mx - rmx).abs().max().item(),
        }
        for n, a, b in zip("qkv", grads, rgrads, strict=True):
            row[f"d{n}_rel_err"] = ((a.float() - b.float()).norm() / b.float().norm()).item()

        def tri(q=q, k=k, v=v, do=do) -> None:  # noqa: ANN001
            o, _ = flash_attention(q, k, v, causal=True)
            o.backward(do)

        def ref(q=q, k=k, v=v, do=do) -> None:  # noqa: ANN001
            F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(do)

        t_tri, t_ref = [], []
        for _ in range(1 if smoke else 3):  # interleaved
            t_tri.append(_bench(tri, 2 if smoke else 20))
            t_ref.append(_bench(ref, 2 if smoke else 20))
        row["triton_fwd_bwd_ms"] = 1e3 * statistics.median(t_tri)
        row["sdpa_fwd_bwd_ms"] = 1e3 * statistics.median(t_ref)
        row["ratio_vs_sdpa"] = row["triton_fwd_bwd_ms"] / row["sdpa_fwd_bwd_ms"]
        # SDPA with the maxima from the fused max pass (the GPU default) or the blockwise one
        qd, kd = q.detach(), k.detach()
        fmx = fused_max_logits(qd, kd, causal=True)
        row["fused_max_max_abs_err"] = (fmx - rmx).abs().max().item()
        t_fused = _bench(
            lambda qd=qd, kd=kd: fused_max_logits(qd, kd, causal=True), 2 if smoke else 20
        )
        t_block = _bench(
            lambda qd=qd, kd=kd: max_logits(qd, kd, chunk=64, fused=False), 2 if smoke else 10
        )
        row["fused_max_ms"] = 1e3 * t_fused
        row["blockwise_max_ms"] = 1e3 * t_block
        row["sdpa_plus_fused_max_over_sdpa"] = 1 + row["fused_max_ms"] / row["sdpa_fwd_bwd_ms"]
        row["sdpa_plus_fused_max_over_triton"] = (
            row["sdpa_fwd_bwd_ms"] + row["fused_max_ms"]
        ) / row["triton_fwd_bwd_ms"]
        print(json.dumps(row), flush=True)
        out.append(row)
    return out


# -- 4. the host-memory tier of a ~1B model ------------------------------------------------------
class _Stalls(Callback):
    def __init__(self) -> None:
        self.stalls: list[float] = []
        self.stall_steps: list[int] = []
        self.ends: list[float] = []

    def post_step(self, state) -> None:  # noqa: ANN001
        _sync()
        self.ends.append(time.perf_counter())

    def on_update_metrics(self, step, metrics) -> None:  # noqa: ANN001
        stall = metrics.get(M.checkpoint_stall("memory"))
        if stall is not None:
            self.stalls.append(float(stall))
            self.stall_steps.append(step)


def memory_tier_check(smoke: bool) -> dict:
    shape = (2, 64, 4, 64, 2) if smoke else (20, 2048, 16, 1024, 4)  # ~1.0B parameters
    steps = 12 if smoke else 24
    over = [
        *gpt_overrides(*shape, steps),
        "checkpoint.memory_interval=4",
        "checkpoint.interval=none",
        "probes.enabled=false",
    ]
    clock = _Stalls()
    with tempfile.TemporaryDirectory() as tmp:
        tr = build_trainer(
            load_config("tiny_cpu", over), run_dir=Path(tmp) / "mem", callbacks=[clock]
        )
        params = sum(p.numel() for p in tr.model.parameters())
        tr.fit()
        mem = tr.core.checkpointer.memory
        # how the snapshot was staged on the device (memory.py `_choose_staging`): the copy to
        # the host's measured time, and the staging buffer kept (a chunk, or the whole)
        staging = {
            "copy_s": getattr(mem, "copy_s", None),
            "chunk_bytes": getattr(getattr(mem, "_copies", None), "chunk", None),
            "staging_bytes": sum(
                t.numel() for t in getattr(getattr(mem, "_copies", None), "_staging", {}).values()
            ),
        }
    steps_s = [b - a for a, b in zip(clock.ends[4:], clock.ends[5:], strict=False)]
    step = statistics.median(steps_s)
    stall = statistics.median(clock.stalls[1:] or clock.stalls)  # the first also allocates
    # what the snapshots cost the loop in all (the host's stall and the device's wait for the
    # copies before the next update), over the steps after the warm-up: sum - n * median
    taken = sum(1 for s in clock.stall_steps if s > 4)
    extra = (sum(steps_s) - len(steps_s) * step) / max(taken, 1)
    return {
        "params": params,
        "step_s": step,
        "stall_s_per_snapshot": stall,
        "stall_over_step": stall / step,
        "snapshot_cost_s": extra,
        "snapshot_cost_over_step": extra / step,
        "snapshots": len(clock.stalls),
        "stalls_s": clock.stalls,
        "first_stall_s": clock.stalls[0] if clock.stalls else None,
        "staging": staging,
    }


SECTIONS: dict[str, Callable[[bool, Path], object]] = {
    # the product end to end (issue 49): each must roll back and finish
    "demo": demo_check,
    "plain_loop": plain_loop_check,
    "plain_loop_fp16": plain_loop_fp16_check,
    "resume": resume_check,
    "hf": hf_check,
    "hf_fp16": hf_fp16_check,
    "lightning": lightning_check,
    "lightning_fp16": lightning_fp16_check,
    "builtin_fault": builtin_fault_check,
    "torchtitan": titan_check,  # issue 48: torchtitan's own trainer, compiled, with a fault
    # its cost
    "syncs": lambda smoke, out: sync_check(smoke),
    "mfu": lambda smoke, out: mfu_check(smoke),
    "attention": lambda smoke, out: attention_check(smoke),
    "memory_tier": lambda smoke, out: memory_tier_check(smoke),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir", nargs="?", default="gpu_check_out")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes: the logic, on any device")
    ap.add_argument("--only", default=",".join(SECTIONS))
    ap.add_argument(
        "--work",
        default=None,
        help="where the end-to-end runs keep their files (default: a temporary directory; "
        "OUT_DIR gets gpu_check.json alone, as the device returns only a few files)",
    )
    args = ap.parse_args()
    if not (CUDA or args.smoke):
        sys.exit("gpu_check needs a CUDA device (or --smoke)")
    if not CUDA:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    global OUT_DIR
    out_dir = OUT_DIR = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(args.work or tempfile.mkdtemp(prefix="gpu_check_"))
    result: dict = {
        "device": torch.cuda.get_device_name() if CUDA else "cpu (smoke)",
        "torch": torch.__version__,
    }
    for name in args.only.split(","):
        t0 = time.perf_counter()
        try:
            result[name] = SECTIONS[name](args.smoke, work)
        except Exception as e:  # a failed section is a finding: report it, run the others
            result[name] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}
        result[f"{name}_s"] = time.perf_counter() - t0
        print(name, json.dumps(result[name]), flush=True)
        (out_dir / "gpu_check.json").write_text(json.dumps(result, indent=2))
    ends = [k for k in SECTIONS if isinstance(result.get(k), dict) and "ok" in result[k]]
    result["end_to_end_ok"] = {k: result[k]["ok"] for k in ends}
    (out_dir / "gpu_check.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
