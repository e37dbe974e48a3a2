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

Two adapter sets in one operand (stacked LoRA features): after ``counters`` the op may take a
second set's six inputs (``a_stack2 [L2, R2, K], scaling2, token_slots2, token_order2,
seg_start2, counters2``) and ``second_lead`` / ``second_width``; ``xcat [T, K + width +
second_width]`` then holds, after the first set's ``width`` columns, the LoRA columns of that
set's own operand on the same ``x``::

    lora_shrink_concat(x, *set1, *set2, lead, width, second_lead, second_width)
        == cat(lora_shrink_concat(x, *set1, lead, width),
               lora_shrink_concat(x, *set2, second_lead, second_width)[:, K:])

which is how the reference computes it, and one kernel launch writes both.

Fused producers (the ``LoraPrologue`` pass): the RMSNorm that computes ``x`` for a LoRA linear and
nothing else (before q/k/v and gate/up, with or without the residual add) folds into the concat,
so a decode step launches one kernel where it launched two::

    rms_norm_lora_concat(h, norm_weight, <lora inputs>, *, eps, lead, width) -> xcat
    add_rms_norm_lora_concat(x, residual, norm_weight, <lora inputs>, *, eps, lead, width)
        -> (xcat, x + residual)

``<lora inputs>`` are ``a_stack, scaling, token_slots, token_order, seg_start, counters`` as
above (and the second set's, with ``second_lead`` / ``second_width``). Each reference is the
composition of the unfused references, so a fused engine on the reference backend equals the
unfused one exactly.
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


def _check_layout(x: Meta, a: Meta, lead: int, width: int, which: str = "") -> None:
    for name, v in ((f"{which}lead", lead), (f"{which}width", width)):
        require(isinstance(v, int) and not isinstance(v, bool) and v >= 0,
                f"lora_shrink_concat: {name} must be a non-negative int, got {v!r}")
    slots_n, rank = dim_of(a, 0), dim_of(a, 1)
    if isinstance(slots_n, int) and isinstance(rank, int):
        need = lead + max(slots_n - 1, 0) * rank
        require(width >= need,
                f"lora_shrink_concat: {which}width {width} cannot hold {which}lead {lead} + "
                f"{slots_n - 1} slot blocks of rank {rank} (expected {which}width >= {need}); "
                f"{which}a_stack {a}")


def _check_set(x: Meta, a: Meta, scaling: Meta, slots: Meta, order: Meta, seg_start: Meta,
               counters: Meta, lead: int, width: int, which: str = "") -> None:
    """One adapter set's inputs against ``x`` (``which``: ``""`` or ``"second "``)."""
    op = f"lora_shrink_concat {which}".rstrip()
    require_rank(a, 3, f"{op} a_stack ([slots, rank, in_features])")
    require_rank(scaling, 1, f"{op} scaling ([slots])")
    for meta, what in ((slots, "token_slots ([tokens])"), (order, "token_order ([tokens])"),
                       (seg_start, "seg_start ([slots + 1])"), (counters, "counters ([n])")):
        require_rank(meta, 1, f"{op} {what}")
        require_int(meta, f"{op} {what.split()[0]}")
    require_same_dtype(x, a, f"{op} x and a_stack")
    require(scaling.dtype in (None, torch.float32),
            f"{op}: scaling must be float32, got {scaling}")
    require(counters.dtype in (None, torch.int32),
            f"{op}: counters must be int32, got {counters}")
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
                f"{op}: {what} differ ({d1} vs {d2}); inputs x {x}, a_stack {a}, "
                f"scaling {scaling}, token_slots {slots}, token_order {order}, "
                f"seg_start {seg_start}")
    _check_layout(x, a, lead, width, which.replace(" ", "_"))


def _shrink_concat_infer(x: Meta, a: Meta, scaling: Meta, slots: Meta, order: Meta,
                         seg_start: Meta, counters: Meta, *second: Meta, lead: int, width: int,
                         second_lead: int = 0, second_width: int = 0) -> Meta:
    require_rank(x, 2, "lora_shrink_concat x ([tokens, in_features])")
    require_float(x, "lora_shrink_concat x")
    _check_set(x, a, scaling, slots, order, seg_start, counters, lead, width)
    require(len(second) in (0, 6),
            f"lora_shrink_concat: a second adapter set is 6 inputs (a_stack, scaling, "
            f"token_slots, token_order, seg_start, counters), got {len(second)}")
    if second:
        _check_set(x, *second, second_lead, second_width, "second ")
    else:
        require(second_lead == 0 and second_width == 0,
                f"lora_shrink_concat: second_lead {second_lead} / second_width {second_width} "
                "without a second adapter set")
    k = dim_of(x, -1)
    if not isinstance(k, int):
        k = dim_of(a, 2)
    cols = k + width + second_width if isinstance(k, int) else None
    return Meta((dim_of(x, 0), cols), x.dtype)


