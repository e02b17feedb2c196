"""Rollback, restore and resume, and the state a checkpoint holds: the step core's side of its
checkpoints (trainer/core/step_core.py owns the step; the `Restorer` it holds, what a
checkpoint of it carries and how the core goes back to one).

One snapshot schema for every client (core/state.py): weights and optimizer (or, under
torchrun, each rank's RNG and scheduler beside the sharded files), `trainer.json` with the
counters, data position, skips, records, the same-step tier and every callback's state, and
the resolved config. A rollback restores in-process and keeps what the run has learned since;
a resume takes everything back.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

import torch

from spikewatch.observatory.findings import findings, skipped
from spikewatch.trainer.checkpoints.errors import CheckpointError
from spikewatch.trainer.checkpoints.format import Snapshot
from spikewatch.trainer.checkpoints.staging import NoTensors, Stager, to_host
from spikewatch.trainer.checkpoints.tiers import MEMORY
from spikewatch.trainer.core.actions import Rollback
from spikewatch.trainer.core.attribution import Measure, attribute
from spikewatch.trainer.core.cause import NotAtHand, cause_of, device_of
from spikewatch.trainer.core.data_state import DataState
from spikewatch.trainer.core.decide import rescale
from spikewatch.trainer.core.intervention import Intervention, RolledBack
from spikewatch.trainer.core.state import (
    ENDED,
    callback_keys,
    join_optimizer,
    rng_states,
    set_rng_states,
    split_optimizer,
)

if TYPE_CHECKING:
    from spikewatch.trainer.checkpoints.tiers import Tiers
    from spikewatch.trainer.core.callbacks import Callback
    from spikewatch.trainer.core.probes import Probes
    from spikewatch.trainer.core.same_step import SameStepGate
    from spikewatch.trainer.core.state import RunState
    from spikewatch.trainer.core.transfer import StepTensors
    from spikewatch.trainer.core.world import World

__all__ = ["Core", "Replay", "Restorer", "Swap"]

log = logging.getLogger(__name__)

# The replay proof's tolerance: the step after a rollback's target, replayed on the restored
# state, gives its recorded loss to within this (relative). On a CPU it comes back to the bit;
# on a GPU a forward may reorder its sums (bf16 autocast, split-K): a few 1e-4 at most.
REPLAY_RTOL = 1e-3

# Replay of one batch for the cause of a spike: (step, batch index) -> the step's tensors after
# backward, and the function that ends the step as the run ended it: `end(True)` applies its
# update, `end(False)` does not (a step the run refused) but advances what the run advanced for
# it all the same (the LR schedule of a Watch: a refused step is a step of the run).
Replay = Callable[[int, int], tuple["StepTensors", Callable[[bool], None]]]
# The device check under torchrun: (step, batch index) -> the loss of the next rank's (rank + 1
# mod W) rows of that batch, computed on this rank's device, forward only, on the current weights.
Swap = Callable[[int, int], torch.Tensor]


class Core(Protocol):
    """What a Restorer reads and writes of the step core that holds it (StepCore, checked
    where it makes its Restorer; named here as an interface, since step_core imports this)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    probes: Probes
    checkpointer: Tiers
    world: World
    run: RunState
    callbacks: list[Callback]
    data_flow: Literal["rewind", "forward"]
    scheduler: Any
    same_step: SameStepGate | None
    replay: Replay | None
    swap: Swap | None
    measure_rows: Measure | None
    skip_samples: bool
    config_changes: dict[str, list[Any]]
    resume_line: str | None

    @property
    def config(self) -> Callable[[], dict[str, Any]]: ...  # the resolved config
    def save(self, tiers: list[str] | None = None) -> None: ...


