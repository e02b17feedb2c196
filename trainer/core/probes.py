"""Every-step, per-layer stability telemetry, computed on device and read in one host transfer.

Layers are the embedding, each block's attention and MLP (their norms' gains included) and the
output head (with the final norm). Per layer: gradient norm (free: clipping computes the
per-tensor norms anyway), parameter norm, update norm and update/parameter ratio, and the
optimizer's state: Adam's first moment norm, mean and max of sqrt(v) and the fraction of v
below 1e-16 (second moments that lag the first; estimated on a fixed strided sample), or
Muon's momentum norm. Those state statistics are full passes over parameter-sized memory, so
they run every `state_interval` probed steps (cheap on a GPU; see benchmarks/probe_overhead.py).
Per layer and head: the max pre-softmax attention logit (from the attention backend).
Globally: mean log-partition z and max output logit (from the model), grad norm, clip factor,
LR, tokens/s (the loop).

Under torchrun (trainer/core/world.py): with DDP every rank holds the full, averaged gradient
and whole parameters, so every probe is computed as in one process. With FSDP2 each rank holds
shards: sums over a layer (squared norms, L1 sums, element counts) are summed over the ranks
before any root or ratio, maxima are maxed, and the grad norms come from the sharded clipping.

The update statistics only exist after the optimizer step, and the step's copy to the host is
enqueued before it (on the host path it is even read before it). So they ride the *next* step's
transfer and reach callbacks through `on_update_metrics` one step late, tagged with their own
step; the last ones are flushed when the fit ends.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from spikewatch.observatory import metric_names as M
from spikewatch.trainer.config import ProbesConfig
from spikewatch.trainer.core.norms import maxima, norms
from spikewatch.trainer.core.transfer import HostTransfer, Reduce
from spikewatch.trainer.core.world import World, local
from spikewatch.trainer.model.optim.factor import inner_optimizer

__all__ = ["Probes", "describe_model", "layer_of", "module_layer_of", "unwrapped"]

V_TINY = 1e-16


def layer_of(name: str) -> str:
    """Parameter name -> probe layer: 'embed', '<i>/attn', '<i>/mlp' or 'lm_head'."""
    if name.startswith("wte."):
        return "embed"
    if name.startswith(("lm_head.", "norm_f.")):
        return "lm_head"
    _, i, part, *_ = name.split(".")  # blocks.<i>.<attn|mlp|attn_norm|mlp_norm>....
    return f"{i}/{'attn' if part.startswith('attn') else 'mlp'}"


# What wrappers put inside a module's own parameter names: torch.compile (`_orig_mod.`),
# activation checkpointing, FSDP (v1). DDP's `module.` goes with `inner_model`. The store gets
# the model's own names.
_WRAPPER_PARTS = {"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"}


def unwrapped(name: str) -> str:
    """A parameter name without the wrappers' parts
    ('model.layers.0._checkpoint_wrapped_module.q.weight' -> 'model.layers.0.q.weight')."""
    return ".".join(p for p in name.split(".") if p not in _WRAPPER_PARTS)


def module_layer_of(name: str) -> str:
    """Any model's parameter name -> probe layer, in the model's own module names: inside a
    numbered block the block index and the child module ('model.layers.3.self_attn.q_proj.weight'
    -> '3/self_attn', so the store sees a layer x step matrix per child), elsewhere the module
    path ('model.embed_tokens.weight' -> 'model.embed_tokens', 'lm_head.weight' -> 'lm_head')."""
    parts = name.split(".")[:-1] or ["root"]
    for i, part in enumerate(parts):
        if part.isdigit():
            return f"{part}/{parts[i + 1] if i + 1 < len(parts) else 'self'}"
    return ".".join(parts)


def inner_model(model: torch.nn.Module) -> torch.nn.Module:
    """The user's own module inside DDP's (or torch.compile's) wrapper."""
    from torch.nn.parallel import DistributedDataParallel

    while True:
        if isinstance(model, DistributedDataParallel):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), torch.nn.Module):
            model = model._orig_mod  # type: ignore[assignment]
        else:
            return model


