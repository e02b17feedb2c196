"""The run's state, as one schema for every client: its counters and records (`RunState`) and
the helpers of its checkpoint files. The step core (core/step_core.py) writes and reads them.

Complete means a resumed run is bitwise equal to an uninterrupted one: weights, optimizer state,
the client's LR scheduler, the data position with its skip ranges, every RNG (python, numpy,
torch CPU and CUDA), the counters, callback states and the resolved config. `trainer.json` holds
everything but tensors; it is also what a framework keeps in its own checkpoints (the Watch's
`state_dict`), so the framework's resume resumes the guard.

Under torchrun the weights and optimizer state are not in the snapshot:
trainer/checkpoints/sharded.py writes them with torch.distributed.checkpoint, and each rank adds
its own RNG states (and the scheduler's) in `rng.rank<r>.pt`.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from spikewatch.trainer.core.data_state import DataState
from spikewatch.trainer.core.intervention import Intervention

__all__ = [
    "DECIDED_KEYS",
    "ENDED",
    "ended",
    "RunState",
    "callback_keys",
    "join_optimizer",
    "rng_states",
    "set_rng_states",
    "split_optimizer",
]


# The parts of `trainer.json` a step's decision changes (read one step late, a host-memory
# snapshot of a step still in flight gets them once the step is read): StepCore._settle_snapshot
DECIDED_KEYS = ("lr_scale", "interventions", "halted", "same_step", "callbacks")


ENDED = "ended.json"  # in the run directory: how and where a run ended (not a failure)


def ended(run_dir: Path) -> dict[str, Any] | None:
    """What `ended.json` says ({"run_id", "status", "step"}), or None (no end recorded: the run
    is unfinished, or was killed)."""
    import json

    try:
        out = json.loads((run_dir / ENDED).read_text())
    except (OSError, ValueError):
        return None
    return out if isinstance(out, dict) else None


@dataclass
class RunState:
    """The counters and records of a run that every checkpoint carries."""

    run_id: str
    run_dir: Path
    step: int = 0  # updates on the live branch
    tokens: int = 0
    lr_scale: float = 1.0  # the rollbacks' LR cuts still in force
    generation: int = 0  # rollbacks carried out: checkpoints of a newer one supersede
    data: DataState = field(default_factory=DataState)
    index: int = 0  # the batch index of the step in progress
    interventions: list[Intervention] = field(default_factory=list)  # JSON: `record()`
    history: list[tuple[int, float]] = field(default_factory=list)  # (step, loss), live branch
    val_losses: list[tuple[int, float]] = field(default_factory=list)
    halted: str | None = None
    resumed_loss: float = math.nan  # the loss of the step a resume started from
    resumed_from: str | None = None  # the checkpoint this process resumed from
    # the loop's loader as the Watch's batches (trainer/watch_loader.py): its position for a
    # disk checkpoint's `data.pt`, and what a resume read of it until the loader is met
    stream: Callable[[], dict[str, Any]] | None = None
    stream_saved: dict[str, Any] | None = None


def rng_states() -> tuple[dict[str, Any], dict[str, Any]]:
    """(tensor states for rng.pt, JSON states for trainer.json)."""
    tensors: dict[str, Any] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        tensors["cuda"] = torch.cuda.get_rng_state_all()
    py = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()  # type: ignore[misc,unused-ignore]
    json_states = {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [name, np.asarray(keys).tolist(), int(pos), int(has_gauss), float(cached)],
    }
    return tensors, json_states


def set_rng_states(tensors: dict[str, Any], states: dict[str, Any]) -> None:
    """RNG states back; torch takes them only as CPU byte tensors (checkpoints are read to the
    CPU: the `.cpu()` is a no-op there, and a guard for any other caller)."""
    torch.set_rng_state(tensors["torch"].cpu())
    if "cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([t.cpu() for t in tensors["cuda"]])
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
