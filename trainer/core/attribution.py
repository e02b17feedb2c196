"""Which samples caused a spike: per-row loss and gradient norm on the restored, pre-onset
weights, for every batch the rollback skips (the onset batch among them), and the rows that
stand out named by batch, row and the data's own id.

A rollback is rare, so a forward and a backward per row is affordable (tens of batches of a few
rows each). The client measures (it knows its batches: the built-in sampler, or the Watch's
`batch_at` with `loss_fn`); the core picks the batches, keeps the RNG and the gradients as they
were, runs compiled models eagerly for it (no graph for a batch of one), gathers every rank's
rows on rank 0, names the outliers there and agrees the result with every rank.

The rule, in log-loss (a loss's noise is multiplicative): the rows split where the two groups
are best separated (Otsu's threshold: the split of largest between-group variance, the upper
group at most half the rows); the lower group is the clean rows' distribution. The upper group
is named when it starts more than `SIGMA` robust deviations (1.4826 x the median absolute
deviation, at least `FLOOR`) above the lower group's median, across a gap of at least `GAP`
deviations: a separate group, not a cut through one tail. A few bad rows then cannot inflate
the spread they are measured against. A named set that is
empty or holds more than half the rows is not an attribution (the whole batch is to blame, or
the optimizer state: the replay tells which); a non-finite row is always named.
"""

from __future__ import annotations

import contextlib
import logging
import math
import statistics
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch

from spikewatch.trainer.core.state import rng_states, set_rng_states
from spikewatch.trainer.core.world import World

__all__ = [
    "FED_STEPS",
    "MAX_BATCHES",
    "MicroBatches",
    "RowStat",
    "attribute",
    "name_rows",
    "preview",
]

log = logging.getLogger(__name__)

SIGMA = 4.0
GAP = 2.0  # the split must be a gap: at least this many deviations between the two groups
FLOOR = 0.02  # the smallest robust deviation of log-losses (a perfectly uniform batch)
MAX_BATCHES = 64  # the skip windows of repeated spikes grow; attribution looks at most this far
# steps of fed batches a framework callback keeps for it (references on the device: a spike is
# detected a few steps after its onset, and a big batch kept 64 times would be gigabytes)
FED_STEPS = 16


@dataclass(frozen=True)
class RowStat:
    """One row of one batch, measured on the restored weights. `row` is its row in the global
    batch (under torchrun: rank * rows-per-rank + the rank's row)."""

    batch: int
    row: int
    loss: float
    grad_norm: float | None = None
    rank: int = 0  # the rank that trained it
    id: str | None = None  # the data's own id (a document id, a file and offset)
    preview: str | None = None  # the row's beginning, decoded


# batch index -> this rank's rows of it, measured on the current weights
Measure = Callable[[int], list[RowStat]]


def attribute(
    indices: Iterable[int], measure: Measure, world: World, near: int | None = None
) -> dict[str, Any]:
    """The record's `samples` (the named rows) and `attribution` (what was measured, the rule's
    threshold, whether it named anything, what it cost), the same on every rank. Of a window
    longer than MAX_BATCHES, the batches nearest batch `near` (the onset's) are measured."""
    t0 = time.perf_counter()
    todo = sorted(set(indices))
    if near is not None and len(todo) > MAX_BATCHES:
        todo = sorted(sorted(todo, key=lambda i: (abs(i - near), i))[:MAX_BATCHES])
    todo = todo[:MAX_BATCHES]
    with _untouched():
        mine = [r for i in todo for r in measure(i)]
    every = world.gather([asdict(r) for r in mine])
    result = None
    if world.is_main:
        rows = [RowStat(**d) for part in every or [] for d in part]
        result = name_rows(rows)
        result["attribution"].update(batches=len(todo), seconds=time.perf_counter() - t0)
        named = result["samples"]
        log.warning(
            "attribution on the restored weights: %s",
            f"{len(named)} of {len(rows)} rows named: {_shown(named)}"
            if named
            else f"no row stands out among {len(rows)} (the whole batches are skipped)",
        )
    return world.agree(result)


