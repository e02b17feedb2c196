"""Run an example under torchrun with one more callback on every rank's Watch, which writes a
digest of that rank's full weights right after each rollback and at the end of the run:
`torchrun ... tests/spikewatch/rank_probe.py OUT_DIR EXAMPLE [example args...]`. The tests
compare the digests across ranks (replicas that diverged silently are what this catches).
It also records a digest of each input row of the rank's first training forwards (at the
model's token embedding, so the same in every client): the tests check that the ranks' rows
differ and that together they are the global batch."""

from __future__ import annotations

import hashlib
import json
import os
import runpy
import sys
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from spikewatch.trainer.core.callbacks import Callback, FitState
from spikewatch.trainer.watch import Watch

REPO = Path(__file__).parents[2]


FORWARDS = 3  # the first training forwards whose rows are recorded


def row_digests(tokens: torch.Tensor) -> list[str]:
    """One digest per row of a (rows, seq) token batch."""
    return [
        hashlib.sha256(r.to(torch.int64).cpu().numpy().tobytes()).hexdigest()[:16] for r in tokens
    ]


def digest(model: torch.nn.Module) -> str:
    """sha256 of every parameter's full value (an FSDP2 shard is gathered: a collective)."""
    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        full = p.full_tensor() if isinstance(p, DTensor) else p
        h.update(name.encode())
        h.update(full.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()


class Capture(Callback):
    def __init__(self, model: torch.nn.Module, out: Path) -> None:
        self.model, self.out = model, out
        self.rank = int(os.environ.get("RANK", "0"))
        self.seen: dict[str, Any] = {"rollbacks": [], "rows": []}
        embedding = next(m for m in model.modules() if isinstance(m, torch.nn.Embedding))
        embedding.register_forward_pre_hook(self._rows)

    def _rows(self, module: torch.nn.Module, args: Any) -> None:
        tokens = args[0] if args else None
        rows = self.seen["rows"]
        if module.training and torch.is_grad_enabled() and len(rows) < FORWARDS:
            if torch.is_tensor(tokens) and tokens.dim() == 2:
                rows.append(row_digests(tokens))
                self._write()

    def on_rollback(self, step: int, record: Any) -> None:
        self.seen["rollbacks"].append([step, digest(self.model)])
        self._write()

    def on_fit_end(self, state: FitState) -> None:
        self.seen["end"] = [state.step, digest(self.model)]
        self._write()

    def _write(self) -> None:
        (self.out / f"rank{self.rank}.json").write_text(json.dumps(self.seen))


def main() -> None:
    out, example, *args = sys.argv[1:]
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    opened = Watch.open

    def open_with_capture(self: Watch) -> Any:
        first = self.core is None
        core = opened(self)
        if first:
            core.callbacks.append(Capture(self.model, out_dir))
        return core

    Watch.open = open_with_capture  # type: ignore[method-assign]
    sys.argv = [example, *args]
    runpy.run_path(str(REPO / "examples" / f"{example}.py"), run_name="__main__")


if __name__ == "__main__":
    main()
