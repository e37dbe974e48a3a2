"""Multi-LoRA: the concatenated operand of a LoRA linear run as one GEMM.

A LoRA linear ``y = x @ W.T + scaling[s] * (x @ A[s].T) @ B[s].T`` (``s`` the token's adapter
slot) is the single GEMM ``y = xcat @ [W | B_1 | ... | B_{L-1}].T`` on::

    xcat = lora_shrink_concat(x, a_stack, scaling, token_slots, token_order, seg_start, counters,
                              lead=lead, width=width)

``xcat [T, K + width]`` (``x``'s dtype) holds ``x`` in columns ``[0, K)``; for a token of slot
``s >= 1`` it holds ``scaling[s] * x[t] @ a_stack[s].T`` (fp32 accumulation, rounded once) in
columns ``K + lead + (s - 1) * R`` onwards (``R`` wide), and exact zeros in every other column
(slot 0, "no adapter": zeros only). ``lead`` zero columns come before slot 1's block and zero
padding after slot ``L - 1``'s, up to ``width``: columns that other adapters own in a shared
weight (see ``tgraph.layers.lora_bank``).

Layouts (shared with ``tgraph.kernels.triton.lora``): ``x [T, K]``, ``a_stack [L, R, K]``,
``scaling`` fp32 ``[L]``, ``token_slots`` int ``[T]``, ``token_order`` int ``[T]`` (token indices
sorted by slot, stable) and ``seg_start`` int ``[L + 1]`` (where each slot's run starts): the
grouping computed once per step, so the kernel of every adapted linear skips the sort;
``counters`` int32 ``[C]``: the kernel's arrival counters, a persistent zeroed buffer it leaves
zeroed (the reference ignores it). A feature allocates ``C = LORA_COUNTER_SLOTS`` of them, once,
with torch: a split launch takes one counter per tile of its grid and a launch of more tiles than
counters runs unsplit, so the count bounds only how large a grid may split, never correctness.

Fused producers (the ``LoraPrologue`` pass): the RMSNorm that computes ``x`` for a LoRA linear and
nothing else (before q/k/v and gate/up, with or without the residual add) folds into the concat,
so a decode step launches one kernel where it launched two::

    rms_norm_lora_concat(h, norm_weight, <lora inputs>, *, eps, lead, width) -> xcat
    add_rms_norm_lora_concat(x, residual, norm_weight, <lora inputs>, *, eps, lead, width)
        -> (xcat, x + residual)

``<lora inputs>`` are ``a_stack, scaling, token_slots, token_order, seg_start, counters`` as
above. Each reference is the composition of the unfused references, so a fused engine on the
reference backend equals the unfused one exactly.
"""
from __future__ import annotations

import torch

from tgraph.ir.ops.fused import add_rms_norm_reference
from tgraph.ir.ops.norms import rms_norm_reference
from tgraph.ir.ops.registry import (
    Meta,
    OpCategory,
    dim_of,
    get_op,
    register_op,
    require,
    require_float,
    require_int,
    require_rank,
    require_same_dtype,
)
from tgraph.ir.shape import dims_conflict

__all__ = ["LORA_COUNTER_SLOTS", "add_rms_norm_lora_concat_reference",
           "lora_shrink_concat_reference", "rms_norm_lora_concat_reference"]

# Arrival counters a LoRA feature allocates for the shrink ops (``counters [LORA_COUNTER_SLOTS]``);
# far more than the tiles of any grid that benefits from a split (a few per SM).
LORA_COUNTER_SLOTS = 1024


def _check_layout(x: Meta, a: Meta, lead: int, width: int) -> None:
    for name, v in (("lead", lead), ("width", width)):
        require(isinstance(v, int) and not isinstance(v, bool) and v >= 0,
                f"lora_shrink_concat: {name} must be a non-negative int, got {v!r}")
    slots_n, rank = dim_of(a, 0), dim_of(a, 1)
    if isinstance(slots_n, int) and isinstance(rank, int):
        need = lead + max(slots_n - 1, 0) * rank
        require(width >= need,
                f"lora_shrink_concat: width {width} cannot hold lead {lead} + {slots_n - 1} slot "
                f"blocks of rank {rank} (expected width >= {need}); a_stack {a}")


