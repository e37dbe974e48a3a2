"""One parametrized test of every op against plain torch (Thunder's OpInfo idea, kept small).

Each :class:`OpInfo` says how to call an op through ``tgraph.nn.functional`` (``fn``), how to
compute the same thing with plain torch, written here and independent of the op registry's
reference (``expect``), and which inputs to try (``samples``). The test records ``fn``, builds the
engine with passes on, runs it on CPU into NaN-poisoned outputs and compares with ``expect``
evaluated in fp64 on the same (already rounded) inputs. The output buffers are shaped and typed
like ``expect`` on the original dtypes, so tgraph's dtype promotion must agree with torch's.

Fused ops (``add_rms_norm``, ``swiglu``, ...) are reached the way a model reaches them: by
recording the unfused spelling and letting the passes fuse it; their entries check that the fusion
happened. :func:`test_every_registered_op_has_an_opinfo` fails for any registered op that no entry
exercises (recorded, or produced by a pass).

Tolerances come from :data:`tests.helpers.TOLERANCES` (fp32 1e-5, fp16 2e-3, bf16 2e-2, each a few
units of the dtype's last place); integer and bool results must match exactly.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.helpers import FLOAT_DTYPES, assert_close, output_names, run_engine, upcast
from tgraph.ir.network import Network
from tgraph.ir.ops import all_ops
from tgraph.ir.value import Value
from tgraph.layers.lora import lora_shrink_concat
from tgraph.nn import distributed as D
from tgraph.nn import functional as F
from tgraph.nn.functional import ActType
from tgraph.nn.module import Parameter
from tgraph.nn.network_manager import recording
from tgraph.nn.tensor import Tensor

INT_DTYPES = (torch.int32, torch.int64)
SHORT = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
         torch.int32: "i32", torch.int64: "i64", torch.bool: "bool"}


@dataclass
class Sample:
    """One set of arguments for an op.

    Attributes:
        inputs: graph inputs by name (each becomes ``Tensor(name, dtype, shape)``).
        kwargs: non-tensor arguments (scalars, dims, flags).
        shapes: symbolic shape overrides of some inputs (e.g. ``("num_tokens", 64)``).
        weights: tensors passed as named ``Parameter`` weights instead of inputs.
        expected: precomputed fp64 results (when ``expect`` can't be evaluated on the inputs,
            e.g. attention checked against unpaged K/V); ``out_dtype`` is then the outputs' dtype.
    """

    inputs: dict[str, torch.Tensor]
    kwargs: dict[str, Any] = field(default_factory=dict)
    shapes: dict[str, tuple | None] = field(default_factory=dict)
    weights: dict[str, torch.Tensor] = field(default_factory=dict)
    expected: dict[str, torch.Tensor] | None = None
    out_dtype: torch.dtype | None = None


@dataclass
class OpInfo:
    """How to test one op (or one fused op, through the spelling the passes fuse).

    Attributes:
        name: the test id.
        fn: ``fn(**inputs, **weights, **kwargs)`` on symbolic tensors, through ``F``.
        expect: the same computation with plain torch (``None`` when samples precompute it).
        samples: ``samples(dtype) -> list[Sample]``.
        dtypes: the dtypes the test runs in.
        fused_into: an op the built engine must contain (proves a fusion pass fired).
        context: a context manager factory the op needs while recording and running (e.g. a
            process group for collectives).
    """

    name: str
    fn: Callable[..., Any]
    expect: Callable[..., Any] | None
    samples: Callable[[torch.dtype], list[Sample]]
    dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES
    fused_into: str | None = None
    context: Callable[[], AbstractContextManager[Any]] = nullcontext


# ---- input makers --------------------------------------------------------------------------------

def rand(*shape: int, dtype: torch.dtype, lo: float = -2.0, hi: float = 2.0,
         device: str = "cpu") -> torch.Tensor:
    """Uniform values in ``[lo, hi)`` (integers in ``[lo, hi]``, bools at random) of ``dtype``."""
    if dtype == torch.bool:
        return torch.rand(shape, device=device) > 0.5
    if not dtype.is_floating_point:
        return torch.randint(int(lo), int(hi) + 1, shape, dtype=dtype, device=device)
    return (torch.rand(shape, device=device) * (hi - lo) + lo).to(dtype)


def nonzero(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    """Values with ``0.5 <= |x| < 2`` (safe divisors)."""
    sign = torch.where(torch.rand(shape) > 0.5, 1.0, -1.0)
    return (sign * (torch.rand(shape) * 1.5 + 0.5)).to(dtype)


def grid(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    """Small integers (as ``dtype``) so that comparisons see ties."""
    return torch.randint(-2, 3, shape).to(dtype)


# ---- pointwise -----------------------------------------------------------------------------------

def _unary(name: str, fn: Callable, expect: Callable, lo: float = -2.0, hi: float = 2.0,
           maker: Callable | None = None) -> OpInfo:
    def samples(dtype: torch.dtype) -> list[Sample]:
        make = maker or (lambda *s, dtype: rand(*s, dtype=dtype, lo=lo, hi=hi))
        return [
            Sample({"x": make(5, 16, dtype=dtype)}, shapes={"x": ("num_tokens", 16)}),
            Sample({"x": make(2, 3, 8, dtype=dtype)}),
        ]
    return OpInfo(name, lambda x: fn(x), lambda x: expect(x), samples)


SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)

UNARY_INFOS = [
    _unary("exp", F.exp, torch.exp),
    _unary("log", F.log, torch.log, 0.1, 3.0),
    _unary("sqrt", F.sqrt, torch.sqrt, 0.1, 3.0),
    _unary("rsqrt", F.rsqrt, lambda x: 1.0 / torch.sqrt(x), 0.1, 3.0),
    _unary("sin", F.sin, torch.sin, -4.0, 4.0),
    _unary("cos", F.cos, torch.cos, -4.0, 4.0),
    _unary("tanh", F.tanh, torch.tanh),
    _unary("sigmoid", F.sigmoid, lambda x: 1.0 / (1.0 + torch.exp(-x)), -4.0, 4.0),
    _unary("silu", F.silu, lambda x: x / (1.0 + torch.exp(-x)), -4.0, 4.0),
    _unary("gelu", F.gelu, lambda x: 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0))), -3.0, 3.0),
    _unary("gelu_tanh", lambda x: F.gelu(x, approximate="tanh"),
           lambda x: 0.5 * x * (1.0 + torch.tanh(SQRT_2_OVER_PI * (x + 0.044715 * x ** 3))),
           -3.0, 3.0),
    _unary("reciprocal", F.reciprocal, lambda x: 1.0 / x, maker=nonzero),
]


def _int_unary_samples(dtype: torch.dtype) -> list[Sample]:
    return [Sample({"x": rand(4, 8, dtype=dtype, lo=0, hi=3)})]


SIGNED_INFOS = [
    OpInfo("neg", lambda x: F.neg(x), lambda x: -x,
           lambda d: [Sample({"x": rand(4, 8, dtype=d)})], FLOAT_DTYPES + INT_DTYPES),
    OpInfo("abs", lambda x: F.abs(x), lambda x: torch.where(x < 0, -x, x),
           lambda d: [Sample({"x": rand(4, 8, dtype=d)})], FLOAT_DTYPES + INT_DTYPES),
    OpInfo("relu", lambda x: F.relu(x), lambda x: torch.where(x > 0, x, torch.zeros_like(x)),
           lambda d: [Sample({"x": rand(4, 8, dtype=d)})], FLOAT_DTYPES + INT_DTYPES),
    # Float ops of integer tensors give the default float dtype, as in torch.
    OpInfo("exp_sqrt_of_int", lambda x: (F.exp(x), F.sqrt(x)), lambda x: (x.exp(), x.sqrt()),
           _int_unary_samples, INT_DTYPES),
    OpInfo("logical_not", lambda x: F.logical_not(x), lambda x: x == 0,
           lambda d: [Sample({"x": rand(4, 8, dtype=d)}),
                      Sample({"x": grid(3, 5, dtype=torch.float32)})], (torch.bool,)),
]


def _binary_samples(make_a: Callable, make_b: Callable, scalar: float) -> Callable:
    def samples(dtype: torch.dtype) -> list[Sample]:
        out = [
            Sample({"a": make_a(4, 8, dtype=dtype), "b": make_b(4, 8, dtype=dtype)},
                   shapes={"a": ("n", 8), "b": ("n", 8)}),
            # broadcasting: [2, 1, 8] with [3, 8] -> [2, 3, 8]
            Sample({"a": make_a(2, 1, 8, dtype=dtype), "b": make_b(3, 8, dtype=dtype)}),
            Sample({"a": make_a(4, 8, dtype=dtype)}, {"b": scalar}),
            Sample({"b": make_b(4, 8, dtype=dtype)}, {"a": scalar}),
        ]
        if not dtype.is_floating_point:
            # an int tensor with a float scalar becomes the default float dtype
            out.append(Sample({"a": make_a(4, 8, dtype=dtype)}, {"b": scalar + 0.5}))
        return out
    return samples


def _binary(name: str, fn: Callable, expect: Callable, make_a: Callable = rand,
            make_b: Callable = rand, scalar: float = 1.5,
            dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES + (torch.int32,)) -> OpInfo:
    return OpInfo(name, fn, expect, _binary_samples(make_a, make_b, scalar), dtypes)


def _tensor_max(a, b, pick_a):
    a_t = a if isinstance(a, torch.Tensor) else torch.tensor(a)
    b_t = b if isinstance(b, torch.Tensor) else torch.tensor(b)
    return torch.where(pick_a(a_t, b_t), a_t, b_t)


def _positive(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return rand(*shape, dtype=dtype, lo=0.5, hi=2.0)


def _exponent(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return rand(*shape, dtype=dtype, lo=-1.5, hi=1.5)


BINARY_INFOS = [
    _binary("add", lambda a, b: F.add(a, b), lambda a, b: a + b),
    _binary("sub", lambda a, b: F.sub(a, b), lambda a, b: a - b),
    _binary("mul", lambda a, b: F.mul(a, b), lambda a, b: a * b),
    _binary("div", lambda a, b: F.div(a, b), lambda a, b: a / b,
            make_a=lambda *s, dtype: rand(*s, dtype=dtype, lo=-6, hi=6),
            make_b=lambda *s, dtype: (nonzero(*s, dtype=dtype) if dtype.is_floating_point
                                      else rand(*s, dtype=dtype, lo=1, hi=4)),
            scalar=-2.5),
    _binary("pow", lambda a, b: F.pow(a, b), lambda a, b: a ** b,
            make_a=_positive, make_b=_exponent, scalar=2.0, dtypes=FLOAT_DTYPES),
    _binary("maximum", lambda a, b: F.maximum(a, b),
            lambda a, b: _tensor_max(a, b, lambda x, y: x >= y), make_a=grid, make_b=grid),
    _binary("minimum", lambda a, b: F.minimum(a, b),
            lambda a, b: _tensor_max(a, b, lambda x, y: x <= y), make_a=grid, make_b=grid),
]

# bf16 + fp32 -> fp32 and int + float tensors: promotion between tensors of different dtypes.
PROMOTION_INFO = OpInfo(
    "add_mixed_dtypes", lambda a, b, c: (F.add(a, b), F.mul(c, a)), lambda a, b, c: (a + b, c * a),
    lambda d: [Sample({"a": rand(4, 8, dtype=d), "b": rand(4, 8, dtype=torch.float32),
                       "c": rand(4, 8, dtype=torch.int32)})])

COMPARE_INFOS = [
    _binary(name, fn, expect, make_a=grid, make_b=grid, scalar=1.0)
    for name, fn, expect in [
        ("eq", F.eq, lambda a, b: a == b), ("ne", F.ne, lambda a, b: a != b),
        ("lt", F.lt, lambda a, b: a < b), ("le", F.le, lambda a, b: a <= b),
        ("gt", F.gt, lambda a, b: a > b), ("ge", F.ge, lambda a, b: a >= b),
    ]
]


def _where_samples(dtype: torch.dtype) -> list[Sample]:
    cond = rand(4, 1, dtype=torch.bool)
    return [
        Sample({"c": rand(4, 8, dtype=torch.bool), "a": rand(4, 8, dtype=dtype),
                "b": rand(4, 8, dtype=dtype)}),
        Sample({"c": cond, "a": rand(4, 8, dtype=dtype), "b": rand(8, dtype=dtype)}),
        Sample({"c": cond, "a": rand(4, 8, dtype=dtype)}, {"b": 0.0}),
        Sample({"c": cond, "b": rand(1, 8, dtype=dtype)}, {"a": -1.0}),
    ]


WHERE_INFO = OpInfo("where", lambda c, a, b: F.where(c, a, b),
                    lambda c, a, b: c * a + (~c) * b if all(isinstance(t, torch.Tensor)
                                                            for t in (a, b))
                    else torch.where(c, a, b),
                    _where_samples, FLOAT_DTYPES + (torch.int64,))


def _cast_samples(dtype: torch.dtype) -> list[Sample]:
    x = rand(4, 8, dtype=dtype, lo=-5, hi=5)
    targets = (torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int64, torch.bool)
    return [Sample({"x": x}, {"dtype": t}) for t in targets if t != dtype]


CAST_INFO = OpInfo("cast", lambda x, dtype: F.cast(x, dtype), lambda x, dtype: x.to(dtype),
                   _cast_samples, FLOAT_DTYPES + (torch.int32,))


# ---- reductions ----------------------------------------------------------------------------------

def _reduce_samples(dtype: torch.dtype) -> list[Sample]:
    out = []
    for dim in (-1, 0, (0, 2), 1):
        for keepdim in (False, True):
            out.append(Sample({"x": rand(3, 4, 8, dtype=dtype)}, {"dim": dim, "keepdim": keepdim},
                              shapes={"x": ("n", 4, 8)}))
    return out


def _expect_reduce(kind: str) -> Callable:
    def expect(x, dim, keepdim):
        dims = (dim,) if isinstance(dim, int) else dim
        out = x
        for d in sorted((d % x.dim() for d in dims), reverse=True):
            if kind == "sum":
                out = out.sum(d, keepdim=True)
            elif kind == "mean":
                out = out.sum(d, keepdim=True) / x.shape[d]
            else:
                out = out.amax(d, keepdim=True)
        if not keepdim:
            for d in sorted((d % x.dim() for d in dims), reverse=True):
                out = out.squeeze(d)
        return out
    return expect


REDUCE_INFOS = [
    OpInfo("sum", lambda x, dim, keepdim: F.sum(x, dim, keepdim), _expect_reduce("sum"),
           _reduce_samples, FLOAT_DTYPES + (torch.int32,)),
    OpInfo("mean", lambda x, dim, keepdim: F.mean(x, dim, keepdim), _expect_reduce("mean"),
           _reduce_samples),
    OpInfo("amax", lambda x, dim, keepdim: F.amax(x, dim, keepdim), _expect_reduce("amax"),
           _reduce_samples, FLOAT_DTYPES + (torch.int32,)),
]


def _softmax_expect(x, dim):
    e = torch.exp(x - x.max(dim, keepdim=True).values)
    return e / e.sum(dim, keepdim=True)


SOFTMAX_INFO = OpInfo(
    "softmax", lambda x, dim: F.softmax(x, dim), _softmax_expect,
    lambda d: [Sample({"x": rand(3, 4, 8, dtype=d, lo=-4, hi=4)}, {"dim": dim},
                      shapes={"x": ("n", 4, 8)}) for dim in (-1, 1, 0)])


# ---- linear algebra and norms --------------------------------------------------------------------

def _linear_fn(x, w, b=None, transpose_a=False, transpose_b=True):
    return F.linear(x, w, b, transpose_a, transpose_b)


def _linear_expect(x, w, b=None, transpose_a=False, transpose_b=True):
    lhs = "km" if transpose_a else "...k"
    rhs = "nk" if transpose_b else "kn"
    out = torch.einsum(f"{lhs},{rhs}->{'mn' if transpose_a else '...n'}", x, w)
    return out if b is None else out + b


def _linear_samples(dtype: torch.dtype) -> list[Sample]:
    r = lambda *s: rand(*s, dtype=dtype, lo=-1, hi=1)  # noqa: E731
    return [
        Sample({"x": r(6, 16), "w": r(8, 16)}, shapes={"x": ("num_tokens", 16)}),
        Sample({"x": r(6, 16), "w": r(8, 16), "b": r(8)}),
        Sample({"x": r(6, 16), "w": r(16, 8), "b": r(8)}, {"transpose_b": False}),
        Sample({"x": r(16, 6), "w": r(8, 16)}, {"transpose_a": True}),
        Sample({"x": r(16, 6), "w": r(16, 8), "b": r(8)},
               {"transpose_a": True, "transpose_b": False}),
        Sample({"x": r(2, 3, 16), "w": r(8, 16), "b": r(8)}, shapes={"x": ("batch", "seq", 16)}),
    ]


def _matmul_samples(dtype: torch.dtype) -> list[Sample]:
    r = lambda *s: rand(*s, dtype=dtype, lo=-1, hi=1)  # noqa: E731
    return [
        Sample({"a": r(4, 8), "b": r(8, 3)}),
        Sample({"a": r(2, 4, 8), "b": r(2, 8, 5)}, shapes={"a": ("batch", 4, 8)}),
        Sample({"a": r(2, 1, 4, 8), "b": r(3, 8, 5)}),  # batch dims broadcast to [2, 3]
    ]


def _rms_expect(x, w=None, eps=1e-6):
    out = x / torch.sqrt((x * x).sum(-1, keepdim=True) / x.shape[-1] + eps)
    return out if w is None else out * w


def _rms_samples(dtype: torch.dtype) -> list[Sample]:
    return [
        Sample({"x": rand(5, 32, dtype=dtype), "w": rand(32, dtype=dtype, lo=0.5, hi=1.5)},
               shapes={"x": ("num_tokens", 32)}),
        Sample({"x": rand(5, 32, dtype=dtype)}),
        Sample({"x": rand(2, 3, 32, dtype=dtype), "w": rand(32, dtype=dtype, lo=0.5, hi=1.5)},
               {"eps": 1e-2}),
    ]


def _ln_expect(x, w=None, b=None, eps=1e-5):
    mu = x.sum(-1, keepdim=True) / x.shape[-1]
    var = ((x - mu) ** 2).sum(-1, keepdim=True) / x.shape[-1]
    out = (x - mu) / torch.sqrt(var + eps)
    if w is not None:
        out = out * w
    return out if b is None else out + b


def _ln_samples(dtype: torch.dtype) -> list[Sample]:
    w, b = rand(32, dtype=dtype, lo=0.5, hi=1.5), rand(32, dtype=dtype, lo=-0.5, hi=0.5)
    return [
        Sample({"x": rand(5, 32, dtype=dtype), "w": w, "b": b}, shapes={"x": ("num_tokens", 32)}),
        Sample({"x": rand(5, 32, dtype=dtype), "w": w}),
        Sample({"x": rand(2, 3, 32, dtype=dtype)}, {"eps": 1e-3}),
    ]


LINALG_INFOS = [
    OpInfo("linear", _linear_fn, _linear_expect, _linear_samples),
    OpInfo("matmul", lambda a, b: F.matmul(a, b), lambda a, b: a @ b, _matmul_samples),
    OpInfo("rms_norm", lambda x, w=None, eps=1e-6: F.rms_norm(x, w, eps), _rms_expect,
           _rms_samples),
    OpInfo("layer_norm", lambda x, w=None, b=None, eps=1e-5: F.layer_norm(x, w, b, eps),
           _ln_expect, _ln_samples),
]


# ---- activations ---------------------------------------------------------------------------------

def _silu64(x):
    return x / (1.0 + torch.exp(-x))


ACT_EXPECT: dict[ActType, Callable] = {
    ActType.SILU: _silu64,
    ActType.GELU: lambda x: 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0))),
    ActType.GELU_TANH: lambda x: 0.5 * x * (1.0 + torch.tanh(SQRT_2_OVER_PI
                                                             * (x + 0.044715 * x ** 3))),
    ActType.RELU: lambda x: torch.where(x > 0, x, torch.zeros_like(x)),
    ActType.SIGMOID: lambda x: 1.0 / (1.0 + torch.exp(-x)),
    ActType.SWIGLU: lambda x: _silu64(x[..., :x.shape[-1] // 2]) * x[..., x.shape[-1] // 2:],
}


def _act_info(act: ActType) -> OpInfo:
    def samples(dtype: torch.dtype) -> list[Sample]:
        return [Sample({"x": rand(5, 32, dtype=dtype, lo=-4, hi=4)},
                       shapes={"x": ("num_tokens", 32)}),
                Sample({"x": rand(2, 3, 16, dtype=dtype, lo=-4, hi=4)})]
    return OpInfo(f"activation_{act.name.lower()}", lambda x: F.activation(x, act),
                  ACT_EXPECT[act], samples,
                  fused_into="swiglu" if act is ActType.SWIGLU else None)


ACTIVATION_INFOS = [_act_info(act) for act in ActType]


# ---- shape and memory ops ------------------------------------------------------------------------

def _resolve(shape: tuple, x: torch.Tensor) -> list[int]:
    """Replace the symbol ``n`` (the first dim of ``x``) by its value."""
    return [x.shape[0] if d == "n" else d for d in shape]


def _index(x: torch.Tensor, dim: int, item: Any) -> tuple:
    return (slice(None),) * (dim % x.dim()) + (item,)


VIEW_INFOS = [
    OpInfo("reshape", lambda x, shape: F.reshape(x, shape),
           lambda x, shape: x.reshape(_resolve(shape, x)),
           lambda d: [Sample({"x": rand(4, 6, dtype=d)}, {"shape": (-1, 3)}),
                      Sample({"x": rand(4, 6, dtype=d)}, {"shape": (2, 12)}),
                      Sample({"x": rand(4, 6, dtype=d)}, {"shape": ("n", 2, 3)},
                             shapes={"x": ("n", 6)}),
                      Sample({"x": rand(4, 6, dtype=d)}, {"shape": (-1, 2, 3)},
                             shapes={"x": ("n", 6)}),
                      Sample({"x": rand(4, 6, dtype=d)}, {"shape": (-1,)},
                             shapes={"x": ("n", 6)})]),
    OpInfo("permute", lambda x, dims: F.permute(x, dims),
           lambda x, dims: x.permute(*dims),
           lambda d: [Sample({"x": rand(2, 3, 4, dtype=d)}, {"dims": (2, 0, 1)}),
                      Sample({"x": rand(2, 3, 4, dtype=d)}, {"dims": (-1, 0, 1)},
                             shapes={"x": ("n", 3, 4)})]),
    OpInfo("transpose", lambda x, a, b: F.transpose(x, a, b),
           lambda x, a, b: x.transpose(a, b),
           lambda d: [Sample({"x": rand(2, 3, 4, dtype=d)}, {"a": 0, "b": 2}),
                      Sample({"x": rand(2, 3, 4, dtype=d)}, {"a": -1, "b": -2})]),
    OpInfo("slice", lambda x, dim, start, end, step: F.slice(x, dim, start, end, step),
           lambda x, dim, start, end, step: x[_index(x, dim, slice(start, end, step))],
           lambda d: [Sample({"x": rand(3, 8, dtype=d)}, {"dim": 1, "start": 1, "end": 6,
                                                          "step": 2}),
                      Sample({"x": rand(3, 8, dtype=d)}, {"dim": -1, "start": -3, "end": None,
                                                          "step": 1}),
                      Sample({"x": rand(5, 8, dtype=d)}, {"dim": 0, "start": 1, "end": 100,
                                                          "step": 1}),
                      Sample({"x": rand(5, 8, dtype=d)}, {"dim": 0, "start": 0, "end": 2,
                                                          "step": 1}, shapes={"x": ("n", 8)})]),
    OpInfo("select", lambda x, dim, index: F.select(x, dim, index),
           lambda x, dim, index: x[_index(x, dim, index)],
           lambda d: [Sample({"x": rand(3, 4, 5, dtype=d)}, {"dim": 0, "index": 1}),
                      Sample({"x": rand(3, 4, 5, dtype=d)}, {"dim": -1, "index": -1})]),
    OpInfo("unsqueeze", lambda x, dim: F.unsqueeze(x, dim), lambda x, dim: x.unsqueeze(dim),
           lambda d: [Sample({"x": rand(3, 4, dtype=d)}, {"dim": k}) for k in (0, 1, -1)]),
    OpInfo("squeeze", lambda x, dim: F.squeeze(x, dim),
           lambda x, dim: x.reshape([s for i, s in enumerate(x.shape) if i != dim % x.dim()]),
           lambda d: [Sample({"x": rand(3, 1, 4, dtype=d)}, {"dim": k}) for k in (1, -2)]),
    OpInfo("contiguous", lambda x: F.contiguous(F.transpose(x, 0, 1)),
           lambda x: x.t().clone(), lambda d: [Sample({"x": rand(3, 5, dtype=d)})]),
]


def _split_samples(dtype: torch.dtype) -> list[Sample]:
    return [
        Sample({"x": rand(4, 8, dtype=dtype)}, {"sizes": [2, 3, 3], "dim": -1}),
        Sample({"x": rand(7, 4, dtype=dtype)}, {"sizes": 3, "dim": 0}),  # chunks of 3, 3, 1
        Sample({"x": rand(4, 8, dtype=dtype)}, {"sizes": [0, 4, 4], "dim": 1},
               shapes={"x": ("n", 8)}),
    ]


def _split_expect(x, sizes, dim):
    d = dim % x.dim()
    total = x.shape[d]
    if isinstance(sizes, int):
        sizes = [min(sizes, total - i) for i in range(0, total, sizes)]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return tuple(x[_index(x, d, slice(s, s + n))] for s, n in zip(starts, sizes))


def _cat_samples(dtype: torch.dtype) -> list[Sample]:
    return [
        Sample({"a": rand(2, 4, dtype=dtype), "b": rand(3, 4, dtype=dtype),
                "c": rand(1, 4, dtype=dtype)}, {"dim": 0, "as_list": False}),
        Sample({"a": rand(3, 4, dtype=dtype), "b": rand(3, 2, dtype=dtype),
                "c": rand(3, 3, dtype=dtype)}, {"dim": -1, "as_list": True},
               shapes={"a": ("n", 4), "b": ("n", 2), "c": ("n", 3)}),
        Sample({"a": rand(2, 1, 3, dtype=dtype), "b": rand(2, 2, 3, dtype=dtype),
                "c": rand(2, 4, 3, dtype=dtype), "d": rand(2, 1, 3, dtype=dtype)},
               {"dim": 1, "as_list": True}),
    ]


def _cat_fn(dim, as_list, **tensors):
    parts = [tensors[k] for k in sorted(tensors)]
    return F.cat(parts, dim=dim) if as_list else F.cat(*parts, dim=dim)


def _cat_expect(dim, as_list, **tensors):
    parts = [tensors[k] for k in sorted(tensors)]
    d = dim % parts[0].dim()
    shape = list(parts[0].shape)
    shape[d] = sum(p.shape[d] for p in parts)
    out = parts[0].new_empty(shape)
    start = 0
    for p in parts:
        out[_index(out, d, slice(start, start + p.shape[d]))] = p
        start += p.shape[d]
    return out


def _gather_samples(dtype: torch.dtype) -> list[Sample]:
    return [
        # lm_head_indices style: pick rows (with a repeat) of the hidden states
        Sample({"x": rand(6, 8, dtype=dtype), "i": torch.tensor([5, 0, 2, 2])}, {"dim": 0},
               shapes={"x": ("num_tokens", 8), "i": ("batch",)}),
        Sample({"x": rand(6, 8, dtype=dtype), "i": torch.tensor([[1, 3, 5], [0, 0, 4]],
                                                                dtype=torch.int32)}, {"dim": 0}),
        Sample({"x": rand(2, 6, 3, dtype=dtype), "i": torch.tensor([4, 1], dtype=torch.int32)},
               {"dim": 1}),
        Sample({"x": rand(4, 7, dtype=dtype), "i": torch.tensor([6, 0, 3])}, {"dim": -1}),
    ]


def _gather_expect(x, i, dim):
    d = dim % x.dim()
    flat = i.reshape(-1).tolist()
    rows = [x[_index(x, d, j)] for j in flat]  # each drops dim d
    return torch.stack(rows, d).reshape(x.shape[:d] + i.shape + x.shape[d + 1:])


def _embedding_samples(dtype: torch.dtype) -> list[Sample]:
    w = rand(10, 16, dtype=dtype)
    return [
        Sample({"ids": torch.tensor([[1, 9, 0, 3, 3], [2, 2, 8, 7, 0]], dtype=torch.int32),
                "w": w}),
        Sample({"ids": torch.tensor([4, 0, 9, 1, 1, 5, 6]), "w": w},
               shapes={"ids": ("num_tokens",)}),
    ]


MEMORY_INFOS = [
    OpInfo("split", lambda x, sizes, dim: F.split(x, sizes, dim), _split_expect, _split_samples),
    OpInfo("cat", _cat_fn, _cat_expect, _cat_samples),
    OpInfo("gather", lambda x, i, dim: F.gather(x, dim, i), _gather_expect, _gather_samples),
    OpInfo("embedding", lambda ids, w: F.embedding(ids, w),
           lambda ids, w: torch.stack([w[j] for j in ids.reshape(-1).tolist()]).reshape(
               ids.shape + w.shape[1:]), _embedding_samples),
]


# ---- rotary embedding ----------------------------------------------------------------------------

def rope_tables(positions: torch.Tensor, rot_dim: int, dtype: torch.dtype,
                base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin ``[tokens, rot_dim / 2]`` at ``positions``."""
    inv_freq = base ** (-torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim)
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :].to(positions.device)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rope_expect_one(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    interleaved: bool) -> torch.Tensor:
    """Rotate with complex numbers: pair ``(x[2i], x[2i+1])`` (interleaved) or
    ``(x[i], x[i + half])`` is ``re + i*im``, multiplied by ``cos + i*sin``."""
    half = cos.shape[-1]
    xr = x[..., :2 * half].to(torch.float64)
    if interleaved:
        pairs = xr.reshape(*xr.shape[:-1], half, 2)
    else:
        pairs = torch.stack((xr[..., :half], xr[..., half:]), dim=-1)
    z = torch.view_as_complex(pairs.contiguous())
    w = torch.complex(cos.to(torch.float64), sin.to(torch.float64))[:, None, :]
    turned = torch.view_as_real(z * w)
    rotated = turned.flatten(-2) if interleaved else torch.cat((turned[..., 0], turned[..., 1]), -1)
    return torch.cat((rotated, x[..., 2 * half:].to(torch.float64)), dim=-1).to(x.dtype)


