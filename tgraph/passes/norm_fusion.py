"""``AddRmsNorm``: a residual add followed by an RMSNorm of the sum becomes one ``add_rms_norm``
that returns both the normed tensor and the new residual."""
from __future__ import annotations

from tgraph.nn import functional as F
from tgraph.passes.pattern import Match, Pattern, PatternPass


def _check(m: Match) -> bool:
    x, residual, w = m.bindings["x"], m.bindings["residual"], m.bindings["w"]
    if x.shape is None or x.shape != residual.shape or x.dtype != residual.dtype:
        return False  # the kernel takes no broadcasting
    return x.dtype is not None and x.dtype.is_floating_point and w.rank == 1


def _pattern(x, residual, w, eps):
    summed = x + residual
    return F.rms_norm(summed, w, eps), summed


def _replacement(x, residual, w, eps):
    return F.record("add_rms_norm", [x, residual, w], eps=eps)


class AddRmsNorm(PatternPass):
    def __init__(self) -> None:
        super().__init__("AddRmsNorm", [Pattern("add_rms_norm", _pattern, _replacement,
                                                scalars=("eps",), extra_check=_check)])
