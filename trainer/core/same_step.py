"""The same-step tier: refuse an isolated extreme update on the step it happens.

One bad batch should cost one skipped update, not a rollback (OLMo-core's skip-step idea):
the step's loss and gradient norm are compared with their rolling level on the device, with
no host read before the update; what persists is left to the rollback. The rule, and why its
level and deviation are these: docs/recovery.md, "The same-step tier's rule".
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from spikewatch.trainer.core.transfer import as32

__all__ = ["AFTER_ROLLBACK", "SameStepConfig", "SameStepGate", "late_factor", "step_factor"]

AFTER_ROLLBACK = "same-step tier, right after a rollback"  # how such a refusal's reason begins

log = logging.getLogger(__name__)

# With sigma 6, the floors make the smallest excursion refused: a loss at 1.75x its rolling mean,
# a gradient norm at 16x. A bad batch shows in its own loss (shifted labels 2.1x, random bytes
# 4x on tiny_cpu), where a small model's own instabilities in clean runs reached 1.2-1.44x with
# gradient norms 7.7-12x (benchmarks/false_refusals.py, docs/recovery.md); an update that only
# its gradient norm marks, below that, is the rollback tier's to judge.
LOSS_FLOOR = math.log(1.75) / 6
GRAD_FLOOR = math.log(16) / 6


class SameStepConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(
        True, description="Refuse an isolated extreme update on its own step (no rollback)."
    )
    window: int = Field(128, ge=8, description="Accepted steps in the rolling statistics.")
    min_history: int = Field(32, ge=4, description="Accepted steps before the tier can refuse.")
    sigma: float = Field(6.0, gt=0, description="Deviations above the rolling level that refuse.")
    level_window: int = Field(
        16,
        ge=2,
        description="The last accepted steps whose mean is the level a step is compared with "
        "(the window's own mean lags a falling loss: early in a run it held the descent's "
        "first values).",
    )
    max_refusals: int = Field(
        2, ge=1, description="Refusals in a row; the next extreme update goes through."
    )
    after_rollback: int = Field(
        64,
        ge=1,
        description="Refusals in a row right after a rollback, each at the rollback's bar "
        "(`after_rollback_ratio`), before the usual `max_refusals` (until a step is not "
        "refused): the weights just restored are known good, so a high "
        "loss on the batches that follow is the data's, most often the rest of a bad stretch "
        "that the rollback's skip range covered only in part (a corrupt shard read as a "
        "stream); letting one through there trained a bad batch and spiked again.",
    )
    after_rollback_ratio: float = Field(
        1.5,
        gt=1,
        description="Right after a rollback, a loss this many times its rolling (geometric) "
        "mean is refused, whatever the window's spread (and `min_loss_excess` nats above it): "
        "a batch of spoilt labels came at 1.74-1.82x, a short run's window spread by its first "
        "steps' descent let 4x through, and a clean batch on restored weights lies near the "
        "mean (one refused by mistake costs that batch alone: the next one learnt ends it).",
    )
    floor: float = Field(
        LOSS_FLOOR,
        gt=0,
        description="Smallest deviation of the loss in log units: ln 1.75 / 6, so that with "
        "sigma 6 a refusal by the loss needs it at 1.75x its rolling mean at least (a bad batch "
        "shows in its own loss; a small model's own instabilities in clean runs reached 1.44x).",
    )
    grad_floor: float = Field(
        GRAD_FLOOR,
        gt=0,
        description="Smallest deviation of the gradient norm in log units: ln 16 / 6, so that "
        "with sigma 6 a refusal by the gradient norm alone needs it at 16x its rolling mean at "
        "least (clean runs' own instabilities reached 12x; below that the rollback tier judges).",
    )
    min_loss_excess: float = Field(
        0.05,
        ge=0,
        description="Nats a loss must lie above its rolling (geometric) mean at least to be "
        "refused: near zero its ratios are noise (a converged classifier's 0.0001 -> 0.006 is "
        "60x its mean and harmless; a bad batch's loss is nats above it).",
    )

    @model_validator(mode="after")
    def _level_in_window(self) -> SameStepConfig:
        if self.level_window > self.window:
            raise ValueError(
                f"same_step.level_window ({self.level_window}) must not exceed same_step.window "
                f"({self.window}): the level is the mean of the window's last steps"
            )
        return self


@dataclass(frozen=True)
class Stats:
    """A series' statistics over the window (log values): `level`, the mean of its last
    `level_window` values; `spread`, its deviation from the successive differences (their mean
    square over two: a trend, such as a run's first descent, does not widen it as it widens
    the window's own deviation); `sq` their sum of squares, `evicted` the square that leaves
    once the full window takes a value, `last` the newest value, `leaving` the value that
    leaves the level (0 while it holds fewer than `level_window`), `k` the level's count."""

    level: float
    spread: float
    sq: float
    evicted: float
    last: float
    leaving: float
    k: int

    def pushed(self, level_window: int) -> tuple[float, float]:
        """(a, b): the level once a value x is added is a + b x (so the device adds it in two
        operations)."""
        k_new = min(self.k + 1, level_window)
        return (self.level * self.k - self.leaving) / k_new, 1.0 / k_new


class SameStepGate:
    """Per step: `limits()` before it, `observe(loss, grad_norm, refused)` after its read (host
    floats); `check` does both from host values (the same rule, for tests and replays)."""

    def __init__(self, cfg: SameStepConfig) -> None:
        self.cfg = cfg
        self.values: list[list[float]] = [[0.0] * cfg.window, [0.0] * cfg.window]  # log values
        self.count = 0  # accepted values held, <= window; they fill slots 0.. in order
        self.pos = 0  # the slot the next accepted value goes to
        self.refused = 0  # refusals in a row

    def limits(self) -> tuple[float, float] | None:
        """The log-values above which the next step's loss or gradient norm is refused; None
        while the tier is not armed (too little history, or `max_refusals` in a row)."""
        cfg = self.cfg
        if self.count < max(cfg.min_history, 2) or self.refused >= cfg.max_refusals:
            return None
        out = []
        for i in range(2):  # level, deviation
            st = self.stats(i)
            if i == 0 and self.refused < 0:  # right after a rollback: the loss's own bar
                spread = self._floor(i, st.level, restored=True)
            else:
                spread = max(st.spread, self._floor(i, st.level))
            out.append(st.level + cfg.sigma * spread)
        return out[0], out[1]

    def ordered(self, i: int) -> list[float]:
        """Series i's accepted log-values, oldest first."""
        series, n = self.values[i], self.count
        return series[:n] if n < self.cfg.window else series[self.pos :] + series[: self.pos]

    def stats(self, i: int) -> Stats:
        """Series i's level and spread, and what the device needs to add a value to them."""
        held = self.ordered(i)
        n, k = len(held), min(len(held), self.cfg.level_window)
        recent = held[n - k :]
        level = math.fsum(recent) / k if k else 0.0
        sq = math.fsum((b - a) ** 2 for a, b in zip(held, held[1:], strict=False))
        full = n == self.cfg.window
        return Stats(
            level=level,
            spread=math.sqrt(sq / (2 * (n - 1))) if n >= 2 else 0.0,
            sq=sq,
            evicted=(held[1] - held[0]) ** 2 if full and n >= 2 else 0.0,
            last=held[-1] if n else 0.0,
            leaving=held[n - k] if k == self.cfg.level_window else 0.0,
            k=k,
        )

    def _floor(self, i: int, mean: float, restored: bool = False) -> float:
        """Series i's smallest deviation (log units) at the log-mean `mean`: its floor, and for
        the loss what `min_loss_excess` nats above the mean need (`loss_floor`); `restored`:
        right after a rollback, the loss's floor is `after_rollback_ratio`'s."""
        cfg = self.cfg
        if i == 0:
            floor = self.after_floor if restored else cfg.floor
            return max(floor, math.log1p(cfg.min_loss_excess * math.exp(-mean)) / cfg.sigma)
        return cfg.grad_floor

    @property
    def after_floor(self) -> float:
        """The loss's floor right after a rollback, in the floors' units (log / sigma)."""
        return math.log(self.cfg.after_rollback_ratio) / self.cfg.sigma

    def limits_after(
        self,
        loss: torch.Tensor,
        grad_norm: torch.Tensor,
        factor: torch.Tensor,
        overflow: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The next step's thresholds while the step before it is still on the device (read
        one step late): what `limits()` would give once `observe` had learnt that step, its
        values and the device's factor taken where they are. Returns ((2,) log-thresholds,
        () armed), both on the device. The host gives the window as its exact mean and sum of
        squared deviations per series; the device adds the step, drops the value it evicts,
        and counts the refusals in a row, with `observe`'s rule (non-finite values never
        learnt, a GradScaler's overflow leaving the window alone)."""
        cfg = self.cfg
        dev = loss.device
        n = self.count
        st = [self.stats(i) for i in range(2)]
        f64 = torch.float64
        x = torch.stack([loss.detach(), grad_norm.detach()]).to(f64)  # (2,)
        fin = torch.isfinite(x)
        loss_ok = fin[0]
        over = torch.zeros((), dtype=torch.bool, device=dev)
        if overflow is not None:
            over = (overflow > 0) & loss_ok
        nonfinite = ~(loss_ok & (fin[1] | over))
        refused = (factor == 0) & ~nonfinite  # by the tier: a finite step the device refused
        learnable = (fin & (x > 0)).all()  # as `_log`: a value <= 0 or non-finite is not learnt
        pushed = ~over & learnable & ~refused
        full = n == cfg.window
        n_new = pushed.to(f64) * (0.0 if full else 1.0) + n
        a, b = zip(*(t.pushed(cfg.level_window) for t in st), strict=True)
        window = torch.tensor(  # one small copy
            [*(t.level for t in st), *(t.sq for t in st), *(t.evicted for t in st),
             *(t.last for t in st), *a],
            dtype=f64, device=dev,
        )  # fmt: skip
        level0, sq0, e, last, added0 = (window[j : j + 2] for j in range(0, 10, 2))
        keep = pushed.to(f64)
        lx = torch.where(pushed, x.log(), 0.0)
        level = torch.where(pushed, added0 + lx * b[0], level0)
        sq = sq0 + keep * ((lx - last) ** 2 - e)  # e: 0 while the window is not full
        c_push, c_keep = _spread_scale(n + (0 if full else 1)), _spread_scale(n)
        sd = (sq * (c_keep + keep * (c_push - c_keep))).clamp_min(0.0).sqrt()
        run = torch.where(over, float(self.refused), torch.where(refused, self.refused + 1.0, 0.0))
        least = loss_floor(level[0], cfg.sigma, cfg.floor, cfg.min_loss_excess)
        bar = loss_floor(level[0], cfg.sigma, self.after_floor, cfg.min_loss_excess)
        loss_sd = torch.where(run < 0, bar, torch.maximum(sd[0], least))  # after a rollback
        sd = torch.stack([loss_sd, sd[1].clamp_min(cfg.grad_floor)])
        lim = level + cfg.sigma * sd
        armed = (n_new >= max(cfg.min_history, 2)) & (run < cfg.max_refusals)
        return lim, armed

    def factor_after(
        self,
        loss: torch.Tensor,
        grad_norm: torch.Tensor,
        ahead: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None],
    ) -> torch.Tensor:
        """`step_factor(loss, grad_norm, self.limits_after(*ahead))` in one device op
        (`spikewatch::late_factor`): the host packs the window's numbers into one small copy,
        the device does the ~50 scalar operations in one call (on CUDA a compiled kernel),
        not ~50 launches from Python on the loop thread every step. Returns (2,): the factor
        and its refusal flag (`late_factor`)."""
        cfg = self.cfg
        v, h = self.late_inputs(loss, grad_norm, ahead)
        return torch.ops.spikewatch.late_factor(
            v, h, cfg.sigma, cfg.floor, cfg.grad_floor, max(cfg.min_history, 2), cfg.max_refusals
        )

    def late_inputs(
        self,
        loss: torch.Tensor,
        grad_norm: torch.Tensor,
        ahead: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None],
    ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """`late_factor`'s (v, h): the device values, and the window's numbers (one copy)."""
        cfg = self.cfg
        n = self.count
        st = [self.stats(i) for i in range(2)]
        prev_loss, prev_norm, prev_factor, overflow = ahead
        full = n == cfg.window
        (a0, b), (a1, _) = (t.pushed(cfg.level_window) for t in st)
        h = torch.tensor(
            [st[0].level, st[1].level, st[0].sq, st[1].sq, st[0].evicted, st[1].evicted,
             float(n), float(full), float(self.refused), float(overflow is not None),
             cfg.min_loss_excess, self.after_floor, st[0].last, st[1].last, a0, a1, b,
             _spread_scale(n + (0 if full else 1)), _spread_scale(n)],
            dtype=torch.float64,
        )  # fmt: skip
        dev = loss.device
        if dev.type != "cpu":
            h = h.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else h.to(dev)
        # six 0-dim values as they are: the op stacks them (inside its one kernel on CUDA),
        # not a stack launched from the loop thread first
        v = [prev_loss, prev_norm, prev_factor, prev_factor if overflow is None else overflow,
             loss, grad_norm]  # fmt: skip
        return [as32(x) for x in v], h

    def z(self, loss: float, grad_norm: float) -> tuple[float, float]:
        """Deviations of the two log-values above their rolling means (0 without history)."""
        (z_loss, _), (z_grad, _) = self.excess(loss, grad_norm)
        return z_loss, z_grad

    def excess(
        self, loss: float, grad_norm: float
    ) -> tuple[tuple[float, float], tuple[float, float]]:
        """(deviations above the rolling mean, times the rolling mean) of the loss and of the
        gradient norm, in the tier's log space: ((0, 1), (0, 1)) without history."""
        x = [_log(loss), _log(grad_norm)]
        if self.count < 2 or not all(math.isfinite(v) for v in x):
            return (0.0, 1.0), (0.0, 1.0)
        out = []
        for i in range(2):
            st = self.stats(i)
            out.append(((x[i] - st.level) / max(st.spread, self._floor(i, st.level)),
                        math.exp(x[i] - st.level)))  # fmt: skip
        return out[0], out[1]

    def observe(self, loss: float, grad_norm: float, refused: bool) -> str:
        """After the step's read: `refused` is what the device decided for a finite step. The
        window learns a normal value or one let through; returns the refusal's reason."""
        reason = ""
        if refused:
            of_loss, of_grad = self.excess(loss, grad_norm)
            reason = self.reason(of_loss, of_grad, self.cfg.sigma, self.refused < 0)
        x = [_log(loss), _log(grad_norm)]
        if all(math.isfinite(v) for v in x) and not refused:
            for series, v in zip(self.values, x, strict=True):
                series[self.pos] = v
            self.pos = (self.pos + 1) % self.cfg.window
            self.count = min(self.count + 1, self.cfg.window)
        self.refused = self.refused + 1 if refused else 0
        return reason

    def check(self, loss: float, grad_norm: float) -> tuple[bool, float, float]:
        """The whole rule on host values: (refuse, z of the loss, z of the grad norm)."""
        limits = self.limits()
        z_loss, z_grad = self.z(loss, grad_norm)
        x = [_log(loss), _log(grad_norm)]
        refuse = (
            limits is not None
            and all(math.isfinite(v) for v in x)
            and (x[0] > limits[0] or x[1] > limits[1])
        )
        self.observe(loss, grad_norm, refuse)
        return refuse, z_loss, z_grad

    def reset(self) -> None:
        """Forget the history (the loss moved to a new level on purpose, or was accepted as
        one): the tier re-arms after `min_history` steps."""
        self.count = self.pos = self.refused = 0

    @staticmethod
    def reason(
        loss: tuple[float, float], grad: tuple[float, float], sigma: float, restored: bool = False
    ) -> str:
        """Why a step was refused, from `excess`: each series above its limit, how many times
        its rolling mean and how many deviations. `restored`: right after a rollback, where
        the loss is held to its floor above the mean (its spread is not asked)."""
        if restored and grad[0] <= sigma:
            return (
                f"{AFTER_ROLLBACK}: loss {loss[1]:.2f}x its rolling mean on weights known good "
                "(the bad stretch goes on): update refused"
            )
        what = [
            f"{name} {ratio:.2f}x its rolling mean ({z:.1f} deviations)"
            for name, (z, ratio) in (("loss", loss), ("grad norm", grad))
            if z > sigma
        ] or [f"loss {loss[0]:.1f} / grad norm {grad[0]:.1f} deviations at the threshold"]
        return f"same-step tier: {' and '.join(what)}: update refused"

    def state_dict(self) -> dict[str, Any]:
        """For the checkpoint."""
        return {
            "values": [list(series) for series in self.values],
            "count": self.count,
            "pos": self.pos,
            "refused": self.refused,
        }

    def after_restore(self) -> None:
        """A rollback restored the tier's state with the weights, which are known good: until
        a step is not refused (which sets the count back to 0 and the usual rule), up to
        `after_rollback` refusals in a row (the count starts that far below 0; while it is
        below 0 the rollback's bar holds, then `max_refusals` more at the usual one),
        and a loss is refused at `after_rollback_ratio` (1.5) times the rolling mean (and
        `min_loss_excess` nats above it) whatever the window's spread: a short run's window
        still holds its first steps' descent, whose spread let a bad batch's 4x loss through at
        5.5 deviations, and spoilt labels came at 1.74x, under the usual 1.75x floor."""
        self.refused = min(self.refused, -self.cfg.after_rollback)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        values = state["values"]
        if [len(series) for series in values] != [self.cfg.window] * 2:  # another window:
            self.reset()  # start the history afresh
            return
        self.values = [[float(v) for v in series] for series in values]
        self.count = int(state["count"])
        self.pos = int(state["pos"])
        self.refused = int(state["refused"])


