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
