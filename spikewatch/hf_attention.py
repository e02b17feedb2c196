"""transformers' attention through spikewatch's recording function: per-head attention maxima
for any Hugging Face model whose `attn_implementation` is "sdpa" or "eager".

`register_attention()` registers `attn_implementation="spikewatch"` (SDPA, or the fused Triton
kernel on CUDA, plus the max pre-softmax logit per head, grouped-query attention included);
`attach_attention(model, rec)` switches a model to it and tells its attention modules where to
record. Used by the Trainer callback (spikewatch/hf.py), the Lightning callback and the Watch in
one's own loop (a Hugging Face model records its maxima without being asked). No Trainer, no
Watch here: importing this module imports neither.
"""

from __future__ import annotations

import logging
from typing import Any, cast

import torch

from spikewatch.trainer.model.attn_max import AttnMax

__all__ = ["ATTN_IMPLEMENTATION", "attach_attention", "attach_within", "register_attention"]

log = logging.getLogger(__name__)

ATTN_IMPLEMENTATION = "spikewatch"


def _attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # (B, H, T, D)
    key: torch.Tensor,  # (B, Hkv, S, D)
    value: torch.Tensor,  # (B, Hkv, S, D)
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """SDPA (or the fused Triton kernel) and, on probed training steps, the per-head max
    pre-softmax logit recorded into the Watch's `AttnMax` for `module.layer_idx`."""
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

    rec: AttnMax | None = getattr(module, "_spikewatch_attn", None)
    n_rep = query.size(1) // key.size(1)
    softcap = kwargs.get("softcap")
    causal = attention_mask is None and bool(
        kwargs.get("is_causal", getattr(module, "is_causal", True))
    )
    if rec is not None and module.training:
        if torch.compiler.is_compiling():  # one graph, probed or not (trainer/model/attn_max.py)
            rec.record_logits(
                _layer(module),
                query,
                key,
                causal=causal,
                mask=attention_mask,
                scale=scaling,
                n_rep=n_rep,
            )
        elif rec.active:
            return _recording(module, rec, query, key, value, attention_mask, dropout, scaling,
                              causal, **kwargs)  # fmt: skip
    if softcap is not None:  # Gemma 2's soft-capped logits: SDPA has no soft-cap
        k, v = repeat_kv(key, n_rep), repeat_kv(value, n_rep)
        return _eager(module, query, k, v, attention_mask, dropout, scaling, softcap, causal)
    return sdpa_attention_forward(
        module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
    )


def _recording(
    module: torch.nn.Module,
    rec: AttnMax,
    query: torch.Tensor,  # (B, H, T, D)
    key: torch.Tensor,  # (B, Hkv, S, D)
    value: torch.Tensor,  # (B, Hkv, S, D)
    attention_mask: torch.Tensor | None,
    dropout: float,
    scaling: float | None,
    causal: bool,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A probed eager step: the maxima (the fused max pass on a GPU, grouped-query keys
    shared; a separate score pass elsewhere), then the model's own attention."""
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

    softcap = kwargs.get("softcap")
    n_rep = query.size(1) // key.size(1)
    layer = _layer(module)
    rec.record_logits(
        layer, query, key, causal=causal, mask=attention_mask, scale=scaling, n_rep=n_rep
    )
    if softcap is not None:
        keys, values = repeat_kv(key, n_rep), repeat_kv(value, n_rep)
        return _eager(
            module, query, keys, values, attention_mask, dropout, scaling, softcap, causal
        )
    return sdpa_attention_forward(
        module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
    )


def _eager(
    module: torch.nn.Module,
    q: torch.Tensor,  # (B, H, T, D)
    k: torch.Tensor,  # (B, H, S, D), repeated for grouped-query attention
    v: torch.Tensor,  # (B, H, S, D)
    mask: torch.Tensor | None,
    dropout: float,
    scaling: float | None,
    softcap: float,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The eager attention of soft-capping models (Gemma 2): tanh soft-cap, mask, softmax."""
    scale = q.size(-1) ** -0.5 if scaling is None else scaling
    w = softcap * torch.tanh((q @ k.transpose(-2, -1)) * scale / softcap)  # (B, H, T, S)
    if mask is not None:
        w = w.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else w + mask
    elif causal:
        T, S = w.shape[-2:]
        w = w.masked_fill(
            torch.ones(T, S, dtype=torch.bool, device=w.device).triu(S - T + 1), float("-inf")
        )
    p = torch.nn.functional.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
    p = torch.nn.functional.dropout(p, p=dropout, training=module.training)
    return (p @ v).transpose(1, 2).contiguous(), p


def _layer(module: torch.nn.Module) -> int:
    return int(cast(int, module.layer_idx))


def register_attention() -> None:
    """Register `attn_implementation="spikewatch"` (and its mask, SDPA's) with transformers."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(ATTN_IMPLEMENTATION, _attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_IMPLEMENTATION, sdpa_mask)


def attach_attention(model: torch.nn.Module, rec: AttnMax) -> int:
    """Route `model`'s attention through the recording function; returns the number of
    attention modules that will record (0 when the model uses another implementation)."""
    config = getattr(model, "config", None)
    impl = getattr(config, "_attn_implementation", None)
    name = type(model).__name__
    if impl not in (ATTN_IMPLEMENTATION, "sdpa", "eager"):
        log.warning(
            "%s: per-head attention maxima not recorded: it uses attn_implementation=%r, and "
            "spikewatch records them in its own attention function, which stands in for "
            "'sdpa' or 'eager' (load the model with one of those)",
            name,
            impl,
        )
        return 0
    register_attention()
    if impl != ATTN_IMPLEMENTATION:
        try:
            cast(Any, model).set_attn_implementation(ATTN_IMPLEMENTATION)
        except (ValueError, NotImplementedError, AttributeError) as e:
            log.warning("%s: per-head attention maxima not recorded: %s", name, e)
            return 0
    modules = [m for m in model.modules() if _is_self_attention(m)]
    for m in modules:
        m.__dict__["_spikewatch_attn"] = rec  # a plain attribute (nn.Module's setattr agrees)
    heads = getattr(config, "num_attention_heads", None)
    if modules and rec.reserved is None and isinstance(heads, int) and heads > 0:
        # the maxima's (layers, heads) table: the fused pass writes each layer's row in place
        rec.reserve(max(int(cast(Any, m).layer_idx) for m in modules) + 1, heads)
    if not modules:
        log.warning(
            "%s: per-head attention maxima not recorded: no self-attention module with a "
            "layer_idx (transformers' attention interface) was found",
            name,
        )
    return len(modules)


def attach_within(module: torch.nn.Module, rec: AttnMax) -> tuple[str, int] | None:
    """`attach_attention` on the Hugging Face model inside `module` (a LightningModule's, or the
    user's own model under DDP): (its class, the attention modules that will record), or None
    when there is none."""
    for m in module.modules():
        if hasattr(m, "set_attn_implementation") and hasattr(m, "config"):
            return type(m).__name__, attach_attention(m, rec)
    return None


def _is_self_attention(m: torch.nn.Module) -> bool:
    """A decoder's attention module as transformers writes them (LlamaAttention,
    GPT2Attention, ...): numbered by `layer_idx`; cross-attention is left out."""
    return (
        isinstance(getattr(m, "layer_idx", None), int)
        and type(m).__name__.endswith("Attention")
        and not getattr(m, "is_cross_attention", False)
    )