def step_factor(
    loss: torch.Tensor,
    grad_norm: torch.Tensor,
    limits: tuple[float, float] | tuple[torch.Tensor, torch.Tensor] | None,
) -> torch.Tensor:
    """() float on the device: 1.0 = apply the update, 0.0 = refuse it (a non-finite loss or
    norm, or one above the same-step `limits`). No host read: the limits are host numbers, or
    (read one step late) `limits_after`'s device thresholds and armed flag."""
    x = torch.stack([loss.detach().float(), grad_norm.detach().float()]).double()  # (2,)
    ok = torch.isfinite(x).all()
    if limits is not None:  # as _log: a value <= 0 has no log, and is never refused
        lx = x.log()
        a, b = limits
        if torch.is_tensor(a):
            over = ((lx[0] > a[0]) | (lx[1] > a[1])) & b
        else:
            over = (lx[0] > a) | (lx[1] > b)
        ok = ok & ~(over & (x > 0).all())
    return ok.float()


def loss_floor(
    mean: torch.Tensor, sigma: float, floor: float | torch.Tensor, excess: float | torch.Tensor
) -> torch.Tensor:
    """The loss's smallest deviation (log units) at its log-mean `mean`, on the device: its
    floor, or what `excess` nats above the (geometric) mean need, the larger."""
    return torch.log1p(excess * torch.exp(-mean)).div(sigma).clamp_min(floor)