def describe_model(model: torch.nn.Module) -> dict[str, Any]:
    """Class, layers and heads for the dashboard (its layer chooser), from a Hugging Face style
    config when the model has one."""
    model = inner_model(model)
    cfg = getattr(model, "config", None)

    def get(key: str) -> Any:
        return getattr(cfg, key, None)

    return {
        "class": type(model).__name__,
        "model_type": get("model_type"),
        "n_layer": get("num_hidden_layers") or get("n_layer") or 0,
        "d_model": get("hidden_size") or get("n_embd") or get("d_model"),
        "n_head": get("num_attention_heads") or get("n_head") or 0,
        "n_kv_head": get("num_key_value_heads"),
        "parameters": sum(p.numel() for p in model.parameters()),
    }


class Pending(NamedTuple):
    """A state step's statistics, on the device until a transfer takes them."""

    step: int
    names: list[str]  # the values' names; none where `reduce` makes the metrics on the host
    values: torch.Tensor
    reduce: Reduce | None = None

    def into(self, xfer: HostTransfer, late: bool = False) -> None:
        """Onto a transfer, which makes the metrics when it is read."""
        if self.reduce is None:
            xfer.add(self.names, self.values, late=late)
        else:
            xfer.add_reduced(self.values, self.reduce, late=late)

    def metrics(self, values: list[float]) -> dict[str, float]:
        """The metrics of `values`, the host copy of `self.values`."""
        if self.reduce is None:
            return dict(zip(self.names, values, strict=True))
        return self.reduce(values)


class _StateOnHost:
    """The one pass's per-layer statistics, made on the host from its per-tensor values: for
    P tensors, 6P sums (||p||^2, ||update||^2, ||m||^2, sum sqrt(v), -, the sampled count of
    v below 1e-16), P sample sizes, P maxima of v; float64, in the op-by-op form's order and
    names (every layer for the update norms, the layers with Adam's state for the rest)."""

    def __init__(self, probes: Probes) -> None:
        self.layers = probes.layers
        self.owner = probes.owner
        self.numel = [float(p.numel()) for p in probes.params]  # whole tensors, every rank
        g = probes.adam_groups
        self.present = [i for i, k in enumerate(g.present) if k]
        sizes = [float(_sample(local(p).detach()).numel()) for p in probes.params]
        self.samples = torch.tensor(sizes, device=probes.device)  # summed over shards
        self.names = [
            [M.layer(la, stat) for la in self.layers]
            for stat in (M.STAT_PARAM_NORM, M.STAT_UPDATE_NORM, M.STAT_UPDATE_RATIO)
        ] + [
            g.names(stat)
            for stat in (
                M.STAT_ADAM_M_NORM,
                M.STAT_ADAM_SQRT_V_MEAN,
                M.STAT_ADAM_SQRT_V_MAX,
                M.STAT_ADAM_V_TINY_FRAC,
            )
        ]

    def __call__(self, values: list[float]) -> dict[str, float]:
        n, nl = len(self.owner), len(self.layers)
        p2, u2, m2, roots, tiny, count, samples = ([0.0] * nl for _ in range(7))
        vmax = [-math.inf] * nl
        sizes, maxima_ = values[6 * n : 7 * n], values[7 * n :]
        for j, la in enumerate(self.owner):
            row = values[6 * j : 6 * j + 6]
            p2[la] += row[0]
            u2[la] += row[1]
            m2[la] += row[2]
            roots[la] += row[3]
            tiny[la] += row[5]
            count[la] += self.numel[j]
            samples[la] += sizes[j]
            vmax[la] = _nanmax(vmax[la], maxima_[j])
        pn, un = [math.sqrt(x) for x in p2], [math.sqrt(x) for x in u2]
        out = [pn, un, [_div(u, p) for u, p in zip(un, pn, strict=True)]]
        at = self.present
        out += [
            [math.sqrt(m2[i]) for i in at],
            [_div(roots[i], count[i]) for i in at],
            [math.sqrt(vmax[i]) if vmax[i] >= 0 else math.nan for i in at],
            [_div(tiny[i], samples[i]) for i in at],
        ]
        metrics: dict[str, float] = {}
        for names, vals in zip(self.names, out, strict=True):
            metrics.update(zip(names, vals, strict=True))
        return metrics


def _div(a: float, b: float) -> float:
    """a / b as the device divides (x / 0 is inf, 0 / 0 and NaN are NaN)."""
    if b == 0.0:
        return math.nan if a == 0.0 or a != a else math.copysign(math.inf, a)
    return a / b


def _nanmax(a: float, b: float) -> float:
    """max that keeps a NaN (as torch's amax does)."""
    return b if b != b or b > a else a


