"""A GPT whose stability fixes are config switches.

RoPE, RMSNorm, SwiGLU, no biases. Switches: QK-norm, z-loss (PaLM: coef * mean log^2 Z),
attention and final-logit soft-caps (Gemma 2: c*tanh(x/c)), norm placement ("pre", or OLMo 2's
"reordered" x + norm(f(x))), tied embeddings, init std. q, k and v are separate projections so
that Muon orthogonalises each and QK-Clip can rescale one head's rows of W_q and W_k.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn as nn
import torch.nn.functional as F

from spikewatch.trainer.config import ModelConfig
from spikewatch.trainer.model.attention import attention

__all__ = ["GPT", "ModelOutput", "build_model", "param_kind"]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.size(-1),), self.weight, self.eps)


def rope_tables(head_dim: int, max_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    ang = torch.outer(torch.arange(max_len, dtype=torch.float64), inv)  # (L, hs/2)
    return ang.cos().float(), ang.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, nh, T, hs); cos, sin: (T, hs/2). Rotates the two halves (GPT-NeoX layout)."""
    h = x.size(-1) // 2
    x1, x2 = x[..., :h], x[..., h:]
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d, self.n_head = cfg.d_model, cfg.n_head
        self.head_dim = d // cfg.n_head
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, d, bias=False)
        self.v_proj = nn.Linear(d, d, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.softcap = cfg.attn_softcap
        self.chunk = cfg.attn_chunk

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: str, need_max: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        B, T, C = x.shape
        shape = (B, T, self.n_head, self.head_dim)
        q = self.q_proj(x).view(shape).transpose(1, 2)  # (B, nh, T, hs)
        k = self.k_proj(x).view(shape).transpose(1, 2)
        v = self.v_proj(x).view(shape).transpose(1, 2)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y, mx = attention(
            q, k, v, backend=backend, softcap=self.softcap, need_max=need_max, chunk=self.chunk
        )
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.o_proj(y), mx


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        hidden = 8 * math.ceil(cfg.mlp_ratio * cfg.d_model * 2 / 3 / 8)
        self.gate_proj = nn.Linear(cfg.d_model, hidden, bias=False)
        self.up_proj = nn.Linear(cfg.d_model, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.reordered = cfg.norm_placement == "reordered"
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: str, need_max: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.reordered:
            a, mx = self.attn(x, cos, sin, backend, need_max)
            x = x + self.attn_norm(a)
            return x + self.mlp_norm(self.mlp(x)), mx
        a, mx = self.attn(self.attn_norm(x), cos, sin, backend, need_max)
        x = x + a
        return x + self.mlp(self.mlp_norm(x)), mx


@dataclass
class ModelOutput:
    loss: torch.Tensor  # () ce + z-loss term, what backward sees
    ce: torch.Tensor  # () cross-entropy, detached
    z_mean: torch.Tensor | None  # () mean log-sum-exp of the logits, detached
    logit_max: torch.Tensor | None  # () max output logit, detached
    attn_max: torch.Tensor | None  # (L, nh) max pre-softmax logit per layer and head
    logits: torch.Tensor  # (B, T, V)


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm_f = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        cos, sin = rope_tables(cfg.d_model // cfg.n_head, cfg.max_seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def backend(self, need_max: bool) -> str:
        """The attention backend for this forward. 'auto': SDPA (flash on a GPU), with the max
        logit, when needed, from the fused max pass on CUDA (one q k^T kernel, exact: measured
        faster than the fused Triton attention, whose maximum comes free but whose forward and
        backward run 1.8-3.7x SDPA flash's on an H200; docs/gpu.md) or a separate score pass on
        a CPU; 'chunked' when an attention soft-cap must be applied. `need_max` does not change
        the choice: a probed step trains with the same arithmetic as an unprobed one."""
        if self.cfg.attention != "auto":
            return self.cfg.attention
        if self.cfg.attn_softcap is not None:
            return "chunked"
        return "sdpa"

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor,
        *,
        need_attn_max: bool = False,
        need_logit_stats: bool = False,
    ) -> ModelOutput:
        """idx, targets: (B, T) int64."""
        T = idx.size(1)
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]  # type: ignore[index]
        backend = self.backend(need_attn_max)
        x = self.wte(idx)  # (B, T, C)
        maxes = []
        for block in self.blocks:
            x, mx = block(x, cos, sin, backend, need_attn_max)
            if mx is not None:
                maxes.append(mx.amax(dim=0))  # (nh,)
        logits = self.lm_head(self.norm_f(x))  # (B, T, V)
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()  # the loss in fp32 under autocast
        if self.cfg.final_softcap is not None:
            c = self.cfg.final_softcap
            logits = c * torch.tanh(logits / c)
        # log_softmax + nll_loss is what cross_entropy runs inside; keeping logp exposes the
        # log-partition for free: lse = x_0 - logp_0, an O(B*T) op instead of O(B*T*V).
        logp = F.log_softmax(logits, dim=-1)  # (B, T, V)
        ce = F.nll_loss(logp.view(-1, logp.size(-1)), targets.reshape(-1))
        loss, z_mean, logit_max = ce, None, None
        if self.cfg.z_loss is not None:
            lse = logits[..., 0] - logp[..., 0]  # (B, T)
            loss = ce + self.cfg.z_loss * lse.square().mean()
            z_mean = lse.detach().mean()
        if need_logit_stats:
            with torch.no_grad():
                if z_mean is None:
                    z_mean = (logits[..., 0] - logp[..., 0]).mean()
                logit_max = logits.amax()
        return ModelOutput(
            loss=loss,
            ce=ce.detach(),
            z_mean=z_mean,
            logit_max=logit_max,
            attn_max=torch.stack(maxes) if maxes else None,
            logits=logits,
        )

    def attention_modules(self) -> list[Attention]:
        return [cast(Attention, b.attn) for b in self.blocks]


def param_kind(name: str, p: torch.Tensor) -> str:
    """'embedding' | 'head' | 'matrix' (2-D hidden weights, Muon's) | 'gain' (norms)."""
    if name.startswith("wte."):
        return "embedding"
    if name.startswith("lm_head."):
        return "head"
    return "matrix" if p.ndim == 2 else "gain"


def _init_weights(model: GPT, cfg: ModelConfig) -> None:
    resid_std = cfg.init_std / math.sqrt(2 * cfg.n_layer)
    for name, p in model.named_parameters():
        if p.ndim < 2:
            continue
        std = resid_std if name.endswith(("o_proj.weight", "down_proj.weight")) else cfg.init_std
        nn.init.normal_(p, mean=0.0, std=std)


def build_model(cfg: ModelConfig, seed: int, device: torch.device | str = "cpu") -> GPT:
    """A freshly initialised GPT; the init is a pure function of (cfg, seed)."""
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    model = GPT(cfg)
    _init_weights(model, cfg)
    torch.random.set_rng_state(gen_state)
    return model.to(device)
