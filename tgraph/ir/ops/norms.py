"""Normalisations. References follow Hugging Face's order of rounding (normalise in fp32, cast
back to the input dtype, then scale), so that tgraph and transformers agree in bf16 too."""
from __future__ import annotations

import torch

from tgraph.ir.ops.pointwise import promote
from tgraph.ir.ops.registry import Meta, OpCategory, dim_of, register_op, require, require_float
from tgraph.ir.shape import dims_conflict


def _check_affine(x: Meta, w: Meta | None, what: str) -> None:
    if w is None or w.shape is None:
        return
    require(len(w.shape) == 1, f"{what} must be 1-D, got {w}")
    require(not dims_conflict(w.shape[0], dim_of(x, -1)),
            f"{what} {w} does not match the last dim of the input {x}")


def norm_infer(x: Meta, weight: Meta | None = None, bias: Meta | None = None, *,
                eps: float) -> Meta:
    require_float(x, "norm input")
    _check_affine(x, weight, "norm weight")
    _check_affine(x, bias, "norm bias")
    dtype = x.dtype if weight is None else promote(x, weight)
    return Meta(x.shape, dtype)


def rms_norm_reference(x, weight=None, *, eps):
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = h.to(x.dtype)
    return h if weight is None else weight * h


def layer_norm_reference(x, weight=None, bias=None, *, eps):
    h = torch.nn.functional.layer_norm(x.to(torch.float32), (x.shape[-1],), eps=eps).to(x.dtype)
    if weight is not None:
        h = weight * h
    if bias is not None:
        h = h + bias
    return h


register_op("rms_norm", infer=lambda x, weight=None, *, eps: norm_infer(x, weight, eps=eps),
            reference=rms_norm_reference, category=OpCategory.NORM)
register_op("layer_norm", infer=norm_infer, reference=layer_norm_reference,
            category=OpCategory.NORM)