def _shrink_concat_infer(x: Meta, a: Meta, scaling: Meta, slots: Meta, order: Meta,
                         seg_start: Meta, counters: Meta, *, lead: int, width: int) -> Meta:
    require_rank(x, 2, "lora_shrink_concat x ([tokens, in_features])")
    require_rank(a, 3, "lora_shrink_concat a_stack ([slots, rank, in_features])")
    require_rank(scaling, 1, "lora_shrink_concat scaling ([slots])")
    for meta, what in ((slots, "token_slots ([tokens])"), (order, "token_order ([tokens])"),
                       (seg_start, "seg_start ([slots + 1])"), (counters, "counters ([n])")):
        require_rank(meta, 1, f"lora_shrink_concat {what}")
        require_int(meta, f"lora_shrink_concat {what.split()[0]}")
    require_float(x, "lora_shrink_concat x")
    require_same_dtype(x, a, "lora_shrink_concat x and a_stack")
    require(scaling.dtype in (None, torch.float32),
            f"lora_shrink_concat: scaling must be float32, got {scaling}")
    require(counters.dtype in (None, torch.int32),
            f"lora_shrink_concat: counters must be int32, got {counters}")
    slots_n = dim_of(a, 0)
    checks = [
        (dim_of(x, -1), dim_of(a, 2), "x in_features vs a_stack dim 2"),
        (slots_n, dim_of(scaling, 0), "a_stack slots vs scaling"),
        (dim_of(x, 0), dim_of(slots, 0), "x tokens vs token_slots"),
        (dim_of(x, 0), dim_of(order, 0), "x tokens vs token_order"),
        (slots_n + 1 if isinstance(slots_n, int) else None, dim_of(seg_start, 0),
         "a_stack slots + 1 vs seg_start"),
    ]
    for d1, d2, what in checks:
        require(not dims_conflict(d1, d2),
                f"lora_shrink_concat: {what} differ ({d1} vs {d2}); inputs x {x}, a_stack {a}, "
                f"scaling {scaling}, token_slots {slots}, token_order {order}, "
                f"seg_start {seg_start}")
    _check_layout(x, a, lead, width)
    k = dim_of(x, -1)
    if not isinstance(k, int):
        k = dim_of(a, 2)
    return Meta((dim_of(x, 0), k + width if isinstance(k, int) else None), x.dtype)


def lora_shrink_concat_reference(x: torch.Tensor, a_stack: torch.Tensor, scaling: torch.Tensor,
                                 token_slots: torch.Tensor, token_order: torch.Tensor,
                                 seg_start: torch.Tensor, counters: torch.Tensor, *, lead: int,
                                 width: int) -> torch.Tensor:
    """The torch reference of ``lora_shrink_concat``: ``x`` copied, then one masked, scaled fp32
    shrink per used slot (see the module docstring).

    Args:
        x: ``[T, K]`` activations.
        a_stack: ``[L, R, K]`` stacked A matrices.
        scaling: fp32 ``[L]`` per-slot scale.
        token_slots: int ``[T]`` adapter slot per token (0: none).
        token_order, seg_start, counters: the kernel's grouping and arrival counters; the
            reference needs none of them.
        lead: zero columns before slot 1's block.
        width: columns after ``x``.

    Returns:
        ``[T, K + width]`` in ``x``'s dtype.

    Raises:
        ValueError: a slot is outside ``[0, L)``.
    """
    T, K = x.shape
    num_slots, rank = a_stack.shape[:2]
    out = torch.zeros(T, K + width, dtype=x.dtype, device=x.device)
    out[:, :K] = x
    slots = token_slots.long()
    if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= num_slots):
        raise ValueError(f"lora_shrink_concat: token_slots must lie in [0, {num_slots}), got "
                         f"values in [{int(slots.min())}, {int(slots.max())}]")
    for s in torch.unique(slots).tolist():
        if s == 0:
            continue  # no adapter: zeros
        rows = (slots == s).nonzero(as_tuple=True)[0]
        shrunk = (x[rows].float() @ a_stack[s].float().t()) * scaling[s].float()
        first = K + lead + (s - 1) * rank
        out[rows, first:first + rank] = shrunk.to(x.dtype)
    return out


register_op("lora_shrink_concat", infer=_shrink_concat_infer,
            reference=lora_shrink_concat_reference, category=OpCategory.LINALG,
            doc="[x | scaling[s] * x @ A[s].T in slot s's column block, zeros elsewhere]: the "
                "operand of a LoRA linear run as one GEMM on [W | B blocks]")


_DOC_TAIL = ", then lora_shrink_concat of the result, in one kernel at decode"


def _rms_norm_concat_infer(h: Meta, norm_weight: Meta, *lora: Meta, eps: float, lead: int,
                           width: int) -> Meta:
    normed = get_op("rms_norm").infer(h, norm_weight, eps=eps)
    return _shrink_concat_infer(normed, *lora, lead=lead, width=width)


def rms_norm_lora_concat_reference(h, norm_weight, *lora, eps, lead, width):
    return lora_shrink_concat_reference(rms_norm_reference(h, norm_weight, eps=eps), *lora,
                                        lead=lead, width=width)


def _add_rms_norm_concat_infer(x: Meta, residual: Meta, norm_weight: Meta, *lora: Meta,
                               eps: float, lead: int, width: int) -> tuple[Meta, Meta]:
    normed, summed = get_op("add_rms_norm").infer(x, residual, norm_weight, eps=eps)
    return _shrink_concat_infer(normed, *lora, lead=lead, width=width), summed


def add_rms_norm_lora_concat_reference(x, residual, norm_weight, *lora, eps, lead, width):
    normed, summed = add_rms_norm_reference(x, residual, norm_weight, eps=eps)
    return lora_shrink_concat_reference(normed, *lora, lead=lead, width=width), summed


register_op("rms_norm_lora_concat", infer=_rms_norm_concat_infer,
            reference=rms_norm_lora_concat_reference, category=OpCategory.FUSED,
            doc="rms_norm(h) * norm_weight" + _DOC_TAIL)
register_op("add_rms_norm_lora_concat", infer=_add_rms_norm_concat_infer,
            reference=add_rms_norm_lora_concat_reference, category=OpCategory.FUSED,
            doc="(rms_norm(x + residual) * norm_weight" + _DOC_TAIL + ", x + residual)")
