"""Helpers for the benchmark scripts: machine banner and medians (the product never imports it)."""

from __future__ import annotations

import os
import platform
import statistics

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402


def machine() -> dict:
    return {
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "python": platform.python_version(),
    }


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
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
