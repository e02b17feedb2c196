"""Step time with every probe on vs all off (and all but the attention max), interleaved.

Configs: tiny_cpu.toml, and a wider model (d=512, 8 layers; smaller batch so a step stays near
a second on 2 cores). Each repetition builds the three variants afresh and times the steps after a
warm-up from inside the loop (post_step), in rotating order; figures are medians of per-step
times. With `model.attention = "auto"`, asking for the attention max switches CPU attention from
SDPA to the chunked backend, so `ratio_all` includes that switch. Last line:
{"tiny": {"ratio_no_attn": a, "ratio_all": b}, "wide": {...}}.

    python benchmarks/probe_overhead.py [--reps 5] [--steps 30] [--wide-steps 8]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import torch  # noqa: E402, F401  (after _common set the thread environment)
from _common import machine, median  # noqa: E402

from spikewatch.trainer.builtin.loop import build_trainer  # noqa: E402
from spikewatch.trainer.config import load_config  # noqa: E402
from spikewatch.trainer.core.callbacks import Callback, StepState  # noqa: E402

VARIANTS = {
    "off": ["probes.enabled=false"],
    "no_attn": ["probes.attn_max=false"],
    "all": [],
    "all_state_every_step": ["probes.state_interval=1"],
}
WIDE = [
    "model.d_model=512",
    "model.n_layer=8",
    "model.n_head=8",
    "data.batch_size=4",
    "data.seq_len=128",
    "model.max_seq_len=128",
]


class _Clock(Callback):
    def __init__(self) -> None:
        self.t: list[float] = []

    def post_step(self, state: StepState) -> None:
        self.t.append(time.perf_counter())


def _step_times(overrides: list[str], steps: int, tmp: str) -> list[float]:
    cfg = load_config(
        "tiny_cpu",
        [
            *overrides,
            f"train.max_steps={steps}",
            "schedule.warmup_steps=1",
            "train.progress=false",
            "eval.interval=none",
            "eval.batches=1",
        ],
    )
    clock = _Clock()
    build_trainer(cfg, run_dir=Path(tmp) / "run", callbacks=[clock]).fit()
    warm = 2
    return [b - a for a, b in zip(clock.t[warm:], clock.t[warm + 1 :], strict=False)]


def bench(name: str, base: list[str], steps: int, reps: int) -> dict:
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    order = list(VARIANTS)
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(reps):
            for v in order[r % len(order) :] + order[: r % len(order)]:
                times[v] += _step_times([*base, *VARIANTS[v]], steps, tmp)
    m = {v: median(ts) for v, ts in times.items()}
    out = {
        "ratio_no_attn": m["no_attn"] / m["off"],
        "ratio_all": m["all"] / m["off"],
        "ratio_all_state_every_step": m["all_state_every_step"] / m["off"],
        "step_ms_off": 1e3 * m["off"],
        "step_ms_no_attn": 1e3 * m["no_attn"],
        "step_ms_all": 1e3 * m["all"],
    }
    print(f"{name}: " + ", ".join(f"{k} {v:.3f}" for k, v in out.items()))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--wide-steps", type=int, default=8)
    args = ap.parse_args()
    print("machine:", json.dumps(machine()))
    tiny = bench("tiny", [], args.steps, args.reps)
    wide = bench("wide", WIDE, args.wide_steps, max(3, args.reps // 2))
    print(json.dumps({"tiny": tiny, "wide": wide}))


if __name__ == "__main__":
    main()
