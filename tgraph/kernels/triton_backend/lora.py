"""Wrappers of ``lora_shrink_concat`` (the multi-LoRA shrink kernel that writes the concatenated
operand ``[x | scaled shrink]`` of a LoRA linear's single GEMM, with one or two adapter sets) and
of the fused producers ``rms_norm_lora_concat`` and ``add_rms_norm_lora_concat``: one launch for a
decode batch (:func:`tgraph.kernels.triton.lora.lora_prologue_concat`), else the producer's
kernel writing ``x`` into the operand and the shrink after it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tgraph.kernels.registry import KernelSpec
from tgraph.kernels.triton_backend.common import Outs, rows
from tgraph.tuning import LoraTuning, Tuning

if TYPE_CHECKING:
    from tgraph.kernels.triton.lora import AdapterSet

__all__ = ["KERNELS", "add_rms_norm_lora_concat_into", "lora_shrink_concat_into",
           "rms_norm_lora_concat_into"]


def _second_set(second: tuple[torch.Tensor, ...], second_lead: int) -> AdapterSet | None:
    """The op's second adapter set (its six inputs) as the kernel's ``AdapterSet``, or None."""
    from tgraph.kernels.triton.lora import AdapterSet

    if not second:
        return None
    a, scaling, slots, order, seg_start, counters = second
    return AdapterSet(a, scaling, slots, counters, second_lead, (order, seg_start))


def lora_shrink_concat_into(outs: Outs, x: torch.Tensor, a_stack: torch.Tensor,
                            scaling: torch.Tensor, token_slots: torch.Tensor,
                            token_order: torch.Tensor, seg_start: torch.Tensor,
                            counters: torch.Tensor, *second: torch.Tensor, tuning: Tuning,
                            lead: int, width: int, second_lead: int = 0,
                            second_width: int = 0) -> torch.Tensor:
    """``outs[0] = lora_shrink_concat(...)`` with the Triton kernel (see ``tgraph.ir.ops.lora``).

    Args:
        outs: one preallocated ``[T, K + width + second_width]`` buffer in ``x``'s dtype.
        x: ``[T, K]`` activations; a_stack ``[L, R, K]``; scaling fp32 ``[L]``; token_slots int
            ``[T]``; token_order / seg_start: the tokens grouped by slot; counters: the zeroed
            int32 arrival counters the feature owns.
        second: the second adapter set's six inputs, or none.
        tuning: the engine's launch settings.
        lead, width, second_lead, second_width: the column layout after ``x``.

    Returns:
        ``outs[0]``.
    """
    from tgraph.kernels.triton.lora import lora_shrink_concat

    x2 = rows(x)
    out = _operand(outs, x2.shape[1], width + second_width, "lora_shrink_concat")
    lora_shrink_concat(x2, a_stack, scaling, token_slots, out, counters, lead=lead,
                       segments=(token_order, seg_start), tuning=tuning.lora, width=width,
                       second=_second_set(second, second_lead))
    return outs[0]


def _operand(outs: Outs, in_features: int, width: int, op: str) -> torch.Tensor:
    out = outs[0].view(-1, outs[0].shape[-1])
    if out.shape[1] != in_features + width:
        raise ValueError(f"{op}: the output buffer {list(outs[0].shape)} must have K + width = "
                         f"{in_features + width} columns")
    return out


def _shrink_in_place(out: torch.Tensor, in_features: int, a_stack, scaling, token_slots,
                     token_order, seg_start, counters, second: AdapterSet | None, lead: int,
                     width: int,
                     tuning: LoraTuning) -> None:
    """The shrink of the ``x`` a producer wrote into ``out[:, :K]`` (its copy writes the same
    values back, so reading and writing the same columns is harmless)."""
    from tgraph.kernels.triton.lora import lora_shrink_concat

    lora_shrink_concat(out[:, :in_features], a_stack, scaling, token_slots, out, counters,
                       lead=lead, segments=(token_order, seg_start), tuning=tuning, width=width,
                       second=second)


def rms_norm_lora_concat_into(outs: Outs, h: torch.Tensor, norm_weight: torch.Tensor,
                              a_stack, scaling, token_slots, token_order, seg_start, counters,
                              *second: torch.Tensor, tuning: Tuning, eps: float, lead: int,
                              width: int, second_lead: int = 0,
                              second_width: int = 0) -> torch.Tensor:
    """``outs[0] = lora_shrink_concat(rms_norm(h) * norm_weight, ...)``."""
    from tgraph.kernels.triton.lora import lora_prologue_concat, prologue_fits
    from tgraph.kernels.triton.norms import rms_norm

    h2 = rows(h)
    k = h2.shape[1]
    out = _operand(outs, k, width + second_width, "rms_norm_lora_concat")
    extra = _second_set(second, second_lead)
    if prologue_fits("rms_norm", h2.shape[0], k, tuning.lora):
        lora_prologue_concat("rms_norm", h2, a_stack, scaling, token_slots, out, lead=lead,
                             norm_weight=norm_weight, eps=eps, tuning=tuning.lora, width=width,
                             second=extra)
    else:
        rms_norm(h2, norm_weight, eps, out[:, :k])
        _shrink_in_place(out, k, a_stack, scaling, token_slots, token_order, seg_start, counters,
                         extra, lead, width, tuning.lora)
    return outs[0]


def add_rms_norm_lora_concat_into(outs: Outs, x: torch.Tensor, residual: torch.Tensor,
                                  norm_weight: torch.Tensor, a_stack, scaling, token_slots,
                                  token_order, seg_start, counters, *second: torch.Tensor,
                                  tuning: Tuning, eps: float, lead: int, width: int,
                                  second_lead: int = 0,
                                  second_width: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(outs[0], outs[1]) = (lora_shrink_concat(rms_norm(x + residual) * norm_weight, ...),
    x + residual)``."""
    from tgraph.kernels.triton.lora import lora_prologue_concat, prologue_fits, rows_overlap
    from tgraph.kernels.triton.norms import add_rms_norm

    x2, r2 = rows(x), rows(residual)
    k = x2.shape[1]
    out = _operand(outs, k, width + second_width, "add_rms_norm_lora_concat")
    summed = outs[1].view(-1, k)
    extra = _second_set(second, second_lead)
    # The one-launch kernel reads whole rows while writing slices of the sum: an engine that
    # planned the sum in place of an input gets the two-launch path.
    if prologue_fits("add_rms_norm", x2.shape[0], k, tuning.lora) and x2.shape[0] > 0 \
            and not (rows_overlap(summed, x2) or rows_overlap(summed, r2)):
        lora_prologue_concat("add_rms_norm", x2, a_stack, scaling, token_slots, out, lead=lead,
                             residual=r2, norm_weight=norm_weight, summed=summed, eps=eps,
                             tuning=tuning.lora, width=width, second=extra)
    else:
        add_rms_norm(x2, r2, norm_weight, eps, out[:, :k], summed)
        _shrink_in_place(out, k, a_stack, scaling, token_slots, token_order, seg_start, counters,
                         extra, lead, width, tuning.lora)
    return outs[0], outs[1]


KERNELS = (
    KernelSpec("lora_shrink_concat", lora_shrink_concat_into, tuned=True),
    KernelSpec("rms_norm_lora_concat", rms_norm_lora_concat_into, tuned=True),
    KernelSpec("add_rms_norm_lora_concat", add_rms_norm_lora_concat_into, tuned=True),
)
