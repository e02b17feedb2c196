"""Online loss-spike detection, the same code online (the trainer's guard) and offline (scan).

A loss spike is a rise that persists above the run's own robust level and noise (log-loss,
median and MAD of first differences), dated from where it began, so that a rollback can go
back to before it; what it must not fire on (warmup, a known regime change, slow divergence)
is held apart, and leading signals warn before it. The rules in full and why each is as it
is: docs/detection.md, "The detector's rules".
"""

from __future__ import annotations

import math
import statistics
from bisect import bisect_left, insort
from collections import deque
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from spikewatch.observatory import metric_names as M

__all__ = ["Detector", "DetectorConfig", "Verdict"]

Kind = Literal["spike", "nonfinite", "warning", "divergence"]


class DetectorConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    window: int = Field(64, ge=8, description="Normal points kept for the noise scale.")
    level_window: int = Field(
        16, ge=3, description="Recent normal points: their median is the level."
    )
    min_history: int = Field(24, ge=4, description="Normal points needed before anything fires.")
    ignore_before: int = Field(0, ge=0, description="No verdicts before this step (warmup).")
    threshold: float = Field(8.0, gt=0, description="Robust z-score of an excursion step.")
    onset_threshold: float = Field(3.0, gt=0, description="Z-score that still counts as rising.")
    persistence: int = Field(3, ge=1, description="Consecutive excursion steps for a spike.")
    climb_steps: int = Field(6, ge=2, description="Rises in a row that make a climb.")
    climb_factor: float = Field(
        30.0, gt=1, description="A climb that multiplies the loss by this is an excursion."
    )
    settle_steps: int = Field(
        16, ge=1, description="Steps under `threshold` that end a reported spike's tail."
    )
    noise_floor: float = Field(
        0.01, gt=0, description="Minimal noise scale in log-loss (1%): perfect curves still vary."
    )
    grad_threshold: float = Field(12.0, gt=0, description="Z-score of a grad-norm warning.")
    update_jump: float = Field(3.0, gt=1, description="Update norm / its median for a warning.")
    attn_warn: float | None = Field(
        100.0, gt=0, description="Max attention logit that warns (Kimi K2's tau); None = off."
    )
    trend_rise: float = Field(
        0.05, gt=0, description="Rise of the long EMA of log-loss over its minimum: divergence."
    )
    trend_horizon: int = Field(200, ge=10, description="Steps of the long EMA (its 1/alpha).")


@dataclass(frozen=True)
class Verdict:
    kind: Kind
    step: int  # when it was decided (the detection step)
    onset_step: int
    peak_step: int
    score: float
    signal: str = "loss"
    message: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class _Robust:
    """Robust level and scale of a series of normal points.

    The score is the point's distance from the median of the last `level_window` points, in
    units of the MAD of the window's successive differences. It runs on every step of every
    followed log, so the sorted differences and the sorted level window are kept up to date
    as points come and go (insort / remove), and the MAD is selected from the two sorted
    halves of the deviations without building them: O(window) memmoves and O(log window)
    Python steps instead of three sorts. Bit for bit the plain definition's numbers
    (`tests/observatory/test_detect_speed.py` checks it against it)."""

    window: int
    level_window: int
    values: deque = field(default_factory=deque)

    def __post_init__(self) -> None:
        self.clear(list(self.values))

    def clear(self, values: list[float] | None = None, steps: list[int] | None = None) -> None:
        """Forget every point (a rebase), or start from `values` taken at `steps` (a restored
        state; a state from before steps were kept has them unknown: -1)."""
        self.values = deque()
        self.steps: deque[int] = deque()
        self._diffs: deque[float] = deque()
        self._sorted_diffs: list[float] = []
        self._recent: deque[float] = deque()
        self._sorted_recent: list[float] = []
        values = list(values or ())
        for v, step in zip(values, steps if steps is not None else [-1] * len(values), strict=True):
            self.add(v, step)

    def forget_after(self, step: int) -> None:
        """Drop the points taken after `step` (a rollback to it: they are another branch's)."""
        if self.steps and self.steps[-1] > step:
            kept = [(v, s) for v, s in zip(self.values, self.steps, strict=True) if s <= step]
            self.clear([v for v, _ in kept], [s for _, s in kept])

    def add(self, v: float, step: int = -1) -> None:
        values, diffs, sorted_diffs = self.values, self._diffs, self._sorted_diffs
        self.steps.append(step)
        if values:
            d = v - values[-1]
            diffs.append(d)
            insort(sorted_diffs, d)
        values.append(v)
        self._recent.append(v)
        insort(self._sorted_recent, v)
        if len(self._recent) > self.level_window or len(self._recent) > self.window:
            del self._sorted_recent[bisect_left(self._sorted_recent, self._recent.popleft())]
        if len(values) > self.window:
            values.popleft()
            self.steps.popleft()
            del sorted_diffs[bisect_left(sorted_diffs, diffs.popleft())]

    def score(self, v: float, floor: float) -> float:
        level = _sorted_median(self._sorted_recent)
        s = self._sorted_diffs
        mad = _deviation_median(s, _sorted_median(s)) if s else 0
        scale = max(1.4826 * mad / _SQRT2, floor)
        return (v - level) / scale


