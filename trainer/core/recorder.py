"""Everything the run does, into the observatory's store, through the sink (never blocking).

Per step: the step's metrics on the live branch; one step late, its update statistics; every
evaluation; every checkpoint written; every intervention as an event. A rollback starts a new
branch forked at the restored step, so the abandoned steps stay stored with their branch.
The spike guard logs its verdicts through the same sink.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping
from typing import Any

from spikewatch.observatory import metric_names as M
from spikewatch.observatory.control import RequestPoller
from spikewatch.observatory.store.db import redact, serve_hint
from spikewatch.observatory.store.records import content_uid
from spikewatch.observatory.store.sink import BaseSink
from spikewatch.observatory.strict_json import tagged
from spikewatch.trainer.core.actions import Action, Continue, Halt, Note, Rollback
from spikewatch.trainer.core.callbacks import Callback, EvalState, FitState, StepState
from spikewatch.trainer.core.watchdog import collectives_said, ranks_said
from spikewatch.trainer.core.world import say

__all__ = ["Recorder"]

log = logging.getLogger(__name__)

_EVENT = {"skip_update": "skip", "rollback": "rollback", "halt": "halt"}


class Recorder(Callback):
    priority = 100  # first: record before anything else reacts

    def __init__(
        self,
        sink: BaseSink,
        tags: list[str] | None = None,
        requests_from: str | None = None,
        sweep_group: str | None = None,
    ) -> None:
        self.sink = sink
        self.tags = tags or []
        self.sweep_group = sweep_group
        self.requests_from = requests_from  # the store URL the dashboard writes requests to
        self.poller: RequestPoller | None = None
        self.handled: list[str] = []
        self.run_id = ""
        self.branch = 0
        self.forks: list[dict[str, Any]] = []  # every branch started: number, parent, fork_step
        self._branch_of: dict[str, int] = {}  # checkpoint path -> the branch that wrote it
        self.reached: int | None = None  # a resume: the step the process before recorded last

    def on_fit_start(self, state: FitState) -> None:
        self.run_id = state.run_id
        self.sink.start_run(
            state.run_id,
            name=state.config.get("name"),
            config=state.config,
            tags=self.tags,
            run_dir=state.run_dir,
            sweep_group=self.sweep_group,
        )
        # A resumed run's branches are in the store already; the sink is told them again exactly
        # as they were (a branch record is an upsert: a made-up fork step would overwrite).
        for fork in self.forks:
            self.sink.start_branch(state.run_id, **fork)
        if len(self.forks) < self.branch:  # a checkpoint from before forks were kept
            self.sink.know_branches(state.run_id, range(1, self.branch + 1))
        if state.resumed_from is not None:  # in the logbook: where this process took over
            abandoned = self._fork_past(state.step)
            message = f"resumed at step {state.step} from {state.resumed_from}"
            data: dict[str, Any] = {"kind": "resume", "from": state.resumed_from}
            if abandoned is not None:
                message += (
                    f"; what the process before did after step {state.step} stays as "
                    f"abandoned branch {abandoned}"
                    if self.reached is None
                    else f"; the process before recorded steps up to {self.reached}: its steps "
                    f"after {state.step} stay as abandoned branch {abandoned}"
                )
                data.update(reached=self.reached, abandoned_branch=abandoned)
            self.sink.log_event(
                state.run_id,
                "note",
                step=state.step,
                branch=self.branch,
                message=message,
                data=tagged(data),
                source="trainer",
            )
        url = getattr(self.sink, "url", None)
        if url is not None:
            say(log, f"run {state.run_id} is recorded in {redact(url)}; see it: {serve_hint(url)}")
        if self.requests_from is not None:
            self.poller = RequestPoller(self.requests_from, state.run_id)
            self.poller.seen.update(self.handled)
            self.poller.start()

    def _fork_past(self, step: int) -> int | None:
        """A resume at `step` where the store holds what the process before did past it (its
        points on this branch, or branches it forked): this process goes on in a branch of its
        own forked at `step`, so that the killed process's steps stay as they were, an
        abandoned branch the run page draws as a rollback's. Returns that abandoned branch."""
        last, top = self.sink.reach(self.run_id, self.branch, step)
        if last is None and (top is None or top <= self.branch):
            return None
        old, self.branch = self.branch, max(top or 0, self.branch) + 1
        self.reached = last
        reason = f"resumed at step {step} after the process before ended"
        if last is not None:
            reason += f" at step {last}"
        fork: dict[str, Any] = {"branch": self.branch, "parent": old, "fork_step": step}
        fork["reason"] = reason
        self.forks.append(fork)
        self.sink.start_branch(self.run_id, **fork)
        return old

    def on_step(self, state: StepState) -> Action:
        """A request from the dashboard becomes the step's action (taken without waiting)."""
        for req in self.poller.take() if self.poller is not None else []:
            self.handled.append(req["uid"])
            action = self._answer(req, state)
            if action is not None:
                return action
        return Continue()

    def _answer(self, req: Mapping[str, Any], state: StepState) -> Action | None:
        what = req.get("action")
        note = f"request {req['uid']} ({what}) taken at step {state.step}"
        self.sink.log_event(
            self.run_id,
            "note",
            step=state.step,
            branch=self.branch,
            message=note,
            data={"request_uid": req["uid"], "action": what},
            source="control",
        )
        if what == "stop":
            return Halt("stop requested from the dashboard")
        if what == "rollback":
            to = req.get("to_step")
            to = state.step - 1 if to is None else min(int(to), state.step - 1)
            return Rollback(
                to_step=max(0, to), reason=f"rollback to step {to} requested from the dashboard"
            )
        log.warning("ignoring request %s: unknown action %r", req["uid"], what)
        return None

    def post_step(self, state: StepState) -> None:
        self.sink.log_metrics(self.run_id, self.branch, state.step, state.metrics)
        if state.action in _EVENT and state.action != "rollback":
            self.sink.log_event(
                self.run_id,
                _EVENT[state.action],
                step=state.step,
                branch=self.branch,
                message=state.reason,
            )

    def on_update_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        self.sink.log_metrics(self.run_id, self.branch, step, metrics)

    def on_eval(self, state: EvalState) -> None:
        self.sink.log_metrics(self.run_id, self.branch, state.step, {M.VAL_LOSS: state.val_loss})

    def on_rollback(self, step: int, record: Mapping[str, Any]) -> None:
        old, self.branch = self.branch, self.branch + 1
        message = str(record.get("reason", ""))
        # The uid names the decision, not its timing: a run killed after recording a rollback
        # and resumed from before it takes the same rollback again, from another tier in
        # another time (`tier`, `restore_s`), and the store must keep it once.
        what = {"step": record.get("step"), "branch": old, "to": step, "message": message}
        self.sink.log_event(
            self.run_id,
            "rollback",
            step=record.get("step"),
            branch=old,
            message=message,
            data=tagged(record),
            uid=content_uid(self.run_id, {"kind": "rollback", **what}),
        )
        reason = str(record.get("reason", ""))
        fork: dict[str, Any] = {"branch": self.branch, "parent": old, "fork_step": step}
        fork["reason"] = reason
        self.forks.append(fork)
        self.sink.start_branch(self.run_id, **fork)

    def on_stall(self, info: Mapping[str, Any]) -> None:
        message = (
            f"stall: no step has ended for {info['idle_s']:.0f} s after step {info['step']} "
            f"(bound {info['bound_s']:.0f} s)"
        )
        if info.get("ranks"):  # under torchrun: who the others wait for
            progress = {int(r): (p[0], p[1]) for r, p in info["ranks"].items()}
            message += "; " + ranks_said(progress, list(info.get("behind") or []))
        if info.get("collectives_in_flight"):  # rank 0's, from torch's flight recorder
            message += "; in flight on rank 0: " + collectives_said(info["collectives_in_flight"])
        self.sink.log_event(self.run_id, "stall", step=info["step"], branch=self.branch,
                            message=message, data=dict(info))  # fmt: skip

    def on_heartbeat(self, info: Mapping[str, Any]) -> None:
        if not self.run_id:  # the run has not started: the watchdog may beat before
            return
        with contextlib.suppress(RuntimeError):  # a sink closed as the watchdog woke
            self.sink.heartbeat(self.run_id, info["period_s"])

    def on_stall_end(self, info: Mapping[str, Any]) -> None:
        message = f"steps resumed after a stall of {info['stalled_s']:.0f} s"
        self.sink.log_event(self.run_id, "resumed", step=info["step"], branch=self.branch,
                            message=message, data=dict(info))  # fmt: skip

    def on_slowdown(self, info: Mapping[str, Any]) -> None:
        message = (
            f"slowdown: the last steps take {info['recent_s']:.3g} s, {info['ratio']:.2f}x the "
            f"run's own {info['baseline_s']:.3g} s"
        )
        if "tokens_per_s" in info:  # judged per token: the steps' lengths vary
            message = (
                f"slowdown: the last steps run at {info['tokens_per_s']:.4g} tokens/s, "
                f"{info['ratio']:.2f}x slower than the run's own "
                f"{info['baseline_tokens_per_s']:.4g}"
            )
        if "since_step" in info:
            message += f", since step {info['since_step']} ({info['lasted_s']:.0f} s)"
        self.sink.log_event(self.run_id, "slowdown", step=info["step"], branch=self.branch,
                            message=message, data=dict(info))  # fmt: skip

    def on_straggler(self, info: Mapping[str, Any]) -> None:
        part = next((k for k in ("forward", "backward") if f"{k}_s" in info), None)
        if "late_s" in info:  # FSDP2: it reaches the collectives last, the others wait inside
            message = (
                f"slowdown: rank {info['rank']} is the straggler, reaching the collectives "
                f"{info['late_s']:.3g} s a step after the other ranks"
            )
        elif part is not None:  # slow in its compute: the others wait for it in backward's sync
            message = (
                f"slowdown: rank {info['rank']} is the straggler, its {part} taking "
                f"{info[f'{part}_s']:.3g} s a step against {info[f'others_{part}_s']:.3g} s on "
                "the other ranks"
            )
        else:
            message = (
                f"slowdown: rank {info['rank']} is the straggler, waiting "
                f"{info['batch_wait_s']:.3g} s a step for its batches against "
                f"{info['others_batch_wait_s']:.3g} s on the other ranks"
            )  # a slowdown of the whole job, told with the rank that sets its pace
        self.sink.log_event(self.run_id, "slowdown", step=info["step"], branch=self.branch,
                            message=message, data=dict(info))  # fmt: skip

    def on_pace_back(self, info: Mapping[str, Any]) -> None:
        message = f"the pace is back ({info['recent_s']:.3g} s a step) after the slowdown"
        self.sink.log_event(self.run_id, "note", step=info["step"], branch=self.branch,
                            message=message, data={"kind": "pace_back", **info})  # fmt: skip

    def on_config_change(self, step: int, changes: Mapping[str, list[Any]]) -> None:
        shown = ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in changes.items())
        self.sink.log_event(
            self.run_id,
            "note",
            step=step,
            branch=self.branch,
            message=f"resumed at step {step} with changed settings: {shown}",
            data=tagged({"kind": "config_change", "changes": dict(changes)}),
            source="trainer",
        )

    def on_note(self, note: Note) -> None:
        """A callback's note (the spike guard's verdicts, warnings, outcomes) as an event."""
        self.sink.log_event(
            self.run_id,
            note.kind,
            step=note.step,
            branch=self.branch,
            message=note.message,
            data=tagged(note.data),
            source=note.source,
        )

    def on_checkpoint(self, step: int, path: str, pinned: bool) -> None:
        """Recorded as "writing" until the checkpointer says it landed (`on_checkpoint_change`):
        an asynchronous save is still in flight here."""
        self._branch_of[path] = self.branch
        self.sink.log_checkpoint(
            self.run_id,
            step=step,
            path=path,
            branch=self.branch,
            pinned=pinned,
            checksum_status="writing",
        )

    def on_checkpoint_change(self, step: int, path: str, status: str, pinned: bool) -> None:
        branch = self._branch_of.pop(path, self.branch) if status == "deleted" else None
        self.sink.log_checkpoint(
            self.run_id,
            step=step,
            path=path,
            branch=self._branch_of.get(path, self.branch) if branch is None else branch,
            pinned=pinned,
            checksum_status=status,
        )

    def persist(self) -> None:
        """Everything logged so far survives a SIGKILL from here on (in the store or in the
        spool, whichever is first; an unreachable or slow store is not waited for): called
        right before a checkpoint is published."""
        self.sink.persist()

    def on_fit_end(self, state: FitState) -> None:
        if self.poller is not None:
            self.poller.close()
        status = {"halted": "halted", "stopped": "stopped", "failed": "failed"}.get(
            state.status, "completed"
        )
        self.sink.set_status(self.run_id, status)
        self.sink.persist(timeout=30)  # a store keeping pace has the whole run; else the spool

    def state_dict(self) -> dict[str, Any]:
        return {"branch": self.branch, "handled": self.handled, "forks": self.forks}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.branch = int(state["branch"])
        self.handled = list(state.get("handled", []))
        self.forks = [dict(f) for f in state.get("forks", [])]