def name_rows(rows: list[RowStat]) -> dict[str, Any]:
    """The outlying rows by the rule above: {"samples": [...], "attribution": {...}}."""
    logs = sorted(_log(r.loss) for r in rows if math.isfinite(_log(r.loss)))
    info: dict[str, Any] = {"rows": len(rows), "sigma": SIGMA}
    if len(logs) < 4:
        bad = [r for r in rows if not math.isfinite(_log(r.loss))]
        clear = 0 < len(bad) <= len(rows) // 2
        samples = [_sample(r) for r in bad] if clear else []
        return {"samples": samples, "attribution": {**info, "clear": clear, "threshold": None}}
    k = _split(logs)
    clean = logs[:k]
    median = statistics.median(clean)
    spread = max(1.4826 * statistics.median(abs(v - median) for v in clean), FLOOR)
    cut = logs[k - 1]  # the upper group: everything above the split
    gap = (logs[k] - cut) / spread if k < len(logs) else 0.0
    far = (logs[k] - median) / spread if k < len(logs) else 0.0
    bad = [r for r in rows if not math.isfinite(_log(r.loss))]  # non-finite: always named
    high = [r for r in rows if math.isfinite(_log(r.loss)) and _log(r.loss) > cut]
    named = bad + (high if gap >= GAP and far >= SIGMA else [])
    clear = 0 < len(named) <= len(rows) // 2
    info.update(
        clear=clear,
        threshold=math.exp(cut),
        median_loss=math.exp(median),
        log_spread=spread,
        gap=gap,
        deviations=far,
    )
    return {"samples": [_sample(r) for r in named] if clear else [], "attribution": info}


def _log(loss: float) -> float:
    return math.log(loss) if loss > 0 else (math.inf if math.isnan(loss) else -math.inf)


def _split(x: list[float]) -> int:
    """Otsu's split of sorted values: the index k maximising the between-group variance of
    x[:k] and x[k:], with at least half the values below it."""
    n = len(x)
    total = sum(x)
    best, best_k, below = -1.0, n, 0.0
    for k in range(1, n):
        below += x[k - 1]
        if k < (n + 1) // 2:
            continue
        m0, m1 = below / k, (total - below) / (n - k)
        between = k * (n - k) * (m0 - m1) ** 2
        if between > best:
            best, best_k = between, k
    return best_k


def preview(tokens: list[int], decode: Callable[[list[int]], str] | None = None) -> str:
    """A row's beginning as text: the run's decoder, else bytes (the byte-level corpus), else
    the token ids."""
    head = tokens[:64]
    if decode is not None:
        text = decode(head)
    elif head and 0 <= min(head) and max(head) < 256:
        text = bytes(head).decode("utf-8", errors="replace")
    else:
        text = " ".join(str(t) for t in head)
    return text[:300]


def _sample(r: RowStat) -> dict[str, Any]:
    out: dict[str, Any] = {"batch": r.batch, "row": r.row, "rank": r.rank, "loss": r.loss}
    out["grad_norm"] = r.grad_norm  # null: not measured (FSDP2 shards measure losses only)
    out["id"] = r.id  # null: the batch carries no id of its own
    if r.preview is not None:
        out["preview"] = r.preview
    return out


def _shown(named: list[dict[str, Any]], most: int = 6) -> str:
    """ "batch 203 rows 8,9 (rank 1)": global rows (under torchrun, rank k's row r of a
    global batch is row k * rows-per-rank + r), with the ranks that trained them."""
    by_batch: dict[int, list[dict[str, Any]]] = {}
    for s in named:
        by_batch.setdefault(s["batch"], []).append(s)
    parts = []
    for b, rows in sorted(by_batch.items()):
        ranks = sorted({s.get("rank", 0) for s in rows})
        on = f" (rank {','.join(map(str, ranks))})" if ranks != [0] else ""
        parts.append(f"batch {b} rows {','.join(str(s['row']) for s in rows)}{on}")
    more = f" and {len(parts) - most} more batches" if len(parts) > most else ""
    return "; ".join(parts[:most]) + more


@contextlib.contextmanager
def _untouched() -> Iterator[None]:
    """The RNGs as they were afterwards, and compiled models run eagerly meanwhile (a row is a
    batch of one: no graph of its own)."""
    tensors, json_states = rng_states()
    stance = getattr(torch.compiler, "set_stance", None)
    eager = stance("force_eager") if stance is not None else contextlib.nullcontext()
    try:
        with eager:
            yield
    finally:
        set_rng_states(tensors, json_states)


