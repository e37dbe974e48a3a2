"""Property test: random programs of ops on random shapes give the same result with every pass on,
with ``passes=False``, and in plain torch.

A program is drawn step by step (each step sees the shapes so far): elementwise math, scalars on
either side, broadcasting, reshapes, slices, reductions, softmax, cat/split, matmul and linears on
new weights, plus the spellings the passes rewrite (``x * sigmoid(x)``, the Hugging Face RMSNorm,
identical subexpressions, ``x + 0``, dead values, linears sharing an input, a residual add after a
linear). Every step is applied to a symbolic tensor (recorded) and to an fp64 torch tensor (the
expectation) at once.

Tolerance: the engines compute in fp32 over chains of at most ~10 ops with bounded values, so
both engines match the fp64 result to ~1e-5 relative; 1e-4 leaves room for error growth through
softmax/normalisation. Fused and unfused engines match each other to the same tolerance (fusions
may round differently, e.g. silu(x) vs x * sigmoid(x)).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers import assert_close, poison_like
from tgraph.nn import functional as F
from tgraph.nn.module import Parameter
from tgraph.nn.network_manager import recording
from tgraph.nn.tensor import Tensor

RTOL = ATOL = 1e-4


@dataclass
class Pair:
    """A value of the program: its symbolic tensor and its fp64 torch expectation."""

    sym: Any
    real: torch.Tensor


@dataclass
class Program:
    """What a drawn program needs besides its values: inputs (real fp32 data) and a log."""

    inputs: dict[str, torch.Tensor]
    log: list[str]


def _unary_steps() -> dict[str, tuple[Callable, Callable]]:
    silu = lambda t: t * torch.sigmoid(t)  # noqa: E731
    return {
        "tanh": (F.tanh, torch.tanh), "sigmoid": (F.sigmoid, torch.sigmoid),
        "sin": (F.sin, torch.sin), "cos": (F.cos, torch.cos), "neg": (F.neg, torch.neg),
        "abs": (F.abs, torch.abs), "relu": (F.relu, torch.relu), "silu": (F.silu, silu),
        "exp_tanh": (lambda x: F.exp(F.tanh(x)), lambda t: torch.exp(torch.tanh(t))),
        "x_sigmoid_x": (lambda x: x * F.sigmoid(x), silu),          # SiluFusion's pattern
        "twice": (lambda x: F.sin(x) + F.sin(x), lambda t: 2 * torch.sin(t)),  # CSE
        "noop": (lambda x: (x + 0) * 1, lambda t: t),               # NoOpRemoval
        "sqrt_abs": (lambda x: F.sqrt(F.abs(x) + 0.5), lambda t: torch.sqrt(t.abs() + 0.5)),
    }


UNARY = _unary_steps()
BINARY: dict[str, tuple[Callable, Callable]] = {
    "add": (lambda a, b: a + b, lambda a, b: a + b),
    "sub": (lambda a, b: a - b, lambda a, b: a - b),
    "mul": (lambda a, b: a * b, lambda a, b: a * b),
    "safe_div": (lambda a, b: a / (F.abs(b) + 1.0), lambda a, b: a / (b.abs() + 1.0)),
    "maximum": (F.maximum, torch.maximum),
    "minimum": (F.minimum, torch.minimum),
    "silu_mul": (lambda a, b: F.silu(a) * b, lambda a, b: a * torch.sigmoid(a) * b),  # SwiGLU
    "where": (lambda a, b: F.where(a > b, a, b * 0.5),
              lambda a, b: torch.where(a > b, a, b * 0.5)),
}
SCALAR: dict[str, tuple[Callable, Callable]] = {
    "add": (lambda x, c: x + c, lambda t, c: t + c),
    "radd": (lambda x, c: c + x, lambda t, c: c + t),
    "rsub": (lambda x, c: c - x, lambda t, c: c - t),
    "mul": (lambda x, c: x * c, lambda t, c: t * c),
    "rmul": (lambda x, c: c * x, lambda t, c: c * t),
    "div": (lambda x, c: x / c, lambda t, c: t / c),
}


def _broadcastable(a: torch.Tensor, b: torch.Tensor) -> bool:
    try:
        torch.broadcast_shapes(a.shape, b.shape)
    except RuntimeError:
        return False
    return True


def _new_weight(prog: Program, shape: tuple[int, ...], data: st.DataObject) -> Pair:
    """A fresh Parameter (real fp32 data) usable by the program."""
    name = f"w{len(prog.inputs)}"
    t = (torch.rand(shape) * 2 - 1) / max(shape[-1], 1) ** 0.5
    prog.inputs[name] = t  # kept for bookkeeping only: weights are not engine inputs
    return Pair(Parameter(t, name=name), t.to(torch.float64))


def step(pool: list[Pair], prog: Program, data: st.DataObject) -> Pair:
    """Draw one op applicable to the values in ``pool`` and apply it to both sides."""
    a = data.draw(st.sampled_from(pool))
    shape, rank = tuple(a.real.shape), a.real.dim()
    kinds = ["unary", "scalar", "binary", "reshape", "softmax", "reduce", "cat", "split",
             "unsqueeze_bcast"]
    if rank >= 1 and a.real.numel() > 0:
        kinds += ["slice", "linear", "rms_norm", "add_rms_norm"]
    if rank >= 2:
        kinds += ["transpose", "matmul"]
    kind = data.draw(st.sampled_from(kinds))
    prog.log.append(f"{kind} on {list(shape)}")

    if kind == "unary":
        g, t = UNARY[data.draw(st.sampled_from(sorted(UNARY)))]
        return Pair(g(a.sym), t(a.real))
    if kind == "scalar":
        g, t = SCALAR[data.draw(st.sampled_from(sorted(SCALAR)))]
        c = data.draw(st.sampled_from([-1.5, -0.5, 0.25, 2.0, 3]))
        return Pair(g(a.sym, c), t(a.real, c))
    if kind == "binary":
        name = data.draw(st.sampled_from(sorted(BINARY)))
        partners = [p for p in pool if _broadcastable(a.real, p.real)]
        b = data.draw(st.sampled_from(partners))
        g, t = BINARY[name]
        return Pair(g(a.sym, b.sym), t(a.real, b.real))
    if kind == "unsqueeze_bcast":
        dim = data.draw(st.integers(0, rank))
        u = Pair(F.unsqueeze(a.sym, dim), a.real.unsqueeze(dim))
        if not _broadcastable(u.real, a.real):
            return u
        return Pair(u.sym * a.sym, u.real * a.real)  # broadcasts [.., 1, ..] against [..]
    if kind == "reshape":
        numel = a.real.numel()
        last = data.draw(st.sampled_from([d for d in range(1, numel + 1) if numel % d == 0]
                                         or [1]))
        target = data.draw(st.sampled_from([(-1,), (-1, last), (numel // last if last else 0,
                                                                last, 1)]))
        return Pair(a.sym.reshape(target), a.real.reshape(target))
    if kind == "softmax":
        if rank == 0:
            return Pair(F.exp(a.sym), torch.exp(a.real))
        dim = data.draw(st.integers(-rank, rank - 1))
        return Pair(F.softmax(a.sym, dim), torch.softmax(a.real, dim))
    if kind == "reduce":
        if rank == 0:
            return Pair(a.sym * 2.0, a.real * 2.0)
        dim = data.draw(st.integers(-rank, rank - 1))
        keep = data.draw(st.booleans())
        op = data.draw(st.sampled_from(["sum", "mean", "amax"]))
        if a.real.shape[dim] == 0:
            op = "sum"  # the mean of nothing is NaN and its amax an error, in torch too
        g = {"sum": F.sum, "mean": F.mean, "amax": F.amax}[op]
        return Pair(g(a.sym, dim, keep), getattr(torch, op)(a.real, dim, keepdim=keep))
    if kind == "cat":
        if rank == 0:
            return Pair(a.sym + a.sym, a.real * 2)
        dim = data.draw(st.integers(-rank, rank - 1))
        same = [p for p in pool if p.real.dim() == rank and all(
            p.real.shape[i] == a.real.shape[i] for i in range(rank) if i != dim % rank)]
        parts = [a] + data.draw(st.lists(st.sampled_from(same), min_size=1, max_size=2))
        return Pair(F.cat([p.sym for p in parts], dim=dim), torch.cat([p.real for p in parts], dim))
    if kind == "split":
        if rank == 0:
            return Pair(F.neg(a.sym), -a.real)
        dim = data.draw(st.integers(-rank, rank - 1))
        size = a.real.shape[dim]
        cut = data.draw(st.integers(0, size))
        sizes = [cut, size - cut]
        parts_s = F.split(a.sym, sizes, dim)
        parts_t = torch.split(a.real, sizes, dim)
        pool.extend(Pair(s, t) for s, t in zip(parts_s, parts_t))
        return Pair(parts_s[-1], parts_t[-1])
    if kind == "slice":
        dim = data.draw(st.integers(-rank, rank - 1))
        size = a.real.shape[dim]
        start = data.draw(st.integers(0, max(size - 1, 0)))
        end = data.draw(st.one_of(st.none(), st.integers(start, size + 2)))
        stp = data.draw(st.integers(1, 3))
        index = [slice(None)] * rank
        index[dim] = slice(start, end, stp)
        return Pair(F.slice(a.sym, dim, start, end, stp), a.real[tuple(index)])
    if kind == "transpose":
        d0, d1 = data.draw(st.integers(0, rank - 1)), data.draw(st.integers(0, rank - 1))
        return Pair(a.sym.transpose(d0, d1), a.real.transpose(d0, d1))
    if kind == "matmul":
        # a @ a^T: batched when rank > 2
        return Pair(a.sym @ a.sym.transpose(-1, -2), a.real @ a.real.transpose(-1, -2))
    if kind == "linear":
        k = shape[-1]
        w1 = _new_weight(prog, (data.draw(st.integers(1, 5)), k), data)
        out = Pair(F.linear(a.sym, w1.sym), a.real @ w1.real.t())
        variant = data.draw(st.sampled_from(["plain", "shared_input", "residual", "act"]))
        if variant == "shared_input":  # HorizontalLinear merges linears of one input
            w2 = _new_weight(prog, (w1.real.shape[0], k), data)
            other = Pair(F.linear(a.sym, w2.sym), a.real @ w2.real.t())
            return Pair(out.sym * other.sym, out.real * other.real)
        if variant == "residual":  # LinearEpilogue folds the add
            res = Pair(F.linear(a.sym, w1.sym), a.real @ w1.real.t())
            return Pair(out.sym + F.tanh(res.sym), out.real + torch.tanh(res.real))
        if variant == "act":
            return Pair(F.silu(out.sym), out.real * torch.sigmoid(out.real))
        return out
    if kind == "rms_norm":  # the Hugging Face spelling, which RmsNormFusion recognises
        w = _new_weight(prog, (shape[-1],), data)
        x32 = F.cast(a.sym, torch.float32)
        var = F.mean(x32 ** 2, -1, keepdim=True)
        sym = w.sym * F.cast(x32 * F.rsqrt(var + 1e-6), torch.float32)
        real = w.real * (a.real * torch.rsqrt((a.real ** 2).mean(-1, keepdim=True) + 1e-6))
        return Pair(sym, real)
    if kind == "add_rms_norm":  # a residual add feeding an RMSNorm: AddRmsNorm's pattern
        b = data.draw(st.sampled_from([p for p in pool if p.real.shape == a.real.shape]))
        w = _new_weight(prog, (shape[-1],), data)
        summed = Pair(a.sym + b.sym, a.real + b.real)
        pool.append(summed)  # the new residual stays readable by later steps
        real = summed.real * torch.rsqrt((summed.real ** 2).mean(-1, keepdim=True) + 1e-5)
        return Pair(F.rms_norm(summed.sym, w.sym, 1e-5), real * w.real)
    raise AssertionError(kind)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.data_too_large])
@given(data=st.data())
def test_random_programs_fused_equal_unfused_equal_torch(data: st.DataObject) -> None:
    rows = data.draw(st.integers(1, 5), label="rows")
    cols = data.draw(st.integers(1, 6), label="cols")
    third = data.draw(st.sampled_from([None, 2, 3]), label="third dim")
    shape = (rows, cols) if third is None else (rows, cols, third)
    symbolic = data.draw(st.booleans(), label="symbolic first dim")
    prog = Program({}, [])
    with recording("property") as net:
        pool: list[Pair] = []
        y_shape = data.draw(st.sampled_from([shape, shape[1:], (1,) + shape[1:]]), label="y shape")
        specs = [("x", shape), ("y", y_shape)]
        for name, s in specs:
            real = torch.rand(s) * 4 - 2
            prog.inputs[name] = real
            sym_shape = ("n",) + s[1:] if symbolic and len(s) == len(shape) and s[0] == rows \
                else s
            pool.append(Pair(Tensor(name, torch.float32, sym_shape), real.to(torch.float64)))
        n_steps = data.draw(st.integers(1, 7), label="steps")
        for _ in range(n_steps):
            pool.append(step(pool, prog, data))
        out = pool[-1]
        net.mark_output(out.sym, "out")
        extra = data.draw(st.sampled_from(pool[2:-1] or [None]), label="second output")
        if extra is not None and extra.sym.kind.value == "intermediate":
            net.mark_output(extra.sym, "mid")
    outputs = {"out": out} | ({"mid": extra} if "mid" in net.outputs else {})

    # Inputs the program never read are not graph inputs (the engine would refuse them).
    inputs = {v.name: prog.inputs[v.name] for v in net.inputs}
    fused = net.build_engine()
    plain = net.build_engine(passes=False)
    context = f"program: {prog.log}\n{net}"
    results = {}
    for label, engine in (("fused", fused), ("plain", plain)):
        like = {k: poison_like(p.real.to(torch.float32)) for k, p in outputs.items()}
        given = {k: v.clone() for k, v in inputs.items()}
        assert set(engine.specs) == set(given), "passes changed the engine's inputs"
        results[label] = engine.forward(given, like)
        for k, v in given.items():
            assert torch.equal(v, inputs[k]), f"{label} engine wrote into input {k}"
        for k, p in outputs.items():
            assert_close(results[label][k], p.real, rtol=RTOL, atol=ATOL,
                         msg=f"{label} vs torch, output {k}\n{context}")
    for k in outputs:
        assert_close(results["fused"][k], results["plain"][k].double(), rtol=RTOL, atol=ATOL,
                     msg=f"fused vs unfused, output {k}\n{context}")


def test_square_of_silu_builds_and_matches_torch() -> None:
    with recording("square_of_silu") as net:
        s = F.silu(Tensor("h", torch.float32, (2, 4)))
        net.mark_output(s * s, "y")
    h = torch.randn(2, 4)
    out = net.build_engine().forward({"h": h})["y"]
    silu = h.double() * torch.sigmoid(h.double())
    assert_close(out, silu * silu)
