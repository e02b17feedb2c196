"""What spikewatch adds to a training step on the device, counted on a CPU (issue 47).

A GPU pays per kernel launch and per byte to the host; a CPU can count both. The plain-loop
GPT at GPT-2-small shape (12 x 768, 12 heads, T=1024, B=16) is built on the `meta` device (no
memory, no arithmetic: every op still dispatches), and a TorchDispatchMode counts the aten ops of
each part of spikewatch's per-step work, before issue 47 and now:

- the per-head attention maxima of 12 layers: the blockwise score pass (before) against the
  fused max pass (now; on meta its fake, one op per layer);
- Adam's v-below-1e-16 count on a state step: five ops per tensor (before) against one
  concatenation, comparison and index_add (now);
- the step factor: read one step late, the same-step tier's thresholds now take the step
  before from the device (scalar ops added, counted);
- what stayed: the clip with its per-tensor norms and per-layer sums, the one packed transfer
  (its bytes), and the update and moment statistics of a state step.

Host time is the Python and dispatch time of each part on meta (what a GPU's host pays before
the kernels run), medians of repeats.

    python benchmarks/step_ops.py          # prints a table, then one JSON line
"""

from __future__ import annotations

import importlib.util
import json
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from spikewatch.trainer.config import ProbesConfig  # noqa: E402
from spikewatch.trainer.core import probes as P  # noqa: E402
from spikewatch.trainer.core.same_step import SameStepConfig, SameStepGate, step_factor  # noqa: E402
from spikewatch.trainer.core.transfer import HostTransfer, StepTensors, clip_by_global_norm  # noqa: E402
from spikewatch.trainer.model.attention import max_logits  # noqa: E402
from spikewatch.trainer.model.attn_max import AttnMax  # noqa: E402
from spikewatch.trainer.model.kernels import max_logits as fused  # noqa: E402,F401  (registers the op)

L, D, H, T, B = 12, 768, 12, 1024, 16
STATE_INTERVAL = 10  # ProbesConfig's default: state statistics every 10th step


# ops that launch no kernel on a GPU: views and allocations
_NO_KERNEL = {"empty", "empty_like", "empty_strided", "new_empty", "lift_fresh"}