def _spread_scale(n: int) -> float:
    """1 / (2 (n - 1)): the squared successive differences of n values to a variance."""
    return 1.0 / (2.0 * max(n - 1, 1))


def _log(v: float) -> float:
    """log, with what has none (<= 0, nan) as nan: never learnt, never refused."""
    return math.log(v) if v > 0 else math.nan


def late_factor(
    vs: list[torch.Tensor],
    h: torch.Tensor,
    sigma: float,
    floor: float,
    grad_floor: float,
    min_history: int,
    refusals: int,
) -> torch.Tensor:
    """`limits_after` then `step_factor`, as one function of small tensors (so that it is
    one op, and one compiled kernel on CUDA). vs: six 0-dim float32 values on the device, the
    step before's loss, grad norm, factor and GradScaler overflow (its factor when there is no
    scaler), then this step's loss and grad norm. h (19,) float64: per series the levels,
    the sums of squared successive differences and the square that leaves a full window; the
    window's count, whether it is full, the refusals in a row, whether there is an overflow
    flag, `min_loss_excess`, the loss's floor right after a rollback (`after_rollback_ratio`'s);
    per series the newest value and the level's constant part once a value is added, its
    factor (`Stats.pushed`), and the variance's scale with and without the value. Returns
    (2,) float32: the factor (1 or 0) and its refusal flag (1 - factor: a fused AdamW's
    `found_inf`), made here so that no op on the loop thread makes the flag from the factor."""
    v = torch.stack(vs)
    x = v[:2].double()  # the step before: (2,)
    fin = torch.isfinite(x)
    loss_ok = fin[0]
    over = (v[3] > 0) & loss_ok & (h[9] > 0)
    nonfinite = ~(loss_ok & (fin[1] | over))
    refused = (v[2] == 0) & ~nonfinite
    learnable = (fin & (x > 0)).all()
    pushed = ~over & learnable & ~refused
    full, n = h[7], h[6]  # as limits_after: a full window keeps its count
    keep = pushed.double()
    n_new = keep * (1.0 - full) + n
    level0, sq0, e, last, added0 = h[0:2], h[2:4], h[4:6], h[12:14], h[14:16]
    lx = torch.where(pushed, x.log(), 0.0)
    mean = torch.where(pushed, added0 + lx * h[16], level0)  # the level
    sq = sq0 + keep * ((lx - last) ** 2 - e)  # e: 0 while the window is not full
    sd = (sq * (h[18] + keep * (h[17] - h[18]))).clamp_min(0.0).sqrt()
    run = torch.where(over, h[8], torch.where(refused, h[8] + 1.0, 0.0))
    least = loss_floor(mean[0], sigma, floor, h[10])
    bar = loss_floor(mean[0], sigma, h[11], h[10])
    loss_sd = torch.where(run < 0, bar, torch.maximum(sd[0], least))  # after a rollback
    lim = mean + sigma * torch.stack([loss_sd, sd[1].clamp_min(grad_floor)])
    armed = (n_new >= min_history) & (run < refusals)
    y = v[4:6].double()  # this step: (2,)
    ok = torch.isfinite(y).all()
    lx = y.log()
    too_high = ((lx[0] > lim[0]) | (lx[1] > lim[1])) & armed
    factor = (ok & ~(too_high & (y > 0).all())).float()
    return torch.stack([factor, 1.0 - factor])


