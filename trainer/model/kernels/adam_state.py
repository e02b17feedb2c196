"""Adam's state statistics of a state step in one pass: no parameter copy, no foreach chain.

The probes' state step (trainer/core/probes.py) reports per layer ||p|| and ||update|| (the
parameters before the update, and the update itself), ||m||, mean sqrt(v), max v and the
fraction of v below 1e-16. Done op by op, that took a copy of every parameter before the update
(345 MB at 124M), two norms and a subtract over the copy, a sqrt of v, and a `cat` of strided
samples: ~3.8 GB moved and ~196 kernels on a GPU, about 37 ms of its state step on an H200.

Here one kernel reads p (after the update), m and v once each (~1 GB at 124M) and, from torch's
Adam / AdamW arithmetic, recovers the update and the parameters before it: with
a = (lr / (1 - b1^t)) * m / (sqrt(v) / sqrt(1 - b2^t) + eps) the Adam part of the step and
d = lr * weight_decay for AdamW (0 for Adam, whose L2 decay is inside m),
    p_after = p_before * (1 - d) - a,   so   p_before = (p_after + a) / (1 - d),
    update = p_after - p_before = -d * p_before - a.
That is the update the kernel applied before rounding; the difference of two fp32 tensors that
the op-by-op path took is that plus each element's rounding (half an ulp of p), so the two agree
to float tolerance where the update is not far below p's ulp (tests/trainer/test_adam_state.py).

A grid of chunks over every tensor (their addresses in a table: one launch for the model); each
chunk writes its partial sums and maximum, and a fixed matrix built once per shape reduces them
per tensor, in a fixed order (no atomics: the same values every run). The v-below-1e-16 count is
of the entries today's sample takes (every `max(1, numel // 4096)`-th), so the fraction is the
same estimate.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable

import torch
import triton
import triton.language as tl
from torch.distributed.tensor import DTensor

__all__ = ["AdamState", "COLUMNS"]

# the partials' columns: sum of p_before^2, update^2, m^2, sqrt(v); max v; sampled v < 1e-16
COLUMNS = ("p2", "u2", "m2", "root_v", "v_max", "tiny")
CHUNK = 1 << 16  # elements a program reduces
BLOCK = 1024  # elements a program loads at once (the interpreter too: numpy-vectorised)


@triton.jit
def _one_minus_exp(x):
    """1 - exp(x) for x <= 0 in float32, without the cancellation near 0 (1 - b^t at t = 1 with
    b = 0.999 is 1e-3): a series where |x| < 0.01 (its error ~x^4 / 120), else 1 - exp(x)."""
    series = -x * (1.0 + x * (0.5 + x * (1.0 / 6.0 + x * (1.0 / 24.0))))
    return tl.where(x > -0.01, series, 1.0 - tl.exp(x))


@triton.jit
def _adam_state_kernel(
    P, M, V, STEP, TENSOR, START, NUMEL, GROUP, HYPER, STRIDE, OUT, tiny,
    CHUNK: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    c = tl.program_id(0)
    t = tl.load(TENSOR + c)
    start = tl.load(START + c)
    numel = tl.load(NUMEL + t)
    end = tl.minimum(start + CHUNK, numel)
    p_ptr = tl.load(P + t).to(tl.pointer_type(tl.float32))
    m_ptr = tl.load(M + t).to(tl.pointer_type(tl.float32))
    v_ptr = tl.load(V + t).to(tl.pointer_type(tl.float32))
    # the optimizer's own step count, read where it lives (the fused optimizer's device scalar):
    # the bias corrections are made here, not by a stack and a chain of ops on the loop thread
    count = tl.load(tl.load(STEP + t).to(tl.pointer_type(tl.float32)))
    hyper = HYPER + tl.load(GROUP + t) * 5  # the tensor's param group's
    lr = tl.load(hyper)
    step_size = lr / _one_minus_exp(count * tl.load(hyper + 1))  # lr / (1 - b1^t)
    bc2s = tl.sqrt(_one_minus_exp(count * tl.load(hyper + 2)))  # sqrt(1 - b2^t)
    eps = tl.load(hyper + 3)
    decay = tl.load(hyper + 4)  # lr * weight_decay (AdamW), 0 (Adam)
    stride = tl.load(STRIDE + t)
    p2 = tl.zeros([BLOCK], tl.float32)
    u2 = tl.zeros([BLOCK], tl.float32)
    m2 = tl.zeros([BLOCK], tl.float32)
    rv = tl.zeros([BLOCK], tl.float32)
    vmax = tl.zeros([BLOCK], tl.float32)
    few = tl.zeros([BLOCK], tl.float32)
    for s in range(0, CHUNK, BLOCK):
        offs = start + s + tl.arange(0, BLOCK)
        mask = offs < end
        p = tl.load(p_ptr + offs, mask=mask, other=0.0)
        m = tl.load(m_ptr + offs, mask=mask, other=0.0)
        v = tl.load(v_ptr + offs, mask=mask, other=0.0)
        root = tl.sqrt(v)
        a = step_size * m / (root / bc2s + eps)
        before = (p + a) / (1.0 - decay)
        update = -decay * before - a
        p2 += before * before
        u2 += update * update
        m2 += m * m
        rv += root
        vmax = tl.maximum(vmax, v)
        sampled = mask & ((offs % stride) == 0) & (v < tiny)
        few += tl.where(sampled, 1.0, 0.0)
    out = OUT + c * 6
    tl.store(out, tl.sum(p2, 0))
    tl.store(out + 1, tl.sum(u2, 0))
    tl.store(out + 2, tl.sum(m2, 0))
    tl.store(out + 3, tl.sum(rv, 0))
    tl.store(out + 4, tl.max(vmax, 0))
    tl.store(out + 5, tl.sum(few, 0))


_dtype = operator.attrgetter("dtype")
_device = operator.attrgetter("device")


def _host_to(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list on `device` without a wait (pinned, copied asynchronously on CUDA)."""
    host = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def _log(beta: float) -> float:
    """ln beta for the kernel's b^t = exp(t ln b); a beta of 0 is -inf (b^t = 0)."""
    beta = float(beta)
    return math.log(beta) if beta > 0 else -math.inf


