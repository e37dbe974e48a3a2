"""Triton-backend wrapper of ``lora_delta``: the multi-LoRA shrink/expand kernels.

Importing this module registers the wrapper into :mod:`tgraph.kernels.fast`'s kernel table (the
LoRA feature imports it, so a network that records ``lora_delta`` always finds it). The launches
themselves are :func:`tgraph.kernels.triton.lora.lora_shrink_expand`'s, the one place that runs
the pair.
"""
from __future__ import annotations

import torch

from tgraph.kernels import fast

__all__ = ["lora_delta_into"]


@fast._register("lora_delta")
def lora_delta_into(outs: fast.Outs, x: torch.Tensor, a_stack: torch.Tensor,
                    b_stack: torch.Tensor, scaling: torch.Tensor, token_slots: torch.Tensor,
                    token_order: torch.Tensor | None = None,
                    seg_start: torch.Tensor | None = None) -> torch.Tensor:
    """``outs[0] = lora_delta(x, a_stack, b_stack, scaling, token_slots)`` with the Triton kernels.

    Args:
        outs: one preallocated ``[T, N]`` buffer in ``x``'s dtype.
        x: ``[T, K]`` activations; a_stack ``[L, R, K]``; b_stack ``[L, N, R]``; scaling fp32
            ``[L]``; token_slots int32 ``[T]``; token_order / seg_start: the tokens grouped by
            slot, when the caller computed them once for the step (see ``tgraph.ir.ops.lora``).

    Returns:
        ``outs[0]``.
    """
    from tgraph.kernels.triton.lora import lora_shrink_expand

    out = outs[0]
    segments = (token_order, seg_start) if token_order is not None and seg_start is not None else None
    # overwrite: the delta replaces the buffer's contents, so the planner's buffer needs no zeroing.
    lora_shrink_expand(fast._rows(x), a_stack, b_stack, scaling, token_slots,
                       out.view(-1, out.shape[-1]), segments=segments, overwrite=True)
    return out