def row_grad_norm(params: Iterable[torch.Tensor], loss: torch.Tensor | None = None) -> float:
    """The global gradient norm of one row's backward (a host read: the rare path): of the
    gradients in `.grad`, or with `loss`, of its gradients taken by autograd.grad, which leaves
    `.grad` alone and runs no DDP reducer hook (those fire as gradients accumulate), so it is
    one rank's own row under DDP too, in any client."""
    if loss is not None:
        inputs = [p for p in params if p.requires_grad]
        got = torch.autograd.grad(loss, inputs, allow_unused=True) if inputs else ()
        grads = [g for g in got if g is not None]
    else:
        grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return math.nan
    return float(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads))))


def measure_rows(
    index: int,
    fed: Any,
    loss_fn: Callable[[Any], torch.Tensor],
    params: Iterable[torch.Tensor] | None,
    rank: int,
    decode: Callable[[list[int]], str] | None = None,
) -> list[RowStat]:
    """Each row of a client's batch `index` as it was `fed` (a batch, `MicroBatches`, or None:
    not at hand) through the user's `loss_fn` alone: its loss and, with `params`, its gradient
    norm on the current weights (autograd.grad: `.grad` and DDP untouched). These are this
    rank's rows; under torchrun row r of rank k is global row k * rows + r."""
    parts = [] if fed is None else fed if isinstance(fed, MicroBatches) else [fed]
    rows = [(part, r) for part in parts for r in range(rows_in(part))]
    params = None if params is None else list(params)
    out = []
    for n, (batch, r) in enumerate(rows):
        with torch.set_grad_enabled(params is not None):  # this rank's row alone
            loss = loss_fn(row_of(batch, r))
        tokens = tokens_of(batch, r)
        out.append(
            RowStat(
                batch=index,
                row=rank * len(rows) + n,
                loss=float(loss.detach()),
                grad_norm=None if params is None else row_grad_norm(params, loss),
                rank=rank,
                id=id_of(batch, r),
                preview=None if tokens is None else preview(tokens, decode),
            )
        )
    return out


# -- a user's batch, row by row (the Watch's `batch_at`) ------------------------------------------
ID_KEYS = ("id", "ids", "doc_id", "document_id")  # a dict batch's own ids of its rows
_TOKEN_KEYS = ("input_ids", "tokens", "x")


class MicroBatches(tuple):
    """A step's batch as the micro-batches a framework fed (gradient accumulation): its rows,
    in order, are theirs."""


def rows_in(batch: Any) -> int:
    """The batch's rows: the leading size of its first tensor."""
    for t in _tensors(batch):
        return int(t.size(0)) if t.dim() else 1
    raise ValueError("spikewatch cannot attribute a batch that holds no tensor")


def row_of(batch: Any, r: int) -> Any:
    """Row `r` of a batch (a tensor, a tuple or list of them, or a dict), as a batch of one."""
    if torch.is_tensor(batch):
        return batch[r : r + 1] if batch.dim() else batch
    if isinstance(batch, Mapping):
        return _like(batch, {k: row_of(v, r) for k, v in batch.items()})
    if isinstance(batch, tuple | list):
        return type(batch)(row_of(v, r) for v in batch)
    return batch


def select_rows(batch: Any, keep: list[int]) -> Any:
    """The batch with only rows `keep` (tensors, tuples or lists of them, dicts; lists of
    per-row values too)."""
    if torch.is_tensor(batch):
        return (
            batch[torch.tensor(keep, dtype=torch.long, device=batch.device)]
            if batch.dim()
            else batch
        )
    if isinstance(batch, Mapping):
        return _like(batch, {k: select_rows(v, keep) for k, v in batch.items()})
    if isinstance(batch, tuple | list):
        if batch and all(isinstance(v, str | int | float | bool) or v is None for v in batch):
            return type(batch)(batch[r] for r in keep)  # per-row values (ids, texts)
        return type(batch)(select_rows(v, keep) for v in batch)
    return batch


def rank_share(batch: Any, rank: int, size: int) -> tuple[Any, int]:
    """(rank `rank`'s consecutive share of a global batch, the global row of its first row):
    under torchrun each rank trains rows [rank * n, (rank + 1) * n) of every global batch, n =
    rows / size, so the ranks' rows differ and together they are the global batch (the built-in
    trainer's rule, World.rows). One process: the batch itself."""
    if size <= 1:
        return batch, 0
    rows = rows_in(batch)
    if rows % size:
        raise ValueError(
            f"a global batch of {rows} rows does not divide among {size} ranks: under torchrun "
            "each rank trains its consecutive share of the batch that batch_at(index) returns "
            "(make its rows a multiple of the world size, or pass shard=False and return this "
            "rank's own rows)"
        )
    n = rows // size
    return select_rows(batch, list(range(rank * n, (rank + 1) * n))), rank * n


