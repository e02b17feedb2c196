"""Compile the Triton attention's launches ahead of time for sm_80 and sm_90, on a CPU.

Run in a process without TRITON_INTERPRET (tests/trainer/test_kernel_aot.py does): the kernels
are then real `JITFunction`s, and `triton.compile` with an explicit `GPUTarget` needs no GPU or
driver (Triton's bundled ptxas builds the cubin). The launches are the ones `flash_attention`
makes, forward and backward, for each case: its kernels are replaced by recorders, so the
dtypes, constexprs, warps, stages and grid compiled are exactly what the launcher would send to
a GPU. The CPU interpreter, which upcasts everything to fp32, would hide what this finds.

    python tests/trainer/kernel_aot.py '[[1, 2, 64, 64, "bf16", "bf16", "bf16", true]]'

prints one JSON list, a row per distinct launch and target (`--grids`: each launch's grid only).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("kernel_aot: run without TRITON_INTERPRET (the kernels must be JITFunctions)")

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from spikewatch.trainer.model.kernels import adam_state as AS  # noqa: E402
from spikewatch.trainer.model.kernels import attention as A  # noqa: E402
from spikewatch.trainer.model.kernels import max_logits as MX  # noqa: E402

SHARED_LIMIT = {80: 166912, 90: 232448}  # bytes of shared memory a block may use (opt-in)
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
NAMES = {v: k for k, v in DTYPES.items()} | {torch.int64: "i64"}  # the Adam pass's tables
KERNELS = {
    A: ("_fwd_kernel", "_bwd_dkdv_kernel", "_bwd_dq_kernel"),
    MX: ("_max_kernel",),
    AS: ("_adam_state_kernel",),
}


class _Recorder:
    def __init__(self, name: str, fn: Any, into: list[dict[str, Any]]) -> None:
        self.name, self.fn, self.into = name, fn, into

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        def launch(*args: Any, **kwargs: Any) -> None:
            self.into.append(dict(name=self.name, fn=self.fn, grid=grid, args=args, kw=kwargs))

        return launch


def launches(cases: list[list[Any]]) -> list[dict[str, Any]]:
    """The kernel launches of flash_attention forward + backward and of the fused max logits
    (keys shared by two query heads where H is even) for each case (B, H, T, D, q dtype, k dtype,
    v dtype, causal), on CPU tensors standing in for CUDA ones."""
    seen: list[dict[str, Any]] = []
    for module, names in KERNELS.items():
        for name in names:
            setattr(module, name, _Recorder(name, getattr(module, name), seen))
    A._check = lambda q, k, v: None  # type: ignore[assignment]  # the CPU stands in for a GPU
    MX.refusal = lambda q, k, mask=None: None  # type: ignore[assignment]
    for B, H, T, D, qd, kd, vd, causal in cases:
        q, k, v = (torch.randn(B, H, T, D).to(DTYPES[d]).requires_grad_() for d in (qd, kd, vd))
        out, _ = A.flash_attention(q, k, v, causal=causal)
        out.backward(torch.randn_like(out))
        MX.fused_max_logits(q, k[:, : H // 2 or 1], causal=causal)
        heads = torch.full((H,), float("-inf"))  # the probes' form: atomic max into (H,)
        MX.fused_head_max_(heads, q, k[:, : H // 2 or 1], causal=causal)
    # the probes' one-pass Adam state statistics (one launch over every tensor)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    AS.AdamState(list(model.parameters()), opt)(1e-16)
    return seen


def _signature(launch: dict[str, Any]) -> tuple[dict[str, str], dict[str, Any], list[int]]:
    fn = launch["fn"]
    sig: dict[str, str] = {}
    pointers = []
    for i, (arg, value) in enumerate(zip(fn.arg_names, launch["args"], strict=False)):
        if torch.is_tensor(value):
            sig[arg] = "*" + NAMES[value.dtype]
            pointers.append(i)
        elif isinstance(value, float):
            sig[arg] = "fp32"
        else:
            sig[arg] = "i32"
    constexprs = {k: v for k, v in launch["kw"].items() if k not in ("num_warps", "num_stages")}
    sig.update({k: "constexpr" for k in constexprs})
    return sig, constexprs, pointers


def compile_all(cases: list[list[Any]]) -> list[dict[str, Any]]:
    rows, done = [], set()
    for launch in launches(cases):
        sig, constexprs, pointers = _signature(launch)
        key = (launch["name"], tuple(sorted(sig.items())), tuple(sorted(constexprs.items())))
        if key in done:
            continue
        done.add(key)
        attrs = {(i,): [["tt.divisibility", 16]] for i in pointers}
        options = {k: launch["kw"][k] for k in ("num_warps", "num_stages")}
        for arch in (80, 90):
            row = dict(
                kernel=launch["name"],
                arch=arch,
                grid=list(launch["grid"]),
                pointer_dtypes=sorted({sig[n] for n in sig if sig[n].startswith("*")}),
                qkv=[sig[n] for n in ("Q", "K", "V") if n in sig],
                constexprs={k: v for k, v in constexprs.items()},
                limit=SHARED_LIMIT[arch],
            )
            src = ASTSource(fn=launch["fn"], signature=sig, constexprs=constexprs, attrs=attrs)
            try:
                ck = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
            except Exception as e:  # a CompilationError (front end) or RuntimeError (ptxas)
                row.update(ok=False, error=f"{type(e).__name__}: {str(e)[-300:]}")
            else:
                ptx = ck.asm.get("ptx", "")
                row.update(ok=True, shared=ck.metadata.shared, tf32="tf32" in ptx)
            rows.append(row)
    return rows


if __name__ == "__main__":
    cases = json.loads(sys.argv[1])
    if sys.argv[2:] == ["--grids"]:  # the launches alone, nothing compiled
        print(json.dumps([dict(kernel=x["name"], grid=list(x["grid"])) for x in launches(cases)]))
    else:
        print(json.dumps(compile_all(cases)))