def _rope_samples(dtype: torch.dtype) -> list[Sample]:
    out = []
    positions = torch.tensor([0, 7, 3, 100, 2047])
    for rot_dim, table_dtype in ((16, dtype), (8, torch.float32)):  # full, then partial rotary
        cos, sin = rope_tables(positions, rot_dim, table_dtype)
        for interleaved in (False, True):
            out.append(Sample({"q": rand(5, 4, 16, dtype=dtype), "k": rand(5, 2, 16, dtype=dtype),
                               "cos": cos, "sin": sin}, {"interleaved": interleaved},
                              shapes={"q": ("num_tokens", 4, 16), "k": ("num_tokens", 2, 16),
                                      "cos": ("num_tokens", rot_dim // 2),
                                      "sin": ("num_tokens", rot_dim // 2)}))
    return out


ROPE_INFO = OpInfo(
    "rope", lambda q, k, cos, sin, interleaved: F.rope(q, k, cos, sin, interleaved),
    lambda q, k, cos, sin, interleaved: (rope_expect_one(q, cos, sin, interleaved),
                                         rope_expect_one(k, cos, sin, interleaved)),
    _rope_samples)


# ---- KV cache and paged attention ----------------------------------------------------------------

def cache_write_expect(k, v, k_cache, v_cache, slots_mapping):
    """Naive per-token copy into clones of the caches; negative slots_mapping write nothing."""
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    block_size = k_cache.shape[1]
    for t, slot in enumerate(slots_mapping.tolist()):
        if slot >= 0:
            k_cache[slot // block_size, slot % block_size] = k[t]
            v_cache[slot // block_size, slot % block_size] = v[t]
    return k_cache, v_cache


def _cache_samples(dtype: torch.dtype) -> list[Sample]:
    out = []
    for slot_dtype in (torch.int32, torch.int64):
        slots_mapping = torch.randperm(20)[:6].to(slot_dtype)
        slots_mapping[1] = slots_mapping[4] = -1  # padding tokens: skipped
        out.append(Sample({"k": rand(6, 2, 8, dtype=dtype), "v": rand(6, 2, 8, dtype=dtype),
                           "k_cache": rand(5, 4, 2, 8, dtype=dtype),
                           "v_cache": rand(5, 4, 2, 8, dtype=dtype),
                           "slots_mapping": slots_mapping},
                          shapes={"k": ("num_tokens", 2, 8), "v": ("num_tokens", 2, 8),
                                  "slots_mapping": ("num_tokens",)}))
    return out


CACHE_INFO = OpInfo("reshape_and_cache",
                    lambda k, v, k_cache, v_cache, slots_mapping: F.reshape_and_cache(
                        k, v, k_cache, v_cache, slots_mapping),
                    cache_write_expect, _cache_samples)


def naive_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                    q_lens: list[int], scale: float, window: int | None) -> torch.Tensor:
    """Causal attention on unpaged per-sequence K/V ``[seq_len, kv_heads, d]``, in fp64.

    Query ``i`` of a sequence with ``q_len`` queries and ``seq_len`` keys sits at position
    ``seq_len - q_len + i`` and sees keys ``j <= p`` with ``p - j < window``.
    """
    tokens, q_heads, head_dim = q.shape
    out = torch.zeros(tokens, q_heads, head_dim, dtype=torch.float64, device=q.device)
    start = 0
    for k, v, n in zip(keys, values, q_lens):
        seq_len, kv_heads = k.shape[0], k.shape[1]
        if n == 0:
            continue
        group = q_heads // kv_heads
        # q head h reads kv head h // group: split the q heads as [kv_heads, group].
        qb = q[start:start + n].to(torch.float64).reshape(n, kv_heads, group, head_dim)
        scores = torch.einsum("nhgd,lhd->hgnl", qb, k.to(torch.float64)) * scale
        p = torch.arange(seq_len - n, seq_len, device=q.device)[:, None]
        j = torch.arange(seq_len, device=q.device)[None, :]
        visible = j <= p
        if window is not None:
            visible &= (p - j) < window
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        ob = torch.einsum("hgnl,lhd->nhgd", probs, v.to(torch.float64))
        out[start:start + n] = ob.reshape(n, q_heads, head_dim)
        start += n
    return out


def attention_sample(dtype: torch.dtype, *, q_lens: list[int], seq_len: list[int], q_heads: int,
                     kv_heads: int, head_dim: int, block_size: int, decode: bool = False,
                     sliding_window: int | None = None, scale: float | None = None,
                     write_new: bool = False, device: str = "cpu") -> Sample:
    """Random per-sequence K/V paged into a cache through a shuffled block table.

    Block 0 is a never-owned "null" block and every slot that holds no key is NaN, so a kernel
    that reads past ``seq_len`` or through a padded block-table entry produces NaN. With
    ``write_new`` the new tokens' k/v are left out of the cache and given as inputs with their
    slots_mapping (to be written by ``reshape_and_cache`` before attention reads them).
    """
    keys = [rand(n, kv_heads, head_dim, dtype=dtype, lo=-1, hi=1, device=device) for n in seq_len]
    values = [rand(n, kv_heads, head_dim, dtype=dtype, lo=-1, hi=1, device=device)
              for n in seq_len]
    q = rand(sum(q_lens), q_heads, head_dim, dtype=dtype, lo=-1, hi=1, device=device)
    blocks_per_seq = [-(-n // block_size) for n in seq_len]
    num_blocks = 1 + sum(blocks_per_seq) + 2
    owned = (torch.randperm(num_blocks - 1) + 1).tolist()  # shuffled, never block 0
    max_blocks = max(max(blocks_per_seq), 1)
    table = torch.zeros(len(seq_len), max_blocks, dtype=torch.int32)
    k_cache = torch.full((num_blocks, block_size, kv_heads, head_dim), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    new_k, new_v, slots_mapping = [], [], []
    for b, (n_keys, q_len) in enumerate(zip(seq_len, q_lens)):
        table[b, :blocks_per_seq[b]] = torch.tensor(owned[:blocks_per_seq[b]], dtype=torch.int32)
        owned = owned[blocks_per_seq[b]:]
        j = torch.arange(n_keys)
        flat = table[b, j // block_size].long() * block_size + j % block_size
        cached = j < n_keys - q_len if write_new else torch.ones(n_keys, dtype=torch.bool)
        k_cache.view(-1, kv_heads, head_dim)[flat[cached]] = keys[b].cpu()[cached]
        v_cache.view(-1, kv_heads, head_dim)[flat[cached]] = values[b].cpu()[cached]
        if write_new:
            new_k.append(keys[b].cpu()[~cached])
            new_v.append(values[b].cpu()[~cached])
            slots_mapping.append(flat[~cached])
    scale_value = head_dim ** -0.5 if scale is None else scale
    expected = naive_attention(q, keys, values, q_lens, scale_value, sliding_window)
    inputs = {"q": q, "k_cache": k_cache.to(device), "v_cache": v_cache.to(device),
              "block_table": table.to(device),
              "seq_len": torch.tensor(seq_len, dtype=torch.int32, device=device)}
    if not decode:
        starts = [0]
        for n in q_lens:
            starts.append(starts[-1] + n)
        inputs["query_start_loc"] = torch.tensor(starts, dtype=torch.int32, device=device)
    if write_new:
        inputs["k"] = torch.cat(new_k).to(device)
        inputs["v"] = torch.cat(new_v).to(device)
        inputs["slots_mapping"] = torch.cat(slots_mapping).to(device=device, dtype=torch.int32)
    shapes = {"q": ("num_tokens", q_heads, head_dim), "block_table": ("batch", max_blocks),
              "seq_len": ("batch",)}
    if write_new:
        shapes.update(k=("num_tokens", kv_heads, head_dim), v=("num_tokens", kv_heads, head_dim),
                      slots_mapping=("num_tokens",))
    return Sample(inputs, {"scale": scale, "sliding_window": sliding_window}, shapes=shapes,
                  expected={"out": expected}, out_dtype=dtype)


def _attention_samples(dtype: torch.dtype) -> list[Sample]:
    common = dict(q_heads=4, head_dim=16, block_size=4)
    return [
        # prefill, GQA (2 q heads per kv head), mixed lengths
        attention_sample(dtype, q_lens=[5, 1, 9], seq_len=[5, 1, 9], kv_heads=2, **common),
        # decode, MQA, mixed context lengths
        attention_sample(dtype, q_lens=[1, 1, 1, 1], seq_len=[1, 6, 9, 13], kv_heads=1,
                         decode=True, **common),
        # chunked prefill: new queries after a cached context; one sequence with no new query
        attention_sample(dtype, q_lens=[3, 4, 0], seq_len=[10, 4, 6], kv_heads=2, **common),
        # sliding window and an explicit scale, prefill and decode
        attention_sample(dtype, q_lens=[7, 3], seq_len=[7, 11], kv_heads=2, sliding_window=3,
                         scale=0.3, **common),
        attention_sample(dtype, q_lens=[1, 1], seq_len=[9, 3], kv_heads=4, sliding_window=4,
                         decode=True, **common),
    ]


def _attention_fn(q, k_cache, v_cache, block_table, seq_len, query_start_loc=None, scale=None,
                  sliding_window=None):
    return F.paged_attention(q, k_cache, v_cache, block_table, seq_len, query_start_loc,
                             scale=scale, sliding_window=sliding_window)


def _chunked_write_samples(dtype: torch.dtype) -> list[Sample]:
    return [attention_sample(dtype, q_lens=[3, 5, 1], seq_len=[9, 5, 4], q_heads=4, kv_heads=2,
                             head_dim=16, block_size=4, write_new=True),
            attention_sample(dtype, q_lens=[1, 1, 1], seq_len=[3, 8, 1], q_heads=4, kv_heads=2,
                             head_dim=16, block_size=4, write_new=True, decode=True,
                             sliding_window=2)]


def _write_then_attend(q, k, v, k_cache, v_cache, slots_mapping, block_table, seq_len,
                       query_start_loc=None, scale=None, sliding_window=None):
    k_cache, v_cache = F.reshape_and_cache(k, v, k_cache, v_cache, slots_mapping)
    return _attention_fn(q, k_cache, v_cache, block_table, seq_len, query_start_loc, scale,
                         sliding_window)


ATTENTION_INFOS = [
    OpInfo("paged_attention", _attention_fn, None, _attention_samples),
    OpInfo("cache_write_then_attention", _write_then_attend, None, _chunked_write_samples),
]


# ---- fused ops, reached through the passes -------------------------------------------------------

def _add_rms_samples(dtype: torch.dtype) -> list[Sample]:
    return [Sample({"x": rand(5, 32, dtype=dtype), "r": rand(5, 32, dtype=dtype),
                    "w": rand(32, dtype=dtype, lo=0.5, hi=1.5)}, {"eps": 1e-5},
                   shapes={"x": ("num_tokens", 32), "r": ("num_tokens", 32)})]


def _silu_mul_samples(dtype: torch.dtype) -> list[Sample]:
    return [Sample({"gate": rand(5, 16, dtype=dtype, lo=-4, hi=4), "up": rand(5, 16, dtype=dtype)},
                   shapes={"gate": ("num_tokens", 16), "up": ("num_tokens", 16)})]


def _rope_cache_fn(q, k, v, cos, sin, k_cache, v_cache, slots_mapping, interleaved):
    q_rot, k_rot = F.rope(q, k, cos, sin, interleaved)
    kc, vc = F.reshape_and_cache(k_rot, v, k_cache, v_cache, slots_mapping)
    return q_rot, kc, vc


def _rope_cache_expect(q, k, v, cos, sin, k_cache, v_cache, slots_mapping, interleaved):
    kc, vc = cache_write_expect(rope_expect_one(k, cos, sin, interleaved).to(k_cache.dtype), v,
                                k_cache, v_cache, slots_mapping)
    return rope_expect_one(q, cos, sin, interleaved), kc, vc


def _rope_cache_samples(dtype: torch.dtype) -> list[Sample]:
    out = []
    for interleaved in (False, True):
        cos, sin = rope_tables(torch.tensor([3, 4, 5, 0, 9, 1]), 8, torch.float32)
        slots_mapping = torch.tensor([7, -1, 0, 12, 3, 19], dtype=torch.int32)
        out.append(Sample({"q": rand(6, 4, 16, dtype=dtype), "k": rand(6, 2, 16, dtype=dtype),
                           "v": rand(6, 2, 16, dtype=dtype), "cos": cos, "sin": sin,
                           "k_cache": rand(5, 4, 2, 16, dtype=dtype),
                           "v_cache": rand(5, 4, 2, 16, dtype=dtype),
                           "slots_mapping": slots_mapping},
                          {"interleaved": interleaved}))
    return out


def _rope_attention_fn(q, k, v, cos, sin, k_cache, v_cache, slots_mapping, block_table, seq_len,
                       interleaved=False, scale=None, sliding_window=None):
    q_rot, k_rot = F.rope(q, k, cos, sin, interleaved)
    kc, vc = F.reshape_and_cache(k_rot, v, k_cache, v_cache, slots_mapping)
    return _attention_fn(q_rot, kc, vc, block_table, seq_len, None, scale, sliding_window)


def _rope_attention_samples(dtype: torch.dtype) -> list[Sample]:
    """Decode samples whose q and new k arrive unrotated: the cache-write samples' q and k turned
    back by the step's angles, so rotating them again gives what the expectation attended."""
    from tgraph.ir.ops.attention import _rotate

    out = []
    for interleaved, window in ((False, None), (True, 2)):
        s = attention_sample(dtype, q_lens=[1, 1, 1], seq_len=[3, 8, 1], q_heads=4, kv_heads=2,
                             head_dim=16, block_size=4, write_new=True, decode=True,
                             sliding_window=window)
        angles = torch.rand(3, 8) * 6.0
        cos, sin = angles.cos(), angles.sin()
        for name in ("q", "k"):
            s.inputs[name] = _rotate(s.inputs[name], cos, -sin, interleaved)
        s.inputs.update(cos=cos, sin=sin)
        s.shapes.update(cos=("batch", 8), sin=("batch", 8))
        for name in ("q", "k", "v", "slots_mapping"):
            s.shapes[name] = ("batch",) + tuple(s.shapes[name][1:])
        s.kwargs["interleaved"] = interleaved
        out.append(s)
    return out


def _qk_norm_attention_fn(q, k, v, qw, kw, cos, sin, k_cache, v_cache, slots_mapping,
                          block_table, seq_len, eps, **attrs):
    return _rope_attention_fn(F.rms_norm(q, qw, eps), F.rms_norm(k, kw, eps), v, cos, sin,
                              k_cache, v_cache, slots_mapping, block_table, seq_len, **attrs)


def _qk_norm_attention_expect(q, k, v, qw, kw, cos, sin, k_cache, v_cache, slots_mapping,
                              block_table, seq_len, eps, **attrs):
    """The fused op's reference (norms, rope, cache write and attention composed) in fp64."""
    from tgraph.ir.ops.fused import qk_norm_rope_cache_attention_reference

    return qk_norm_rope_cache_attention_reference(
        q, k, v, qw, kw, cos, sin, k_cache, v_cache, slots_mapping, block_table, seq_len,
        eps=eps, **attrs)[0]


def _qk_norm_attention_samples(dtype: torch.dtype) -> list[Sample]:
    samples = _rope_attention_samples(dtype)
    for s in samples:
        s.expected, s.out_dtype = None, None
        s.weights.update(qw=rand(16, dtype=dtype, lo=0.5, hi=1.5),
                         kw=rand(16, dtype=dtype, lo=0.5, hi=1.5))
        s.kwargs["eps"] = 1e-6
    return samples


def _epilogue_fn(x, w, b=None, r=None, act=None):
    out = F.linear(x, w, b)
    if act is not None:
        out = F.activation(out, act)
    return out if r is None else out + r


def _epilogue_expect(x, w, b=None, r=None, act=None):
    out = torch.einsum("...k,nk->...n", x, w)
    if b is not None:
        out = out + b
    if act is not None:
        out = ACT_EXPECT[act](out)
    return out if r is None else out + r


def _epilogue_samples(dtype: torch.dtype) -> list[Sample]:
    r = lambda *s: rand(*s, dtype=dtype, lo=-1, hi=1)  # noqa: E731
    return [
        Sample({"x": r(6, 16), "w": r(8, 16), "b": r(8), "r": r(6, 8)}),
        Sample({"x": r(6, 16), "w": r(8, 16)}, {"act": ActType.SILU}),
        Sample({"x": r(6, 16), "w": r(8, 16), "b": r(8)}, {"act": ActType.GELU_TANH}),
    ]


def _norm_linear_fn(x, g, w, eps, gated=False):
    out = F.linear(F.rms_norm(x, g, eps), w)
    if not gated:
        return out
    gate, up = F.split(out, [out.shape[-1] // 2] * 2, -1)
    return F.silu(gate) * up


def _norm_linear_expect(x, g, w, eps, gated=False):
    out = torch.einsum("...k,nk->...n", _rms_expect(x, g, eps), w)
    if not gated:
        return out
    gate, up = out.chunk(2, dim=-1)
    return _silu64(gate) * up


def _norm_linear_samples(dtype: torch.dtype) -> list[Sample]:
    r = lambda *s: rand(*s, dtype=dtype, lo=-1, hi=1)  # noqa: E731
    # Weights of scale 1/sqrt(K), as in a model: the normed activations are O(1) and rounded to
    # the dtype before the matmul (the unfused order), which the fp64 expectation does not do;
    # this keeps that rounding within the dtype's tolerance.
    w = (r(16, 32).double() / 32**0.5).to(dtype)
    return [Sample({"x": r(3, 32)}, {"eps": 1e-5, "gated": gated},
                   weights={"g": rand(32, dtype=dtype, lo=0.5, hi=1.5), "w": w},
                   shapes={"x": ("batch", 32)})
            for gated in (False, True)]


def _merged_linear_samples(dtype: torch.dtype) -> list[Sample]:
    r = lambda *s: rand(*s, dtype=dtype, lo=-1, hi=1)  # noqa: E731
    return [Sample({"x": r(5, 16)}, weights={"wq": r(8, 16), "wk": r(4, 16), "wv": r(4, 16)},
                   shapes={"x": ("num_tokens", 16)})]


FUSED_INFOS = [
    OpInfo("fused_add_rms_norm",
           lambda x, r, w, eps: (F.rms_norm(x + r, w, eps), x + r),
           lambda x, r, w, eps: (_rms_expect(x + r, w, eps), x + r), _add_rms_samples,
           fused_into="add_rms_norm"),
    OpInfo("fused_silu_mul", lambda gate, up: F.silu(gate) * up,
           lambda gate, up: _silu64(gate) * up, _silu_mul_samples, fused_into="silu_mul"),
    OpInfo("fused_rope_cache", _rope_cache_fn, _rope_cache_expect, _rope_cache_samples,
           fused_into="rope_cache"),
    # Decode: the rope and the cache write move into the attention kernel (RopeAttention).
    OpInfo("fused_rope_cache_attention", _rope_attention_fn, None, _rope_attention_samples,
           fused_into="rope_cache_attention"),
    # Decode, Qwen3: the per-head q/k RMSNorms move into that kernel too (QkNormAttention).
    OpInfo("fused_qk_norm_rope_cache_attention", _qk_norm_attention_fn,
           _qk_norm_attention_expect, _qk_norm_attention_samples,
           fused_into="qk_norm_rope_cache_attention"),
    OpInfo("fused_linear_epilogue", _epilogue_fn, _epilogue_expect, _epilogue_samples,
           fused_into="linear_epilogue"),
    # RMSNorm into the linear after it (and the gate after that), by NormLinear.
    OpInfo("fused_norm_linear", _norm_linear_fn, _norm_linear_expect, _norm_linear_samples,
           fused_into="norm_linear"),
    # q/k/v projections of one input, with weights: merged into one GEMM by HorizontalLinear.
    OpInfo("merged_qkv_linear",
           lambda x, wq, wk, wv: (F.linear(x, wq), F.linear(x, wk), F.linear(x, wv)),
           lambda x, wq, wk, wv: tuple(torch.einsum("tk,nk->tn", x, w) for w in (wq, wk, wv)),
           _merged_linear_samples),
]

def _pointwise_chain(x, b):
    e = F.exp(x - F.amax(x, -1, keepdim=True))
    soft = e / F.sum(e, -1, keepdim=True)
    gated = F.where(x > 0.0, F.tanh(x * 0.5 + b), -x)
    return soft, gated


def _pointwise_chain_expect(x, b):
    return _softmax_expect(x, -1), torch.where(x > 0, torch.tanh(x * 0.5 + b), -x)


# Once a generic pointwise fusion registers ``fused_pointwise``, this entry requires that the
# chain is fused into it (and, like every entry, that the fused result still equals torch).
_POINTWISE_FUSED = "fused_pointwise" if "fused_pointwise" in {o.name for o in all_ops()} else None
FUSED_INFOS.append(OpInfo(
    "fused_pointwise_chain", _pointwise_chain, _pointwise_chain_expect,
    lambda d: [Sample({"x": rand(4, 16, dtype=d, lo=-3, hi=3), "b": rand(16, dtype=d)}),
               Sample({"x": rand(3, 2, 8, dtype=d, lo=-3, hi=3), "b": rand(8, dtype=d)},
                      shapes={"x": ("n", 2, 8)})],
    fused_into=_POINTWISE_FUSED))

# ---- collectives ---------------------------------------------------------------------------------

@contextmanager
def single_rank_group() -> Iterator[None]:
    """A one-process gloo group (made here unless one exists), for recording and running
    collectives. Their multi-rank results are checked by tests/distributed/test_tp_gloo.py."""
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _collective_samples(dtype: torch.dtype) -> list[Sample]:
    return [Sample({"x": rand(3, 4, dtype=dtype)}, {"dim": -1}, shapes={"x": ("num_tokens", 4)}),
            Sample({"x": rand(2, 3, 4, dtype=dtype)}, {"dim": 0})]


def _all_reduce_add_rms(x, r, w, eps):
    h = r + D.all_reduce(x)
    return F.rms_norm(h, w, eps), h


COLLECTIVE_INFOS = [
    # With one rank the sum over ranks is the input and the gather along ``dim`` is the input.
    OpInfo("fused_all_reduce_add_rms_norm", _all_reduce_add_rms,
           lambda x, r, w, eps: (_rms_expect(r + x, w, eps), r + x), _add_rms_samples,
           fused_into="all_reduce_add_rms_norm", context=single_rank_group),
    OpInfo("all_reduce", lambda x, dim: D.all_reduce(F.exp(x)), lambda x, dim: torch.exp(x),
           _collective_samples, context=single_rank_group),
    OpInfo("all_gather", lambda x, dim: D.all_gather(F.exp(x), dim),
           lambda x, dim: torch.cat([torch.exp(x)], dim), _collective_samples,
           context=single_rank_group),
]


def _lora_shrink_concat_samples(dtype):
    r = lambda *s: rand(*s, dtype=dtype, lo=-1, hi=1)  # noqa: E731
    slots = torch.tensor([0, 2, 1, 2, 0, 1, 1], dtype=torch.int32)  # 0: no adapter
    order = torch.argsort(slots, stable=True).to(torch.int32)
    seg_start = torch.searchsorted(slots[order.long()], torch.arange(4, dtype=torch.int32),
                                   out_int32=True)
    inputs = {"x": r(7, 16), "a": r(3, 4, 16), "scaling": torch.tensor([0.0, 0.5, 2.0]),
              "slots": slots, "order": order, "seg_start": seg_start,
              "counters": torch.zeros(8, dtype=torch.int32)}
    tokens = {"x": ("num_tokens", 16), "slots": ("num_tokens",), "order": ("num_tokens",)}
    # Blocks right after x, then with lead columns and trailing padding (another feature's).
    return [Sample(inputs, {"lead": 0, "width": 8}, shapes=tokens),
            Sample(dict(inputs), {"lead": 3, "width": 16}, shapes=tokens)]


def _lora_shrink_concat_expect(x, a, scaling, slots, order, seg_start, counters, lead, width):
    rank = a.shape[1]
    rows = []
    for t, s in enumerate(slots.tolist()):
        lora = torch.zeros(width, dtype=x.dtype)
        if s:
            first = lead + (s - 1) * rank
            lora[first:first + rank] = scaling[s].to(x.dtype) * (a[s] @ x[t])
        rows.append(torch.cat([x[t], lora]))
    return torch.stack(rows)


LORA_INFO = OpInfo("lora_shrink_concat",
                   lambda x, a, scaling, slots, order, seg_start, counters, lead, width:
                   lora_shrink_concat(x, a, scaling, slots, order, seg_start, counters, lead=lead,
                                      width=width),
                   _lora_shrink_concat_expect, _lora_shrink_concat_samples)


def _lora_prologue_samples(dtype, prologue: str):
    """The shrink samples with x replaced by the producer's inputs (LoraPrologue fuses them)."""
    samples = []
    for sample in _lora_shrink_concat_samples(dtype):
        inputs = dict(sample.inputs)
        x = inputs.pop("x")
        # A of scale 1/sqrt(K), as adapters have: the producer's output is rounded to the dtype
        # before the shrink (the unfused order), which the fp64 expectation does not do; this
        # keeps that rounding, summed over K, within the dtype's tolerance.
        inputs["a"] = (inputs["a"].double() / x.shape[1] ** 0.5).to(dtype)
        tokens = {k: v for k, v in sample.shapes.items() if k != "x"}
        head = {"x": x, "w": rand(x.shape[1], dtype=dtype, lo=0.5, hi=1.5)}
        if prologue == "add_rms_norm":
            head["r"] = rand(*x.shape, dtype=dtype)
        tokens.update({k: ("num_tokens", v.shape[1]) for k, v in head.items() if v.dim() == 2})
        kwargs = dict(sample.kwargs, eps=1e-5)
        samples.append(Sample({**head, **inputs}, kwargs, shapes=tokens))
    return samples


def _lora_prologue_info(prologue: str) -> OpInfo:
    lora_args = ("a", "scaling", "slots", "order", "seg_start", "counters")

    def shrink(x, kw):
        return lora_shrink_concat(x, *(kw[k] for k in lora_args), lead=kw["lead"],
                                  width=kw["width"])

    def expect(x, kw):
        return _lora_shrink_concat_expect(x, *(kw[k] for k in lora_args), kw["lead"], kw["width"])

    if prologue == "rms_norm":
        fn = lambda x, w, eps, **kw: shrink(F.rms_norm(x, w, eps), kw)  # noqa: E731
        want = lambda x, w, eps, **kw: expect(_rms_expect(x, w, eps), kw)  # noqa: E731
    else:
        # The sum is an output too: the fused op's second output keeps it.
        fn = lambda x, r, w, eps, **kw: (shrink(F.rms_norm(x + r, w, eps), kw), x + r)  # noqa: E731
        want = lambda x, r, w, eps, **kw: (expect(_rms_expect(x + r, w, eps), kw), x + r)  # noqa: E731
    return OpInfo(f"fused_{prologue}_lora_concat", fn, want,
                  lambda dtype: _lora_prologue_samples(dtype, prologue),
                  fused_into=f"{prologue}_lora_concat")


# The producer of a LoRA linear's input folded into its shrink (LoraPrologue).
LORA_PROLOGUE_INFOS = [_lora_prologue_info(p) for p in ("rms_norm", "add_rms_norm")]

def _sdpa_fn(q, k_cache, v_cache, block_table, seq_len, query_start_loc=None, scale=None,
             sliding_window=None):
    return F.sdpa_attention(q, k_cache, v_cache, block_table, seq_len, query_start_loc,
                            scale=scale, sliding_window=sliding_window)


SDPA_INFO = OpInfo("sdpa_attention", _sdpa_fn, None,
                   lambda dtype: [s for s in _attention_samples(dtype)
                                  if "query_start_loc" in s.inputs])
TO_DEVICE_INFO = OpInfo("to_device", lambda x: F.to_device(x, "cpu:1"), lambda x: x.clone(),
                        lambda dtype: [Sample({"x": rand(5, 8, dtype=dtype)},
                                              shapes={"x": ("num_tokens", 8)})])

# A hint: x comes back unchanged whatever the weights (the kernel prefetches them on CUDA only).
PREFETCH_INFO = OpInfo(
    "l2_prefetch",
    lambda x, w_o, w_gate_up: F.record("l2_prefetch", [x, w_o, w_gate_up], halves=(1, 2)),
    lambda x, w_o, w_gate_up: x,
    lambda dtype: [Sample({"x": rand(3, 4, 8, dtype=dtype)}, shapes={"x": ("num_tokens", 4, 8)},
                          weights={"w_o": rand(32, 32, dtype=dtype),
                                   "w_gate_up": rand(64, 32, dtype=dtype)})])

def _moe_expect(x, logits, w13, w2, top_k=2, renormalize=True):
    """Each token's top-k experts by softmax probability, one token at a time."""
    inter = w2.shape[-1]
    out = torch.zeros_like(x)
    probs = torch.softmax(logits, -1)
    for t in range(x.shape[0]):
        top = torch.topk(probs[t], top_k)
        weights = top.values / top.values.sum() if renormalize else top.values
        for w, e in zip(weights, top.indices):
            gu = w13[e] @ x[t]
            out[t] += w * (w2[e] @ (gu[:inter] * torch.sigmoid(gu[:inter]) * gu[inter:]))
    return out


MOE_INFO = OpInfo(
    "moe",
    lambda x, logits, w13, w2, top_k=2, renormalize=True: F.moe(x, logits, w13, w2, top_k,
                                                                 renormalize),
    _moe_expect,
    lambda dtype: [
        Sample({"x": rand(5, 16, dtype=dtype), "logits": rand(5, 4, dtype=dtype, lo=-3, hi=3)},
               shapes={"x": ("num_tokens", 16), "logits": ("num_tokens", 4)},
               weights={"w13": rand(4, 24, 16, dtype=dtype, lo=-0.5, hi=0.5),
                        "w2": rand(4, 16, 12, dtype=dtype, lo=-0.5, hi=0.5)}),
        Sample({"x": rand(3, 16, dtype=dtype), "logits": rand(3, 4, dtype=dtype, lo=-3, hi=3)},
               {"top_k": 3, "renormalize": False},
               weights={"w13": rand(4, 24, 16, dtype=dtype, lo=-0.5, hi=0.5),
                        "w2": rand(4, 16, 12, dtype=dtype, lo=-0.5, hi=0.5)}),
    ])



def _moe_add_rms_fn(x, logits, r, w, w13, w2, eps):
    summed = F.moe(x, logits, w13, w2, 2, True) + r
    return F.rms_norm(summed, w, eps), summed


def _moe_add_rms_expect(x, logits, r, w, w13, w2, eps):
    summed = _moe_expect(x, logits, w13, w2) + r
    return _rms_expect(summed, w, eps), summed


# The experts' combine moves into the add + RMSNorm after them (MoeAddRmsNorm).
MOE_ADD_RMS_INFO = OpInfo(
    "fused_moe_add_rms_norm", _moe_add_rms_fn, _moe_add_rms_expect,
    lambda dtype: [
        Sample({"x": rand(5, 16, dtype=dtype), "logits": rand(5, 4, dtype=dtype, lo=-3, hi=3),
                "r": rand(5, 16, dtype=dtype), "w": rand(16, dtype=dtype, lo=0.5, hi=1.5)},
               {"eps": 1e-5},
               shapes={"x": ("num_tokens", 16), "logits": ("num_tokens", 4),
                       "r": ("num_tokens", 16)},
               weights={"w13": rand(4, 24, 16, dtype=dtype, lo=-0.5, hi=0.5),
                        "w2": rand(4, 16, 12, dtype=dtype, lo=-0.5, hi=0.5)})],
    fused_into="moe_add_rms_norm")

OP_INFOS: list[OpInfo] = (
    UNARY_INFOS + SIGNED_INFOS + BINARY_INFOS + [PROMOTION_INFO] + COMPARE_INFOS
    + [WHERE_INFO, CAST_INFO] + REDUCE_INFOS + [SOFTMAX_INFO] + LINALG_INFOS + ACTIVATION_INFOS
    + VIEW_INFOS + MEMORY_INFOS + [ROPE_INFO, CACHE_INFO] + ATTENTION_INFOS + FUSED_INFOS
    + COLLECTIVE_INFOS + [LORA_INFO] + LORA_PROLOGUE_INFOS + [SDPA_INFO, TO_DEVICE_INFO]
    + [PREFETCH_INFO, MOE_INFO, MOE_ADD_RMS_INFO]
)


# ---- the tests -----------------------------------------------------------------------------------

def _rename(obj: Any, symbols: set[str], i: int) -> Any:
    """Give sample ``i``'s symbols their own names, so samples can share one network."""
    if isinstance(obj, tuple):
        return tuple(_rename(o, symbols, i) for o in obj)
    if isinstance(obj, str) and obj in symbols:
        return f"{obj}#{i}"
    return obj


def record_samples(info: OpInfo, samples: list[Sample]) -> Network:
    """Record ``info.fn`` once per sample into one network (one engine build per test).

    Sample ``i``'s inputs, weights and outputs are named ``s{i}.{name}``.
    """
    with recording(info.name) as net:
        for i, sample in enumerate(samples):
            symbols = {d for shape in sample.shapes.values() if shape for d in shape
                       if isinstance(d, str)}
            args: dict[str, Any] = {}
            for k, t in sample.inputs.items():
                shape = _rename(tuple(sample.shapes[k]), symbols, i) if k in sample.shapes \
                    else tuple(t.shape)
                args[k] = Tensor(f"s{i}.{k}", t.dtype, shape)
            for k, t in sample.weights.items():
                args[k] = Parameter(t, name=f"s{i}.{k}")
            kwargs = {k: _rename(v, symbols, i) for k, v in sample.kwargs.items()}
            for name, value in output_names(info.fn(**args, **kwargs)).items():
                net.mark_output(value, f"s{i}.{name}")
    return net


def _check_recorded(value: Value, want: torch.Tensor, label: str) -> None:
    """Record-time inference must agree with torch wherever it already knows the answer."""
    assert value.dtype in (None, want.dtype), \
        f"{label}: recorded as {value.describe()}, torch gives {want.dtype}"
    if value.shape is not None:
        assert len(value.shape) == want.dim(), \
            f"{label}: recorded as {value.describe()}, torch gives {list(want.shape)}"
        for got, dim in zip(value.shape, want.shape):
            assert not isinstance(got, int) or got == dim, \
                f"{label}: recorded as {value.describe()}, torch gives {list(want.shape)}"


def _sample_of(output_name: str) -> int:
    return int(output_name[1:].split(".")[0])


def check_samples(info: OpInfo, samples: list[Sample], label: str) -> set[str]:
    """Record all samples, build once (passes on), run into poisoned outputs and compare.

    Returns:
        the ops of the built (possibly fused) network.
    """
    net = record_samples(info, samples)
    engine = net.build_engine()
    inputs: dict[str, torch.Tensor] = {}
    like: dict[str, torch.Tensor] = {}
    expected: dict[str, torch.Tensor] = {}
    for i, sample in enumerate(samples):
        inputs.update({f"s{i}.{k}": v.clone() for k, v in sample.inputs.items()})
        args = {**sample.inputs, **sample.weights}
        if sample.expected is None:
            assert info.expect is not None, f"{label}: no expect and no precomputed result"
            like_i = output_names(info.expect(**{k: v.clone() for k, v in args.items()},
                                              **sample.kwargs))
            expected_i = output_names(info.expect(**{k: upcast(v) for k, v in args.items()},
                                                  **sample.kwargs))
        else:
            expected_i = sample.expected
            like_i = {k: v.to(sample.out_dtype) for k, v in expected_i.items()}
        like.update({f"s{i}.{k}": v for k, v in like_i.items()})
        expected.update({f"s{i}.{k}": v for k, v in expected_i.items()})
    assert set(net.outputs) == set(expected), \
        f"{label}: outputs {sorted(net.outputs)} != expected {sorted(expected)}"
    for name, value in net.outputs.items():
        _check_recorded(value, like[name], f"{label} {name} {samples[_sample_of(name)].kwargs}")
    # The engine writes declared caches in place: it runs on copies of the inputs.
    got = run_engine(engine, {k: v.clone() for k, v in inputs.items()}, like)
    for name in expected:
        assert_close(got[name], expected[name],
                     msg=f"{label} {name} {samples[_sample_of(name)].kwargs}")
    # Without preallocated outputs the kernels' own results come back: their dtype and shape
    # must be what the shape rules promised (a copy into a given buffer would hide a mismatch).
    fresh = run_engine(engine, inputs)
    for name, t in fresh.items():
        assert (t.dtype, t.shape) == (like[name].dtype, like[name].shape), \
            f"{label} {name}: the kernel returned {t.dtype}{list(t.shape)}, the rules promised " \
            f"{like[name].dtype}{list(like[name].shape)}"
    return {n.op for n in engine.net.nodes}


def _ids() -> list[Any]:
    return [pytest.param(info, dtype, id=f"{info.name}-{SHORT[dtype]}")
            for info in OP_INFOS for dtype in info.dtypes]


@pytest.mark.parametrize("info, dtype", _ids())
def test_op_matches_torch(info: OpInfo, dtype: torch.dtype) -> None:
    samples = info.samples(dtype)
    assert samples, f"{info.name}: no samples"
    with info.context():
        ops = check_samples(info, samples, f"{info.name}[{SHORT[dtype]}]")
    if info.fused_into is not None:
        assert info.fused_into in ops, \
            f"{info.name}: the passes did not produce {info.fused_into} (ops: {sorted(ops)})"


def test_every_registered_op_has_an_opinfo() -> None:
    """A new op must come with an OpInfo entry: one that records it, or, for a fused op, one whose
    ``fused_into`` names it (test_op_matches_torch checks that the passes really produce it)."""
    covered = {info.fused_into for info in OP_INFOS if info.fused_into}
    for info in OP_INFOS:
        with info.context():
            covered |= {n.op for n in record_samples(info, info.samples(info.dtypes[0])).nodes}
    missing = sorted({op.name for op in all_ops()} - covered)
    assert not missing, f"registered ops that no OpInfo exercises (add entries to OP_INFOS): " \
                        f"{missing}"


def test_activation_covers_every_act_type() -> None:
    assert set(ACT_EXPECT) == set(ActType), "add the new ActType to ACT_EXPECT"


# ---- realistic shapes on a GPU ------------------------------------------------------------------

def _gpu_cases(dtype: torch.dtype) -> list[tuple[OpInfo, Callable[[], Sample]]]:
    dev = "cuda"
    r = lambda *s, lo=-1.0, hi=1.0: rand(*s, dtype=dtype, lo=lo, hi=hi, device=dev)  # noqa: E731
    by_name = {i.name: i for i in OP_INFOS}
    cos, sin = rope_tables(torch.arange(512, device=dev) * 3, 128, torch.float32)
    return [
        (by_name["linear"], lambda: Sample({"x": r(512, 4096), "w": r(4096, 4096) / 64},
                                           shapes={"x": ("num_tokens", 4096)})),
        (by_name["linear"], lambda: Sample({"x": r(3, 4096), "w": r(11008, 4096) / 64,
                                            "b": r(11008)})),
        (by_name["rms_norm"], lambda: Sample({"x": r(512, 4096), "w": r(4096, lo=0.5, hi=1.5)},
                                             shapes={"x": ("num_tokens", 4096)})),
        (by_name["activation_swiglu"], lambda: Sample({"x": r(512, 2 * 11008, lo=-4, hi=4)})),
        (by_name["rope"], lambda: Sample({"q": r(512, 32, 128), "k": r(512, 8, 128),
                                          "cos": cos, "sin": sin}, {"interleaved": False})),
        (by_name["embedding"], lambda: Sample({"ids": torch.randint(0, 32000, (512,), device=dev),
                                               "w": r(32000, 2048)})),
        (by_name["softmax"], lambda: Sample({"x": r(64, 32000, lo=-8, hi=8)}, {"dim": -1})),
        (by_name["paged_attention"], lambda: attention_sample(
            dtype, q_lens=[1000, 37, 511], seq_len=[1000, 37, 511], q_heads=32, kv_heads=8,
            head_dim=128, block_size=16, device=dev)),
        (by_name["paged_attention"], lambda: attention_sample(
            dtype, q_lens=[1] * 16, seq_len=[1 + 131 * i for i in range(16)], q_heads=32,
            kv_heads=8, head_dim=128, block_size=16, decode=True, device=dev)),
        (by_name["paged_attention"], lambda: attention_sample(
            dtype, q_lens=[256, 1, 64], seq_len=[1024, 700, 64], q_heads=28, kv_heads=4,
            head_dim=64, block_size=16, sliding_window=128, device=dev)),
    ]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_ops_realistic_shapes_gpu(dtype: torch.dtype) -> None:
    for i, (info, make) in enumerate(_gpu_cases(dtype)):
        check_samples(info, [make()], f"gpu case {i} {info.name}[{SHORT[dtype]}]")
