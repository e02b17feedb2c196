"""Tokens/s of `fit()` (probes off, spike guard on) vs a minimal hand-written PyTorch loop.

Both use the same model, optimizer, data and schedule; the plain loop is what a user would write
by hand (forward, backward, clip, step, one `.item()` for the loss). Steps after a warm-up are
timed from inside each loop, so setup is excluded from both. Repetitions alternate A B / B A and
the figures are medians. Last line: a JSON object with `ratio_vs_plain` per config and overall.

    python benchmarks/throughput.py [--steps 40] [--reps 5] [--configs tiny_cpu,ablation]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import torch  # noqa: E402
from _common import machine, median  # noqa: E402

from spikewatch.trainer.builtin.loop import build_trainer  # noqa: E402
from spikewatch.trainer.builtin.schedule import lr_multiplier  # noqa: E402
from spikewatch.trainer.config import TrainConfig, load_config  # noqa: E402
from spikewatch.trainer.core.callbacks import Callback, StepState  # noqa: E402

WARMUP = 5


class _Clock(Callback):
    def __init__(self) -> None:
        self.t: list[float] = []

    def post_step(self, state: StepState) -> None:
        self.t.append(time.perf_counter())


def run_fit(cfg: TrainConfig, tmp: str) -> float:
    clock = _Clock()
    build_trainer(cfg, run_dir=Path(tmp) / "fit", callbacks=[clock]).fit()
    return _tps(cfg, clock.t)


def run_plain(cfg: TrainConfig, tmp: str) -> float:
    tr = build_trainer(cfg, run_dir=Path(tmp) / "plain")  # same model, optimizer, sampler
    model, opt, sampler = tr.model, tr.optimizer, tr.sampler
    times = []
    for step in range(1, cfg.train.max_steps + 1):
        x, y = sampler.batch(step - 1, step)
        loss = model(x, y).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip or 1e9)
        mult = lr_multiplier(cfg.schedule, step, cfg.train.max_steps)
        for g in opt.param_groups:
            g["lr"] = g["base_lr"] * mult
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
        times.append(time.perf_counter())
    return _tps(cfg, times)


def _tps(cfg: TrainConfig, t: list[float]) -> float:
    tokens = cfg.data.batch_size * cfg.data.seq_len * (len(t) - WARMUP)
    return tokens / (t[-1] - t[WARMUP - 1])


def bench(name: str, steps: int, reps: int) -> dict:
    cfg = load_config(
        name,
        [
            f"train.max_steps={steps}",
            "schedule.warmup_steps=2",
            "train.progress=false",
            "eval.interval=none",
            "probes.enabled=false",  # the comparison; the spike guard stays on
        ],
    )
    fit_tps, plain_tps = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(reps):
            order = [(run_fit, fit_tps), (run_plain, plain_tps)]
            for fn, out in order if r % 2 == 0 else order[::-1]:
                out.append(fn(cfg, tmp))
    f, p = median(fit_tps), median(plain_tps)
    print(f"{name}: fit {f:,.0f} tok/s, plain {p:,.0f} tok/s, ratio {f / p:.3f}")
    return {"ratio_vs_plain": f / p, "fit_tokens_per_s": f, "plain_tokens_per_s": p}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--configs", default="tiny_cpu,ablation")
    args = ap.parse_args()
    print("machine:", json.dumps(machine()))
    results = {n: bench(n, args.steps, args.reps) for n in args.configs.split(",")}
    overall = min(r["ratio_vs_plain"] for r in results.values())
    print(json.dumps({"ratio_vs_plain": overall, **results}))


if __name__ == "__main__":
    main()