_SAID_SHRUNK: set[int] = set()  # the Watches (by id) that said why their batches shrink


def leave_out(batch: Any, keep: list[int], index: int, owner: object) -> Any:
    """The batch with only rows `keep` (the named samples left out), its batch dimension marked
    dynamic: a compiled model compiles once more for the smaller batch and no more for any other
    size (not once per size). Said once per `owner`, with why."""
    rows = rows_in(batch)
    out = select_rows(batch, keep)
    for t in _tensors(out):
        if t.dim():
            torch._dynamo.maybe_mark_dynamic(t, 0)
    if id(owner) not in _SAID_SHRUNK:
        _SAID_SHRUNK.add(id(owner))
        model = getattr(owner, "model", None)
        compiled = model is not None and _compiled(model)
        log.warning(
            "batch %d trains on %d of its %d rows (the named samples are left out, not "
            "replaced: the loop's data is its own)%s",
            index,
            len(keep),
            rows,
            "; the compiled model compiles once more, for a batch of dynamic size"
            if compiled
            else "",
        )
    return out


def _compiled(model: Any) -> bool:
    """The model, or a module inside it, is under `torch.compile` (`torch.compile(model)`'s
    wrapper, or `module.compile()` in place)."""
    modules = model.modules() if isinstance(model, torch.nn.Module) else []
    return any(
        hasattr(m, "_orig_mod") or getattr(m, "_compiled_call_impl", None) is not None
        for m in modules
    )


def moved(batch: Any, device: torch.device | str) -> Any:
    """The batch with its tensors on `device` (another rank's batch, received on the host)."""
    if torch.is_tensor(batch):
        return batch.to(device)
    if isinstance(batch, Mapping):
        return _like(batch, {k: moved(v, device) for k, v in batch.items()})
    if isinstance(batch, tuple | list):
        return type(batch)(moved(v, device) for v in batch)
    return batch


def id_of(batch: Any, r: int) -> str | None:
    """The data's own id of row `r`, from a dict batch's "id" / "ids" entry."""
    if isinstance(batch, Mapping):
        for k in ID_KEYS:
            if k in batch:
                ids = batch[k]
                value = ids[r] if hasattr(ids, "__getitem__") and not isinstance(ids, str) else ids
                return str(value.item() if torch.is_tensor(value) else value)
    return None


def tokens_of(batch: Any, r: int) -> list[int] | None:
    """Row `r` of the batch's inputs (a dict's "input_ids", else its first integer tensor)."""
    if isinstance(batch, Mapping):
        for k in _TOKEN_KEYS:
            if k in batch and torch.is_tensor(batch[k]):
                return [int(v) for v in batch[k][r].reshape(-1).tolist()]
    for t in _tensors(batch):
        if t.dim() and not t.is_floating_point():
            return [int(v) for v in t[r].reshape(-1).tolist()]
    return None


def tokens_in(batch: Any) -> int:
    """The tokens a batch feeds: the size of its inputs (a dict's "input_ids", else its first
    integer tensor); 0 when it holds none."""
    if isinstance(batch, Mapping):
        for k in _TOKEN_KEYS:
            if k in batch and torch.is_tensor(batch[k]):
                return int(batch[k].numel())
    for t in _tensors(batch):
        if not t.is_floating_point():
            return int(t.numel())
    return 0


def _like(batch: Mapping[str, Any], items: dict[str, Any]) -> Any:
    """`items` in the mapping type the batch came in (transformers' `BatchEncoding`, a
    `UserDict`), where that type is built from a dict; else a dict."""
    if type(batch) is dict:
        return items
    factory: Any = type(batch)
    try:
        return factory(items)
    except Exception:  # a mapping type not built from a dict: a dict serves `model(**batch)`
        return items


def _tensors(batch: Any) -> Iterator[torch.Tensor]:
    if torch.is_tensor(batch):
        yield batch
    elif isinstance(batch, Mapping):
        for v in batch.values():
            yield from _tensors(v)
    elif isinstance(batch, tuple | list):
        for v in batch:
            yield from _tensors(v)
