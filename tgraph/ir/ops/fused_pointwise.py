"""The ``fused_pointwise`` op: a chain of pointwise ops (and last-dim reductions) run as one kernel.

The ``PointwiseFusion`` pass replaces a connected group of pointwise nodes by one node of this op.
Its only attribute, ``program``, is a :class:`PointwiseProgram`: straight-line code over the node's
tensor inputs, in which instruction ``i`` defines value ``i``:

- ``("load", k)``: the node's input ``k``;
- ``("const", c)``: a Python scalar baked into the program (weakly typed, as in torch);
- ``("op", name, (a, b, ...), attrs)``: a registered pointwise op applied to earlier values;
- ``("reduce", "sum" | "mean" | "amax", a)``: a reduction over the last dim, keeping it (size 1),
  so the result broadcasts back against full rows;
- ``("cast", a, dtype)``: a cast (rounds to ``dtype``, as the unfused cast does).

``program.outputs`` lists the values the node returns, in order. The shape/dtype rule and the torch
reference both interpret the program with the registry entries of the original ops, so the fused
node has exactly the semantics of the nodes it replaced.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from tgraph.ir.ops.registry import Meta, OpCategory, get_op, register_op
from tgraph.ir.shape import ShapeRuleError
from tgraph.ir.value import scalar_dtype

__all__ = [
    "BOOL_RESULT_OPS", "FUSIBLE_DTYPES", "FUSIBLE_OPS", "MAX_REDUCTION_WIDTH", "REDUCE_OPS",
    "PointwiseProgram", "program_metas",
]

# Pointwise ops the code generator can emit. ``cast`` is an instruction of its own.
FUSIBLE_OPS = frozenset({
    "exp", "log", "sqrt", "rsqrt", "sin", "cos", "tanh", "sigmoid", "silu", "gelu", "gelu_tanh",
    "reciprocal", "neg", "abs", "relu", "logical_not", "add", "mul", "sub", "div", "pow",
    "maximum", "minimum", "eq", "ne", "lt", "le", "gt", "ge", "where",
})
# Ops whose result may be a bool mask; every other op must produce a float.
BOOL_RESULT_OPS = frozenset({"eq", "ne", "lt", "le", "gt", "ge", "logical_not", "where"})
REDUCE_OPS = frozenset({"sum", "mean", "amax"})
# Tensor dtypes a fused kernel loads and stores: math runs in fp32, masks stay bool.
FUSIBLE_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16, torch.bool})
# A program with reductions holds a whole row in registers (one BLOCK = next_power_of_2(N)).
MAX_REDUCTION_WIDTH = 16384

Instr = tuple


def _fmt_const(c: Any) -> str:
    return repr(c)


@dataclass(frozen=True)
class PointwiseProgram:
    """Straight-line pointwise code: the ``program`` attribute of a ``fused_pointwise`` node.

    Immutable and hashable, so it is part of the node's identity (CSE) and of kernel cache keys.

    Attributes:
        instrs: the instructions; instruction ``i`` defines value ``i`` (see the module doc).
        outputs: indices of the values the node returns, in output order.
    """

    instrs: tuple[Instr, ...]
    outputs: tuple[int, ...]
    _hash: int = field(init=False, repr=False, compare=False, default=0)

    def __post_init__(self) -> None:
        object.__setattr__(self, "instrs", tuple(tuple(i) for i in self.instrs))
        object.__setattr__(self, "outputs", tuple(self.outputs))
        # Hashed on every kernel launch (the compile-cache key): compute it once.
        object.__setattr__(self, "_hash", hash((self.instrs, self.outputs)))
        for i, ins in enumerate(self.instrs):
            self._check(i, ins)
        if not self.outputs:
            raise ValueError("PointwiseProgram: at least one output is required")
        for o in self.outputs:
            if not isinstance(o, int) or not 0 <= o < len(self.instrs):
                raise ValueError(f"PointwiseProgram: output {o!r} is not an instruction index "
                                 f"(0..{len(self.instrs) - 1})")
            if self.instrs[o][0] == "const":
                raise ValueError(f"PointwiseProgram: output {o} is a constant, not a tensor")

    @staticmethod
    def _check(i: int, ins: Instr) -> None:
        def ref(a: Any) -> None:
            if not isinstance(a, int) or not 0 <= a < i:
                raise ValueError(f"PointwiseProgram: instruction {i} {ins!r} reads {a!r}, which is "
                                 "not an earlier instruction")

        kind = ins[0] if ins else None
        if kind == "load" and len(ins) == 2:
            if not isinstance(ins[1], int) or ins[1] < 0:
                raise ValueError(f"PointwiseProgram: instruction {i}: bad input index {ins[1]!r}")
        elif kind == "const" and len(ins) == 2:
            if not isinstance(ins[1], (bool, int, float)):
                raise ValueError(f"PointwiseProgram: instruction {i}: a constant must be a Python "
                                 f"bool/int/float, got {type(ins[1]).__name__}")
        elif kind == "op" and len(ins) == 4:
            if ins[1] not in FUSIBLE_OPS:
                raise ValueError(f"PointwiseProgram: instruction {i}: op {ins[1]!r} cannot be "
                                 f"fused; fusible ops: {', '.join(sorted(FUSIBLE_OPS))}")
            if not isinstance(ins[2], tuple) or not isinstance(ins[3], tuple):
                raise ValueError(f"PointwiseProgram: instruction {i}: operands and attrs must be "
                                 f"tuples, got {ins!r}")
            for a in ins[2]:
                ref(a)
        elif kind == "reduce" and len(ins) == 3:
            if ins[1] not in REDUCE_OPS:
                raise ValueError(f"PointwiseProgram: instruction {i}: reduction {ins[1]!r} is not "
                                 f"one of {sorted(REDUCE_OPS)}")
            ref(ins[2])
        elif kind == "cast" and len(ins) == 3:
            if not isinstance(ins[2], torch.dtype):
                raise ValueError(f"PointwiseProgram: instruction {i}: cast needs a torch.dtype, "
                                 f"got {ins[2]!r}")
            ref(ins[1])
        else:
            raise ValueError(f"PointwiseProgram: instruction {i} is malformed: {ins!r}; expected "
                             "('load', k), ('const', c), ('op', name, args, attrs), "
                             "('reduce', kind, a) or ('cast', a, dtype)")

    def __hash__(self) -> int:
        return self._hash

    # ---- queries ---------------------------------------------------------------------------

    @property
    def num_inputs(self) -> int:
        """How many tensor inputs the program loads (one more than the largest load index)."""
        return max((ins[1] + 1 for ins in self.instrs if ins[0] == "load"), default=0)

    @property
    def has_reductions(self) -> bool:
        return any(ins[0] == "reduce" for ins in self.instrs)

    def op_names(self) -> list[str]:
        """The ops of the program in order (loads and constants left out), for naming kernels."""
        names = []
        for ins in self.instrs:
            if ins[0] == "op":
                names.append(ins[1])
            elif ins[0] in ("reduce", "cast"):
                names.append(ins[1] if ins[0] == "reduce" else "cast")
        return names

    def __str__(self) -> str:
        names: dict[int, str] = {}
        parts = []
        for i, ins in enumerate(self.instrs):
            kind = ins[0]
            if kind == "load":
                names[i] = f"in{ins[1]}"
                continue
            if kind == "const":
                names[i] = _fmt_const(ins[1])
                continue
            names[i] = f"t{i}"
            if kind == "op":
                args = [names[a] for a in ins[2]] + [f"{k}={v}" for k, v in ins[3]]
                parts.append(f"t{i}={ins[1]}({','.join(args)})")
            elif kind == "reduce":
                parts.append(f"t{i}={ins[1]}({names[ins[2]]},-1)")
            else:
                parts.append(f"t{i}=cast({names[ins[1]]},{str(ins[2]).replace('torch.', '')})")
        outs = ",".join(names[o] for o in self.outputs)
        return "{" + "; ".join(parts) + " -> " + outs + "}"


def program_metas(program: PointwiseProgram, input_metas: Sequence[Meta]) -> list[Meta]:
    """The meta (shape, dtype) of every value of ``program``, given the input metas.

    Each instruction runs the shape/dtype rule of the op it came from, so symbolic and concrete
    shapes both work, and the result types are exactly those of the unfused ops.

    Args:
        program: the program.
        input_metas: one meta per tensor input.
    Returns:
        one meta per instruction.
    Raises:
        ShapeRuleError: when an instruction's rule rejects its operands.
    """
    if len(input_metas) != program.num_inputs:
        raise ShapeRuleError(f"fused_pointwise: the program loads {program.num_inputs} inputs, "
                             f"got {len(input_metas)}")
    metas: list[Meta] = []
    for i, ins in enumerate(program.instrs):
        kind = ins[0]
        try:
            if kind == "load":
                m = input_metas[ins[1]]
                if m is None or m.scalar:
                    raise ShapeRuleError(f"input {ins[1]} must be a tensor, got {m}")
            elif kind == "const":
                m = Meta((), scalar_dtype(ins[1]), scalar=True)
            elif kind == "op":
                m = get_op(ins[1]).infer_metas([metas[a] for a in ins[2]], dict(ins[3]))[0]
            elif kind == "reduce":
                m = get_op(ins[1]).infer_metas([metas[ins[2]]], {"dim": -1, "keepdim": True})[0]
            else:
                m = get_op("cast").infer_metas([metas[ins[1]]], {"dtype": ins[2]})[0]
        except ShapeRuleError as err:
            raise ShapeRuleError(f"instruction {i} {ins[0]} {ins[1]!r}: {err}") from None
        metas.append(m)
    return metas


def _infer(*input_metas: Meta, program: PointwiseProgram) -> list[Meta]:
    if not isinstance(program, PointwiseProgram):
        raise ShapeRuleError(f"program must be a PointwiseProgram, got {type(program).__name__}")
    metas = program_metas(program, input_metas)
    return [metas[o] for o in program.outputs]


def _reference(*inputs: torch.Tensor, program: PointwiseProgram) -> Any:
    """Run the program op by op with the registry references (the unfused semantics)."""
    values: list[Any] = []
    for ins in program.instrs:
        kind = ins[0]
        if kind == "load":
            values.append(inputs[ins[1]])
        elif kind == "const":
            values.append(ins[1])
        elif kind == "op":
            values.append(get_op(ins[1]).reference(*(values[a] for a in ins[2]), **dict(ins[3])))
        elif kind == "reduce":
            values.append(get_op(ins[1]).reference(values[ins[2]], dim=-1, keepdim=True))
        else:
            values.append(get_op("cast").reference(values[ins[1]], dtype=ins[2]))
    outs = tuple(values[o] for o in program.outputs)
    return outs[0] if len(outs) == 1 else outs


register_op(
    "fused_pointwise", infer=_infer, reference=_reference, category=OpCategory.FUSED,
    doc="A chain of pointwise ops and last-dim reductions, run as one generated kernel.",
)
