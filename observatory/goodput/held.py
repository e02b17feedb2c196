"""Which saves a tier still holds after its n-th save, for many lanes at once: the retention
rules of the tiers (observatory/retention.py's exponential rule applied at every save, or
keep-last-k), in closed form where there is one.

The exponential rule applied at every save is a conveyor. Past the newest K saves, a save's age
(in saves) falls in levels: ages whose age in steps has the same bit length. Each level holds
at most one save, its oldest candidate: a save that ages into an occupied level is dropped, and
the occupant moves on when it ages out, so the level takes the first save that arrives after.
Saves arrive at level 0 every save, so level 0 takes every W0-th (W0: its width in saves); level
j receives level j-1's saves, every P(j-1) saves, and takes every ceil(Wj / P(j-1))-th of them:
the saves a level takes are those with index = 1 mod Pj, Pj = ceil(Wj / P(j-1)) * P(j-1). After
save n, level j holds the one such save whose age lies in its range, if any. The tests compare
this with the rule applied save by save. A count cap (`max_kept`) drops the oldest holders and so
changes which saves the levels take next: capped tiers are computed save by save (cached).
"""

from __future__ import annotations

import functools

import numpy as np

from spikewatch.observatory.retention import keep

__all__ = ["LaneRetention", "Retention"]

_HORIZON = 1 << 40  # levels up to this age: any run


class Retention:
    """One tier's rule over save indices (step / interval)."""

    def __init__(self, interval: int, rule: str, keep_last: int, max_kept: int | None) -> None:
        self.k, self.rule, self.K, self.cap = interval, rule, keep_last, max_kept
        if rule == "last":
            self.K = keep_last if max_kept is None else min(keep_last, max_kept)
        self.closed = rule == "last" or max_kept is None  # else: save by save


@functools.lru_cache(maxsize=256)
def _levels(k: int, K: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    first, last, period = [], [], []
    age, p = K, 1
    while age <= _HORIZON:
        bits = (age * k).bit_length()
        end = -(-(1 << bits) // k) - 1  # the oldest age (in saves) of that bit length in steps
        p = -(-(end - age + 1) // p) * p
        first.append(age)
        last.append(end)
        period.append(p)
        age = end + 1
    return np.array(first), np.array(last), np.array(period)


def _capped(rule: Retention, n: int, limit: int) -> int:
    held = _growing(rule.k, rule.K, rule.cap)[n]
    below = [i for i in held if i <= limit]
    return below[-1] if below else 0


@functools.lru_cache(maxsize=64)
def _growing(k: int, K: int, cap: int | None) -> _Growing:
    return _Growing(k, K, cap)


class _Growing:
    """The exponential rule with a cap, applied save by save as the tiers apply it, as far as
    a query reaches."""

    def __init__(self, interval: int, keep_last: int, max_kept: int | None) -> None:
        self.k, self.keep_last, self.cap = interval, keep_last, max_kept
        self.sets: list[tuple[int, ...]] = [()]
        self.kept: set[int] = set()

    def __getitem__(self, n: int) -> tuple[int, ...]:
        while len(self.sets) <= n:
            j = len(self.sets)
            steps = keep({*self.kept, j * self.k}, j * self.k, keep_last=self.keep_last)
            if self.cap is not None and len(steps) > self.cap:
                steps = set(sorted(steps)[-self.cap :])
            self.kept = steps
            self.sets.append(tuple(sorted(s // self.k for s in steps)))
        return self.sets[n]


class LaneRetention:
    """Each lane's rule for one tier (lanes of many scenarios), queried for many lanes at once:
    the closed-form levels padded to one array, the capped tiers save by save."""

    def __init__(self, rules: list[Retention | None], horizon: int) -> None:
        self.rules = rules
        L = len(rules)
        self.K = np.array([r.K if r else 0 for r in rules], np.int64)
        self.last_rule = np.array([bool(r and r.rule == "last") for r in rules])
        self.capped = np.array([bool(r and not r.closed) for r in rules])
        self.any_capped = bool(self.capped.any())
        levels = [
            _levels_to(r.k, r.K, horizon // r.k + 1)
            if r and r.rule == "exponential" and r.closed
            else None
            for r in rules
        ]
        J = max([len(lv[0]) for lv in levels if lv is not None], default=1)
        never = np.int64(1) << 62
        self.first = np.full((L, J), never, np.int64)
        self.last = np.full((L, J), -1, np.int64)
        self.period = np.ones((L, J), np.int64)
        for lane, lv in enumerate(levels):
            if lv is not None:
                j = len(lv[0])
                self.first[lane, :j], self.last[lane, :j], self.period[lane, :j] = lv
        self.youngest = self.first.min(axis=0)  # per level column: no lane's level starts sooner
        self._one: dict[int, tuple[int, list[tuple[int, int, int]]]] = {}

    def newest(self, ia: np.ndarray, n: np.ndarray, limit: np.ndarray) -> np.ndarray:
        """Per lane of `ia`, the newest save index <= `limit` held after save `n` (0: none)."""
        top = np.minimum(n, limit)
        recent = top >= n - self.K[ia] + 1  # among the newest K: held, and none is newer
        out = np.where(recent, np.maximum(top, 0), 0)
        deep = (~recent).nonzero()[0]  # older: the levels (or the capped rule) decide
        if not deep.size:
            return out
        ia, n, limit = ia[deep], n[deep], limit[deep]
        J = int(np.searchsorted(self.youngest, n.max(), side="right"))  # levels reached
        age0 = n[:, None] - self.first[ia, :J]
        i = age0 - (age0 - 1) % self.period[ia, :J]
        ok = (i >= 1) & (i >= n[:, None] - self.last[ia, :J]) & (i <= limit[:, None])
        got = np.where(ok, i, 0).max(axis=1, initial=0)
        for j in np.flatnonzero(self.capped[ia]) if self.any_capped else ():
            rule = self.rules[int(ia[j])]
            assert rule is not None
            got[j] = max(int(got[j]), _capped(rule, int(n[j]), int(limit[j])))
        out[deep] = got
        return out

    def newest_one(self, lane: int, n: int, limit: int) -> int:
        """`newest` for one lane, in plain Python (goodput/scalar.py's). The levels hold ever
        older saves: the first that holds one at or before `limit` holds the newest."""
        got = self._one.get(lane)
        if got is None:
            reached = self.first[lane] < (1 << 62)
            cols = (a[lane][reached].tolist() for a in (self.first, self.last, self.period))
            got = self._one[lane] = (int(self.K[lane]), list(zip(*cols, strict=True)))
        K, levels = got
        top = min(n, limit)
        out = max(top, 0) if top >= n - K + 1 else 0
        for first, last, period in levels:
            if first > n:
                break
            age0 = n - first
            i = age0 - (age0 - 1) % period
            if 1 <= i <= limit and i >= n - last:
                out = max(out, i)
                break
        if self.capped[lane]:
            rule = self.rules[lane]
            assert rule is not None
            out = max(out, _capped(rule, n, limit))
        return out


def _levels_to(k: int, K: int, ages: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    first, last, period = _levels(k, K)
    j = int(np.searchsorted(first, ages, side="right")) + 1
    return first[:j], last[:j], period[:j]