class Restorer:
    """The step core's checkpoints seen from its side: what a snapshot of the core holds, and
    how the core goes back to one (rollback, resume, a framework's state). StepCore holds one
    (`core.restorer`) and hands it what a rollback needs; the fields it reads are the core's."""

    def __init__(self, core: Core) -> None:
        self.core = core
        self.proof_off = False  # a rollback's replay proved nothing in this run: not tried again
        # each rank's replayed losses and the swapped-rows losses of the spike's batches, for
        # `device_of` (a rollback's cause under torchrun)
        self._replayed_ranks: dict[tuple[int, int], list[float]] = {}
        self._swapped_ranks: dict[tuple[int, int], list[float]] = {}

    # -- rollback, restore, resume ------------------------------------------------------------
    def rollback(self, action: Rollback) -> None:
        """Restore the newest intact checkpoint at or before `to_step`, in-process, then skip;
        the cause of a spike is told by replaying it first where the client can."""
        core = self.core
        ck = core.checkpointer
        from_step, t0 = core.run.step, time.perf_counter()
        fallbacks: list[dict[str, Any]] = []
        # the steps a replay may prove a target on: recorded on this branch before the spike's
        # onset (rank 0's guard's; taken before a restore puts the target's own windows back)
        first_bad = action.spike.onset_step if action.spike is not None else from_step + 1
        seen = core.world.agree(self._recorded(min(action.to_step + 1, first_bad - 1)))
        limit, proof = action.to_step, None
        failed: list[tuple[int, Path | int, str | None, dict[str, Any], list[int]]] = []
        while True:  # a target that fails its check or its replay: the next older one
            step, where, abandoned = ck.rollback_point(limit)
            why = None
            try:
                loaded = ck.read(where)
            except CheckpointError as e:
                if not isinstance(where, int) or ck.memory is None:
                    raise  # a disk checkpoint is verified when found: not intact means none
                why = str(e)
            # every rank alike: one rank's failed copy sends all to the next older target
            if isinstance(where, int) and core.world.min_int(0 if why else 1) == 0:
                why = why or f"another rank's host-memory snapshot of step {step} failed its check"
                log.warning("%s: it is dropped, the rollback takes the next older target", why)
                fallbacks.append({"step": step, "tier": MEMORY, "why": why})
                assert ck.memory is not None
                ck.memory.drop(step)
                continue
            tier = ck.last_tier
            self.restore(loaded, resume=False)
            proof = None if self.proof_off else self._replay_proof(step, seen, loaded)
            if proof is None or proof["reproduced"]:
                for f_step, _, f_tier, f_proof, _ in failed:  # the restore's fault, not the loop's
                    fallbacks.append({"step": f_step, "tier": f_tier, "why": f_proof["why"]})
                    if f_tier == MEMORY and ck.memory is not None:
                        ck.memory.drop(f_step)  # unreliable: no later rollback takes it
                break
            proof["why"] = (
                f"the restored step {step} does not reproduce step {proof['step']}'s loss "
                f"({proof['loss']:.6g} replayed, {proof['recorded']:.6g} recorded)"
            )
            failed.append((step, where, tier, proof, abandoned))
            if len(failed) < 2 and ck.latest(step - 1) is not None:
                log.warning("%s: the rollback takes the next older target", proof["why"])
                limit = step - 1
                continue
            # two targets (or the only one) that do not reproduce: the replay cannot prove this
            # run's restores (the loop's recorded loss is not what its loss_fn gives, or the run
            # is not deterministic); the newest target stands, and the proof is off from now on
            self.proof_off = True
            step, where, tier, proof, abandoned = failed[0]
            proof["kept"] = "the replay proves nothing in this run: off from now on"
            log.warning(
                "%s%s: the replay cannot prove this run's restores (is loss_fn the loop's own "
                "loss? is the run deterministic?); step %d restored, the proof off from now on",
                proof["why"],
                f", and so does step {failed[1][0]}" if len(failed) > 1 else "",
                step,
            )
            ck.last_tier = tier  # (restored below)
            break
        if proof is not None:  # the replay's draws, gradients and buffers undone
            loaded = ck.read(where)
            self.restore(loaded, resume=False)
        restored_at = int(loaded["trainer.json"]["data_state"]["batch_index"])  # its position
        decided = core.run.interventions[-1]  # the action's record, made when it was agreed
        found: dict[str, Any] = {}  # what the attribution and the replay tell
        restore_s = time.perf_counter() - t0
        spike = action.spike
        if spike is not None and core.measure_rows is not None:  # on the restored weights
            batches = [i for start, end in action.skip_ranges for i in range(start, end)]
            onset = [i for s, i in spike.replay if s >= spike.onset_step]  # the spike's own
            near = min(onset) if onset else decided.batch_index
            found.update(attribute(batches, core.measure_rows, core.world, near))
            core.optimizer.zero_grad(set_to_none=True)  # the rows' gradients are not the run's
        if spike is not None and spike.replay and core.replay is not None:

            def reload() -> None:
                self.restore(ck.read(where), resume=False)

            t1, self._replayed_ranks, self._swapped_ranks = time.perf_counter(), {}, {}
            try:
                found.update(cause_of(spike, step, self._replay_losses, reload))
                found.update(device_of(spike, self._replayed_ranks, self._swapped_ranks))
            except NotAtHand as e:  # on every rank alike: the batches went, not the cause
                log.warning("the spike's cause is not told: %s", e)
                found.update(cause="unknown", cause_note=str(e))
            n = len(spike.replay) + (len(spike.control) if "control_peak_loss" in found else 0)
            found.update(replay_steps=n, replay_s=time.perf_counter() - t1)
            reload()
        departed = list(spike.ranks) if spike is not None else []
        suspects = self._suspects(found.get("cause"), found.get("device_ranks") or departed)
        core.checkpointer.pin(step, "rollback target")
        named = found.get("samples") if core.skip_samples else None
        skips = () if named else action.skip_ranges  # the named rows alone, else whole batches
        if named:
            core.run.data.block((s["batch"], s["row"]) for s in named)
        for start, end in skips:
            core.run.data.add_skip(start, end)
        core.run.lr_scale = rescale(core.run.lr_scale, action)
        resumed_at = passed_over = None
        if core.data_flow == "forward":  # the data went on: what lay behind is not fed again
            resumed_at = core.run.data.batch_index
            bad = {i for a, b in action.skip_ranges for i in range(a, b)}
            passed_over = sum(1 for i in range(restored_at, resumed_at) if i not in bad)
        kept = [list(r) for r in action.skip_ranges] if named else None
        ranges = [list(r) for r in skips]
        n_named = len(named) if named else None
        said = skipped(  # the one story every report tells (findings.skipped)
            {"passed_over": passed_over, "skipped_samples": n_named, "batches_kept": kept,
             "skip_ranges": ranges}
        )  # fmt: skip
        outcome = RolledBack(
            from_step=from_step,
            to_step=step,
            tier=ck.last_tier,
            restore_s=restore_s,
            skip_ranges=ranges,
            lr_scale=action.lr_scale,
            lr_scale_after=core.run.lr_scale,  # the run's scale of its schedule from now on
            dropped_checkpoints=abandoned,
            skipped=said,
            restore_fallbacks=fallbacks or None,
            check_s=(
                ck.memory.last_check_s if ck.last_tier == MEMORY and ck.memory is not None else None
            ),
            replay_proof=proof,
            suspect_devices=suspects or None,
            skipped_samples=n_named,
            batches_kept=kept,
            skipped_rows=[[s["batch"], s["row"]] for s in named] if named else None,
            resumed_at_batch=resumed_at,
            passed_over=passed_over,
            **found,
        )
        reason = decided.reason if not (skips or named) else f"{decided.reason}, {outcome.skipped}"
        done = replace(decided, reason=reason, rolled_back=outcome)
        core.run.interventions[-1] = done
        record = done.record()
        found_said = findings(record)
        log.warning(
            "rolled back from step %d to step %d (%s tier, %.3fs), %s%s",
            from_step,
            step,
            ck.last_tier,
            restore_s,
            outcome.skipped,
            f": {found_said}" if found_said else "",
        )
        for cb in core.callbacks:
            cb.on_rollback(step, record)
        # Rewrite the restored step's checkpoint with what the run learned (skip ranges, LR
        # scale, policy and detector states) as the next generation, which a resume prefers to
        # the abandoned newer steps; only then delete those. A crash at any moment must not
        # train the bad batches again. A file written in the background: they are deleted on
        # its writer thread once it is written, and the loop goes on meanwhile.
        core.run.generation += 1
        core.save()
        core.checkpointer.drop_after(step, background=True)
        core.checkpointer.report(core.callbacks)

    def resume(self, check: Callable[[Path], dict[str, list[Any]]]) -> int:
        """Continue from the newest intact checkpoint; `check(path)` refuses a config that may
        not resume it and returns the changes it may make ({key: [then, now]}, announced to the
        callbacks at start). Returns the step."""
        core = self.core
        step, path = core.checkpointer.resume_point()
        changes = check(path)
        self.restore(core.checkpointer.read(path), resume=True)
        core.run.resumed_from = str(path)
        (core.run.run_dir / ENDED).unlink(missing_ok=True)  # it goes on: no longer ended
        shown = ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in changes.items())
        # said at the start, once the record has told how far the process before got
        core.resume_line = (
            f"resumed run {core.run.run_id} at step {step} from its disk checkpoint {path}"
            + (f", with changed settings: {shown}" if shown else "")
        )
        core.config_changes = changes
        return step

    def _refused_on_branch(self, after: int) -> set[int]:
        """Steps after `after` whose update this branch refused (same-step tier, non-finite):
        the records since the branch began, this rollback's own (the last) aside."""
        out = set()
        for rec in reversed(self.core.run.interventions[:-1]):
            if rec.kind == "rollback":
                break
            if rec.kind == "skip_update" and rec.step > after:
                out.add(rec.step)
        return out

    def _suspects(self, cause: str | None, mine: list[int]) -> list[int]:
        """A rank whose spikes keep coming without a data cause (device, or transient) is a
        suspect device: named in the record (and so in the alert and on the run page). `mine`:
        this rollback's ranks (the device's, else the departed)."""
        if cause not in ("device", "transient"):
            return []
        past = [
            (rb.device_ranks or list(i.spike.ranks if i.spike is not None else ()))
            for i in self.core.run.interventions
            if (rb := i.rolled_back) is not None and rb.cause in ("device", "transient")
        ]  # this rollback's own not yet among them: its ranks count once more
        suspects = [r for r in mine if 1 + sum(r in ranks for ranks in past) >= 2]
        if suspects:
            log.warning(
                "rank(s) %s: repeated spikes without a data cause: suspect devices", suspects
            )
        return suspects

    def _recorded(self, until: int) -> tuple[dict[int, float], dict[int, int]]:
        """The loss and the batch index of each step up to `until` that the spike guard still
        holds, as this branch recorded them (copies). The guard is rank 0's: `agree` gives them
        to every rank, so that all replay alike."""
        for cb in self.core.callbacks:
            loss_of, batch_of = getattr(cb, "loss_of", None), getattr(cb, "batch_of", None)
            if isinstance(loss_of, dict) and isinstance(batch_of, dict):
                return (
                    {s: v for s, v in loss_of.items() if s <= until},
                    {s: v for s, v in batch_of.items() if s <= until},
                )
        return {}, {}

    def _replay_proof(
        self, step: int, seen: tuple[dict[int, float], dict[int, int]], loaded: dict[str, Any]
    ) -> dict[str, Any] | None:
        """A restore's second proof, beside the snapshot's checksums: the step after the target
        replayed on the restored state (its batch drawn again, forward and backward, no update)
        must give the loss this branch recorded for it. Where the run draws again what it drew
        (data "rewind": its RNGs are restored with the target), the step lies before the
        spike's onset and its loss was finite and recorded; else None (not told). The replay
        draws with the target's RNG states (a dropout mask as the step drew it); a run whose data
        flows forward gets its own back after."""
        core = self.core
        loss_of, batch_of = seen  # (steps before the spike's onset alone)
        nxt = step + 1
        want, index = loss_of.get(nxt), batch_of.get(nxt)
        if (
            core.replay is None
            or "rng.pt" not in loaded
            or want is None
            or index is None
            or not math.isfinite(want)
        ):
            return None
        t1 = time.perf_counter()
        live = rng_states() if core.data_flow != "rewind" else None  # (rewind: restored already)
        set_rng_states(loaded["rng.pt"], loaded["trainer.json"]["rng"])
        try:
            t, _apply = core.replay(nxt, index)
            t = core.world.reduce(t, stop=False)
            got = float(t.loss)  # a rollback's path: one read
        except NotAtHand:
            return None
        finally:
            core.optimizer.zero_grad(set_to_none=True)
            if live is not None:
                set_rng_states(*live)
        ok = math.isfinite(got) and abs(got - want) <= REPLAY_RTOL * max(abs(want), 1e-12)
        return {
            "step": nxt,
            "batch_index": index,
            "loss": got,
            "recorded": want,
            "reproduced": ok,
            "seconds": time.perf_counter() - t1,
        }

    def _replay_losses(self, pairs: Iterable[tuple[int, int]], from_step: int) -> dict[int, float]:
        """The losses of (step, batch index) pairs replayed in order, each update applied as the
        run applied it (a step it refused is refused again, a non-finite one never applied), and,
        under torchrun, each rank's own, for `device_of`."""
        core = self.core
        assert core.replay is not None
        losses = {}
        refused = self._refused_on_branch(from_step)
        for step, index in pairs:
            if step <= from_step:
                continue
            t, end = core.replay(step, index)
            t = core.world.reduce(t, stop=False)
            if t.rank_losses is not None:
                self._replayed_ranks[(step, index)] = t.rank_losses.tolist()
                if core.swap is not None:  # on the same weights: before the update
                    done = core.world.every(core.swap(step, index).float()).tolist()
                    w = len(done)  # rank k computed rank k + 1's rows: by owner, k + 1's first
                    self._swapped_ranks[(step, index)] = [done[(o - 1) % w] for o in range(w)]
            loss, gnorm = torch.stack([t.loss, t.grad_norm]).tolist()  # rare path: one sync
            end(math.isfinite(loss) and math.isfinite(gnorm) and step not in refused)
            core.optimizer.zero_grad(set_to_none=True)
            losses[step] = loss if math.isfinite(loss) else math.inf
        return losses

    # -- the state a checkpoint holds (core/state.py's schema) -------------------------------
    def state_dict(self, decided: bool = True) -> dict[str, Any]:
        """`trainer.json` without the RNG states: counters, data position, skips, records, the
        same-step tier and every callback's state (JSON types). `decided` False: without what
        the decision of the step in flight changes (DECIDED_KEYS; filled in later)."""
        if not decided:
            return self._counters()
        return {**self._counters(), **self._decided()}

    def _counters(self) -> dict[str, Any]:
        core = self.core
        run = core.run
        return {
            "run_id": run.run_id,
            "step": run.step,
            "tokens": run.tokens,
            "generation": run.generation,
            "data_state": run.data.to_dict(),
            "val_losses": run.val_losses,
            "state_moved": core.probes.state_moved,  # a state step moved past a checkpoint
        }

    def _decided(self) -> dict[str, Any]:
        core = self.core
        run = core.run
        return {
            "lr_scale": run.lr_scale,
            "interventions": [i.record() for i in run.interventions],
            "halted": run.halted,
            "same_step": None if core.same_step is None else core.same_step.state_dict(),
            "callbacks": {
                key: cb.state_dict()
                for key, cb in zip(callback_keys(core.callbacks), core.callbacks, strict=True)
            },
        }

    def snapshot(self, stage: Stager | None, *, decided: bool = True) -> Snapshot:
        """The current state as a checkpoint `Snapshot` (core/state.py's schema). `decided`
        False: the step is still in flight, and what its decision changes (DECIDED_KEYS) is
        left out, to be filled in once it is read (StepCore._settle_snapshot)."""
        core = self.core
        rng_tensors, rng_json = rng_states()
        run = core.run
        sched = None if core.scheduler is None else core.scheduler.state_dict()
        # the loop's loader (the Watch's batches): its position, for a resume only (a rollback
        # lets the data flow on), so host memory does without it
        wanted = not isinstance(stage, NoTensors) or stage.wants_stream
        stream = None if run.stream is None or not wanted else run.stream()
        if core.world.distributed:  # weights and optimizer: sharded, by the checkpointer
            own = {**rng_tensors, "json": rng_json}
            if sched is not None:
                own["scheduler"] = sched
            if stream is not None:  # each rank's loader gives its own share
                own["data"] = stream
            torch_files = {f"rng.rank{core.world.rank}.pt": own}
        else:
            torch_files = {"rng.pt": rng_tensors}
            if not isinstance(stage, NoTensors):  # host memory copies the live tensors itself
                torch_files["model.pt"] = to_host(core.model.state_dict(), stage)
                opt = to_host(core.optimizer.state_dict(), stage)
                torch_files.update(split_optimizer(opt))
            if sched is not None:
                torch_files["scheduler.pt"] = sched
            if stream is not None:
                torch_files["data.pt"] = stream
        return Snapshot(
            step=run.step,
            torch_files=torch_files,
            json_files={
                "trainer.json": {**self.state_dict(decided), "rng": rng_json},
                "config.json": core.config(),
            },
            meta={
                "run_id": run.run_id,
                "loss": run.history[-1][1] if run.history else None,
                "tokens": run.tokens,
                "data_state": run.data.to_dict(),
                "generation": run.generation,
            },
        )

    def restore(self, loaded: dict[str, Any], *, resume: bool) -> None:
        """Load a checkpoint (as `Checkpointer.read` returns it) into the live objects. A resume
        takes everything back; a rollback keeps what the run has learned since."""
        core = self.core
        state = loaded["trainer.json"]
        if "memory" in loaded:  # in place, from this rank's host buffers
            assert core.checkpointer.memory is not None
            core.checkpointer.memory.load_tensors(loaded["memory"])
        elif "sharded" in loaded:  # in place, every rank its part (torch.distributed.checkpoint)
            from spikewatch.trainer.checkpoints.sharded import load_sharded

            load_sharded(core.model, core.optimizer, loaded["sharded"], core.world)
        elif loaded.get("in_place"):  # a framework's own checkpointer loaded it already
            pass
        else:
            core.model.load_state_dict(loaded["model.pt"])
            core.optimizer.load_state_dict(join_optimizer(loaded))
        if core.scheduler is not None and "scheduler.pt" in loaded:
            core.scheduler.load_state_dict(loaded["scheduler.pt"])
        # the RNGs: a resume takes them back (bitwise equal to the uninterrupted run); so does a
        # rollback of a client that draws any batch again from its index (data "rewind"). With
        # data flowing forward (the Watch), a rollback leaves them going: a loop that samples
        # with the global RNG (nanoGPT's random windows) would otherwise draw again the very
        # batches the rollback skips
        if "rng.pt" in loaded and (resume or core.data_flow == "rewind"):
            set_rng_states(loaded["rng.pt"], state["rng"])
        if resume:
            core.run.stream_saved = loaded.get("data.pt")  # until the loop's loader is met
            last = loaded.get("meta", {}).get("loss")
            core.run.resumed_loss = math.nan if last is None else float(last)
        self.load_state_dict(state, resume=resume)

    def load_state_dict(self, state: Mapping[str, Any], *, resume: bool = True) -> None:
        """Counters and records from `trainer.json` (or a framework's copy of it). A resume takes
        everything back; a rollback keeps what the run has learned since (interventions, skip
        ranges, LR scale, callback states) and, with forward data flow, the data position."""
        core = self.core
        run = core.run
        run.step, run.tokens = int(state["step"]), int(state.get("tokens", 0))
        core.probes.state_moved = state.get("state_moved")  # taken past the same checkpoint
        if core.same_step is not None and state.get("same_step") is not None:
            core.same_step.load_state_dict(state["same_step"])
            if not resume:  # a rollback: the weights restored are known good
                core.same_step.after_restore()
        restored = DataState.from_dict(state["data_state"])
        if resume:
            run.run_id = str(state["run_id"])
            run.generation = int(state.get("generation", 0))
            run.data = restored
            run.lr_scale = float(state["lr_scale"])
            run.interventions = [Intervention.from_record(d) for d in state["interventions"]]
            run.val_losses = [(int(s), float(v)) for s, v in state["val_losses"]]
            run.halted = state.get("halted")
            saved = state["callbacks"]
            for key, cb in zip(callback_keys(core.callbacks), core.callbacks, strict=True):
                if key in saved:
                    cb.load_state_dict(saved[key])
        else:
            saved = state.get("callbacks") or {}
            for key, cb in zip(callback_keys(core.callbacks), core.callbacks, strict=True):
                cb.on_restore(run.step, saved.get(key) or {})
            if core.data_flow == "rewind":
                ranges = sorted(set(restored.skip_ranges) | set(run.data.skip_ranges))
                run.data = DataState(
                    restored.batch_index, ranges, restored.blocked | run.data.blocked
                )
            run.val_losses = [(s, v) for s, v in run.val_losses if s <= run.step]
        run.history = [(s, v) for s, v in run.history if s <= run.step]
