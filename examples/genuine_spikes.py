"""Genuine loss spikes: Adam's own instability, reproduced on a CPU, under the Watch.

    python examples/genuine_spikes.py --case mlp --seed 0 --steps 3000 --db sqlite:///g.db
    python examples/genuine_spikes.py --case lm --seed 0 --steps 6000 --remedy vfloor

Nothing is injected. Bai et al. ("Adaptive Preconditioners Trigger Loss Spikes in Adam", arXiv
2506.04805): once the gradients are small next to Adam's second moment (g^2 << v), v decays like
beta2^t, the preconditioned sharpness grows, and the loss jumps by orders of magnitude when it
passes 2/lr. Both cases drive the loss towards zero, full batch, with beta2 = 0.999:

- `mlp`: an MLP 3072-256-256-10 fitting 200 random inputs with random one-hot labels (MSE),
  Adam lr 1e-3, eps 1e-8 (the paper's setup);
- `lm`: a 2-layer byte-level GPT (d=64) memorising 16 sequences of 32 bytes from the shipped
  corpus (a distinct first byte each, so that every context has one answer), Adam lr 1e-2,
  cross-entropy with label smoothing 0.1. Without smoothing it does not spike: as the loss goes
  to zero the cross-entropy's curvature vanishes with it, so the preconditioned sharpness never
  grows (docs/spikes.md). With smoothing the optimum is a finite minimum with finite
  curvature (its loss is the smoothed target's entropy, `Case.floor`), as for the MSE.

`--remedy` picks what spikewatch does about them (docs/spikes.md compares them on the same
seeds): `none` (detect and record only), `rollback` (roll back and skip, never cutting the LR),
`lrcut` (the default policy: a repeat within 500 steps halves the LR, and a spike the replay
finds in the optimizer state may come back 8 times before a halt, not 3), `samestep` (refuse
an isolated extreme update), `beta2` (beta2 0.95 from the start), `eps` (eps 1e-6 from the
start) and `vfloor` (rollback, and at each rollback raise Adam's eps to a tenth of the median
sqrt(v) of the restored state: a remedy aimed at the cause, see `VFloor`). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from spikewatch import Watch  # noqa: E402
from spikewatch.trainer.core.callbacks import Callback  # noqa: E402

REMEDIES = ("none", "rollback", "lrcut", "samestep", "beta2", "eps", "vfloor")


@dataclass
class Case:
    model: torch.nn.Module
    batch: tuple[torch.Tensor, torch.Tensor]
    loss_fn: Callable[[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]
    lr: float
    floor: float = 0.0  # the least loss possible: the curve's excess over it goes to zero


def mlp_case(seed: int) -> Case:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(200, 3072, generator=g)
    y = F.one_hot(torch.randint(0, 10, (200,), generator=g), 10).float()
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(3072, 256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 10),
    )
    return Case(model, (x, y), lambda b: F.mse_loss(model(b[0]), b[1]), 1e-3)


def lm_case(seed: int, n_seq: int = 16, seq_len: int = 32, smoothing: float = 0.1) -> Case:
    from plain_loop import GPT

    from spikewatch.corpus import text_corpus

    train, _ = text_corpus()
    g = torch.Generator().manual_seed(1234)  # the same sequences for every seed
    starts = torch.randint(0, len(train) - seq_len, (n_seq,), generator=g)
    seqs = torch.stack([train[s : s + seq_len] for s in starts]).long()
    seqs[:, 0] = torch.arange(n_seq) % 32  # a distinct first byte: every context has one answer
    torch.manual_seed(seed)
    model = GPT(64, 2, 4, seq_len - 1)

    def loss_fn(b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = b
        h = model.wte(x) + model.wpe(torch.arange(x.size(1)))
        for block in model.h:
            h = block(h)
        logits = model.lm_head(model.ln_f(h)).flatten(0, 1)
        return F.cross_entropy(logits, y.flatten(), label_smoothing=smoothing)

    hi, lo = 1 - smoothing + smoothing / 256, smoothing / 256
    floor = -(hi * math.log(hi) + 255 * lo * math.log(lo))  # the smoothed target's entropy
    return Case(model, (seqs[:, :-1], seqs[:, 1:]), loss_fn, 1e-2, floor)


CASES = {"mlp": mlp_case, "lm": lm_case}


class VFloor(Callback):
    """At each rollback, raise every Adam param group's eps to `fraction` x the median sqrt(v)
    of the restored state (never lower it).

    Why: the spike comes from v decaying far below the gradients' past scale, so the smallest
    sqrt(v) entries make the preconditioner's largest step sizes. An eps at a tenth of the
    typical sqrt(v) caps them at ten times the typical step, and it is chosen from the run's own
    state at the moment the instability was seen, not guessed in advance."""

    def __init__(self, optimizer: torch.optim.Optimizer, fraction: float = 1.0) -> None:
        self.optimizer, self.fraction = optimizer, fraction
        self.raised: list[tuple[int, float]] = []  # (step, new eps)

    def on_rollback(self, step: int, record: Any) -> None:
        roots = [
            s["exp_avg_sq"].sqrt().flatten()
            for s in self.optimizer.state.values()
            if "exp_avg_sq" in s
        ]
        if not roots:
            return
        eps = self.fraction * float(torch.cat(roots).median())
        for group in self.optimizer.param_groups:
            if eps > group["eps"]:
                group["eps"] = eps
        self.raised.append((step, eps))


def settings_for(remedy: str, memory_interval: int = 10) -> dict[str, Any]:
    """The Watch's settings of a remedy (the optimizer's own changes are made by `run`)."""
    act = remedy in ("rollback", "lrcut", "vfloor")
    policy = {"lr_decay": 1.0} if remedy in ("rollback", "vfloor") else {}
    return {
        "probes": {"state_interval": 1},
        "checkpoint": {
            "interval": None,
            "memory_interval": memory_interval if act else None,
            "keep_last": 4,
        },
        "guard": {
            "rollback": act,
            "same_step": {"enabled": remedy == "samestep"},
            "policy": policy,
        },
    }


def run(
    case: str,
    seed: int,
    steps: int,
    remedy: str = "none",
    *,
    db: str | None = None,
    run_dir: str | Path | None = None,
    name: str | None = None,
    callbacks: Callable[[Case, torch.optim.Optimizer], list[Callback]] | None = None,
) -> dict[str, Any]:
    """One run under the Watch; its losses and a summary. `callbacks(case, optimizer)` adds
    the caller's own callbacks (a probe of its own, as the benchmark's sharpness)."""
    if remedy not in REMEDIES:
        raise ValueError(f"remedy must be one of {', '.join(REMEDIES)}; got {remedy!r}")
    c = CASES[case](seed)
    betas = (0.9, 0.95 if remedy == "beta2" else 0.999)
    eps = 1e-6 if remedy == "eps" else 1e-8
    opt = torch.optim.Adam(c.model.parameters(), lr=c.lr, betas=betas, eps=eps)
    floor = VFloor(opt) if remedy == "vfloor" else None
    watch = Watch(
        c.model,
        opt,
        name=name or f"genuine-{case}-{remedy}-s{seed}",
        db=db,
        run_dir=run_dir,
        max_steps=steps,
        settings=settings_for(remedy),
        callbacks=([floor] if floor else []) + (callbacks(c, opt) if callbacks else []),
        tags=["genuine", case, remedy],
        model_info={"model_type": case},
    )
    if hasattr(c.model, "use_recorder"):  # the GPT's attention records per-head maxima
        c.model.use_recorder(watch.attn)
    losses: dict[int, float] = {}  # the kept branch: a rollback's steps are computed again
    computed = 0
    t0 = time.perf_counter()
    with watch:
        for batch in watch.batches(lambda i: c.batch, loss_fn=c.loss_fn):
            loss = c.loss_fn(batch)
            loss.backward()
            step = watch.step_count + 1  # the update this batch is for
            if watch.step(loss) != "rolled_back":
                losses[step] = float(loss.detach())
            computed += 1
        halted = watch.halted
    final = [v for s, v in sorted(losses.items()) if s > max(losses, default=0) - 50 and v > 0]
    return {
        "case": case,
        "seed": seed,
        "remedy": remedy,
        "run_id": watch.run_id,
        "steps": steps,
        "steps_computed": computed,
        "halted": halted,
        "seconds": round(time.perf_counter() - t0, 1),
        "final_loss": math.exp(sum(map(math.log, final)) / len(final)) if final else None,
        "losses": [losses[s] for s in sorted(losses)],
        "floor": c.floor,
        "eps_raised": floor.raised if floor else [],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--case", choices=sorted(CASES), default="mlp")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--remedy", choices=REMEDIES, default="none")
    p.add_argument("--db", default=None, help="store URL (default runs/spikewatch.db here)")
    args = p.parse_args(argv)
    out = run(args.case, args.seed, args.steps, args.remedy, db=args.db)
    out.pop("losses")
    sys.stdout.write(json.dumps(out) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