class Ops(TorchDispatchMode):
    """Counts the aten ops that would launch a kernel (views and allocations left out)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        name = func.overloadpacket.__name__
        if not (func.is_view or name in _NO_KERNEL):
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


def measure(fn: Callable[[], object], reps: int = 5) -> tuple[int, float]:
    """(ops dispatched by one call, its median host time in ms)."""
    with Ops() as mode:
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sum(mode.ops.values()), 1e3 * statistics.median(times)


def main() -> None:
    spec = importlib.util.spec_from_file_location(
        "plain_loop", Path(__file__).resolve().parents[1] / "examples/plain_loop.py"
    )
    assert spec is not None and spec.loader is not None
    ex = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ex)
    with torch.device("meta"):
        model = ex.GPT(D, L, H, T)
    params = [p for p in model.parameters()]
    for p in params:
        p.grad = torch.empty_like(p)
    opt = torch.optim.AdamW(params, lr=1e-3)
    for p in params:
        opt.state[p] = {
            "step": torch.tensor(1.0),
            "exp_avg": torch.empty_like(p),
            "exp_avg_sq": torch.empty_like(p),
        }
    probes = P.Probes(model, opt, ProbesConfig(), layer_of=P.module_layer_of)  # as the Watch
    n_params = sum(p.numel() for p in params)
    q = torch.empty(B, H, T, D // H, device="meta", dtype=torch.bfloat16)
    scale = (D // H) ** -0.5

    def maxima_blockwise() -> None:
        rec = AttnMax()
        rec.active = True
        for layer in range(L):
            rec._keep(layer, max_logits(q, q, chunk=64, fused=False))
        rec.take()

    def maxima_fused() -> None:
        rec = AttnMax()
        rec.active = True
        for layer in range(L):
            rec._keep(layer, torch.ops.spikewatch.fused_max_logits(q, q, True, scale))
        rec.take()

    loss = torch.empty((), device="meta")
    norm_out: dict = {}

    def clip_and_norms() -> None:
        norm, factor, per_tensor = clip_by_global_norm(params, 1.0)
        norm_out.update(
            norm=norm, factor=factor, per=per_tensor, names=probes.grad_norms(per_tensor)
        )

    clip_and_norms()
    attn = torch.empty(L, H, device="meta")

    tier = SameStepGate(SameStepConfig())
    for i in range(200):  # a full window
        tier.observe(2.0 + 0.01 * (i % 7), 1.0 + 0.02 * (i % 5), False)
    one = torch.ones((), device="meta")

    def factor_and_transfer(late: bool) -> Callable[[], None]:
        def run() -> None:  # read late, the thresholds take the step before on the device
            limits = tier.limits_after(loss, norm_out["norm"], one, None) if late else tier.limits()
            transfer(step_factor(loss, norm_out["norm"], limits))

        return run

    def transfer(f: torch.Tensor) -> None:
        x = HostTransfer()
        x.add_step(StepTensors(loss, norm_out["norm"], norm_out["factor"], norm_out["per"],
                               attn_max=attn))  # fmt: skip
        x.add(["_factor"], f)
        x.add_by_layer(*norm_out["names"])
        x.start()
        norm_out["values"] = len(x.names)

    def state_step(tiny: Callable[[list[torch.Tensor]], torch.Tensor]) -> Callable[[], None]:
        def run() -> None:
            saved = P._tiny_counts
            P._tiny_counts = lambda v, device, index: tiny(v)  # type: ignore[assignment]
            try:
                probes.before_update(STATE_INTERVAL)
                probes.after_update(STATE_INTERVAL, True)
                probes.take_pending()
            finally:
                P._tiny_counts = saved

        return run

    def per_tensor(v: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack([P._tiny_count(x) for x in v])

    index: dict = {}
    tiny_counts = P._tiny_counts

    def few(v: list[torch.Tensor]) -> torch.Tensor:
        return tiny_counts(v, torch.device("meta"), index)

    parts = {
        "attention maxima (12 layers)": (maxima_blockwise, maxima_fused, 1),
        "clip, per-tensor norms, per-layer grad norms": (clip_and_norms, clip_and_norms, 1),
        "step factor and the packed transfer": (
            factor_and_transfer(False),
            factor_and_transfer(True),
            1,
        ),
        "update and moment statistics (a state step)": (
            state_step(per_tensor),
            state_step(few),
            STATE_INTERVAL,
        ),
    }
    rows, total = [], {"before": [0.0, 0.0], "now": [0.0, 0.0]}
    print(f"{n_params / 1e6:.0f}M parameters in {len(params)} tensors, B={B}, T={T}")
    print("| part | ops before | ops now | host ms before | host ms now | per step |")
    print("|---|---:|---:|---:|---:|---|")
    for name, (before, now, every) in parts.items():
        (ob, tb), (on, tn) = measure(before), measure(now)
        for key, (o, t) in (("before", (ob, tb)), ("now", (on, tn))):
            total[key][0] += o / every
            total[key][1] += t / every
        per = "every step" if every == 1 else f"1 in {every}"
        print(f"| {name} | {ob} | {on} | {tb:.2f} | {tn:.2f} | {per} |")
        rows.append(
            dict(part=name, ops_before=ob, ops_now=on, ms_before=tb, ms_now=tn, every=every)
        )
    to_host = 4 * norm_out["values"]
    print(
        f"| a step on average | {total['before'][0]:.0f} | {total['now'][0]:.0f} | "
        f"{total['before'][1]:.2f} | {total['now'][1]:.2f} | |"
    )
    print(f"to the host per step: one copy of {to_host} bytes ({norm_out['values']} values)")
    print(json.dumps({"rows": rows, "ops_per_step": total, "bytes_to_host": to_host}))


if __name__ == "__main__":
    main()
