"""Triton-backend wrapper of ``lora_shrink_concat``: the multi-LoRA shrink kernel that writes the
concatenated operand ``[x | scaled shrink]`` of a LoRA linear's single GEMM.

Importing this module registers the wrapper into :mod:`tgraph.kernels.fast`'s kernel table (the
LoRA layers import it, so a network that records ``lora_shrink_concat`` always finds it). The
launch itself is :func:`tgraph.kernels.triton.lora.lora_shrink_concat`'s.
"""
from __future__ import annotations

import torch

from tgraph.kernels import fast

__all__ = ["lora_shrink_concat_into"]


@fast._register("lora_shrink_concat")
def lora_shrink_concat_into(outs: fast.Outs, x: torch.Tensor, a_stack: torch.Tensor,
                            scaling: torch.Tensor, token_slots: torch.Tensor,
                            token_order: torch.Tensor, seg_start: torch.Tensor,
                            counters: torch.Tensor, *, lead: int, width: int) -> torch.Tensor:
    """``outs[0] = lora_shrink_concat(...)`` with the Triton kernel (see ``tgraph.ir.ops.lora``).

    Args:
        outs: one preallocated ``[T, K + width]`` buffer in ``x``'s dtype.
        x: ``[T, K]`` activations; a_stack ``[L, R, K]``; scaling fp32 ``[L]``; token_slots int
            ``[T]``; token_order / seg_start: the tokens grouped by slot; counters: the zeroed
            int32 arrival counters the feature owns.
        lead, width: the column layout after ``x``.

    Returns:
        ``outs[0]``.
    """
    from tgraph.kernels.triton.lora import lora_shrink_concat

    out = outs[0]
    x2 = fast._rows(x)
    if out.shape[-1] != x2.shape[1] + width:
        raise ValueError(f"lora_shrink_concat: the output buffer {list(out.shape)} must have "
                         f"K + width = {x2.shape[1] + width} columns")
    lora_shrink_concat(x2, a_stack, scaling, token_slots, out.view(-1, out.shape[-1]), counters,
                       lead=lead, segments=(token_order, seg_start))
    return out
