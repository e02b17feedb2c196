"""Helpers for the benchmark scripts: machine banner and medians (the product never imports it)."""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import logging
import os
import platform
import statistics
import time
import warnings
from collections import Counter
from collections.abc import Callable
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

ALLOCATOR = {"malloc": "default"}  # what steady_allocator() set, for the banner


def machine() -> dict:
    return {
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "python": platform.python_version(),
        **ALLOCATOR,
    }


def steady_allocator() -> bool:
    """Stop glibc's malloc from giving memory back to the OS between steps (a fixed trim
    threshold of 1 GiB, and a fixed mmap threshold of 32 MiB, the most glibc allows).

    By default glibc trims the top of its heap whenever more than twice the largest tensor
    freed so far lies free there, and mmaps allocations above a moving threshold: each step's
    activations are then faulted in afresh, 2,500-5,000 page faults a step at B=16 here. How
    many depends on which allocation happens to sit at the heap's top when the backward frees
    the activations, so any change to a step's allocations (spikewatch's, or a framework's
    order of hooks) moves a CPU step by +-5% through page faults alone: the plain loop
    faulted less with spikewatch than without it, Lightning more (page_faults.py).
    Measuring spikewatch's cost means holding that still on both sides. CUDA tensors do not
    come from malloc (PyTorch's caching allocator keeps them), so GPU runs do not see it.
    Returns whether glibc took both settings (False off glibc)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    ok = bool(mallopt(m_trim_threshold, 1 << 30)) and bool(mallopt(m_mmap_threshold, 32 << 20))
    if ok:
        ALLOCATOR["malloc"] = "glibc, trim 1 GiB and mmap 32 MiB thresholds fixed"
    return ok


def allocator_flag(ap: argparse.ArgumentParser) -> None:
    """`--glibc-default`, read by `quiet_one_thread`."""
    ap.add_argument(
        "--glibc-default",
        action="store_true",
        help="leave glibc's malloc trimming its heap between steps (see steady_allocator)",
    )


def quiet_one_thread(args: argparse.Namespace) -> None:
    """A timing script's set-up: the allocator held still (unless `--glibc-default`), one
    thread, no log lines or warnings between the steps; then the machine banner."""
    if not getattr(args, "glibc_default", False):
        steady_allocator()
    logging.disable(logging.WARNING)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    print("machine:", json.dumps(machine()))


def clocked(obj: Any, name: str, label: str, into: Callable[[], Counter]) -> None:
    """Wrap `obj.name` with a clock adding its seconds to `into()[label]` (`into` picks the
    counter at each call: per thread, say)."""
    inner = getattr(obj, name)

    def timed(*a: Any, **k: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return inner(*a, **k)
        finally:
            into()[label] += time.perf_counter() - t0

    setattr(obj, name, timed)


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def plain_step(model, opt, sched, watch, x: torch.Tensor, i: int) -> None:  # noqa: ANN001
    """One step of a benchmark's plain loop (a Hugging Face causal LM on batch `x`): the
    Watch's, or the same arithmetic by hand (clip at 1.0, step, schedule, zero)."""
    if watch is not None:
        watch.begin_step(i)
    loss = model(input_ids=x, labels=x).loss
    loss.backward()
    if watch is not None:
        watch.step(loss)
    else:
        plain_update(model, opt, sched)


def plain_update(model, opt, sched) -> None:  # noqa: ANN001
    """The plain loop's update after backward: clip at 1.0, step, schedule, zero."""
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)