def _one_set(x: torch.Tensor, a_stack: torch.Tensor, scaling: torch.Tensor,
             token_slots: torch.Tensor, lead: int, width: int) -> torch.Tensor:
    """``[x | one set's columns]``: ``x`` copied, then one masked, scaled fp32 shrink per used
    slot."""
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


def lora_shrink_concat_reference(x: torch.Tensor, a_stack: torch.Tensor, scaling: torch.Tensor,
                                 token_slots: torch.Tensor, token_order: torch.Tensor,
                                 seg_start: torch.Tensor, counters: torch.Tensor,
                                 *second: torch.Tensor, lead: int, width: int,
                                 second_lead: int = 0, second_width: int = 0) -> torch.Tensor:
    """The torch reference of ``lora_shrink_concat``: ``x`` copied, then one masked, scaled fp32
    shrink per used slot (see the module docstring); with a second adapter set, the LoRA columns
    of that set's own operand on the same ``x`` appended.

    Args:
        x: ``[T, K]`` activations.
        a_stack: ``[L, R, K]`` stacked A matrices.
        scaling: fp32 ``[L]`` per-slot scale.
        token_slots: int ``[T]`` adapter slot per token (0: none).
        token_order, seg_start, counters: the kernel's grouping and arrival counters; the
            reference needs none of them.
        second: optionally the second set's ``a_stack, scaling, token_slots, token_order,
            seg_start, counters``.
        lead: zero columns before slot 1's block.
        width: columns after ``x`` (the first set's).
        second_lead, second_width: the second set's layout, after the first set's columns.

    Returns:
        ``[T, K + width + second_width]`` in ``x``'s dtype.

    Raises:
        ValueError: a slot is outside ``[0, L)``.
    """
    out = _one_set(x, a_stack, scaling, token_slots, lead, width)
    if not second:
        return out
    a2, scaling2, slots2 = second[:3]
    tail = _one_set(x, a2, scaling2, slots2, second_lead, second_width)[:, x.shape[1]:]
    return torch.cat([out, tail], dim=1)


register_op("lora_shrink_concat", infer=_shrink_concat_infer,
            reference=lora_shrink_concat_reference, category=OpCategory.LINALG,
            doc="[x | scaling[s] * x @ A[s].T in slot s's column block, zeros elsewhere "
                "(| a second adapter set's columns)]: the operand of a LoRA linear run as one "
                "GEMM on [W | B blocks]")


_DOC_TAIL = ", then lora_shrink_concat of the result, in one kernel at decode"


def _rms_norm_concat_infer(h: Meta, norm_weight: Meta, *lora: Meta, eps: float,
                           **layout: int) -> Meta:
    normed = get_op("rms_norm").infer(h, norm_weight, eps=eps)
    return _shrink_concat_infer(normed, *lora, **layout)


def rms_norm_lora_concat_reference(h, norm_weight, *lora, eps, **layout):
    return lora_shrink_concat_reference(rms_norm_reference(h, norm_weight, eps=eps), *lora,
                                        **layout)


def _add_rms_norm_concat_infer(x: Meta, residual: Meta, norm_weight: Meta, *lora: Meta,
                               eps: float, **layout: int) -> tuple[Meta, Meta]:
    normed, summed = get_op("add_rms_norm").infer(x, residual, norm_weight, eps=eps)
    return _shrink_concat_infer(normed, *lora, **layout), summed


def add_rms_norm_lora_concat_reference(x, residual, norm_weight, *lora, eps, **layout):
    normed, summed = add_rms_norm_reference(x, residual, norm_weight, eps=eps)
    return lora_shrink_concat_reference(normed, *lora, **layout), summed


register_op("rms_norm_lora_concat", infer=_rms_norm_concat_infer,
            reference=rms_norm_lora_concat_reference, category=OpCategory.FUSED,
            doc="rms_norm(h) * norm_weight" + _DOC_TAIL)
register_op("add_rms_norm_lora_concat", infer=_add_rms_norm_concat_infer,
            reference=add_rms_norm_lora_concat_reference, category=OpCategory.FUSED,
            doc="(rms_norm(x + residual) * norm_weight" + _DOC_TAIL + ", x + residual)")