class _Groups:
    """Sums and maxima of per-tensor values by layer, as one small matmul / masked max."""

    def __init__(self, layers: list[str], owner: list[int], device: torch.device) -> None:
        self.layers = layers
        onehot = torch.zeros(len(layers), len(owner), device=device)
        for j, li in enumerate(owner):
            onehot[li, j] = 1.0
        self.onehot = onehot  # (L, P)
        self.present = [li in set(owner) for li in range(len(layers))]  # host-side: no sync
        self.index = torch.tensor([i for i, k in enumerate(self.present) if k], device=device)
        self.count: torch.Tensor | None = None  # elements per layer, cached on first use
        self._sample_count: torch.Tensor | None = None

    def sample_count(self, v: list[torch.Tensor]) -> torch.Tensor:
        if self._sample_count is None:
            n = [float(_sample(x).numel()) for x in v]
            self._sample_count = self.sum(torch.tensor(n, device=self.onehot.device))
        return self._sample_count

    def names(self, stat: str) -> list[str]:
        return [M.layer(la, stat) for la, k in zip(self.layers, self.present, strict=True) if k]

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        return self.onehot @ x  # (L,)

    def max(self, x: torch.Tensor) -> torch.Tensor:
        masked = torch.where(self.onehot > 0, x.unsqueeze(0), torch.full_like(self.onehot, -1.0))
        return masked.amax(dim=1)  # (L,), values are >= 0


TINY_SAMPLE = 4096


