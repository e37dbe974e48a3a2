"""Multi-LoRA: the per-token adapter delta of one (possibly packed) linear.

``lora_delta(x, a_stack, b_stack, scaling, token_slots[, token_order, seg_start])`` computes, for every token ``t`` with
adapter slot ``s = token_slots[t]``::

    delta[t] = scaling[s] * (x[t] @ a_stack[s].T) @ b_stack[s].T

Layouts (shared with ``tgraph.kernels.triton.lora``): ``x [T, K]``, ``a_stack [L, R, K]``,
``b_stack [L, N, R]``, ``scaling`` fp32 ``[L]``, ``token_slots`` int32 ``[T]`` -> ``[T, N]`` in
``x``'s dtype. Slot 0 means "no adapter": its rows are zero whatever the stacks hold, so the
model code adds the delta unconditionally.
"""
from __future__ import annotations

import torch

from tgraph.ir.ops.registry import (
    Meta,
    OpCategory,
    dim_of,
    register_op,
    require,
    require_float,
    require_int,
    require_rank,
    require_same_dtype,
)
from tgraph.ir.shape import dims_conflict


def _lora_delta_infer(x: Meta, a: Meta, b: Meta, scaling: Meta, slots: Meta,
                      order: Meta | None = None, seg_start: Meta | None = None) -> Meta:
    require_rank(x, 2, "lora_delta x ([tokens, in_features])")
    require_rank(a, 3, "lora_delta a_stack ([slots, rank, in_features])")
    require_rank(b, 3, "lora_delta b_stack ([slots, out_features, rank])")
    require_rank(scaling, 1, "lora_delta scaling ([slots])")
    require_rank(slots, 1, "lora_delta token_slots ([tokens])")
    require_float(x, "lora_delta x")
    require_same_dtype(x, a, "lora_delta x and a_stack")
    require_same_dtype(x, b, "lora_delta x and b_stack")
    require(scaling.dtype in (None, torch.float32),
            f"lora_delta scaling must be float32, got {scaling}")
    require_int(slots, "lora_delta token_slots")
    checks = [
        (dim_of(x, -1), dim_of(a, 2), "x in_features vs a_stack dim 2"),
        (dim_of(a, 0), dim_of(b, 0), "a_stack slots vs b_stack slots"),
        (dim_of(a, 1), dim_of(b, 2), "a_stack rank vs b_stack rank"),
        (dim_of(a, 0), dim_of(scaling, 0), "a_stack slots vs scaling"),
        (dim_of(x, 0), dim_of(slots, 0), "x tokens vs token_slots"),
    ]
    for d1, d2, what in checks:
        require(not dims_conflict(d1, d2),
                f"lora_delta: {what} differ ({d1} vs {d2}); inputs x {x}, a_stack {a}, "
                f"b_stack {b}, scaling {scaling}, token_slots {slots}")
    require((order is None) == (seg_start is None),
            "lora_delta: pass token_order and seg_start together, or neither")
    if order is not None:
        require_rank(order, 1, "lora_delta token_order ([tokens])")
        require_rank(seg_start, 1, "lora_delta seg_start ([slots + 1])")
        require_int(order, "lora_delta token_order")
        require_int(seg_start, "lora_delta seg_start")
        require(not dims_conflict(dim_of(order, 0), dim_of(x, 0)),
                f"lora_delta: token_order {order} must have one entry per token of x {x}")
        slots_n = dim_of(a, 0)
        if isinstance(slots_n, int):
            require(not dims_conflict(dim_of(seg_start, 0), slots_n + 1),
                    f"lora_delta: seg_start {seg_start} must have slots + 1 = {slots_n + 1} entries")
    tokens = dim_of(x, 0)
    n = dim_of(b, 1)
    return Meta((tokens, n), x.dtype)


def lora_delta_reference(x: torch.Tensor, a_stack: torch.Tensor, b_stack: torch.Tensor,
                         scaling: torch.Tensor, token_slots: torch.Tensor,
                         token_order: torch.Tensor | None = None,
                         seg_start: torch.Tensor | None = None) -> torch.Tensor:
    """The torch reference of ``lora_delta`` (fp32 accumulation, one GEMM pair per used slot).

    Args:
        x: ``[T, K]`` activations.
        a_stack: ``[L, R, K]`` stacked A matrices.
        b_stack: ``[L, N, R]`` stacked B matrices.
        scaling: fp32 ``[L]`` per-slot scale.
        token_slots: int ``[T]`` adapter slot per token (0: none).
        token_order, seg_start: optional grouping of the tokens by slot (token indices sorted
            by slot, and where each slot's run starts), computed once per step by the caller
            so kernels need not sort per linear; the reference does not need them.

    Returns:
        ``[T, N]`` in ``x``'s dtype.

    Raises:
        ValueError: a slot is outside ``[0, L)``.
    """
    num_slots = a_stack.shape[0]
    out = torch.zeros(x.shape[0], b_stack.shape[1], dtype=torch.float32, device=x.device)
    slots = token_slots.long()
    if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= num_slots):
        raise ValueError(f"lora_delta: token_slots must lie in [0, {num_slots}), got values in "
                         f"[{int(slots.min())}, {int(slots.max())}]")
    for s in torch.unique(slots).tolist():
        if s == 0:
            continue  # no adapter
        rows = (slots == s).nonzero(as_tuple=True)[0]
        shrunk = x[rows].float() @ a_stack[s].float().t()  # (rows, R)
        out[rows] = (shrunk @ b_stack[s].float().t()) * scaling[s].float()
    return out.to(x.dtype)


register_op("lora_delta", infer=_lora_delta_infer, reference=lora_delta_reference,
            category=OpCategory.LINALG,
            doc="per-token multi-LoRA delta scaling[s] * x @ A[s].T @ B[s].T (slot 0: zero)")
