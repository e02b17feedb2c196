"""One prepared H200 check (about 5 minutes): the fused Triton attention against SDPA, and a
124M-class GPT's probe overhead and MFU. Writes OUT_DIR/gpu_check.json and prints it last.

1. Correctness in bf16 at B=8, H=12, T in {1024, 4096}, D in {64, 128}: output, gradients and
   max logit of `flash_attention` vs `scaled_dot_product_attention` (flash) and an fp32 max.
2. Forward+backward time of the Triton kernel vs SDPA flash, interleaved, medians.
3. GPT-2-small shape (12 layers, d=768, 12 heads, T=1024, byte vocabulary), bf16 autocast,
   batch 16: step time with every probe on vs all off (interleaved), and MFU with probes on
   (model FLOPs 6N + 12 L T d per token, over the H200's 989 TFLOP/s dense bf16).

    bash benchmarks/gpu_check.sh [OUT_DIR]
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.builtin.loop import build_trainer  # noqa: E402
from trainer.config import load_config  # noqa: E402
from trainer.core.callbacks import Callback  # noqa: E402
from trainer.model.attention import max_logits  # noqa: E402
from trainer.model.kernels.attention import flash_attention  # noqa: E402

PEAK_BF16 = 989e12


def _bench(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def kernel_checks() -> list[dict]:
    out = []
    for T in (1024, 4096):
        for D in (64, 128):
            g = torch.Generator(device="cuda").manual_seed(T + D)
            q, k, v = (
                torch.randn(
                    8, 12, T, D, device="cuda", dtype=torch.bfloat16, generator=g
                ).requires_grad_()
                for _ in range(3)
            )
            do = torch.randn_like(q)
            o, mx = flash_attention(q, k, v, causal=True)
            grads = torch.autograd.grad(o, (q, k, v), do)
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
                ro = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                rgrads = torch.autograd.grad(ro, (q, k, v), do)
            rmx = max_logits(q.float(), k.float(), chunk=512)
            row = {
                "T": T,
                "D": D,
                "out_max_abs_err": (o.float() - ro.float()).abs().max().item(),
                "max_logit_max_abs_err": (mx - rmx).abs().max().item(),
            }
            for n, a, b in zip("qkv", grads, rgrads, strict=True):
                row[f"d{n}_rel_err"] = ((a.float() - b.float()).norm() / b.float().norm()).item()

            def tri(q=q, k=k, v=v, do=do):
                o, _ = flash_attention(q, k, v, causal=True)
                o.backward(do)

            def ref(q=q, k=k, v=v, do=do):
                with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
                    F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(do)

            t_tri, t_ref = [], []
            for _ in range(3):  # interleaved
                t_tri.append(_bench(tri))
                t_ref.append(_bench(ref))
            row["triton_fwd_bwd_ms"] = 1e3 * statistics.median(t_tri)
            row["sdpa_flash_fwd_bwd_ms"] = 1e3 * statistics.median(t_ref)
            row["ratio_vs_sdpa"] = row["triton_fwd_bwd_ms"] / row["sdpa_flash_fwd_bwd_ms"]
            print(json.dumps(row), flush=True)
            out.append(row)
    return out


class _Clock(Callback):
    def __init__(self) -> None:
        self.t: list[float] = []

    def post_step(self, state) -> None:
        self.t.append(time.perf_counter())


def gpt_check(steps: int = 30, reps: int = 3) -> dict:
    base = [
        "model.n_layer=12",
        "model.d_model=768",
        "model.n_head=12",
        "model.max_seq_len=1024",
        "data.seq_len=1024",
        "data.batch_size=16",
        "train.dtype=bfloat16",
        "train.device=cuda",
        "train.progress=false",
        f"train.max_steps={steps}",
        "schedule.warmup_steps=5",
        "eval.interval=none",
        "eval.batches=1",
        "probes.state_interval=1",
    ]
    times: dict[str, list[float]] = {"on": [], "off": []}
    params = 0
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(reps):
            for variant in ("on", "off") if r % 2 == 0 else ("off", "on"):
                extra = [] if variant == "on" else ["probes.enabled=false"]
                cfg = load_config("tiny_cpu", [*base, *extra])
                clock = _Clock()
                tr = build_trainer(cfg, run_dir=Path(tmp) / f"{variant}{r}", callbacks=[clock])
                params = sum(p.numel() for p in tr.model.parameters())
                tr.fit()
                times[variant] += [b - a for a, b in zip(clock.t[5:], clock.t[6:], strict=False)]
    on, off = statistics.median(times["on"]), statistics.median(times["off"])
    L, d, T, tokens = 12, 768, 1024, 16 * 1024
    flops = (6 * params + 12 * L * T * d) * tokens
    return {
        "params": params,
        "step_s_probes_on": on,
        "step_s_probes_off": off,
        "probe_overhead_ratio": on / off,
        "mfu_probes_on": flops / on / PEAK_BF16,
        "tokens_per_s_probes_on": tokens / on,
    }


def main() -> None:
    out_dir = Path(sys.argv[1] if len(sys.argv) > 1 else "gpu_check_out")
    out_dir.mkdir(parents=True, exist_ok=True)
    assert torch.cuda.is_available(), "gpu_check needs a CUDA device"
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    result["attention"] = kernel_checks()
    result["gpt124m"] = gpt_check()
    (out_dir / "gpu_check.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
