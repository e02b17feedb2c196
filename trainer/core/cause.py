"""The cause of a spike, told by replaying it after the rollback (the core's replay).

From the restored state, the spike's steps once more on the same batches: a spike that comes
back needs this data with this state (PaLM, "data_x_state"); one that does not was transient
(a flaky update, possibly a hardware fault: Megatron's question). One that comes back is
replayed once more, from the same state, on batches the run trained on without trouble before
the restore point (`Spike.control`): if it comes back there too, the data is not its cause but
the state ("state": Adam's own instability, which skipping cannot cure; observatory/policy.py
acts on it, docs/spikes.md measures it)."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable
from typing import Any

from spikewatch.trainer.core.actions import Spike

__all__ = ["DEVICE_TOL", "NotAtHand", "cause_of", "classify", "device_of"]

# Relative disagreement of a rank's replayed own loss with the one it first computed beyond
# which the first computation was wrong (a deterministic replay agrees to the bit; GPU kernels
# that reduce in another order, to ~1e-6)
DEVICE_TOL = 1e-3

log = logging.getLogger(__name__)

Replayer = Callable[[Iterable[tuple[int, int]], int], dict[int, float]]


class NotAtHand(LookupError):
    """A client cannot draw a batch of the replay again (it keeps only recent ones): every
    rank raises it at the same batch, and the cause is not told."""


def cause_of(
    spike: Spike, from_step: int, replay: Replayer, reload: Callable[[], None]
) -> dict[str, Any]:
    """The record's `cause`, `replay_peak_loss` and (after a second replay) `control_peak_loss`;
    `replay(pairs, from_step)` gives the losses of (step, batch index) pairs replayed in order,
    `reload()` restores the state the rollback restored."""
    cause, replay_peak = classify(spike, replay(spike.replay, from_step))
    out: dict[str, Any] = {"replay_peak_loss": replay_peak}
    if cause == "data_x_state" and spike.control:
        reload()
        try:
            again, control_peak = classify(spike, replay(spike.control, from_step))
        except NotAtHand as e:  # the spike's own replay stands; its control is not told
            log.warning("no control replay: %s", e)
        else:
            out["control_peak_loss"] = control_peak
            cause = "state" if again == "data_x_state" else cause
    log.warning(
        "replayed steps %d..%d: the spike %s (peak %.4f, originally %.4f)%s",
        from_step + 1,
        max((s for s, _ in spike.replay), default=from_step),
        "does not reproduce" if cause == "transient" else "reproduces",
        replay_peak,
        spike.peak_loss if spike.peak_loss is not None else math.nan,
        ", and on batches that trained well before: the optimizer state's, not the data's"
        if cause == "state"
        else "",
    )
    return out | {"cause": cause}


def device_of(
    spike: Spike,
    replayed: dict[tuple[int, int], list[float]],
    swapped: dict[tuple[int, int], list[float]] | None = None,
) -> dict[str, Any]:
    """Under torchrun: the replay computes each rank's own loss on the spike's batches again,
    from the same state, and (`swapped`, by owner) each rank's rows once more on the next rank's
    device. A device wrong once: at the first step where a rank's replayed loss disagrees with
    what it first computed while some ranks agree, the data (the same both times) is not the
    cause. A device wrong every time: its replay agrees with it, but the departed rank's rows
    computed on a rank that did not depart give another loss. Returns {"cause": "device",
    "device_ranks", "device_step", "device_check", "device_losses"} then, else {}."""
    first = dict(spike.rank_losses)
    agreed = []  # steps the replay computed as the run did, on every rank (the same weights)
    for step, index in sorted(spike.replay):
        old, new = first.get(step), replayed.get((step, index))
        if old is None or new is None or len(old) != len(new):
            continue
        off = [r for r, (a, b) in enumerate(zip(old, new, strict=True)) if not _same(a, b)]
        if not off:
            agreed.append((step, index))
            continue
        if len(off) == len(old):  # every rank computed otherwise: a replay gone its own way
            break
        log.warning(  # some ranks computed it again alike: theirs was right
            "step %d: rank(s) %s computed their loss otherwise the first time (%s, replayed "
            "%s): the device's, not the data's",
            step,
            off,
            [round(old[r], 4) for r in off],
            [round(new[r], 4) for r in off],
        )
        return _device(off, step, "replay", {"first": list(old), "replayed": list(new)})
    departed = set(spike.ranks)
    for step, index in agreed if swapped else ():
        old, there = first[step], swapped.get((step, index)) if swapped else None
        if step < spike.onset_step or there is None or len(there) != len(old):
            continue
        w = len(old)  # rank o's rows were computed on rank o - 1: one that did not depart
        off = [
            o
            for o in sorted(departed)
            if (o - 1) % w not in departed and not _same(old[o], there[o])
        ]
        if off:
            log.warning(
                "step %d: rank(s) %s's rows computed on another rank give %s, not %s: the "
                "device's, not the data's",
                step,
                off,
                [round(there[o], 4) for o in off],
                [round(old[o], 4) for o in off],
            )
            return _device(off, step, "swap", {"first": list(old), "elsewhere": list(there)})
    return {}


def _same(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=DEVICE_TOL, abs_tol=1e-6)


def _device(ranks: list[int], step: int, check: str, losses: dict[str, Any]) -> dict[str, Any]:
    return {
        "cause": "device",
        "device_ranks": ranks,
        "device_step": step,
        "device_check": check,
        "device_losses": losses,
    }


def classify(spike: Spike, losses: dict[int, float]) -> tuple[str, float]:
    """(cause, replay peak) from the replayed losses: "data_x_state" when the spike comes back
    to at least half its height, "transient" when it does not, "unknown" without a level."""
    level, peak = spike.pre_spike_loss, spike.peak_loss
    after = [v for s, v in losses.items() if s >= spike.onset_step]
    replay_peak = max(after, default=math.nan)
    if level is None or peak is None or not after:
        return "unknown", replay_peak
    if not math.isfinite(peak):  # a non-finite spike reproduces only as non-finite
        return ("data_x_state" if math.isinf(replay_peak) else "transient"), replay_peak
    if math.isinf(replay_peak) or replay_peak >= level + 0.5 * (peak - level):
        return "data_x_state", replay_peak  # it reproduces
    return "transient", replay_peak
