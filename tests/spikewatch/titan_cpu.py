"""torchtitan 0.3 on a CPU, for the tests only (the product carries no shim): a config module
for `python -m torchtitan.train --module tests.spikewatch.titan_cpu --config debug_cpu`.

What torchtitan lacks on a CPU, patched here at import (before the trainer is built):
- its device is "cuda" when no accelerator is found: "cpu", with a stand-in for torch.cuda's
  memory and device queries;
- FlexAttention has no CPU backward: causal SDPA in its place (the same arithmetic for one
  document a row, which is what the tests' loader makes);
- `torch.distributed.set_timeout`, which it calls after the first step, is missing in this
  torch: a no-op;
- FSDP2's reduce-scatter with its gradient divide factor of 1 is a PREMUL_SUM, which gloo
  lacks: a plain SUM (the same gradients), and the SPMD backend `partial_dtensor`.
Its data are tests/spikewatch/titan_data.py's (a byte tokenizer, corpus windows with a
poisoned region, shared with the GPU check)."""

from __future__ import annotations

import sys
import types
from typing import Any

import torch
from torchtitan.tools import utils as _utils


class _CpuDevice(types.SimpleNamespace):
    """The part of torch.cuda that torchtitan calls, for a CPU."""

    def __init__(self) -> None:
        super().__init__()
        for name in ("set_device", "reset_peak_memory_stats", "empty_cache", "synchronize"):
            setattr(self, name, lambda *a, **k: None)
        self.get_device_name = lambda *a: "cpu"
        self.current_device = lambda: 0
        self.device_count = lambda: 1
        self.is_available = lambda: True
        self.memory_stats = lambda *a: {}
        self.get_device_properties = lambda *a: types.SimpleNamespace(
            total_memory=24 * 2**30, name="cpu"
        )


def _patch() -> None:
    cpu = _CpuDevice()
    for module in list(sys.modules.values()):  # the modules that imported the names already
        name = getattr(module, "__name__", "")
        if name.startswith("torchtitan") and getattr(module, "device_type", None) == "cuda":
            module.device_type, module.device_module = "cpu", cpu
    _utils.device_type, _utils.device_module = "cpu", cpu

    from torchtitan.models.common.attention import FlexAttention

    def sdpa(
        self,
        q_BLNH,
        k_BLNH,
        v_BLNH,
        *,
        attention_masks=None,
        scale=None,  # noqa: ANN001, ANN202, N803
        enable_gqa=False,
        **kw,
    ):  # (its parameters' names: torchtitan's local_map reads them)
        q, k, v = (t.transpose(1, 2) for t in (q_BLNH, k_BLNH, v_BLNH))
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=scale, enable_gqa=enable_gqa
        )
        return out.transpose(1, 2)

    FlexAttention.forward = sdpa
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.distributed import fsdp

    divide_by_one = fsdp.disable_fsdp_gradient_division

    def sum_on_gloo(model: torch.nn.Module) -> None:  # gloo has no PREMUL_SUM: a plain SUM
        divide_by_one(model)
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_force_sum_reduction_for_comms(True)

    fsdp.disable_fsdp_gradient_division = sum_on_gloo
    if not hasattr(torch.distributed, "set_timeout"):
        from torchtitan.distributed import utils as dist_utils

        dist_utils.set_pg_timeouts = lambda *a, **k: None


_patch()

from torchtitan.models.llama3.config_registry import llama3_debugmodel  # noqa: E402

from spikewatch.torchtitan import SpikewatchTrainer, with_spikewatch  # noqa: E402

from .titan_data import ByteTokenizer, WindowsLoader, window_start  # noqa: E402, F401


def debug_cpu_plain() -> Any:
    """torchtitan's Llama 3 debug model (6 layers, d=256, 16 heads) at T=64, 4 rows a rank,
    torchtitan's own Trainer (the overhead's baseline)."""
    config = llama3_debugmodel()
    config.tokenizer = ByteTokenizer.Config()
    config.dataloader = WindowsLoader.Config()
    config.training.seq_len, config.training.local_batch_size = 64, 4
    config.training.steps = 120
    config.training.disable_cuda_graphs = True
    # float32 throughout: a CPU without bf16 instructions (AVX2 only) multiplies bf16 in a
    # generic loop, ~30x slower than MKL's float32
    config.training.mixed_precision_param = "float32"
    config.lr_scheduler.warmup_steps = 5
    config.checkpoint.enable = False
    config.validator.enable = False
    config.metrics.log_freq = 10
    config.debug.seed = 0  # the same weights every run (a resume compares with its twin)
    config.parallelism.spmd_backend = "partial_dtensor"  # FSDP2 on gloo (one process: alike)
    return config


def debug_cpu() -> SpikewatchTrainer.Config:
    """The same job with spikewatch on."""
    return with_spikewatch(debug_cpu_plain())