class _Columns(dict[str, torch.Tensor]):
    """`sums` and `v_max`, and each column of `sums` by name when asked for (the probes take
    `sums` whole: a slice each was five more dispatches a state step on the loop thread)."""

    COLUMNS = {"p2": 0, "u2": 1, "m2": 2, "root_v": 3, "tiny": 5}

    def __missing__(self, key: str) -> torch.Tensor:
        if key not in self.COLUMNS:
            raise KeyError(key)
        return self["sums"][:, self.COLUMNS[key]]


class AdamState:
    """The per-tensor statistics of torch's Adam / AdamW state after an applied update, in one
    launch. Built once per (parameters, optimizer); `refusal` says why it cannot take them."""

    def __init__(
        self,
        params: list[torch.Tensor],
        optimizer: torch.optim.Optimizer,
        local: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
    ) -> None:
        """`params`: the optimizer's parameters (its state's keys); `local`: a tensor's own
        part on this rank (a DTensor's local shard)."""
        self.params = params
        self.optimizer = optimizer
        self.local = local
        self.decoupled = type(optimizer) is torch.optim.AdamW
        self._group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
        self._shape: tuple | None = None
        self._plan: tuple[torch.Tensor, ...] = ()
        self._group_index: list[int] = []  # each tensor's param group
        self._step_values: torch.Tensor | None = None  # the step counts, where not on the device
        self._checked: tuple[list[torch.Tensor], ...] | None = None  # `refusal`'s tensors
        # DTensor parameters (FSDP2): their state is too; each read through `local`
        self._sharded = any(isinstance(p, DTensor) for p in params)
        # the tensors' addresses as last copied to the device (Adam updates its state in
        # place: the same addresses each state step, so the copy is made once), and that copy
        self._addresses: list[int] = []
        self._address_rows: tuple[torch.Tensor, ...] = ()

    @staticmethod
    def optimizer_refusal(optimizer: torch.optim.Optimizer) -> str | None:
        if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
            return f"{type(optimizer).__name__} is not torch's Adam or AdamW"
        for g in optimizer.param_groups:
            if g.get("amsgrad") or g.get("differentiable"):
                return "amsgrad or differentiable Adam"
            if torch.is_tensor(g["lr"]) and g["lr"].device.type != "cpu":
                return "a learning rate held on the device (reading it would wait)"
        return None

    def refusal(self) -> str | None:
        """Why the one pass cannot take the state as it is now (None: it can). The checks run
        over lists of the tensors (a few C-level passes, not a Python loop over ~450 of them
        on the loop thread at every state step)."""
        why = self.optimizer_refusal(self.optimizer)
        if why is not None:
            return why
        states = list(map(self.optimizer.state.get, self.params))
        try:
            ps = list(self.params)
            ms = [s["exp_avg"] for s in states]  # type: ignore[index]
            vs = [s["exp_avg_sq"] for s in states]  # type: ignore[index]
            _ = [s["step"] for s in states]  # type: ignore[index]  # (a step count each)
        except (KeyError, TypeError):  # no state, or not Adam's all of it
            return "a parameter without Adam's state yet"
        if self._sharded:
            ps, ms, vs = (list(map(self.local, xs)) for xs in (ps, ms, vs))
        every = ps + ms + vs
        device = ps[0].device
        if (
            set(map(_dtype, every)) != {torch.float32}
            or set(map(_device, every)) != {device}
            or not all(map(torch.Tensor.is_contiguous, every))
        ):
            return "state that is not contiguous float32 on one device"
        # the tensors as checked, for this state step's pass after the update (Adam updates
        # its state in place: the same tensors), so that it walks them no second time
        self._checked = (ps, ms, vs)
        return None

    def discard(self) -> None:
        """The state step whose tensors `refusal` checked takes no pass (its update refused)."""
        self._checked = None

    def prepare(self) -> None:
        """Build the chunk plan ahead (once a shape), on a step with nothing else to do."""
        self._plan_for(self.local(self.params[0]).device)

    def _plan_for(
        self, device: torch.device, ps: list[torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, ...]:
        numel = [p.numel() for p in (ps if ps is not None else map(self.local, self.params))]
        shape = (tuple(numel), device)
        if self._shape != shape:
            tensor, start = [], []
            for i, n in enumerate(numel):
                for s in range(0, max(n, 1), CHUNK):
                    tensor.append(i)
                    start.append(s)
            owner = torch.tensor(tensor)
            onehot = torch.zeros(len(numel), len(tensor))
            onehot[owner, torch.arange(len(tensor))] = 1.0
            stride = [max(1, n // 4096) for n in numel]  # probes.TINY_SAMPLE's stride
            index = {id(g): i for i, g in enumerate(self.optimizer.param_groups)}
            self._group_index = [index[id(self._group_of[id(p)])] for p in self.params]
            self._plan = (
                torch.tensor(self._group_index, dtype=torch.int64, device=device),
                owner.to(device),
                torch.tensor(start, dtype=torch.int64, device=device),
                torch.tensor(numel, dtype=torch.int64, device=device),
                torch.tensor(stride, dtype=torch.int64, device=device),
                onehot.to(device),  # (P, C): chunk partials summed per tensor
                onehot.to(device) > 0,
            )
            self._shape = shape
        return self._plan

    def _step_addresses(self, device: torch.device) -> list[int]:
        """Where the kernel reads each tensor's step count: the optimizer's own float32
        scalars where they live on the device (the fused and capturable forms: updated in place,
        no copy), else a (P,) copy of them on the device (a host count, or another dtype; no
        wait either way), held until the next call so the kernel reads it."""
        state = self.optimizer.state
        steps = [state[p]["step"] for p in self.params]
        if all(
            torch.is_tensor(x) and x.device == device and x.dtype == torch.float32 for x in steps
        ):
            return [x.data_ptr() for x in steps]
        if all(torch.is_tensor(x) and x.device == device for x in steps):
            values = torch.stack(steps).float()
        else:
            values = _host_to([float(x) for x in steps], torch.float32, device)
        self._step_values = values
        return [values.data_ptr() + 4 * i for i in range(len(steps))]

    def _addresses_of(
        self,
        device: torch.device,
        ps: list[torch.Tensor],
        ms: list[torch.Tensor],
        vs: list[torch.Tensor],
    ) -> tuple[torch.Tensor, ...]:
        """The kernel's table of where p, m, v and each step count live, (4, P) on the device:
        copied there only when an address moved (the kernel reads what is at each address
        when it runs, so an unchanged table is the right one)."""
        at = [
            *map(torch.Tensor.data_ptr, ps),
            *map(torch.Tensor.data_ptr, ms),
            *map(torch.Tensor.data_ptr, vs),
            *self._step_addresses(device),
        ]
        rows = self._address_rows
        if at != self._addresses or not rows or rows[0].device != device:
            table = _host_to(at, torch.int64, device).view(4, len(ps))
            self._address_rows = rows = tuple(table.unbind(0))
            self._addresses = at
        return rows

    @torch.no_grad()
    def __call__(self, tiny: float) -> dict[str, torch.Tensor]:
        """(P,) per tensor: p2, u2, m2, root_v (sums), v_max, tiny (the sampled count)."""
        checked, self._checked = self._checked, None
        if checked is None:  # not checked this step (a direct call): check now
            if (why := self.refusal()) is not None:
                raise ValueError(f"the one pass cannot take this optimizer's state: {why}")
            checked, self._checked = self._checked, None
        assert checked is not None
        ps, ms, vs = checked  # (their addresses alone are read: no detach needed)
        device = ps[0].device
        group, owner, start, numel, stride, onehot, member = self._plan_for(device, ps)
        hyper = _host_to(  # per group: lr, ln b1, ln b2, eps, decoupled decay (no device read)
            [[float(g["lr"]), _log(g["betas"][0]), _log(g["betas"][1]), float(g["eps"]),
              float(g["lr"]) * float(g["weight_decay"]) if self.decoupled else 0.0]
             for g in self.optimizer.param_groups],
            torch.float32,
            device,
        )  # fmt: skip
        p_at, m_at, v_at, step_at = self._addresses_of(device, ps, ms, vs)
        partial = torch.empty(owner.numel(), 6, device=device, dtype=torch.float32)
        _adam_state_kernel[(owner.numel(),)](
            p_at, m_at, v_at, step_at, owner, start, numel, group, hyper, stride, partial,
            float(tiny), CHUNK=CHUNK, BLOCK=BLOCK, num_warps=4, num_stages=1,
        )  # fmt: skip
        sums = onehot @ partial  # (P, 6), a fixed order
        vmax = torch.where(member, partial[:, 4].unsqueeze(0), 0.0).amax(dim=1)
        return _Columns(sums=sums, v_max=vmax)  # (P, 6): column 4 is no statistic