_COMPILED: dict[tuple, Any] = {}


def _late_factor_cuda(
    v: list[torch.Tensor],
    h: torch.Tensor,
    sigma: float,
    floor: float,
    grad_floor: float,
    min_history: int,
    refusals: int,
) -> torch.Tensor:
    """On CUDA: `late_factor` compiled once per setting into one kernel (its inputs have fixed
    shapes, the settings are constants: no recompile); eager if the compiler is not at hand."""
    key = (sigma, floor, grad_floor, min_history, refusals)
    fn = _COMPILED.get(key)
    if fn is None:
        eager = functools.partial(
            late_factor, sigma=sigma, floor=floor, grad_floor=grad_floor,
            min_history=min_history, refusals=refusals,
        )  # fmt: skip
        try:
            fn = torch.compile(eager, dynamic=False, fullgraph=True)
            fn(v, h)
        except Exception as e:  # no Triton, no compiler: the same arithmetic, op by op
            log.info("same-step tier: the late factor runs eagerly (%s)", e)
            fn = eager
        _COMPILED[key] = fn
    return fn(v, h)


@torch.library.custom_op("spikewatch::late_factor", mutates_args=())
def _late_factor_op(
    v: list[torch.Tensor],
    h: torch.Tensor,
    sigma: float,
    floor: float,
    grad_floor: float,
    min_history: int,
    refusals: int,
) -> torch.Tensor:
    if v[0].is_cuda:
        return _late_factor_cuda(v, h, sigma, floor, grad_floor, min_history, refusals)
    return late_factor(v, h, sigma, floor, grad_floor, min_history, refusals)


@_late_factor_op.register_fake
def _(v, h, sigma, floor, grad_floor, min_history, refusals):  # noqa: ANN001, ANN202
    return v[0].new_empty((2,), dtype=torch.float32)
