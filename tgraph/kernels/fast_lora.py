"""Triton-backend wrapper of ``lora_delta``: the multi-LoRA shrink/expand kernels.

Importing this module registers the wrapper into :mod:`tgraph.kernels.fast`'s kernel table (the
LoRA feature imports it, so a network that records ``lora_delta`` always finds it).
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
    from tgraph.kernels.triton.lora import lora_expand, lora_segments, lora_shrink

    out = outs[0]
    x2 = fast._rows(x)
    slots = token_slots if token_slots.dtype == torch.int32 else token_slots.to(torch.int32)
    slots = slots.contiguous()
    a_stack, b_stack = a_stack.contiguous(), b_stack.contiguous()
    num_slots = a_stack.shape[0]
    if token_order is not None and seg_start is not None:
        segments = (token_order, seg_start)
    else:  # one sort serves both launches of this linear
        segments = lora_segments(slots, num_slots)
    # fp32 intermediate: the rank is small, and it keeps the shrink's accumulation unrounded.
    shrunk = torch.empty(x2.shape[0], a_stack.shape[1], dtype=torch.float32, device=x2.device)
    lora_shrink(x2, a_stack, slots, shrunk, segments=segments)
    lora_expand(shrunk, b_stack, slots, out.view(-1, out.shape[-1]), scaling, segments=segments,
                overwrite=True)
    return out