def _sample(x: torch.Tensor) -> torch.Tensor:
    """A fixed strided sample of at most ~TINY_SAMPLE entries (a view: no copy)."""
    flat = x.view(-1)
    return flat[:: max(1, flat.numel() // TINY_SAMPLE)]


def _tiny_count(v: torch.Tensor) -> torch.Tensor:
    """Entries of v below 1e-16 in the sample: a fraction estimate at O(1) cost per tensor
    (an exact count is a full pass with a temporary, ~5% of a CPU step on a 25M model)."""
    return (_sample(v) < V_TINY).sum().float()


def _tiny_counts(vs: list[torch.Tensor], device: torch.device, index: dict) -> torch.Tensor:
    """(P,) `_tiny_count` of each tensor in a few kernels, not five per tensor (on a GPU the
    launches, not the arithmetic, were the cost): the samples concatenated, compared once and
    summed by tensor. `index` caches the tensor of each sampled entry by the samples' sizes."""
    if not vs or any(x.device != device for x in vs):
        return torch.stack([_tiny_count(x).to(device) for x in vs])  # a model over devices
    samples = [_sample(x) for x in vs]
    sizes = tuple(x.numel() for x in samples)
    owner = index.get(sizes)
    if owner is None:
        counts = torch.tensor(sizes, device=device)
        owner = index[sizes] = torch.repeat_interleave(  # its size given: no device read
            torch.arange(len(vs), device=device), counts, output_size=sum(sizes)
        )
    below = (torch.cat(samples) < V_TINY).float()
    return torch.zeros(len(vs), device=device).index_add_(0, owner, below)


# The one-pass state statistics (trainer/model/kernels/adam_state.py) run on CUDA; tests set
# this to run them through Triton's interpreter on a CPU.
ONE_PASS_OFF_GPU = False

ROOT_CHUNK = 1 << 24  # elements of sqrt(v) held at once (64 MB in fp32)


def root_sums(vs: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """(P,) sum(sqrt(v)) of each tensor (v >= 0), in fp32. A foreach norm of order 1/2 has no
    fused CUDA kernel (it launches one per tensor: 149 at 124M); sqrt then an L1 norm do, so
    sqrt(v) is taken a few tensors at a time (at most ROOT_CHUNK elements held) and summed by
    the fused L1 norm: a handful of launches, no parameter-sized temporary."""
    if not vs or any(x.device != device for x in vs):  # a model over devices: as before
        return norms(vs, device, 0.5).float().sqrt()
    out: list[torch.Tensor] = []
    chunk: list[torch.Tensor] = []
    held = 0
    for x in [*vs, None]:
        if chunk and (x is None or held + x.numel() > ROOT_CHUNK):
            roots = torch._foreach_sqrt(chunk)
            out += torch._foreach_norm(roots, 1, dtype=torch.float32)
            chunk, held = [], 0
        if x is not None:
            chunk.append(x)
            held += x.numel()
    return torch.stack(out)


class Probes:
    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        cfg: ProbesConfig,
        world: World | None = None,
        layer_of: Callable[[str], str] = layer_of,
    ) -> None:
        self.cfg = cfg
        self.world = world or World()
        self.model = model
        self.optimizer = optimizer
        own = inner_model(model).named_parameters()  # DDP's `module.` is no name of the model
        named = [(unwrapped(n), p) for n, p in own if p.requires_grad]
        self.params: list[torch.Tensor] = [p for _, p in named]
        self.layers = list(dict.fromkeys(layer_of(n) for n, _ in named))
        owner = self.owner = [self.layers.index(layer_of(n)) for n, _ in named]
        device = self.device = self.params[0].device
        self.groups = _Groups(self.layers, owner, device)
        muon = {id(p) for g in optimizer.param_groups if g.get("use_muon") for p in g["params"]}
        self.is_muon = [id(p) in muon for p in self.params]
        self.adam_groups = _Groups(
            self.layers, [o for o, m in zip(owner, self.is_muon, strict=True) if not m], device
        )
        self.muon_groups = _Groups(
            self.layers, [o for o, m in zip(owner, self.is_muon, strict=True) if m], device
        )
        self._grad_names = [M.layer(layer, M.STAT_GRAD_NORM) for layer in self.layers]
        self._prev: list[torch.Tensor] | None = None
        self._tiny_index: dict[tuple[int, ...], torch.Tensor] = {}
        self.pending: Pending | None = None
        self._early: tuple[int, HostTransfer] | None = None  # `start_pending`'s copy
        self._on_host: _StateOnHost | None = None  # the one pass's per-layer reduction
        self._one_pass: Any = None  # kernels.adam_state.AdamState, once it can take the state
        self._prepared = False  # the one pass's plan built ahead (`_prepare_one_pass`)
        self._one_pass_step: int | None = None  # the state step it takes (no parameter copy)
        # [from, to]: the state step `stagger_state` moved (saved with a checkpoint: a resume
        # or a rollback to it takes the state step where the run took it)
        self.state_moved: list[int] | None = None

    # -- which probes run ------------------------------------------------------------------
    def active(self, step: int) -> bool:
        return self.cfg.enabled and step % self.cfg.interval == 0

    def state_active(self, step: int) -> bool:
        moved = self.state_moved
        if moved is not None and step in moved:
            return step == moved[1] and self.active(step)
        return self._state_due(step)

    def _state_due(self, step: int) -> bool:
        return self.active(step) and step % (self.cfg.interval * self.cfg.state_interval) == 0

    def stagger_state(self, step: int, checkpoint_due: bool) -> None:
        """Before `step`'s update: a state step that falls on a checkpoint's step moves two
        probed steps on (past the step that reads and completes the checkpoint), so that the
        two never add up on one step of the loop thread (each is a few ms of host work;
        together they were the longest step of a run)."""
        if checkpoint_due and self._state_due(step) and self.cfg.state_interval > 2:
            # (every step or every other one: the step it would move to is a state step too)
            self.state_moved = [step, step + 2 * self.cfg.interval]

    def wants_attn_max(self, step: int) -> bool:
        return self.active(step) and self.cfg.attn_max

    def wants_logit_stats(self, step: int) -> bool:
        return self.active(step) and self.cfg.output_logits

    # -- before the transfer ---------------------------------------------------------------
    def grad_norms(self, per_tensor: torch.Tensor) -> tuple[list[str], torch.Tensor, list[int]]:
        """Per-layer grad norms as the host transfer takes them: the layers' names, the (P,)
        per-tensor norms clipping computed, and each tensor's layer. The transfer sums them by
        layer on the host when it reads the step (`HostTransfer.add_by_layer`): no device op,
        and P values more to copy (a few hundred bytes)."""
        if not self.cfg.grad_norms:
            return [], per_tensor[:0], []
        return self._grad_names, per_tensor, self.owner

    # -- around the update -----------------------------------------------------------------
    def before_update(self, step: int) -> None:
        """On a state step only: the parameters before the update (for the update norms), a
        copy held until `after_update` and then given back, never for the whole run."""
        self._prev = None
        self._one_pass_step = None
        if self.state_active(step) and self._one_pass_ready():
            self._one_pass_step = step  # after the update, from the optimizer's own arithmetic
            return
        if self.state_active(step) and self.cfg.update_norms:
            live = [local(p).detach() for p in self.params]
            self._prev = [torch.empty_like(x) for x in live]
            torch._foreach_copy_(self._prev, live)

    @torch.no_grad()
    def after_update(self, step: int, applied: bool) -> None:
        """Compute the update and optimizer-state statistics of `step`; they wait on device
        for the next host transfer."""
        prev, self._prev = self._prev, None  # parameter-sized: not kept past this step
        one_pass, self._one_pass_step = self._one_pass_step == step, None
        if one_pass and not applied:
            self._one_pass.discard()  # its checked tensors are this step's alone
        if not (self.state_active(step) and applied):
            if applied and not self._prepared:
                self._prepare_one_pass()
            return
        if one_pass:
            self.pending = self._one_pass_stats(step)
            return
        names: list[str] = []
        parts: list[torch.Tensor] = []
        if self.cfg.update_norms and prev is not None:
            p2 = norms(prev, self.device).float().square()
            torch._foreach_sub_(prev, [local(p).detach() for p in self.params])  # -(update)
            u2 = norms(prev, self.device).float().square()
            del prev
            self._update_parts(p2, u2, names, parts)
        if self.cfg.optimizer_state:
            n, v = self._optimizer_stats()
            names += n
            parts.append(v)
        if parts:
            self.pending = Pending(step, names, torch.cat(parts))

    # -- the one-pass form (trainer/model/kernels/adam_state.py) ------------------------------
    def _one_pass_ready(self) -> bool:
        """Whether this state step's statistics come from one kernel over p, m and v after the
        update (torch's Adam / AdamW, fp32 state on a GPU, both kinds of statistics on): no
        copy of the parameters, no chain of foreach ops. Else the op-by-op form."""
        cfg = self.cfg
        if not (cfg.update_norms and cfg.optimizer_state) or any(self.is_muon):
            return False
        if not (self.device.type == "cuda" or ONE_PASS_OFF_GPU):
            return False
        from spikewatch.trainer.model.kernels.adam_state import AdamState  # imports Triton

        if self._one_pass is None:
            optimizer = inner_optimizer(self.optimizer)
            if AdamState.optimizer_refusal(optimizer) is not None:
                self._one_pass = False
                return False
            self._one_pass = AdamState(self.params, optimizer, local)
        return bool(self._one_pass) and self._one_pass.refusal() is None

    def _prepare_one_pass(self) -> None:
        """Once, on the first step that is not a state step after the optimizer's state exists:
        what the first state step would otherwise build on top of its own work (the one pass's
        chunk plan and its per-layer names and sample sizes: ~5 ms of host at 124M on meta)."""
        if not self.cfg.enabled:
            self._prepared = True  # nothing to prepare, ever
            return
        if not inner_optimizer(self.optimizer).state:
            return
        self._prepared = True
        if self._one_pass_ready():
            self._one_pass.prepare()
            if self._on_host is None:
                self._on_host = _StateOnHost(self)

    def _one_pass_stats(self, step: int) -> Pending:
        """The same statistics as the op-by-op form, in the same order: the one pass's
        per-tensor sums (summed over shards under FSDP2) go to the host as they are, and the
        host makes the per-layer statistics from them (`_StateOnHost`, float64) when the
        transfer is read, where a chain of ~25 small device ops ran on the loop thread."""
        per = self._one_pass(V_TINY)
        if self._on_host is None:
            self._on_host = _StateOnHost(self)
        w = self.world
        summed = w.sum_shards(torch.cat((per["sums"].flatten(), self._on_host.samples)))
        values = torch.cat((summed, w.max_shards(per["v_max"])))
        return Pending(step, [], values, self._on_host)

    # -- per-tensor values to per-layer statistics (both forms) ------------------------------
    def _update_parts(
        self, p2: torch.Tensor, u2: torch.Tensor, names: list[str], parts: list[torch.Tensor]
    ) -> None:
        """Per layer ||p||, ||update|| and their ratio from each tensor's squared norms."""
        w = self.world
        pn = w.sum_shards(self.groups.sum(p2)).sqrt()
        un = w.sum_shards(self.groups.sum(u2)).sqrt()
        for stat, v in ((M.STAT_PARAM_NORM, pn), (M.STAT_UPDATE_NORM, un),
                        (M.STAT_UPDATE_RATIO, un / pn)):  # fmt: skip
            names += [M.layer(layer, stat) for layer in self.layers]
            parts.append(v)

    def _adam_parts(
        self,
        v: list[torch.Tensor],
        m2: torch.Tensor,
        roots: torch.Tensor,
        vmax: torch.Tensor,
        tiny: torch.Tensor,
        names: list[str],
        parts: list[torch.Tensor],
    ) -> None:
        """Per layer ||m||, mean and max sqrt(v), the fraction of v below 1e-16, from each
        tensor's squared m norm, sum of sqrt(v), max v and sampled count (`v`: the tensors, for
        their sizes)."""
        g, w = self.adam_groups, self.world
        if g.count is None:
            n = torch.tensor([float(x.numel()) for x in v], device=self.device)
            g.count = w.sum_shards(g.sum(n))
        m_norm = w.sum_shards(g.sum(m2)).sqrt()
        mean = w.sum_shards(g.sum(roots)) / g.count
        v_max = w.max_shards(g.max(vmax.float().sqrt()))
        frac = w.sum_shards(g.sum(tiny)) / w.sum_shards(g.sample_count(v))
        for stat, val in (
            (M.STAT_ADAM_M_NORM, m_norm),
            (M.STAT_ADAM_SQRT_V_MEAN, mean),
            (M.STAT_ADAM_SQRT_V_MAX, v_max),
            (M.STAT_ADAM_V_TINY_FRAC, frac),
        ):
            names += g.names(stat)
            parts.append(val[g.index])

    def _norm(self, g: _Groups, xs: list[torch.Tensor]) -> torch.Tensor:
        """Per-layer L2 norm: squares summed by layer (and over shards), then the root."""
        return self.world.sum_shards(g.sum(norms(xs, self.device).float().square())).sqrt()

    def _optimizer_stats(self) -> tuple[list[str], torch.Tensor]:
        state = self.optimizer.state
        adam = [p for p, m in zip(self.params, self.is_muon, strict=True) if not m]
        muon = [p for p, m in zip(self.params, self.is_muon, strict=True) if m]
        names: list[str] = []
        parts: list[torch.Tensor] = []
        if adam and all("exp_avg" in state[p] for p in adam):
            m = [local(state[p]["exp_avg"]) for p in adam]
            v = [local(state[p]["exp_avg_sq"]) for p in adam]
            m2 = norms(m, self.device).float().square()
            roots = root_sums(v, self.device)  # sum(sqrt(v)) per tensor
            tiny = _tiny_counts(v, self.device, self._tiny_index)
            self._adam_parts(v, m2, roots, maxima(v, self.device), tiny, names, parts)
        if muon and all("momentum_buffer" in state[p] for p in muon):
            g = self.muon_groups
            buf = [local(state[p]["momentum_buffer"]) for p in muon]
            norm = self._norm(g, buf)
            names += g.names(M.STAT_MUON_MOMENTUM_NORM)
            parts.append(norm[g.index])
        return names, (torch.cat(parts) if parts else torch.zeros(0, device=self.device))

    def take_pending(self) -> Pending | None:
        out, self.pending = self.pending, None
        return out

    def start_pending(self) -> None:
        """Enqueue the waiting statistics' copy to the host now (no wait), apart from the next
        step's transfer: before a drain, whose one wait then covers it, or for a disk save of
        a step in flight, which emits them once that step is read. `take_pending_metrics`
        then waits for nothing."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            xfer = HostTransfer()
            pending.into(xfer)
            xfer.start()
            self._early = (pending.step, xfer)

    def discard_pending(self) -> None:
        """The waiting statistics belong to an abandoned branch: never emitted."""
        self.pending = self._early = None

    def take_pending_metrics(self, early_only: bool = False) -> tuple[int, dict[str, float]] | None:
        """The waiting statistics as host values, (step, {name: value}), oldest first: those
        `start_pending` copied early (no wait), else (unless `early_only`) the ones waiting for
        the next transfer (one sync), for the moments when they cannot ride it (a checkpoint,
        the end)."""
        early, self._early = self._early, None
        if early is not None:
            return early[0], early[1].fetch()[0]
        pending = None if early_only else self.take_pending()
        if pending is None:
            return None
        return pending.step, pending.metrics(pending.values.tolist())  # (one sync)
