"""Triton code generation for ``fused_pointwise`` programs.

:func:`compile_pointwise` turns a :class:`~tgraph.ir.ops.fused_pointwise.PointwiseProgram` into
Triton source, writes it to a file in the cache directory (Triton's ``@triton.jit`` reads a
kernel's source from its file) and imports it. The generated kernel:

- computes in fp32 (bool masks stay ``int1``), loads with masks, and stores each output in its
  own dtype; a ``cast`` instruction rounds to its dtype, as the unfused cast does;
- without reductions, is a flat 1-D elementwise kernel over the output's elements; a tensor that
  has the output's shape and is contiguous is addressed by the flat index, any other (a broadcast
  weight, a strided view) through its strides, with stride 0 along broadcast dims;
- with reductions, runs one program per block of rows, a whole row (``BLOCK =
  next_power_of_2(N)``) in registers, so ``sum``/``mean``/``amax`` over the last dim are register
  reductions whose ``[rows, 1]`` results broadcast back against the row.

Compiled kernels are cached by (program, input dtypes, input ranks, which inputs broadcast along
the last dim) and never by sizes: the token count, the batch and the leading dims are runtime
arguments that Triton does not specialise on, so one kernel serves every token count.
"""
from __future__ import annotations

import hashlib
import importlib.util
import math
import os
import re
import sys
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import triton

from tgraph import envs
from tgraph.ir.ops import Meta
from tgraph.ir.ops.fused_pointwise import (
    FUSIBLE_DTYPES,
    MAX_REDUCTION_WIDTH,
    PointwiseProgram,
    program_metas,
)
from tgraph.ir.shape import ShapeRuleError, broadcast_shapes
from tgraph.kernels.triton.pdl import pdl_kwargs

__all__ = [
    "PointwiseKernel", "cache_dir", "cache_size", "clear_cache", "compile_pointwise",
    "run_fused_pointwise",
]

_FLAT_BLOCK = 1024
# Elements per program to aim for in row kernels: short rows are packed several to a program.
_ROW_TILE = 2048
_MAX_ROWS = 16

_TL_DTYPE = {torch.float32: "tl.float32", torch.float16: "tl.float16",
             torch.bfloat16: "tl.bfloat16"}

# Helpers the generated kernels call. Triton's interpreter has no libdevice, so tanh and pow are
# spelled in core ops; both stay within a few fp32 ulps of torch.
_PRELUDE = '''\
import triton
import triton.language as tl

from tgraph.kernels.triton.pdl import pdl_wait

_NEG_INF = tl.constexpr(float("-inf"))


@triton.jit
def _tanh(x):
    # Below 0.25, the odd Taylor series (truncation error < 3e-10 relative), where
    # (1 - e^-2|x|) / (1 + e^-2|x|) would lose digits to cancellation; the quotient above it.
    ax = tl.abs(x)
    t = tl.exp(-2.0 * ax)
    big = (1.0 - t) / (1.0 + t)
    x2 = x * x
    small = ax * (1.0 + x2 * (-0.3333333333333333 + x2 * (0.13333333333333333 + x2 * (
        -0.05396825396825397 + x2 * (0.021869488536155203 + x2 * -0.008863235529902197)))))
    r = tl.where(ax < 0.25, small, big)
    return tl.where(x < 0.0, -r, r)


@triton.jit
def _gelu_tanh(x):
    return 0.5 * x * (1.0 + _tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)))


@triton.jit
def _pow(a, b):
    # a ** b = 2 ** (b * log2 |a|), negated for a negative base and an odd integer exponent;
    # a negative base with a fractional exponent gives log2(a < 0) = nan, as torch does.
    b_int = tl.floor(b) == b
    odd = b_int & (tl.floor(b * 0.5) * 2.0 != b)
    r = tl.exp2(b * tl.log2(tl.where(b_int, tl.abs(a), a)))
    r = tl.where(odd & (a < 0.0), -r, r)
    return tl.where((b == 0.0) | (a == 1.0), 1.0, r)
'''


