"""Rewrites that recognise plain-op spellings of primitives, so that a model written with ``+``,
``*``, ``rsqrt``... still reaches the fused kernels:

- ``SiluFusion``: ``x * sigmoid(x)`` -> ``silu(x)``.
- ``RmsNormFusion``: the Hugging Face RMSNorm spelling
  ``w * (x.float() * rsqrt(mean(x.float() ** 2, -1, keepdim) + eps)).to(x.dtype)`` (and the
  variants without casts, with ``h * h``) -> ``rms_norm(x, w, eps)``.
"""
from __future__ import annotations

import torch

from tgraph.ir.value import Value
from tgraph.nn import functional as F
from tgraph.passes.pattern import Match, Pattern, PatternPass

silu_pattern = Pattern("silu", lambda x: x * F.sigmoid(x), lambda x: F.silu(x))


def _rms_body(h, eps, square_by_pow: bool):
    sq = h ** 2 if square_by_pow else h * h
    return h * F.rsqrt(F.mean(sq, -1, keepdim=True) + eps)


def _rms_check(m: Match) -> bool:
    x: Value = m.bindings["x"]
    w: Value = m.bindings["w"]
    if x.dtype is None or not x.dtype.is_floating_point or x.rank is None:
        return False
    if w.rank != 1 or (isinstance(w.shape[0], int) and isinstance(x.shape[-1], int)
                       and w.shape[0] != x.shape[-1]):
        return False
    (mean,) = m.graph_nodes("mean")
    if mean.attrs["dim"] % x.rank != x.rank - 1 or not mean.attrs["keepdim"]:
        return False
    casts = m.graph_nodes("cast")
    if casts:
        up, down = casts[0], casts[-1]
        if up.attrs["dtype"] != torch.float32 or down.attrs["dtype"] != x.dtype:
            return False
    elif x.dtype != torch.float32:
        return False  # without casts the math is only the same in fp32
    return True


def _rms_patterns() -> list[Pattern]:
    patterns = []
    for square_by_pow in (True, False):
        patterns.append(Pattern(
            "rms_norm_cast",
            lambda x, w, eps, p=square_by_pow: w * F.cast(
                _rms_body(F.cast(x, torch.float32), eps, p), torch.float32),
            lambda x, w, eps: F.rms_norm(x, w, eps),
            scalars=("eps",), ignore_attrs=("dtype",), extra_check=_rms_check))
        patterns.append(Pattern(
            "rms_norm",
            lambda x, w, eps, p=square_by_pow: w * _rms_body(x, eps, p),
            lambda x, w, eps: F.rms_norm(x, w, eps),
            scalars=("eps",), extra_check=_rms_check))
    return patterns


class SiluFusion(PatternPass):
    def __init__(self) -> None:
        super().__init__("SiluFusion", [silu_pattern])


class RmsNormFusion(PatternPass):
    def __init__(self) -> None:
        super().__init__("RmsNormFusion", _rms_patterns())
