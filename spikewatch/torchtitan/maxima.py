"""The per-head attention maxima of a torchtitan model's inner attention modules.

Two ways in, chosen per module when the Watch opens:
- **FlexAttention, on a device whose Flex kernel gives its maxima** (CUDA): the module's forward
  asks Flex for them (`return_aux=AuxRequest(max_scores=True)`, as torchtitan's QK-clip does):
  the kernel that computes the attention writes each query row's maximum score as it goes, with
  the block mask applied (a packed batch's documents, a sliding window), so no second pass over
  q and k is launched. The maxima (B, H, L) go into the recorder's (layers, heads) table, in the
  compiled graph itself; torchtitan's forward is otherwise its own (the same call, the same
  transposes, the same `out_transform`).
- **Any other inner attention** (SDPA, varlen; Flex on a CPU, whose Flex has no maxima): a
  forward pre-hook gives q and k to `AttnMax.record_logits`, which computes the causal maxima in
  a pass of its own (a packed batch's document masks are not applied there: an upper bound).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch

from spikewatch.trainer.model.attn_max import AttnMax

__all__ = ["attach_inner_attention"]

log = logging.getLogger(__name__)

SUFFIX = "attention.inner_attention"


def _flex_class() -> type | None:
    try:
        from torchtitan.models.common.attention import FlexAttention
    except ImportError:  # another torchtitan: the pre-hook serves every module
        return None
    return FlexAttention


def flex_gives_maxima(device: torch.device) -> bool:
    """Whether Flex computes its maxima on `device` (torch 2.13: not on a CPU or MPS)."""
    return device.type not in ("cpu", "mps", "meta")


def attach_inner_attention(
    model: torch.nn.Module, rec: AttnMax, *, flex_maxima: bool | None = None
) -> int:
    """Record each `...attention.inner_attention` module's per-head maxima (layer = the block's
    index). `flex_maxima`: take a FlexAttention module's from its own kernel (None: where the
    model's device gives them). Returns the modules hooked."""
    flex = _flex_class()
    if flex_maxima is None:
        param = next(model.parameters(), None)
        flex_maxima = param is not None and flex_gives_maxima(param.device)
    found = []
    for name, module in model.named_modules():
        if not name.endswith(SUFFIX):
            continue
        numbered = [int(part) for part in name.split(".") if part.isdigit()]
        if numbered:  # the block's index, as the probes number layers
            found.append((name, numbered[0], module))
    if not found:
        log.warning("torchtitan model: no inner attention module found, no attention maxima")
        return 0
    by_flex = flex is not None and flex_maxima and all(isinstance(m, flex) for _, _, m in found)
    if by_flex:
        heads = {getattr(model.get_submodule(n[: -len(".inner_attention")]), "n_heads", None)
                 for n, _, _ in found}  # fmt: skip
        if len(heads) == 1 and isinstance(h := heads.pop(), int) and rec.reserved is None:
            rec.reserve(max(layer for _, layer, _ in found) + 1, h)  # a head count per rank
            # that differs (tensor parallel) does not fit the table: recorded beside it
    for _, layer, module in found:
        if by_flex:
            module.forward = _flex_forward(module, rec, layer)
        else:
            module.register_forward_pre_hook(_pre_hook(rec, layer), with_kwargs=True)
    log.info(
        "torchtitan model: attention maxima of %d layers %s",
        len(found),
        "from FlexAttention's own kernel" if by_flex else "in a pass of their own (causal)",
    )
    return len(found)


def _pre_hook(rec: AttnMax, layer: int) -> Any:
    def hook(mod: Any, args: tuple, kwargs: dict) -> None:
        q, k = args[0].transpose(1, 2), args[1].transpose(1, 2)  # (B, L, N, H) after RoPE
        rec.record_logits(
            layer, q, k, causal=True, scale=kwargs.get("scale"), n_rep=q.size(1) // k.size(1)
        )

    return hook


def _flex_forward(module: Any, rec: AttnMax, layer: int) -> Any:
    """torchtitan's `FlexAttention.forward` (0.3), asking its kernel for the maxima too."""
    from torch.nn.attention.flex_attention import AuxRequest
    from torchtitan.models.common import attention as titan

    flex = titan.FlexAttention
    regional = getattr(titan, "maybe_regional_inductor", None)

    def forward(
        q_BLNH: torch.Tensor,
        k_BLNH: torch.Tensor,
        v_BLNH: torch.Tensor,
        *,
        attention_masks: Any,
        score_mod: Any = None,
        scale: float | None = None,
        enable_gqa: bool = False,
        out_transform: Any = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        q, k, v = (t.transpose(1, 2) for t in (q_BLNH, k_BLNH, v_BLNH))
        region = regional(flex.inductor_configs) if regional else contextlib.nullcontext()
        with region:
            out, aux = flex.compiled_flex_attn(
                q,
                k,
                v,
                score_mod=score_mod,
                block_mask=attention_masks,
                scale=scale,
                enable_gqa=enable_gqa,
                return_aux=AuxRequest(lse=out_transform is not None, max_scores=True),
                kernel_options=module.kernel_options,
            )
        if aux.max_scores is not None:
            rec.record(layer, aux.max_scores)  # (B, N, L): each query row's maximum score
        out = out.transpose(1, 2)
        return out if out_transform is None else out_transform(out, aux.lse.transpose(1, 2))

    return forward
