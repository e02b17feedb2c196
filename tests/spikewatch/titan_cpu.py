"""torchtitan 0.3 on a CPU, for the tests only (the product carries no shim): a config module
for `python -m torchtitan.train --module tests.spikewatch.titan_cpu --config debug_cpu`.

What torchtitan lacks on a CPU, patched here at import (before the trainer is built):
- its device is "cuda" when no accelerator is found: "cpu", with a stand-in for torch.cuda's
  memory and device queries;
- FlexAttention has no CPU backward: causal SDPA in its place (the same arithmetic for one
  document a row, which is what the loader below makes);
- `torch.distributed.set_timeout`, which it calls after the first step, is missing in this
  torch: a no-op;
- FSDP2's reduce-scatter with its gradient divide factor of 1 is a PREMUL_SUM, which gloo
  lacks: a plain SUM (the same gradients), and the SPMD backend `partial_dtensor`.
And what it would download: a byte-level tokenizer and a loader of windows of the shipped
corpus (`spikewatch.corpus`), each data-parallel rank its own, with a poisoned region on one
rank (`--dataloader.poison_at/poison_len/poison_rank`, one row of each batch with
`--dataloader.poison_row`), with `--dataloader.ids` each row's window start as its "id" (a
plain torchtitan Trainer would hand it to the model); and a process death once at each of
some batches (`--dataloader.die_at 36,50`, a marker file each: the restarted job goes on)."""

from __future__ import annotations

import os
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import IterableDataset
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

from torchtitan.components.dataloader import ParallelAwareDataloader  # noqa: E402
from torchtitan.components.tokenizer import BaseTokenizer  # noqa: E402
from torchtitan.models.llama3.config_registry import llama3_debugmodel  # noqa: E402

from spikewatch.torchtitan import SpikewatchTrainer, with_spikewatch  # noqa: E402


class ByteTokenizer(BaseTokenizer):
    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        pass

    def __init__(self, config: Config, tokenizer_path: str | None = None, **kw: Any) -> None:
        super().__init__()
        self.eos_id = 0

    def encode(self, text: str, *a: Any, **k: Any) -> list[int]:
        return list(text.encode())

    def decode(self, ids: list[int], *a: Any, **k: Any) -> str:
        return bytes(ids).decode(errors="replace")

    def get_vocab_size(self) -> int:
        return 256


def window_start(i: int, rank: int, world: int, n: int, seq_len: int) -> int:
    """Where rank `rank`'s row `i` starts in the corpus of `n` bytes."""
    import numpy as np

    rng = np.random.default_rng([0, i * world + rank])
    return int(rng.integers(0, n - seq_len - 1))


class _Windows(IterableDataset):
    """Row i of data-parallel rank r: window (i * world + r) of the corpus; rows of batches
    [poison_at, poison_at + poison_len) (in batches of `batch` rows) poisoned on
    `poison_rank` (or every rank for -1)."""

    def __init__(
        self,
        seq_len: int,
        rank: int,
        world: int,
        batch: int,
        poison: Any,
        die_at: str,
        ids: bool,
    ) -> None:
        from spikewatch.corpus import text_corpus

        self.data, _ = text_corpus(source="code")
        self.seq_len, self.rank, self.world, self.batch, self.poison = (
            seq_len, rank, world, batch, poison,
        )  # fmt: skip
        self.die_at = {int(b) for b in die_at.split(",") if b}
        self.ids = ids
        self.i = 0

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        while True:
            i, self.i = self.i, self.i + 1
            if i % self.batch == 0 and i // self.batch in self.die_at:
                marker = f"died-{i // self.batch}"
                if not os.path.exists(marker):
                    open(marker, "w").close()  # noqa: SIM115
                    os._exit(9)  # as a SIGKILL would: no clean-up, no checkpoint
            start = window_start(i, self.rank, self.world, len(self.data), self.seq_len)
            row = self.data[start : start + self.seq_len + 1].long()
            x, y = row[:-1], row[1:]
            at, length, rank, only = self.poison
            if at <= i // self.batch < at + length and rank in (-1, self.rank):
                if only in (-1, i % self.batch):
                    y = torch.zeros_like(y)  # a corrupt shard: every target a NUL byte
            yield ({"input": x, "id": start} if self.ids else {"input": x}), y

    def state_dict(self) -> dict[str, Any]:
        return {"i": self.i}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.i = int(state["i"])


class WindowsLoader(ParallelAwareDataloader):
    @dataclass(kw_only=True, slots=True)
    class Config(ParallelAwareDataloader.Config):
        poison_at: int = -1
        poison_len: int = 0
        poison_rank: int = -1
        poison_row: int = -1
        die_at: str = ""
        ids: bool = False

    def __init__(
        self,
        config: Config,
        *,
        dp_world_size: int,
        dp_rank: int,
        tokenizer: Any,
        seq_len: int,
        local_batch_size: int,
        **kw: Any,
    ) -> None:
        poison = (config.poison_at, config.poison_len, config.poison_rank, config.poison_row)
        data = _Windows(
            seq_len, dp_rank, dp_world_size, local_batch_size, poison, config.die_at,
            config.ids,
        )  # fmt: skip
        super().__init__(
            data, dp_rank=dp_rank, dp_world_size=dp_world_size, batch_size=local_batch_size
        )


def debug_cpu_plain() -> Any:
    """torchtitan's Llama 3 debug model (6 layers, d=256, 16 heads) at T=64, 4 rows a rank,
    torchtitan's own Trainer (the overhead's baseline)."""
    config = llama3_debugmodel()
    config.tokenizer = ByteTokenizer.Config()
    config.dataloader = WindowsLoader.Config()
    config.training.seq_len, config.training.local_batch_size = 64, 4
    config.training.steps = 120
    config.training.disable_cuda_graphs = True
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
