"""spikewatch in torchtitan on the GPU (issue 48, item 4), for benchmarks/gpu/gpu_check.py: a
Llama-3-style model of 8 layers (torchtitan's Llama 3 1B blocks: d=2048, 16 heads, SwiGLU,
RoPE; a 2048-token vocabulary), each block compiled by torchtitan, bf16 under FSDP2's mixed
precision, T=2048, 4 rows, trained by torchtitan's own entry point with a poisoned region:
it must roll back to before its onset and finish. Its cost: torchtitan's own tokens per second
with `SpikewatchTrainer` over its plain `Trainer` (goal >= 0.97), the steps before the fault.

As a script, under torchrun, it is torchtitan's `torchtitan.train` with what the device image
lacks stood in first (Hugging Face `datasets` and TensorBoard, which torchtitan 0.3 imports at
start and this job does not use); as a module (`--module benchmarks._gpu_titan`), the configs:

    torchrun --nproc_per_node=1 benchmarks/gpu/_gpu_titan.py --module benchmarks._gpu_titan \\
        --config gpu_llama --dataloader.poison_at 60 ...

The data are the tests' (tests/spikewatch/titan_data.py: a byte tokenizer, windows of the
shipped corpus, nothing downloaded). A helper of gpu_check.py."""

from __future__ import annotations

import json
import re
import statistics
import sys
import types
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
TPS = re.compile(r"step:\s+(\d+).*?tps:\s+([\d,]+)")


def stand_in_missing() -> list[str]:
    """Modules torchtitan imports at start that this job never uses, where the image lacks
    them: a stand-in that raises if it is ever called. Returns what was stood in."""
    done = []
    try:
        import datasets  # noqa: F401
    except ImportError:

        def unused(*a: Any, **k: Any) -> Any:
            raise RuntimeError("Hugging Face datasets is not installed (gpu_check stand-in)")

        ds = types.ModuleType("datasets")
        ds.Dataset, ds.IterableDataset, ds.load_dataset = object, object, unused  # type: ignore[attr-defined]
        dist = types.ModuleType("datasets.distributed")
        dist.split_dataset_by_node = unused  # type: ignore[attr-defined]
        ds.distributed = dist  # type: ignore[attr-defined]
        sys.modules.update({"datasets": ds, "datasets.distributed": dist})
        done.append("datasets")
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        tb = types.ModuleType("torch.utils.tensorboard")

        class SummaryWriter:
            def __init__(self, *a: Any, **k: Any) -> None:
                raise RuntimeError("TensorBoard is not installed (gpu_check stand-in)")

        tb.SummaryWriter = SummaryWriter  # type: ignore[attr-defined]
        sys.modules["torch.utils.tensorboard"] = tb
        done.append("tensorboard")
    return done


# -- the configs (torchtitan imports this module by name) ------------------------------------
def gpu_llama_plain() -> Any:
    """torchtitan's own Trainer: 8 Llama 3 1B blocks, bf16 (FSDP2's mixed precision), each
    block compiled, T=2048, 4 rows, AdamW, warmup 10, 120 steps, no checkpoint."""
    from torchtitan.models.llama3 import model_registry
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    from tests.spikewatch.titan_data import ByteTokenizer, WindowsLoader

    config = llama3_debugmodel()
    spec = model_registry("1B")  # FlexAttention, as torchtitan trains Llama 3 by default
    small = model_registry("debugmodel").model  # its 2048-token vocabulary
    model = spec.model
    model.layers = model.layers[:8]
    model.vocab_size, model.tok_embeddings = small.vocab_size, small.tok_embeddings
    model.tok_embeddings.embedding_dim = model.dim
    model.lm_head.out_features = small.vocab_size
    config.model_spec = spec
    config.tokenizer = ByteTokenizer.Config()
    config.dataloader = WindowsLoader.Config()
    config.training.seq_len, config.training.local_batch_size = 2048, 4
    config.training.steps = 120
    config.training.disable_cuda_graphs = True  # spikewatch's probes run Python in forward
    config.compile.enable = True
    config.lr_scheduler.warmup_steps = 10
    config.checkpoint.enable = False
    config.validator.enable = False
    config.metrics.log_freq = 5
    config.debug.seed = 0
    return config


def gpu_llama() -> Any:
    """The same job with spikewatch on."""
    from spikewatch.torchtitan import with_spikewatch

    return with_spikewatch(gpu_llama_plain())


# -- the section --------------------------------------------------------------------------------
def titan_check(smoke: bool, out_dir: Path) -> dict:
    """The fault run (must roll back to before its onset and finish), then the plain run: the
    ratio of torchtitan's tokens per second before the fault (steps 30-55). --smoke: the
    tests' CPU shim and debug model (tests/spikewatch/titan_cpu.py), the logic only."""
    from _gpu_product import _outcome, _subprocess

    module = "tests.spikewatch.titan_cpu" if smoke else "benchmarks._gpu_titan"
    config = "debug_cpu" if smoke else "gpu_llama"
    steps, poison = ("80", "60") if smoke else ("120", "60")
    launcher = ["-m", "torchtitan.train"] if smoke else [str(REPO / "benchmarks" / "_gpu_titan.py")]

    def run(name: str, plain: bool) -> tuple[dict, list[float]]:
        where = out_dir / f"torchtitan_{name}"
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc_per_node=1", *launcher, "--module", module,
            "--config", config + ("_plain" if plain else ""), "--dump_folder", str(where / "out"),
            "--training.steps", steps,
        ]  # fmt: skip
        if not plain:
            cmd += ["--dataloader.poison_at", poison, "--dataloader.poison_len", "8"]
            cmd += ["--spikewatch.db", f"sqlite:///{where}/sw.db"]
            cmd += ["--spikewatch.summary_json", str(where / "summary.json")]
        out = _subprocess(cmd, where, 400 if not smoke else 300)
        log = (where / "log.txt").read_text()
        tps = [float(t.replace(",", "")) for s, t in TPS.findall(log) if 30 <= int(s) <= 55]
        return out, tps

    watched, tps_with = run("fault", plain=False)
    result = _outcome(watched, out_dir / "torchtitan_fault" / "summary.json", int(steps))
    plain, tps_without = run("plain", plain=True)
    result["plain_rc"] = plain["rc"]
    if tps_with and tps_without:
        result["tps_with"] = statistics.median(tps_with)
        result["tps_without"] = statistics.median(tps_without)
        result["ratio"] = round(result["tps_with"] / result["tps_without"], 3)
    return result


if __name__ == "__main__":  # torchtitan's entry point, the image's gaps stood in first
    sys.path.insert(0, str(REPO))
    stood_in = stand_in_missing()
    if stood_in:
        print(json.dumps({"stood_in": stood_in}), flush=True)
    from torchtitan.train import main

    main()
