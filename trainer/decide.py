"""The step's decision, shared by the built-in loop and `Watch`: one rule for every way in.

The callbacks (recorder, spike guard, the user's) each propose an action for the step before
its update; a non-finite loss or gradient is always refused; the strongest proposal wins
(`actions.strongest`). A non-Continue outcome becomes an intervention record for the summary
and the store.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from trainer.actions import Action, Continue, Halt, Rollback, SkipUpdate, strongest
from trainer.callbacks import Callback, StepState

__all__ = ["action_name", "intervention", "propose"]

NONFINITE = "non-finite loss or gradient"


def action_name(action: Action) -> str:
    return {Continue: "continue", SkipUpdate: "skip_update", Rollback: "rollback", Halt: "halt"}[
        type(action)
    ]


def propose(state: StepState, callbacks: Iterable[Callback]) -> tuple[Action, list[str]]:
    """(the action for the step, pin reasons asked for by the callbacks that continue)."""
    proposed: list[Action] = []
    if state.nonfinite:
        proposed.append(SkipUpdate(reason=NONFINITE))
    proposed += [cb.pre_update(state) for cb in callbacks]
    pins = [a.pin for a in proposed if isinstance(a, Continue) and a.pin is not None]
    return strongest(proposed), pins


def intervention(action: Action, state: StepState) -> dict[str, Any]:
    """The record of a non-Continue action. It is the action's own `info` dict, so the callback
    that asked may complete it later (the rollback's outcome)."""
    assert not isinstance(action, Continue)
    record = action.info
    record.update(
        step=state.step,
        batch_index=state.batch_index,
        kind=action_name(action),
        reason=action.reason,
        loss=state.loss,
        grad_norm=state.grad_norm,
    )
    return record