_SQRT2 = math.sqrt(2)


def _sorted_median(s: list[float]) -> float:
    n = len(s)
    if n == 0:
        raise statistics.StatisticsError("no median for empty data")
    i = n // 2
    return s[i] if n % 2 else (s[i - 1] + s[i]) / 2


def _deviation_median(s: list[float], mid: float) -> float:
    """median(abs(d - mid) for d in s) of sorted `s`: the deviations below `mid` (read
    backwards) and from `mid` up are two sorted runs (rounding is monotonic), so the middle
    ones are found by bisection over how many come from each."""
    j = bisect_left(s, mid)
    n = len(s)
    if n % 2:
        return _kth(s, mid, j, n // 2)
    return (_kth(s, mid, j, n // 2 - 1) + _kth(s, mid, j, n // 2)) / 2


def _kth(s: list[float], mid: float, j: int, k: int) -> float:
    """The k-th smallest (0-based) of abs(d - mid) over sorted `s`, `j` values below `mid`."""
    lo, hi = max(0, k + 1 - (len(s) - j)), min(j, k + 1)
    while lo < hi:  # take i from below and k + 1 - i from above
        i = (lo + hi) // 2
        if mid - s[j - 1 - i] < s[j + k - i] - mid:
            lo = i + 1
        else:
            hi = i
    if lo == 0:
        return s[j + k] - mid
    if lo == k + 1:
        return mid - s[j - lo]
    a, b = mid - s[j - lo], s[j + k - lo] - mid
    return a if a > b else b


def _peak(excursion: list[tuple[int, float]]) -> tuple[int, float]:
    """The (step, score) of an excursion's highest point."""
    return max(excursion, key=lambda e: e[1])


_UPDATE, _ATTN = 1, 2  # `observe`'s kinds of leading signal


class Detector:
    """Feed it one step at a time; it returns a `Verdict` when there is something to act on."""

    def __init__(self, cfg: DetectorConfig | None = None) -> None:
        self.cfg = cfg or DetectorConfig()
        self.loss = _Robust(self.cfg.window, self.cfg.level_window)
        self.grad = _Robust(self.cfg.window, self.cfg.level_window)
        self.recent: deque[tuple[int, float]] = deque(maxlen=32)  # (step, z) of normal points
        self.excursion: list[tuple[int, float]] = []
        self.run = 0  # consecutive excursion steps now
        self.calm = 0  # steps in a row under `threshold` since the excursion's last step
        self.quiet = 0  # steps in a row under `onset_threshold` since then
        self.tail: list[tuple[int, float]] = []  # (step, score) from a spike's first calm step
        self.reported = False  # the excursion now under way has had its verdict
        self.prev: float | None = None  # the last log-loss
        self.rises = 0  # rises in a row up to it
        self.climb_from: tuple[int, float] = (-1, 0.0)  # (step, log-loss) the rises began at
        self.pending: list[tuple[int, float]] = []  # a climb's (step, log-loss), held out
        self.updates: dict[str, deque[float]] = {}
        self._kind: dict[str, int] = {}  # metric name -> _UPDATE, _ATTN or 0 (names recur)
        self.ema: float | None = None
        self.ema_min = math.inf
        self.trend_n = 0
        self.diverging = False
        self.last_step = -1

    # -- the loss ---------------------------------------------------------------------------
    def update(self, step: int, loss: float, grad_norm: float | None = None) -> list[Verdict]:
        """All verdicts for this step: at most one loss verdict, plus warnings."""
        if step <= self.last_step:
            raise ValueError(f"steps must increase: got {step} after {self.last_step}")
        self.last_step = step
        if not math.isfinite(loss) or (grad_norm is not None and not math.isfinite(grad_norm)):
            return [Verdict("nonfinite", step, step, step, math.inf, message="non-finite value")]
        if loss <= 0:  # log-space detection cannot use it (a fully memorised batch): skip
            return []
        out = []
        if grad_norm is not None and grad_norm > 0:
            out += self._grad(step, math.log(grad_norm))
        v = self._loss(step, math.log(loss))
        if v is not None:
            out.append(v)
        return out

    def _armed(self, step: int, series: _Robust) -> bool:
        return step >= self.cfg.ignore_before and len(series.values) >= self.cfg.min_history

    def _climbing(self, step: int, z: float) -> bool:
        """Whether the loss has climbed `climb_factor`-fold in `climb_steps` rises in a row."""
        if self.prev is not None and z > self.prev:
            self.rises += 1
        else:
            self.rises, self.climb_from = 0, (step, z)
        self.prev = z
        return self._climbed()

    def _climbed(self) -> bool:
        rise = (self.prev or 0.0) - self.climb_from[1]
        return self.rises >= self.cfg.climb_steps and rise >= math.log(self.cfg.climb_factor)

    def _comes_back(self, score: float, climb: bool) -> bool:
        """Whether a reported spike's tail turns into a new spike: a climb that began after
        its peak, or a jump of `threshold` sigmas over the tail's median once the tail has
        `persistence` steps (it bounces around a level of its own, above the run's; one deep
        trough is not that level)."""
        tail_from = self.tail[0][0] if self.tail else math.inf
        spike = [e for e in self.excursion if e[0] < tail_from]  # the steps before its tail
        if climb and self.climb_from[0] > _peak(spike)[0]:
            return True
        if len(self.tail) < self.cfg.persistence:
            return False
        return score > statistics.median(x for _, x in self.tail) + self.cfg.threshold

    def _loss(self, step: int, z: float) -> Verdict | None:
        cfg = self.cfg
        armed = self._armed(step, self.loss)
        score = self.loss.score(z, cfg.noise_floor) if armed else 0.0
        climb = self._climbing(step, z) and armed and score > cfg.onset_threshold
        if self.reported and self._comes_back(score, climb):  # a new spike out of the last one's
            self._end_excursion()  # tail
        if score > cfg.threshold or climb:
            self.pending = []  # the climb was the spike's rise: none of it joins the level
            self.excursion.append((step, score))
            self.run += 1
            self.calm = self.quiet = 0
            if self.tail:
                self.tail.append((step, score))
            if self.run >= cfg.persistence and not self.reported:
                self.reported = True  # one verdict per excursion, however it wavers
                return self._spike(step)
            if len(self.excursion) >= cfg.window:  # not a spike but a new level: accept it
                self.rebase(step)
            return None
        self.run = 0
        if self.excursion:  # an excursion ends only after `persistence` calm steps in a row;
            self.calm += 1  # a reported spike's tail, once it is back near its level, or
            self.quiet = self.quiet + 1 if score <= cfg.onset_threshold else 0  # settled
            if self.reported:
                self.tail.append((step, score))
                if self.quiet < cfg.persistence and self.calm < cfg.settle_steps:
                    return None
            elif self.calm < cfg.persistence:
                return None
            self._end_excursion()
        self.recent.append((step, score))
        if score > cfg.onset_threshold:  # climbing, not yet an excursion: held out of the
            self.pending.append((step, z))  # level while it climbs, so it cannot drag it up
            if len(self.pending) >= cfg.window:  # not a climb but a new level: accept it
                self.rebase(step)
            return self._trend(step, z)
        for at, held in self.pending:  # the climb stopped short of a spike: its points join
            self.loss.add(held, at)
        self.pending = []
        self.loss.add(z, step)
        return self._trend(step, z)

    def _end_excursion(self) -> None:
        if self.reported:  # the points before a spike say nothing of the next one's onset
            self.recent.clear()
        self._clear_excursion()

    def _clear_excursion(self) -> None:
        self.excursion, self.run, self.calm, self.quiet, self.reported = [], 0, 0, 0, False
        self.tail = []

    def _spike(self, step: int) -> Verdict:
        onset = self.excursion[0][0]
        message = None
        if self._climbed():  # a climb: it began where the rises did
            onset = min(onset, self.climb_from[0] + 1)
            fold = math.exp((self.prev or 0.0) - self.climb_from[1])
            message = f"the loss climbed {fold:.0f}x in {self.rises} rises in a row"
        for s, score in reversed(self.recent):  # walk back while the curve was already rising
            if s >= onset:
                continue
            if score < self.cfg.onset_threshold or s < onset - len(self.recent):
                break
            onset = s
        peak_step, peak = _peak(self.excursion)
        return Verdict(
            "spike",
            step,
            onset,
            peak_step,
            peak,
            message=message or f"log-loss {peak:.1f} robust sigmas above its level",
        )

    def _trend(self, step: int, z: float) -> Verdict | None:
        if step < self.cfg.ignore_before:
            return None
        h = self.cfg.trend_horizon
        self.ema = z if self.ema is None else (1 - 1 / h) * self.ema + z / h
        self.trend_n += 1
        if self.trend_n < h:  # the EMA still remembers its start
            return None
        self.ema_min = min(self.ema_min, self.ema)
        rise = self.ema - self.ema_min
        if rise > self.cfg.trend_rise and not self.diverging:
            self.diverging = True
            msg = f"smoothed log-loss {rise:.3f} above its minimum: slow divergence"
            return Verdict("divergence", step, step, step, rise, message=msg)
        return None

    # -- leading signals --------------------------------------------------------------------
    def _grad(self, step: int, g: float) -> list[Verdict]:
        score = self.grad.score(g, 0.05) if self._armed(step, self.grad) else 0.0
        if score > self.cfg.grad_threshold:
            return [
                Verdict(
                    "warning",
                    step,
                    step,
                    step,
                    score,
                    M.STAT_GRAD_NORM,  # the signal's name (the verdict's, not a metric's)
                    f"grad norm {score:.1f} robust sigmas above its level",
                )
            ]
        self.grad.add(g, step)
        return []

    def observe(self, step: int, metrics: Mapping[str, float]) -> list[Verdict]:
        """Leading signals from the probes: per-layer update norms and attention maxima."""
        out = []
        kinds = self._kind
        for name, value in metrics.items():
            kind = kinds.get(name)
            if kind is None:
                kind = kinds[name] = (
                    _UPDATE
                    if M.is_per_layer(name, M.STAT_UPDATE_NORM)
                    else _ATTN
                    if M.is_per_layer(name, M.STAT_ATTN_MAX)
                    else 0
                )
            if not kind:
                continue
            if kind == _UPDATE and math.isfinite(value) and value > 0:
                hist = self.updates.setdefault(name, deque(maxlen=self.cfg.window))
                if len(hist) >= self.cfg.min_history and step >= self.cfg.ignore_before:
                    med = statistics.median(hist)
                    if value > self.cfg.update_jump * med:
                        out.append(
                            Verdict(
                                "warning",
                                step,
                                step,
                                step,
                                value / med,
                                name,
                                f"{name} jumped to {value / med:.1f}x its median",
                            )
                        )
                        continue
                hist.append(value)
            elif kind == _ATTN and self.cfg.attn_warn is not None and value > self.cfg.attn_warn:
                out.append(
                    Verdict(
                        "warning",
                        step,
                        step,
                        step,
                        value,
                        name,
                        f"{name} = {value:.0f} > {self.cfg.attn_warn:.0f}",
                    )
                )
        return out

    def level(self) -> float | None:
        """The current loss level (exp of the median recent log-loss), once there is one."""
        vals = list(self.loss.values)[-self.cfg.level_window :]
        return math.exp(statistics.median(vals)) if vals else None

    # -- regime changes, rollbacks, checkpoints ---------------------------------------------
    def rebase(self, step: int) -> None:
        """A known regime change at `step` (mixture stage, WSD decay): restart the baseline."""
        self.loss.clear()
        self.recent.clear()
        self._clear_excursion()
        self.pending = []
        self.prev, self.rises = None, 0
        self.ema, self.ema_min, self.trend_n = None, math.inf, 0
        self.cfg = self.cfg.model_copy(update={"ignore_before": max(self.cfg.ignore_before, step)})

    def rewind(self, step: int) -> None:
        """After a rollback to `step`: the spike's points are gone; forget the excursion, and
        the points taken after `step` (a rollback far back must not judge the restored,
        higher loss by the level the run had reached since)."""
        self._clear_excursion()
        self.prev, self.rises = None, 0
        self.recent = deque(((s, z) for s, z in self.recent if s <= step), maxlen=32)
        self.pending = [(s, z) for s, z in self.pending if s <= step]
        self.loss.forget_after(step)
        self.grad.forget_after(step)
        self.last_step = step

    def state_dict(self) -> dict[str, Any]:
        return {
            "cfg": self.cfg.model_dump(),
            "loss": list(self.loss.values),
            "loss_steps": list(self.loss.steps),
            "grad": list(self.grad.values),
            "grad_steps": list(self.grad.steps),
            "recent": [list(r) for r in self.recent],
            "excursion": [list(e) for e in self.excursion],
            "calm": self.calm,
            "quiet": self.quiet,
            "tail": [list(t) for t in self.tail],
            "prev": self.prev,
            "rises": self.rises,
            "climb_from": list(self.climb_from),
            "run": self.run,
            "reported": self.reported,
            "pending": [list(p) for p in self.pending],
            "updates": {k: list(v) for k, v in self.updates.items()},
            "ema": self.ema,
            "ema_min": self.ema_min if math.isfinite(self.ema_min) else None,
            "trend_n": self.trend_n,
            "diverging": self.diverging,
            "last_step": self.last_step,
        }

    def restore_series(self, d: dict[str, Any]) -> None:
        """The loss and gradient-norm windows (and the recent scores) of a saved state, this
        detector's settings kept: a rollback's restore (its `rewind` follows)."""
        self.loss = _Robust(self.cfg.window, self.cfg.level_window)
        self.loss.clear(list(d["loss"]), d.get("loss_steps"))
        self.grad = _Robust(self.cfg.window, self.cfg.level_window)
        self.grad.clear(list(d["grad"]), d.get("grad_steps"))
        self.recent = deque(((int(s), float(z)) for s, z in d["recent"]), maxlen=32)

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.cfg = DetectorConfig.model_validate(d["cfg"])
        self.loss = _Robust(self.cfg.window, self.cfg.level_window)
        self.loss.clear(list(d["loss"]), d.get("loss_steps"))
        self.grad = _Robust(self.cfg.window, self.cfg.level_window)
        self.grad.clear(list(d["grad"]), d.get("grad_steps"))
        self.recent = deque(((int(s), float(z)) for s, z in d["recent"]), maxlen=32)
        self.excursion = [(int(s), float(z)) for s, z in d["excursion"]]
        self.calm = d["calm"]
        self.quiet = int(d.get("quiet", 0))  # states from before the climb rule lack these
        self.tail = [(int(s), float(x)) for s, x in d.get("tail", [])]
        self.prev = d.get("prev")
        self.rises = int(d.get("rises", 0))
        step, z = d.get("climb_from", (-1, 0.0))
        self.climb_from = (int(step), float(z))
        self.run = int(d.get("run", len(self.excursion) if not self.calm else 0))
        # a state from before the flag: an excursion at persistence had its verdict
        self.reported = bool(d.get("reported", len(self.excursion) >= self.cfg.persistence))
        self.pending = [(int(p[0]), float(p[1])) for p in d.get("pending", [])]
        self.updates = {k: deque(v, maxlen=self.cfg.window) for k, v in d["updates"].items()}
        self.ema = d["ema"]
        self.ema_min = d["ema_min"] if d["ema_min"] is not None else math.inf
        self.trend_n = d["trend_n"]
        self.diverging = d["diverging"]
        self.last_step = d["last_step"]