def cache_dir() -> Path:
    """Where generated kernel sources are written: ``$TGRAPH_CACHE_DIR/pointwise``, or
    ``~/.cache/tgraph/pointwise`` when the variable is unset."""
    return envs.TGRAPH_CACHE_DIR / "pointwise"


def _row_layout(n: int) -> tuple[int, int, int]:
    """``(BLOCK, ROWS, num_warps)`` of a row kernel, from the row width alone (never the rows)."""
    block = triton.next_power_of_2(max(n, 1))
    rows = max(1, min(_MAX_ROWS, _ROW_TILE // block))
    tile = block * rows
    warps = 4 if tile <= 2048 else 8 if tile <= 4096 else 16
    return block, rows, warps


# ---- code generation ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _Key:
    program: PointwiseProgram
    dtypes: tuple[torch.dtype, ...]
    ranks: tuple[int, ...]
    bcast_last: tuple[bool, ...]  # per input, in row kernels: broadcast along the last dim


class _Codegen:
    """Builds the source of one kernel from a key."""

    def __init__(self, key: _Key) -> None:
        self.key = key
        self.program = program = key.program
        self.n_in = program.num_inputs
        self.n_out = len(program.outputs)
        self.rank = max(key.ranks)
        self.rowwise = program.has_reductions
        # Symbolic shapes stand in for sizes: ``d0..d{r-1}`` for the output's dims, 1 where an
        # input broadcasts along the last dim. Only structure reaches the kernel, never sizes.
        full = tuple(f"d{k}" for k in range(self.rank))
        metas = []
        for dtype, rank, bcast in zip(key.dtypes, key.ranks, key.bcast_last):
            shape = full[self.rank - rank:]
            if bcast and rank:
                shape = shape[:-1] + (1,)
            metas.append(Meta(shape, dtype))
        try:
            self.metas = program_metas(program, metas)
        except ShapeRuleError as err:
            raise ValueError(f"fused_pointwise program {program} does not fit inputs "
                             f"{[str(m) for m in metas]}: {err}") from None
        for i, m in enumerate(self.metas):
            if not m.scalar and m.dtype not in FUSIBLE_DTYPES:
                raise ValueError(f"fused_pointwise: instruction {i} {program.instrs[i]} has dtype "
                                 f"{m.dtype}; generated kernels handle float32, float16, "
                                 "bfloat16 and bool")
        self.out_dtypes = tuple(self.metas[o].dtype for o in program.outputs)
        self.is_bool = [m.dtype == torch.bool for m in self.metas]
        self.level = self._levels()
        self.globals: list[str] = []
        self.lines: list[str] = []

    # -- analysis --

    def _levels(self) -> list[str]:
        """Per value: 'elem' (varies along a row), 'row' (one value per row) or 'const'."""
        levels: list[str] = []
        for ins in self.program.instrs:
            kind = ins[0]
            if kind == "load":
                bcast = self.rowwise and self.key.bcast_last[ins[1]]
                levels.append("row" if bcast else "elem")
            elif kind == "const":
                levels.append("const")
            elif kind == "reduce":
                levels.append("row")
            else:
                args = ins[2] if kind == "op" else (ins[1],)
                got = {levels[a] for a in args}
                levels.append("elem" if "elem" in got else "row" if "row" in got else "const")
        return levels

    # -- operands --

    def _float_literal(self, c: float | int | bool) -> str:
        c = float(c)
        if math.isfinite(c):
            return repr(c)
        name = f"_K{len(self.globals)}"
        self.globals.append(f'{name} = tl.constexpr(float("{c}"))')
        return name

    def _f(self, i: int, tensor: bool = False) -> str:
        """Value ``i`` as an fp32 expression (a tensor when ``tensor``, for tl functions)."""
        ins = self.program.instrs[i]
        if ins[0] == "const":
            lit = self._float_literal(ins[1])
            return f"tl.full([1], {lit}, tl.float32)" if tensor else lit
        return f"v{i}.to(tl.float32)" if self.is_bool[i] else f"v{i}"

    def _b(self, i: int) -> str:
        """Value ``i`` as a bool (``int1``) tensor expression."""
        ins = self.program.instrs[i]
        if ins[0] == "const":
            return f"tl.full([1], {bool(ins[1])}, tl.int1)"
        return f"v{i}" if self.is_bool[i] else f"(v{i} != 0.0)"

    # -- instructions --

    _UNARY = {
        "exp": "tl.exp({a})", "log": "tl.log({a})", "sqrt": "tl.sqrt({a})",
        "rsqrt": "tl.rsqrt({a})", "sin": "tl.sin({a})", "cos": "tl.cos({a})",
        "tanh": "_tanh({a})", "sigmoid": "tl.sigmoid({a})", "silu": "({a} * tl.sigmoid({a}))",
        "gelu": "(0.5 * {a} * (1.0 + tl.erf({a} * 0.7071067811865476)))",
        "gelu_tanh": "_gelu_tanh({a})", "reciprocal": "(1.0 / {a})", "neg": "(-{a})",
        "abs": "tl.abs({a})", "relu": "tl.where({a} < 0.0, 0.0, {a})",
    }
    _BINARY = {"add": "+", "sub": "-", "mul": "*", "div": "/",
               "eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">="}
    # x ** c for the exponents models use, as torch computes them (x * x is exact).
    _POW_CONST = {2.0: "({a} * {a})", 3.0: "({a} * {a} * {a})", 1.0: "({a})",
                  0.5: "tl.sqrt({a})", -0.5: "tl.rsqrt({a})", -1.0: "(1.0 / {a})",
                  -2.0: "(1.0 / ({a} * {a}))", 4.0: "(({a} * {a}) * ({a} * {a}))",
                  0.0: "tl.where({a} == {a}, 1.0, 1.0)"}

    def _op(self, i: int, name: str, args: tuple[int, ...]) -> str:
        if name in self._UNARY:
            return self._UNARY[name].format(a=self._f(args[0]))
        if name in self._BINARY:
            return f"({self._f(args[0])} {self._BINARY[name]} {self._f(args[1])})"
        if name in ("maximum", "minimum"):
            a, b = (self._f(x, tensor=True) for x in args)
            return f"tl.{name}({a}, {b}, propagate_nan=tl.PropagateNan.ALL)"
        if name == "pow":
            base, exp = args
            exp_ins = self.program.instrs[exp]
            if exp_ins[0] == "const" and float(exp_ins[1]) in self._POW_CONST:
                return self._POW_CONST[float(exp_ins[1])].format(a=self._f(base))
            return f"_pow({self._f(base, tensor=True)}, {self._f(exp, tensor=True)})"
        if name == "logical_not":
            return f"({self._b(args[0])} == 0)"
        if name == "where":
            cond, a, b = args
            if self.is_bool[i]:
                return f"tl.where({self._b(cond)}, {self._b(a)}, {self._b(b)})"
            return f"tl.where({self._b(cond)}, {self._f(a)}, {self._f(b)})"
        raise ValueError(f"fused_pointwise: no code generation for op {name!r}")

    def _check_result(self, i: int, name: str) -> None:
        if self.is_bool[i] and name not in ("eq", "ne", "lt", "le", "gt", "ge", "logical_not",
                                            "where"):
            raise ValueError(f"fused_pointwise: {name} on bool tensors (instruction {i}) is not "
                             "supported; generated kernels only do float math on masks")

    def _reduce(self, kind: str, a: int) -> str:
        if self.level[a] != "elem":
            return self._f(a)  # reducing a dim of size 1
        x = self._f(a)
        if kind == "amax":
            return f"tl.max(tl.where(mask, {x}, _NEG_INF), axis=1)[:, None]"
        total = f"tl.sum(tl.where(mask, {x}, 0.0), axis=1)[:, None]"
        return total if kind == "sum" else f"({total} / N)"

    def _cast(self, a: int, dtype: torch.dtype) -> str:
        if self.program.instrs[a][0] == "const":
            raise ValueError("fused_pointwise: cast of a constant is not supported")
        if dtype == torch.bool:
            return self._b(a)
        if dtype not in _TL_DTYPE:
            raise ValueError(f"fused_pointwise: cast to {dtype} is not supported; generated "
                             "kernels handle float32, float16, bfloat16 and bool")
        x = self._f(a)
        if dtype == torch.float32 or self.is_bool[a]:
            return x  # bool -> float is exact
        return f"{x}.to({_TL_DTYPE[dtype]}).to(tl.float32)"

    # -- kernel text --

    def _params(self) -> tuple[list[str], list[str], list[str]]:
        tensors = [f"in{k}" for k in range(self.n_in)] + [f"out{j}" for j in range(self.n_out)]
        r = self.rank
        sizes = [f"D{d}" for d in range(1, r - 1)]
        strides = [f"s{t}_{d}" for t in range(len(tensors)) for d in range(r)]
        # Rows, leading sizes and outer strides change with the token count: never specialised.
        # The flat kernel's element count is left to Triton's divisibility-by-16 specialisation,
        # which lets masked loads vectorise; it is the same for every token count whenever the
        # last dim is a multiple of 16 (at most two variants otherwise).
        dynamic = (["R"] if self.rowwise else []) + sizes \
            + [f"s{t}_{d}" for t in range(len(tensors)) for d in range(r - 2)]
        constexprs = ["BLOCK: tl.constexpr", "PDL: tl.constexpr"]
        if self.rowwise:
            constexprs.insert(0, "ROWS: tl.constexpr")
        else:
            constexprs += [f"C{t}: tl.constexpr" for t in range(len(tensors))]
        return tensors + ["R", "N"] + sizes + strides + constexprs, dynamic, tensors

    def _decompose(self, index: str) -> list[str]:
        """Lines that split a (row) index into the leading-dim indices ``i0..i{r-2}``."""
        r = self.rank
        if r < 2:
            return []
        lines = [f"rem = {index}"]
        for d in range(r - 2, 0, -1):
            lines += [f"i{d} = rem % D{d}", f"rem = rem // D{d}"]
        lines.append("i0 = rem")
        return lines

    def _row_offset(self, t: int) -> str:
        r = self.rank
        if r < 2:
            return "rem0 * 0"
        return " + ".join(f"i{d} * s{t}_{d}" for d in range(r - 1))

    def build(self, name: str) -> str:
        params, dynamic, tensors = self._params()
        body = self._body_rows(tensors) if self.rowwise else self._body_flat(tensors)
        head = (f"@triton.jit(do_not_specialize={dynamic!r})\n"
                f"def {name}(\n" + "".join(f"    {p},\n" for p in params) + "):")
        ops = "\n".join(f"#   {line}" for line in _wrap(str(self.program), 96))
        note = (f"# Generated by tgraph.kernels.pointwise_codegen for\n{ops}\n"
                f"# inputs: {', '.join(str(d).replace('torch.', '') for d in self.key.dtypes)}"
                f"; ranks {list(self.key.ranks)}; outputs: "
                f"{', '.join(str(d).replace('torch.', '') for d in self.out_dtypes)}\n")
        consts = ("\n".join(self.globals) + "\n\n") if self.globals else ""
        body = ["pdl_wait(PDL)"] + body  # see tgraph.kernels.triton.pdl
        return (note + _PRELUDE + "\n" + consts + "\n" + head + "\n"
                + "\n".join(f"    {line}" for line in body) + "\n")

    def _body_flat(self, tensors: list[str]) -> list[str]:
        r = self.rank
        lines = ["idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)",
                 "mask = idx < R"]
        if r >= 1:
            lines.append("col = idx % N" if r >= 2 else "col = idx")
        lines += self._decompose("idx // N")
        for t in range(len(tensors)):
            if r == 0:
                lines.append(f"o{t} = idx * 0")
                continue
            strided = " + ".join([f"i{d} * s{t}_{d}" for d in range(r - 1)]
                                 + [f"col * s{t}_{r - 1}"])
            lines += [f"if C{t}:", f"    o{t} = idx", "else:", f"    o{t} = {strided}"]
        lines += self._compute(lambda k: f"tl.load(in{k} + o{k}, mask=mask, other=0)",
                               lambda k: f"tl.load(in{k} + o{k}, mask=mask, other=0)")
        for j, o in enumerate(self.program.outputs):
            t = self.n_in + j
            lines.append(f"tl.store(out{j} + o{t}, {self._store_value(j, o)}, mask=mask)")
        return lines

    def _body_rows(self, tensors: list[str]) -> list[str]:
        r = self.rank
        lines = ["rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)",
                 "cols = tl.arange(0, BLOCK)",
                 "rmask = (rows < R)[:, None]",
                 "mask = rmask & (cols < N)[None, :]",
                 "rem0 = rows.to(tl.int64)"]
        lines += self._decompose("rem0")
        for t in range(len(tensors)):
            lines.append(f"r{t} = ({self._row_offset(t)})[:, None]")
        last = r - 1

        def elem(k: int) -> str:
            return f"tl.load(in{k} + r{k} + cols[None, :] * s{k}_{last}, mask=mask, other=0)"

        def row(k: int) -> str:
            return f"tl.load(in{k} + r{k}, mask=rmask, other=0)"

        lines += self._compute(elem, row)
        for j, o in enumerate(self.program.outputs):
            t = self.n_in + j
            value = self._store_value(j, o)
            if self.level[o] == "elem":
                lines.append(f"tl.store(out{j} + r{t} + cols[None, :] * s{t}_{last}, {value}, "
                             "mask=mask)")
            else:
                lines.append(f"tl.store(out{j} + r{t}, {value}, mask=rmask)")
        return lines

    def _store_value(self, j: int, o: int) -> str:
        if self.out_dtypes[j] == torch.bool:
            return self._b(o)
        return f"{self._f(o)}.to(out{j}.dtype.element_ty)"

    def _compute(self, elem_load, row_load) -> list[str]:
        lines = []
        for i, ins in enumerate(self.program.instrs):
            kind = ins[0]
            if kind == "const":
                continue
            if kind == "load":
                k = ins[1]
                load = row_load(k) if self.level[i] == "row" else elem_load(k)
                conv = " != 0" if self.key.dtypes[k] == torch.bool else ".to(tl.float32)"
                expr = f"{load}{conv}"
            elif kind == "op":
                self._check_result(i, ins[1])
                expr = self._op(i, ins[1], ins[2])
            elif kind == "reduce":
                expr = self._reduce(ins[1], ins[2])
            else:
                expr = self._cast(ins[1], ins[2])
            lines.append(f"v{i} = {expr}")
        return lines


def _wrap(text: str, width: int) -> list[str]:
    return [text[i:i + width] for i in range(0, len(text), width)] or [""]


# ---- compiled kernels ---------------------------------------------------------------------------


class PointwiseKernel:
    """A compiled ``fused_pointwise`` kernel: call it with the input tensors, then the outputs.

    ``str(kernel)`` is the generated Triton source; ``kernel.path`` the file it lives in.
    """

    def __init__(self, key: _Key, gen: _Codegen, fn: object, source: str, name: str,
                 path: Path) -> None:
        self.key = key
        self.program = key.program
        self.rowwise = gen.rowwise
        self.rank = gen.rank
        self.num_inputs = gen.n_in
        self.out_dtypes = gen.out_dtypes
        self.fn = fn
        self.source = source
        self.name = name
        self.path = path
        self._shapes: dict[tuple, list[tuple[int, ...]]] = {}

    def __str__(self) -> str:
        return self.source

    def __repr__(self) -> str:
        kind = "row" if self.rowwise else "flat"
        return f"<PointwiseKernel {self.name} ({kind}, rank {self.rank}): {self.program}>"

    def output_shapes(self, input_shapes: Sequence[tuple[int, ...]]) -> list[tuple[int, ...]]:
        """The output shapes for concrete input shapes (the program's shape rule)."""
        key = tuple(tuple(s) for s in input_shapes)
        shapes = self._shapes.get(key)
        if shapes is None:
            metas = [Meta(s, d) for s, d in zip(key, self.key.dtypes)]
            try:
                values = program_metas(self.program, metas)
            except ShapeRuleError as err:
                raise ValueError(f"fused_pointwise {self.name}: inputs of shapes {list(key)} "
                                 f"do not fit the program {self.program}: {err}") from None
            shapes = [tuple(values[o].shape) for o in self.program.outputs]
            if len(self._shapes) < 64:
                self._shapes[key] = shapes
        return shapes

    def __call__(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Run the kernel on ``inputs..., outputs...``; the outputs are written in place.

        Returns:
            the output tensors.
        Raises:
            TypeError: a non-tensor argument or a wrong argument count.
            ValueError: a dtype, rank, shape or device the kernel was not compiled for.
        """
        n_in, n_out = self.num_inputs, len(self.out_dtypes)
        if len(tensors) != n_in + n_out:
            raise TypeError(f"{self.name}: expected {n_in} inputs and {n_out} outputs, got "
                            f"{len(tensors)} tensors")
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{self.name}: argument {i} must be a torch.Tensor, got "
                                f"{type(t).__name__}")
        inputs, outputs = tensors[:n_in], tensors[n_in:]
        for k, (t, dtype, rank) in enumerate(zip(inputs, self.key.dtypes, self.key.ranks)):
            if t.dtype != dtype or t.dim() != rank:
                raise ValueError(f"{self.name}: input {k} is {t.dtype}{list(t.shape)}, the kernel "
                                 f"was compiled for {dtype} of rank {rank}")
        _check_device(self.name, tensors)
        full = _broadcast([tuple(t.shape) for t in inputs], self.name)
        if self.rowwise and full[-1] != 1:
            got = tuple(_bcast_last(tuple(t.shape), full) for t in inputs)
            if got != self.key.bcast_last:
                raise ValueError(f"{self.name}: inputs broadcast along the last dim as {got}, the "
                                 f"kernel was compiled for {self.key.bcast_last}")
        want = self.output_shapes([tuple(t.shape) for t in inputs])
        for j, (t, shape, dtype) in enumerate(zip(outputs, want, self.out_dtypes)):
            if tuple(t.shape) != shape or t.dtype != dtype:
                raise ValueError(f"{self.name}: output {j} is {t.dtype}{list(t.shape)}, expected "
                                 f"{dtype}{list(shape)}")
        numel = math.prod(full)
        if numel == 0:
            return tuple(outputs)
        r = self.rank
        strides = [s for t in tensors for s in _strides(t, full)]
        sizes = list(full[1:r - 1])
        n = full[-1] if r else 1
        if self.rowwise:
            if n > MAX_REDUCTION_WIDTH:
                raise ValueError(f"{self.name}: rows of {n} elements exceed the row kernel's "
                                 f"limit of {MAX_REDUCTION_WIDTH}")
            block, rows, warps = _row_layout(n)
            num_rows = numel // n
            grid = (triton.cdiv(num_rows, rows),)
            self.fn[grid](*tensors, num_rows, n, *sizes, *strides, ROWS=rows, BLOCK=block,
                          num_warps=warps, **pdl_kwargs(outputs[0]))
        else:
            flags = {f"C{t}": tuple(x.shape) == full and x.is_contiguous()
                     for t, x in enumerate(tensors)}
            grid = (triton.cdiv(numel, _FLAT_BLOCK),)
            self.fn[grid](*tensors, numel, n, *sizes, *strides, BLOCK=_FLAT_BLOCK, num_warps=4,
                          **flags, **pdl_kwargs(outputs[0]))
        return tuple(outputs)


def _check_device(name: str, tensors: Sequence[torch.Tensor]) -> None:
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"{name}: all tensors must be on one device, got "
                         f"{sorted(str(d) for d in devices)}")
    device = devices.pop()
    interpreted = device.type == "cpu" and envs.TRITON_INTERPRET
    if device.type != "cuda" and not interpreted:
        raise ValueError(f"{name}: Triton kernels need CUDA tensors, got {device} (CPU works only "
                         "under TRITON_INTERPRET=1)")


def _broadcast(shapes: Sequence[tuple], what: str) -> tuple:
    try:
        return tuple(broadcast_shapes(*shapes))
    except ShapeRuleError as err:
        raise ValueError(f"{what}: {err}") from None


def _bcast_last(shape: tuple, full: tuple) -> bool:
    """Whether an operand of ``shape`` is constant along the last dim of ``full``."""
    if not full or full[-1] == 1:
        return False
    return len(shape) == 0 or shape[-1] == 1


def _strides(t: torch.Tensor, full: tuple) -> list[int]:
    """``t``'s strides aligned to ``full``'s dims, 0 along the dims it broadcasts."""
    r = len(full)
    out = [0] * r
    offset = r - t.dim()
    for k, (size, stride) in enumerate(zip(t.shape, t.stride())):
        d = offset + k
        out[d] = 0 if size == 1 and full[d] != 1 else stride
    return out


# ---- the cache -----------------------------------------------------------------------------------

_lock = threading.Lock()
_kernels: dict[_Key, PointwiseKernel] = {}
_functions: dict[str, tuple[object, Path]] = {}  # source digest -> (jit function, file)


def _meta_of(x: Meta | torch.Tensor) -> Meta:
    if isinstance(x, torch.Tensor):
        return Meta(tuple(x.shape), x.dtype)
    if isinstance(x, Meta):
        return x
    raise TypeError(f"compile_pointwise: input metas must be tgraph Metas or torch tensors, got "
                    f"{type(x).__name__}")


def _make_key(program: PointwiseProgram, metas: Sequence[Meta]) -> _Key:
    if not isinstance(program, PointwiseProgram):
        raise TypeError(f"expected a PointwiseProgram, got {type(program).__name__}")
    if len(metas) != program.num_inputs:
        raise ValueError(f"the program loads {program.num_inputs} inputs, got {len(metas)} metas")
    if not metas:
        raise ValueError("a fused_pointwise program needs at least one tensor input")
    for k, m in enumerate(metas):
        if m.scalar or m.shape is None:
            raise ValueError(f"input {k}: a tensor of known rank is required, got {m}")
        if m.dtype not in FUSIBLE_DTYPES:
            raise ValueError(f"input {k}: dtype {m.dtype} is not supported; expected float32, "
                             "float16, bfloat16 or bool")
    shapes = [tuple(m.shape) for m in metas]
    full = _broadcast(shapes, "fused_pointwise inputs")
    if program.has_reductions:
        if not full:
            raise ValueError("a program with reductions needs inputs of rank >= 1")
        bcast = tuple(_bcast_last(s, full) for s in shapes)
    else:
        bcast = (False,) * len(metas)
    return _Key(program, tuple(m.dtype for m in metas), tuple(len(s) for s in shapes), bcast)


def _kernel_name(program: PointwiseProgram, digest: str) -> str:
    ops = [re.sub(r"\W", "", op) for op in program.op_names()[:4]]
    return "_".join(["fused"] + ops + [digest[:10]])


def _writable_cache_dir() -> Path:
    directory = cache_dir()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        if os.access(directory, os.W_OK):
            return directory
    except OSError:
        pass
    # A read-only home (some containers): fall back to a per-user temporary directory.
    fallback = Path(tempfile.gettempdir()) / f"tgraph-pointwise-{os.getuid()}"
    fallback.mkdir(parents=True, exist_ok=True)
    return fallback


def _load_module(name: str, source: str) -> tuple[object, Path]:
    directory = _writable_cache_dir()
    path = directory / f"{name}.py"
    if not path.exists() or path.read_text() != source:
        # Atomic: concurrent processes compiling the same kernel never see a partial file.
        tmp = directory / f".{name}.{os.getpid()}.{threading.get_ident()}.tmp"
        tmp.write_text(source)
        os.replace(tmp, path)
    module_name = f"tgraph_pointwise_{name}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import generated kernel {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return getattr(module, name), path


def compile_pointwise(program: PointwiseProgram,
                      input_metas: Sequence[Meta | torch.Tensor]) -> PointwiseKernel:
    """The compiled kernel of ``program`` for inputs like ``input_metas`` (cached).

    Args:
        program: the ``program`` attribute of a ``fused_pointwise`` node.
        input_metas: one per input: a :class:`~tgraph.ir.ops.Meta` (shape may be symbolic) or a
            tensor. Only dtypes, ranks and which inputs broadcast along the last dim matter;
            sizes never do.
    Returns:
        a :class:`PointwiseKernel`, callable as ``kernel(*inputs, *outputs)``.
    Raises:
        TypeError / ValueError: an unsupported program, dtype or rank.
    """
    key = _make_key(program, [_meta_of(m) for m in input_metas])
    kernel = _kernels.get(key)
    if kernel is not None:
        return kernel
    with _lock:
        kernel = _kernels.get(key)
        if kernel is None:
            gen = _Codegen(key)
            draft = gen.build("KERNEL_NAME")
            digest = hashlib.sha256(draft.encode()).hexdigest()
            name = _kernel_name(program, digest)
            source = draft.replace("KERNEL_NAME", name)
            if digest not in _functions:
                _functions[digest] = _load_module(name, source)
            fn, path = _functions[digest]
            kernel = PointwiseKernel(key, gen, fn, source, name, path)
            _kernels[key] = kernel
    return kernel


def run_fused_pointwise(program: PointwiseProgram, inputs: Sequence[torch.Tensor],
                        outputs: Sequence[torch.Tensor | None] | None = None
                        ) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """Run a ``fused_pointwise`` node with the generated Triton kernel (the engine's Triton
    backend calls this).

    Args:
        program: the node's ``program`` attribute.
        inputs: the node's input tensors, in order (all on one CUDA device, or on the CPU under
            ``TRITON_INTERPRET=1``).
        outputs: preallocated output tensors (shapes and dtypes as the node's outputs); missing
            ones (``None``, or no list at all) are allocated contiguous.
    Returns:
        like the op's reference: the output tensor, or a tuple when the program has several.
    """
    kernel = compile_pointwise(program, inputs)
    outs = list(outputs) if outputs is not None else [None] * len(program.outputs)
    if len(outs) != len(program.outputs):
        raise TypeError(f"{kernel.name}: expected {len(program.outputs)} outputs, got {len(outs)}")
    if any(o is None for o in outs):
        shapes = kernel.output_shapes([tuple(t.shape) for t in inputs])
        outs = [torch.empty(s, dtype=d, device=inputs[0].device) if o is None else o
                for o, s, d in zip(outs, shapes, kernel.out_dtypes)]
    result = kernel(*inputs, *outs)
    return result[0] if len(result) == 1 else result


def cache_size() -> int:
    """How many compiled kernels the cache holds (one per program/dtypes/ranks/broadcast)."""
    return len(_kernels)


def clear_cache() -> None:
    """Forget compiled kernels (generated files stay on disk and are reused)."""
    with _lock:
        _kernels.clear()
        _functions.clear()
