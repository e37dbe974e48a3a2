"""``SwiGLU``: ``silu(gate) * up`` becomes one kernel: ``swiglu`` on a packed gate|up tensor
(split into two halves of the last dim), or ``silu_mul`` on two separate tensors."""
from __future__ import annotations

from tgraph.nn import functional as F
from tgraph.passes.pattern import Match, Pattern, PatternPass


def _packed_check(m: Match) -> bool:
    x = m.bindings["x"]
    (split,) = m.graph_nodes("split")
    sizes = split.attrs["sizes"]
    if x.rank is None or x.dtype is None or not x.dtype.is_floating_point:
        return False
    return (len(sizes) == 2 and sizes[0] == sizes[1]
            and split.attrs["dim"] % x.rank == x.rank - 1)


def _packed(x):
    gate, up = F.split(x, [1, 1], -1)
    return F.silu(gate) * up


def _separate_check(m: Match) -> bool:
    gate, up = m.bindings["gate"], m.bindings["up"]
    return (gate.shape is not None and gate.shape == up.shape and gate.dtype == up.dtype
            and gate.dtype is not None and gate.dtype.is_floating_point)


class SwiGLU(PatternPass):
    def __init__(self) -> None:
        super().__init__("SwiGLU", [
            Pattern("swiglu_packed", _packed, lambda x: F.record("swiglu", [x]),
                    ignore_attrs=("sizes",), extra_check=_packed_check),
            Pattern("silu_mul", lambda gate, up: F.silu(gate) * up,
                    lambda gate, up: F.record("silu_mul", [gate, up]),
                    extra_check=_separate_check),
        ])
