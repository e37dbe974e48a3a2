"""Matrix products."""
from __future__ import annotations

import torch

from tgraph.ir.ops.registry import Meta, OpCategory, register_op, require, require_same_dtype
from tgraph.ir.shape import ShapeRuleError, broadcast_shapes, dims_conflict, merge_dims
from tgraph.quant import dense


def _inner(k_a, k_b, what: str):
    try:
        return merge_dims(k_a, k_b)
    except ShapeRuleError:
        raise ShapeRuleError(f"{what}: inner dims differ ({k_a} vs {k_b})") from None


LINEAR_IMPLS = (None, "reference")


def linear_infer(x: Meta, w: Meta, bias: Meta | None = None, *, transpose_a: bool = False,
                 transpose_b: bool = True, impl: str | None = None) -> Meta:
    require(impl in LINEAR_IMPLS, f"linear: impl must be one of {LINEAR_IMPLS}, got {impl!r}")
    require_same_dtype(x, w, "linear input and weight")
    if w.shape is not None:
        require(len(w.shape) == 2, f"linear weight must be 2-D, got {w}")
    if bias is not None and bias.shape is not None:
        require(len(bias.shape) == 1, f"linear bias must be 1-D, got {bias}")
    n = None if w.shape is None else (w.shape[0] if transpose_b else w.shape[1])
    k_w = None if w.shape is None else (w.shape[1] if transpose_b else w.shape[0])
    if bias is not None and bias.shape is not None:
        require(not dims_conflict(bias.shape[0], n), f"linear bias {bias} does not match N={n}")
    if x.shape is None:
        return Meta(None, x.dtype)
    if transpose_a:
        require(len(x.shape) == 2, f"transpose_a needs a 2-D input, got {x}")
        k_x, lead = x.shape[0], (x.shape[1],)
    else:
        require(len(x.shape) >= 1, f"linear input must have rank >= 1, got {x}")
        k_x, lead = x.shape[-1], x.shape[:-1]
    _inner(k_x, k_w, f"linear of {x} and weight {w} (transpose_b={transpose_b})")
    return Meta(lead + (n,), x.dtype)


def linear_reference(x, w, bias=None, *, transpose_a=False, transpose_b=True, impl=None):
    w = dense(w, x.dtype)  # a quantized weight, dequantized per call
    a = x.t() if transpose_a else x
    b = w.t() if transpose_b else w
    out = a @ b
    return out + bias if bias is not None else out


register_op("linear", infer=linear_infer, reference=linear_reference, category=OpCategory.LINALG,
            doc="x @ w.T (+ bias) with torch.nn.Linear's weight layout by default; "
                "impl='reference' asks every backend for the torch reference (a rule's choice "
                "for a quantized weight), which passes leave unfused")


def _matmul_infer(a: Meta, b: Meta) -> Meta:
    require_same_dtype(a, b, "matmul operands")
    if a.shape is None or b.shape is None:
        return Meta(None, a.dtype)
    require(len(a.shape) >= 2 and len(b.shape) >= 2,
            f"matmul needs operands of rank >= 2 (reshape vectors first), got {a} and {b}")
    _inner(a.shape[-1], b.shape[-2], f"matmul of {a} and {b}")
    batch = broadcast_shapes(a.shape[:-2], b.shape[:-2])
    return Meta(batch + (a.shape[-2], b.shape[-1]), a.dtype)


register_op("matmul", infer=_matmul_infer, reference=torch.matmul, category=OpCategory.LINALG)
