"""The step's decision, shared by the built-in loop and `Watch`: one rule for every way in.

`decide` is the one place a step's action is chosen: the callbacks (recorder, spike guard, the
user's) each propose one from the step's values; a refused update (non-finite values, the
same-step tier: decided on the device) is a `SkipUpdate`; the strongest proposal wins
(`actions.strongest`). A non-Continue outcome becomes an intervention record for the summary
and the store.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from spikewatch.trainer.core.actions import Action, Continue, Halt, Rollback, SkipUpdate, strongest
from spikewatch.trainer.core.callbacks import Callback, StepState

__all__ = ["action_name", "decide", "deliver_notes", "rescale"]

NONFINITE = "non-finite loss or gradient"


def action_name(action: Action) -> str:
    return {Continue: "continue", SkipUpdate: "skip_update", Rollback: "rollback", Halt: "halt"}[
        type(action)
    ]


def decide(state: StepState, callbacks: Iterable[Callback]) -> tuple[Action, list[str]]:
    """(the action for the step, pin reasons asked for by the callbacks that continue). A
    Continue carries the product of every Continue's `lr_scale`."""
    proposed: list[Action] = []
    if state.nonfinite:
        proposed.append(SkipUpdate(reason=NONFINITE))
    elif state.refused_by:
        proposed.append(SkipUpdate(reason=state.refused_by))
    proposed += [cb.on_step(state) for cb in callbacks]
    goes_on = [a for a in proposed if isinstance(a, Continue)]
    pins = [a.pin for a in goes_on if a.pin is not None]
    action = strongest(proposed)
    if isinstance(action, Continue):
        action = Continue(lr_scale=math.prod(a.lr_scale for a in goes_on))
    return action, pins


def deliver_notes(callbacks: Sequence[Callback]) -> None:
    """Every note the callbacks have, to every callback (the Recorder stores them)."""
    for source in callbacks:
        for note in source.take_notes():
            for cb in callbacks:
                cb.on_note(note)


def rescale(lr_scale: float, action: Action) -> float:
    """The run's LR scale after `action`: a rollback's cut, or a Continue giving one back
    (never above 1)."""
    if isinstance(action, Rollback):
        return lr_scale * action.lr_scale
    if isinstance(action, Continue) and action.lr_scale != 1.0:
        return min(1.0, lr_scale * action.lr_scale)
    return lr_scale
