"""The trainer's complete state as a checkpoint `Snapshot`, and back.

Complete means a resumed run is bitwise equal to an uninterrupted one: weights, optimizer state,
the data position with its skip ranges, every RNG (python, numpy, torch CPU and CUDA), the
counters, callback states and the resolved config. The LR schedule is a pure function of the
step, so it needs only the step and the rollback LR scale.

Under torchrun the weights and optimizer state are not in the snapshot:
trainer/checkpoints/sharded.py writes them with torch.distributed.checkpoint, and each rank adds
its own RNG states.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from trainer.builtin.data import DataState
from trainer.checkpoints.format import Snapshot
from trainer.checkpoints.staging import Stager, to_host
from trainer.config import TrainConfig
from trainer.core.callbacks import Callback
from trainer.core.same_step import SameStepGate
from trainer.core.world import World


class Trainer(Protocol):
    """What a snapshot is taken from and restored into: the loop's Trainer
    (trainer/builtin/loop.py), named by its fields so that this module does not import the loop."""

    cfg: TrainConfig
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    world: World
    callbacks: Sequence[Callback]
    run_id: str
    run_dir: Path
    step: int
    tokens: int
    lr_scale: float
    data_state: DataState
    interventions: list[dict[str, Any]]
    val_losses: list[tuple[int, float]]
    history: list[tuple[int, float]]
    resumed_loss: float
    generation: int
    same_step: SameStepGate | None


__all__ = [
    "Trainer",
    "build_snapshot",
    "callback_keys",
    "join_optimizer",
    "restore",
    "rng_states",
    "set_rng_states",
    "split_optimizer",
]


def rng_states() -> tuple[dict[str, Any], dict[str, Any]]:
    """(tensor states for rng.pt, JSON states for trainer.json)."""
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        tensors["cuda"] = torch.cuda.get_rng_state_all()
    py = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    json_states = {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)],
    }
    return tensors, json_states


def set_rng_states(tensors: dict[str, Any], states: dict[str, Any]) -> None:
    torch.set_rng_state(tensors["torch"])
    if "cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(tensors["cuda"])
    v, keys, gauss = states["python"]
    random.setstate((v, tuple(keys), gauss))
    name, keys, pos, has_gauss, cached = states["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))


def callback_keys(callbacks: list[Any]) -> list[str]:
    """Stable keys for callback states: the class name, numbered only among its own kind, so
    adding or dropping another callback (the progress bar) on resume changes nothing."""
    seen: dict[str, int] = {}
    keys = []
    for cb in callbacks:
        name = type(cb).__name__
        keys.append(f"{name}:{seen.get(name, 0)}")
        seen[name] = seen.get(name, 0) + 1
    return keys


def split_optimizer(sd: dict[str, Any]) -> dict[str, Any]:
    """Two files of about equal size (the state of alternate parameters), so the optimizer
    state, twice the weights' size under Adam, is written by two threads at once."""
    state = sd["state"]
    odd = {k: v for i, (k, v) in enumerate(state.items()) if i % 2}
    even = {k: v for k, v in state.items() if k not in odd}
    return {"optimizer.pt": {**sd, "state": even}, "optimizer.1.pt": {"state": odd}}


def join_optimizer(loaded: dict[str, Any]) -> dict[str, Any]:
    sd = dict(loaded["optimizer.pt"])
    sd["state"] = {**sd["state"], **loaded.get("optimizer.1.pt", {"state": {}})["state"]}
    return sd


def build_snapshot(tr: Trainer, stage: Stager | None) -> Snapshot:
    rng_tensors, rng_json = rng_states()
    state = {
        "step": tr.step,
        "tokens": tr.tokens,
        "lr_scale": tr.lr_scale,
        "run_id": tr.run_id,
        "data_state": tr.data_state.to_dict(),
        "interventions": tr.interventions,
        "val_losses": tr.val_losses,
        "generation": tr.generation,
        "same_step": None if tr.same_step is None else tr.same_step.state_dict(),
        "rng": rng_json,
        "callbacks": {
            key: cb.state_dict()
            for key, cb in zip(callback_keys(tr.callbacks), tr.callbacks, strict=True)
        },
    }
    last = tr.history[-1][1] if tr.history else None
    if tr.world.distributed:  # weights and optimizer: sharded, by the checkpointer
        torch_files = {f"rng.rank{tr.world.rank}.pt": {**rng_tensors, "json": rng_json}}
    else:
        torch_files = {
            **split_optimizer(to_host(tr.optimizer.state_dict(), stage, "optimizer")),
            "model.pt": to_host(tr.model.state_dict(), stage, "model"),
            "rng.pt": rng_tensors,
        }
    return Snapshot(
        step=tr.step,
        torch_files=torch_files,
        json_files={"trainer.json": state, "config.json": tr.cfg.to_dict()},
        meta={
            "run_id": tr.run_id,
            "loss": last,
            "tokens": tr.tokens,
            "data_state": tr.data_state.to_dict(),
            "generation": tr.generation,
        },
    )


def restore(tr: Trainer, loaded: dict[str, Any], *, resume: bool) -> None:
    """Load a checkpoint into `tr`. A resume takes everything back; a rollback keeps what the
    run has learned since (interventions, skip ranges, LR scale, callback states)."""
    state = loaded["trainer.json"]
    if "sharded" in loaded:  # in place, every rank its part (torch.distributed.checkpoint)
        from trainer.checkpoints.sharded import load_sharded

        load_sharded(tr.model, tr.optimizer, loaded["sharded"], tr.world)
    else:
        tr.model.load_state_dict(loaded["model.pt"])
        tr.optimizer.load_state_dict(join_optimizer(loaded))
    set_rng_states(loaded["rng.pt"], state["rng"])
    tr.step, tr.tokens = state["step"], state["tokens"]
    if tr.same_step is not None and state.get("same_step") is not None:
        tr.same_step.load_state_dict(state["same_step"])
    restored = DataState.from_dict(state["data_state"])
    if resume:
        last = loaded.get("meta", {}).get("loss")
        tr.resumed_loss = math.nan if last is None else float(last)
        tr.generation = int(state.get("generation", 0))
        tr.data_state = restored
        tr.lr_scale = state["lr_scale"]
        tr.interventions = list(state["interventions"])
        tr.val_losses = [(int(s), float(v)) for s, v in state["val_losses"]]
        for key, cb in zip(callback_keys(tr.callbacks), tr.callbacks, strict=True):
            if key in state["callbacks"]:
                cb.load_state_dict(state["callbacks"][key])
    else:
        ranges = sorted(set(restored.skip_ranges) | set(tr.data_state.skip_ranges))
        tr.data_state = DataState(restored.batch_index, ranges)
        tr.val_losses = [(s, v) for s, v in tr.val_losses if s <= tr.step]
    tr.history = [(s, v) for s, v in tr.history if s <= tr.step]
