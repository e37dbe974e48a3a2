"""Triton-backend wrappers of ``lora_shrink_concat`` (the multi-LoRA shrink kernel that writes
the concatenated operand ``[x | scaled shrink]`` of a LoRA linear's single GEMM) and of the fused
producers ``rms_norm_lora_concat`` and ``add_rms_norm_lora_concat``: one launch for a decode batch (:func:`tgraph.kernels.triton.lora.lora_prologue_concat`), else the
producer's kernel writing ``x`` into the operand and the shrink after it.

Importing this module registers the wrapper into :mod:`tgraph.kernels.fast`'s kernel table (the
LoRA layers import it, so a network that records ``lora_shrink_concat`` always finds it). The
launch itself is :func:`tgraph.kernels.triton.lora.lora_shrink_concat`'s.
"""
from __future__ import annotations

import torch

from tgraph.kernels import fast

__all__ = ["add_rms_norm_lora_concat_into", "lora_shrink_concat_into", "rms_norm_lora_concat_into"]


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

    x2 = fast._rows(x)
    out = _operand(outs, x2.shape[1], width, "lora_shrink_concat")
    lora_shrink_concat(x2, a_stack, scaling, token_slots, out, counters, lead=lead,
                       segments=(token_order, seg_start))
    return outs[0]


def _operand(outs: fast.Outs, in_features: int, width: int, op: str) -> torch.Tensor:
    out = outs[0].view(-1, outs[0].shape[-1])
    if out.shape[1] != in_features + width:
        raise ValueError(f"{op}: the output buffer {list(outs[0].shape)} must have K + width = "
                         f"{in_features + width} columns")
    return out


def _shrink_in_place(out: torch.Tensor, in_features: int, a_stack, scaling, token_slots,
                     token_order, seg_start, counters, lead: int) -> None:
    """The shrink of the ``x`` a producer wrote into ``out[:, :K]`` (its copy writes the same
    values back, so reading and writing the same columns is harmless)."""
    from tgraph.kernels.triton.lora import lora_shrink_concat

    lora_shrink_concat(out[:, :in_features], a_stack, scaling, token_slots, out, counters,
                       lead=lead, segments=(token_order, seg_start))


@fast._register("rms_norm_lora_concat")
def rms_norm_lora_concat_into(outs: fast.Outs, h: torch.Tensor, norm_weight: torch.Tensor,
                              a_stack, scaling, token_slots, token_order, seg_start, counters, *,
                              eps: float, lead: int, width: int) -> torch.Tensor:
    """``outs[0] = lora_shrink_concat(rms_norm(h) * norm_weight, ...)``."""
    from tgraph.kernels.triton.lora import lora_prologue_concat, prologue_fits
    from tgraph.kernels.triton.norms import rms_norm

    h2 = fast._rows(h)
    k = h2.shape[1]
    out = _operand(outs, k, width, "rms_norm_lora_concat")
    if prologue_fits("rms_norm", h2.shape[0], k):
        lora_prologue_concat("rms_norm", h2, a_stack, scaling, token_slots, out, lead=lead,
                             norm_weight=norm_weight, eps=eps)
    else:
        rms_norm(h2, norm_weight, eps, out[:, :k])
        _shrink_in_place(out, k, a_stack, scaling, token_slots, token_order, seg_start, counters,
                         lead)
    return outs[0]


@fast._register("add_rms_norm_lora_concat")
def add_rms_norm_lora_concat_into(outs: fast.Outs, x: torch.Tensor, residual: torch.Tensor,
                                  norm_weight: torch.Tensor, a_stack, scaling, token_slots,
                                  token_order, seg_start, counters, *, eps: float, lead: int,
                                  width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(outs[0], outs[1]) = (lora_shrink_concat(rms_norm(x + residual) * norm_weight, ...),
    x + residual)``."""
    from tgraph.kernels.triton.lora import lora_prologue_concat, prologue_fits, rows_overlap
    from tgraph.kernels.triton.norms import add_rms_norm

    x2, r2 = fast._rows(x), fast._rows(residual)
    k = x2.shape[1]
    out = _operand(outs, k, width, "add_rms_norm_lora_concat")
    summed = outs[1].view(-1, k)
    # The one-launch kernel reads whole rows while writing slices of the sum: an engine that
    # planned the sum in place of an input gets the two-launch path.
    if prologue_fits("add_rms_norm", x2.shape[0], k) and x2.shape[0] > 0 \
            and not (rows_overlap(summed, x2) or rows_overlap(summed, r2)):
        lora_prologue_concat("add_rms_norm", x2, a_stack, scaling, token_slots, out, lead=lead,
                             residual=r2, norm_weight=norm_weight, summed=summed, eps=eps)
    else:
        add_rms_norm(x2, r2, norm_weight, eps, out[:, :k], summed)
        _shrink_in_place(out, k, a_stack, scaling, token_slots, token_order, seg_start, counters,
                         lead)
    return outs[0], outs[1]

