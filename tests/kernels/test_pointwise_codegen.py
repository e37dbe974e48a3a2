"""Generated Triton kernels for ``fused_pointwise`` programs vs the program's reference.

On CPU the kernels run under ``TRITON_INTERPRET=1`` at small shapes; with CUDA the same tests run
on the device and the ``gpu`` tests add 4096 x 4096 half-precision shapes.

The oracle is the op's own reference (the registry references of the fused ops, in order) run on
the inputs upcast to fp32, so it shares the kernel's fp32 math and differs only in rounding order,
in the approximations of tanh/pow/exp, and in the final rounding to the output dtype. Tolerances
come from ``tests.helpers.TOLERANCES`` for the coarsest dtype the value passes through (the output,
or an explicit cast inside the program):

- fp32 ``(1e-5, 1e-5)``: a few fp32 ulps, far below any indexing or formula error;
- fp16 ``(2e-3, 2e-3)``: one rounding of the fp32 result (unit roundoff 4.9e-4) plus any cast
  inside the program, about 4 units;
- bf16 ``(2e-2, 2e-2)``: the same in bf16 units (unit roundoff 3.9e-3; Triton's interpreter
  truncates instead of rounding, so one cast costs up to 2 units).

Outputs are poisoned (NaN, or the negated expected mask for bool outputs) before every launch, so
an element the kernel does not write fails the comparison. Bool results must be exact.
"""
from __future__ import annotations

import os
import re
import textwrap
from pathlib import Path

import pytest
import torch

import tgraph.ir.ops.fused_pointwise  # noqa: F401  (registers the op until ir.ops imports it)
from tests.helpers import assert_close, poison_like, run_without_interpreter, tolerance
from tgraph.engine import build_engine
from tgraph.ir.ops import Meta, get_op
from tgraph.ir.ops.fused_pointwise import FUSIBLE_OPS, MAX_REDUCTION_WIDTH, PointwiseProgram
from tgraph.kernels import pointwise_codegen as pc
from tgraph.nn import functional as F
from tgraph.nn.network_manager import recording
from tgraph.nn.tensor import Tensor
from tgraph.passes.pointwise_fusion import PointwiseFusion

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHORT = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}

# Masked-off lanes load 0 and still run the math (log(0), 1/0...); the interpreter's numpy warns
# about them although the results are never stored.
pytestmark = [pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")]


@pytest.fixture(autouse=True, scope="module")
def _cache_dir(tmp_path_factory):
    """Generated sources go to a temporary TGRAPH_CACHE_DIR, not the user's home."""
    saved = os.environ.get("TGRAPH_CACHE_DIR")
    os.environ["TGRAPH_CACHE_DIR"] = str(tmp_path_factory.mktemp("tgraph_cache"))
    yield
    if saved is None:
        os.environ.pop("TGRAPH_CACHE_DIR", None)
    else:
        os.environ["TGRAPH_CACHE_DIR"] = saved


# ---- helpers ------------------------------------------------------------------------------------


def _fused(fn, specs: dict[str, tuple[torch.dtype, tuple]]) -> tuple[PointwiseProgram, list[str]]:
    """Record ``fn`` on symbolic inputs, fuse it, and return the one program and its input names
    (the whole function must become a single fused node)."""
    with recording("codegen") as net:
        out = fn(**{k: Tensor(k, d, s) for k, (d, s) in specs.items()})
        for i, o in enumerate(out if isinstance(out, tuple) else (out,)):
            net.mark_output(o, f"out{i}")
    assert PointwiseFusion().run(net) == 1
    assert [n.op for n in net.nodes] == ["fused_pointwise"], str(net)
    node = net.nodes[0]
    return node.attrs["program"], [v.name for v in node.inputs]


def _oracle(program: PointwiseProgram, inputs: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    up = [t.float() if t.is_floating_point() else t for t in inputs]
    out = get_op("fused_pointwise").reference(*up, program=program)
    return out if isinstance(out, tuple) else (out,)


def _tol(program: PointwiseProgram, dtype: torch.dtype) -> tuple[float, float]:
    dtypes = [dtype] + [i[2] for i in program.instrs if i[0] == "cast" and i[2].is_floating_point]
    return max(tolerance(d) for d in dtypes if d.is_floating_point) if dtype.is_floating_point \
        else (0.0, 0.0)


def _check(program: PointwiseProgram, inputs: list[torch.Tensor],
           outputs: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Run the generated kernel into poisoned outputs and compare with the fp32 oracle."""
    kernel = pc.compile_pointwise(program, inputs)
    want = _oracle(program, inputs)
    shapes = kernel.output_shapes([tuple(t.shape) for t in inputs])
    if outputs is None:
        outputs = [torch.empty(s, dtype=d, device=DEVICE)
                   for s, d in zip(shapes, kernel.out_dtypes)]
    for o, w in zip(outputs, want):
        o.copy_(poison_like(w.to(o.dtype)))
    got = pc.run_fused_pointwise(program, inputs, outputs)
    got = got if isinstance(got, tuple) else (got,)
    for j, (g, o, w) in enumerate(zip(got, outputs, want)):
        assert g is o, "run_fused_pointwise must return the tensors it was given"
        rtol, atol = _tol(program, o.dtype)
        assert_close(o, w, rtol=rtol, atol=atol, msg=f"output {j} of {program}")
    return list(got)


def _randn(*shape, dtype=torch.float32, lo=-3.0, hi=3.0) -> torch.Tensor:
    return (torch.rand(*shape, device=DEVICE) * (hi - lo) + lo).to(dtype)


def _softmax(x):
    e = F.exp(x - F.amax(x, -1, keepdim=True))
    return e / F.sum(e, -1, keepdim=True)


def _hf_rms_norm(x, w):
    h = F.cast(x, torch.float32)
    r = F.rsqrt(F.mean(h * h, -1, keepdim=True) + 1e-6)
    return w * F.cast(h * r, x.dtype), r  # r: a [..., 1] row value as a second output


def _layer_norm(x, w, b):
    c = x - F.mean(x, -1, keepdim=True)
    return c * F.rsqrt(F.mean(c * c, -1, keepdim=True) + 1e-5) * w + b


def _gelu_tanh_masked(x, keep, b):
    g = 0.5 * x * (1.0 + F.tanh(0.7978845608028654 * (x + 0.044715 * x ** 3)))
    return F.where(keep, g, x * b)


def _case(name: str, dtype: torch.dtype, rows: int = 7):
    """(program, inputs) of a named test case, the inputs in the fused node's order."""
    if name == "softmax":
        fn, specs = _softmax, {"x": (dtype, ("n", 20))}
        data = {"x": _randn(rows, 20, dtype=dtype)}
    elif name == "rms_norm":
        fn, specs = _hf_rms_norm, {"x": (dtype, (2, "s", 24)), "w": (dtype, (24,))}
        data = {"x": _randn(2, rows, 24, dtype=dtype), "w": _randn(24, dtype=dtype)}
    elif name == "layer_norm":
        fn, specs = _layer_norm, {"x": (dtype, ("n", 33)), "w": (dtype, (33,)),
                                  "b": (dtype, (1, 33))}
        data = {"x": _randn(rows, 33, dtype=dtype), "w": _randn(33, dtype=dtype),
                "b": _randn(1, 33, dtype=dtype)}
    else:
        fn, specs = _gelu_tanh_masked, {"x": (dtype, ("n", 40)), "keep": (torch.bool, ("n", 40)),
                                        "b": (dtype, (40,))}
        data = {"x": _randn(rows, 40, dtype=dtype), "b": _randn(40, dtype=dtype),
                "keep": torch.rand(rows, 40, device=DEVICE) > 0.3}
    program, names = _fused(fn, specs)
    assert sorted(names) == sorted(data)
    return program, [data[k] for k in names]


# ---- numbers -------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=SHORT.get)
@pytest.mark.parametrize("case", ["softmax", "rms_norm", "layer_norm", "gelu_tanh_masked"])
def test_generated_kernel_matches_reference(case, dtype):
    program, inputs = _case(case, dtype)
    assert program.has_reductions == (case != "gelu_tanh_masked")
    _check(program, inputs)


def _unary_input(op: str) -> torch.Tensor:
    if op in ("log", "sqrt", "rsqrt", "reciprocal"):
        return _randn(5, 19, lo=0.1, hi=4.0)
    if op == "logical_not":
        return torch.rand(5, 19, device=DEVICE) > 0.5
    return _randn(5, 19, lo=-4.0, hi=4.0)


_UNARY = sorted(op for op in FUSIBLE_OPS if op not in
                ("add", "sub", "mul", "div", "pow", "maximum", "minimum", "eq", "ne", "lt", "le",
                 "gt", "ge", "where"))
_BINARY = ["add", "sub", "mul", "div", "maximum", "minimum", "eq", "ne", "lt", "le", "gt", "ge"]


@pytest.mark.parametrize("op", _UNARY)
def test_every_unary_op(op):
    program = PointwiseProgram((("load", 0), ("op", op, (0,), ())), (1,))
    x = _unary_input(op)
    if op in ("tanh", "gelu_tanh"):  # exercise both branches of the tanh helper, and 0
        x = torch.cat([x, _randn(5, 19, lo=-0.3, hi=0.3), torch.zeros(1, 19, device=DEVICE)])
    _check(program, [x])


@pytest.mark.parametrize("op", _BINARY)
@pytest.mark.parametrize("form", ["tensors", "const_right", "const_left"])
def test_every_binary_op(op, form):
    a, b = _randn(4, 24), _randn(4, 24)
    if op in ("eq", "ne", "le", "ge"):
        b = torch.where(torch.rand(4, 24, device=DEVICE) > 0.5, a, b)  # some ties
    if form == "tensors":
        program = PointwiseProgram((("load", 0), ("load", 1), ("op", op, (0, 1), ())), (2,))
        _check(program, [a, b])
    else:
        c = 0.75 if op not in ("eq", "ne") else float(a[0, 0])
        args = (0, 1) if form == "const_right" else (1, 0)
        program = PointwiseProgram((("load", 0), ("const", c), ("op", op, args, ())), (2,))
        _check(program, [a])


@pytest.mark.parametrize("exponent", [2, 3, 0.5, -0.5, -1, -2, 4, 1, 0, 2.5, -1.5])
def test_pow_with_constant_exponents(exponent):
    base = _randn(4, 20, lo=0.2, hi=3.0) if exponent not in (2, 3, -1, -2, 4, 1, 0) \
        else _randn(4, 20, lo=-3.0, hi=3.0)
    program = PointwiseProgram((("load", 0), ("const", exponent), ("op", "pow", (0, 1), ())),
                               (2,))
    _check(program, [base])


def test_pow_with_tensor_exponent_and_negative_base():
    base = _randn(6, 16, lo=-2.0, hi=2.0)
    exponent = torch.randint(-3, 4, (6, 16), device=DEVICE).float()  # integers: sign matters
    exponent[0] = 1.5  # fractional: NaN for the negative bases, as in torch
    base[0, :8] = base[0, :8].abs() + 0.1
    program = PointwiseProgram((("load", 0), ("load", 1), ("op", "pow", (0, 1), ())), (2,))
    want = _oracle(program, [base, exponent])[0]
    got = pc.run_fused_pointwise(program, [base, exponent])
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    finite = ~torch.isnan(want)
    assert_close(got[finite], want[finite])
    base2 = torch.tensor([[2.0, -2.0]], device=DEVICE)
    const_base = PointwiseProgram((("const", 2.0), ("load", 0), ("op", "pow", (0, 1), ())), (2,))
    _check(const_base, [base2])


def test_maximum_minimum_propagate_nan():
    a, b = _randn(2, 8), _randn(2, 8)
    a[0, 3] = float("nan")
    b[1, 5] = float("nan")
    for op in ("maximum", "minimum"):
        program = PointwiseProgram((("load", 0), ("load", 1), ("op", op, (0, 1), ())), (2,))
        got = pc.run_fused_pointwise(program, [a, b])
        want = _oracle(program, [a, b])[0]
        assert torch.equal(torch.isnan(got), torch.isnan(want)) and torch.isnan(got).sum() == 2
        assert_close(got[~torch.isnan(got)], want[~torch.isnan(want)])


def test_where_masks_casts_and_bool_outputs():
    # where with tensor/const branches, a bool result, casts to bool / half and back.
    x, y = _randn(5, 12), _randn(5, 12)
    cond = torch.rand(5, 12, device=DEVICE) > 0.5
    program = PointwiseProgram((
        ("load", 0), ("load", 1), ("load", 2),                  # 0 x, 1 y, 2 cond
        ("op", "gt", (0, 1), ()),                               # 3 bool
        ("op", "where", (2, 0, 1), ()),                         # 4 where(cond, x, y)
        ("const", -1.0), ("op", "where", (3, 4, 5), ()),        # 6 where(x > y, ., -1)
        ("cast", 0, torch.bool),                                # 7 x != 0
        ("op", "logical_not", (2,), ()),                        # 8 ~cond
        ("op", "where", (8, 3, 7), ()),                         # 9 bool where
        ("cast", 6, torch.float16), ("cast", 10, torch.float32),  # 11 rounded through fp16
        ("cast", 2, torch.float32), ("op", "add", (11, 12), ()),  # 13 + float(cond)
    ), (13, 9, 8))
    outs = _check(program, [x, y, cond])
    assert [o.dtype for o in outs] == [torch.float32, torch.bool, torch.bool]


def test_reduction_of_a_value_constant_along_the_row():
    # s is [M, 1]: its loads are one value per row, and sum(x * s) must not count s N times.
    x, s = _randn(6, 10), _randn(6, 1)
    program = PointwiseProgram((
        ("load", 0), ("load", 1), ("op", "mul", (0, 1), ()), ("reduce", "sum", 2),
        ("reduce", "amax", 1), ("op", "add", (3, 4), ()), ("op", "mul", (5, 0), ()),
        ("reduce", "mean", 1),
    ), (6, 5, 7))
    outs = _check(program, [x, s])
    assert [tuple(o.shape) for o in outs] == [(6, 10), (6, 1), (6, 1)]


@pytest.mark.parametrize("rowwise", [False, True], ids=["flat", "rows"])
def test_broadcast_and_strided_operands(rowwise):
    # x: a column slice of a wider tensor (row stride 2N), pos: [S, N] against [B, S, N],
    # w: [N], b: [1, 1, N], scale: 0-d; the output is itself a strided view.
    B, S, N = 2, 5, 12
    x = _randn(B, S, 2 * N)[..., :N]
    pos, w, b = _randn(S, N), _randn(N), _randn(1, 1, N)
    scale = torch.tensor(0.5, device=DEVICE)
    instrs = [("load", 0), ("load", 1), ("op", "mul", (0, 1), ()), ("load", 2),
              ("op", "add", (2, 3), ()), ("load", 3), ("op", "mul", (4, 5), ()), ("load", 4),
              ("op", "mul", (6, 7), ())]
    if rowwise:
        instrs += [("reduce", "amax", 8), ("op", "sub", (8, 9), ())]
    program = PointwiseProgram(tuple(instrs), (len(instrs) - 1,))
    out = torch.empty(B, S, 3 * N, device=DEVICE)[..., N:2 * N]
    _check(program, [x, pos, w, b, scale], [out])
    # A transposed input: a non-unit stride along the last dim.
    xt = _randn(N, S).t()
    flat = PointwiseProgram((("load", 0), ("op", "exp", (0,), ())), (1,))
    _check(flat, [xt])


def test_empty_and_single_element_inputs():
    program = PointwiseProgram((("load", 0), ("op", "sigmoid", (0,), ())), (1,))
    _check(program, [torch.empty(0, 8, device=DEVICE)])
    _check(program, [torch.tensor(1.5, device=DEVICE)])  # rank 0
    softmax, inputs = _case("softmax", torch.float32, rows=1)
    _check(softmax, inputs)


def test_fused_engine_on_the_triton_backend_matches_the_reference_engine():
    with recording("engine") as net:
        x = Tensor("x", torch.bfloat16, ("n", 32))
        w = Tensor("w", torch.bfloat16, (32,))
        h, r = _hf_rms_norm(x, w)
        net.mark_output(_softmax(h), "y")
        net.mark_output(r, "r")
    work, _ = net.clone()
    assert PointwiseFusion().run(work) == 1  # the norm and the softmax share rows: one kernel
    engine = build_engine(work, passes=False, backend="triton")
    plain = net.build_engine(passes=False, backend="reference")
    assert str(engine).count("triton.fused_pointwise") == 1
    for rows in (3, 9):
        inputs = {"x": _randn(rows, 32, dtype=torch.bfloat16),
                  "w": _randn(32, dtype=torch.bfloat16)}
        got, want = engine.forward(inputs), plain.forward(inputs)
        for name in want:
            # The reference rounds every intermediate to bf16, the kernel only at casts and
            # outputs: a few bf16 units apart.
            assert_close(got[name], want[name].float(), msg=name)


# ---- compilation and the cache ------------------------------------------------------------------


def test_one_compiled_kernel_serves_every_row_count():
    pc.clear_cache()
    softmax, _ = _case("softmax", torch.bfloat16)
    rms, _ = _case("rms_norm", torch.float16)
    symbolic = pc.compile_pointwise(softmax, [Meta(("n", 20), torch.bfloat16)])
    assert pc.cache_size() == 1
    for rows in (1, 7, 40):
        _check(*_case("softmax", torch.bfloat16, rows))
        _check(*_case("rms_norm", torch.float16, rows))
        _check(*_case("gelu_tanh_masked", torch.float32, rows))
    assert pc.cache_size() == 3
    assert pc.compile_pointwise(softmax, [_randn(123, 20, dtype=torch.bfloat16)]) is symbolic
    # Another dtype is another kernel.
    pc.compile_pointwise(softmax, [Meta(("n", 20), torch.float16)])
    assert pc.cache_size() == 4
    kernel = pc.compile_pointwise(rms, [Meta((2, "s", 24), torch.float16),
                                        Meta((24,), torch.float16)])
    assert "do_not_specialize=['R', 'D1', " in kernel.source  # rows and leading dims are dynamic


def test_generated_source_is_a_file_and_printable():
    program, inputs = _case("softmax", torch.float32, rows=37)
    kernel = pc.compile_pointwise(program, inputs)
    text = str(kernel)
    assert text == kernel.source and "@triton.jit" in text and f"def {kernel.name}(" in text
    assert kernel.name.startswith("fused_amax_sub_exp_sum_")
    assert kernel.path.parent == Path(os.environ["TGRAPH_CACHE_DIR"]) / "pointwise"
    assert kernel.path.read_text() == text
    assert not re.search(r"\b(37|20|32)\b", text.split("@triton.jit(do_not")[1]), \
        "sizes must not be baked into the kernel"


def test_bad_inputs_are_refused_with_clear_errors(monkeypatch):
    program, inputs = _case("softmax", torch.float32)
    (x,) = inputs
    kernel = pc.compile_pointwise(program, inputs)
    with pytest.raises(TypeError, match="1 inputs and 1 outputs"):
        kernel(x)
    with pytest.raises(TypeError, match="argument 1 must be a torch.Tensor"):
        kernel(x, [1.0])
    with pytest.raises(ValueError, match="compiled for torch.float32"):
        kernel(x.half(), torch.empty_like(x))
    with pytest.raises(ValueError, match=r"output 0 is torch.float32\[7, 21\], expected"):
        kernel(x, torch.empty(7, 21, device=DEVICE))
    with pytest.raises(ValueError, match="dtype torch.int32 is not supported"):
        pc.compile_pointwise(program, [Meta(("n", 20), torch.int32)])
    with pytest.raises(ValueError, match="known rank"):
        pc.compile_pointwise(program, [Meta(None, torch.float32)])
    with pytest.raises(ValueError, match="exceed the row kernel's limit"):
        pc.run_fused_pointwise(program, [torch.zeros(1, MAX_REDUCTION_WIDTH + 1, device=DEVICE)])
    two = PointwiseProgram((("load", 0), ("load", 1), ("op", "add", (0, 1), ())), (2,))
    with pytest.raises(ValueError, match="do not broadcast"):
        pc.run_fused_pointwise(two, [x, torch.zeros(3, 20, device=DEVICE)])
    with pytest.raises(ValueError, match="malformed"):
        PointwiseProgram((("load",), ("op", "exp", (0,), ())), (1,))
    with pytest.raises(ValueError, match="cannot be fused"):
        PointwiseProgram((("load", 0), ("op", "linear", (0, 0), ())), (1,))
    with pytest.raises(ValueError, match="not an earlier instruction"):
        PointwiseProgram((("load", 0), ("op", "exp", (2,), ())), (1,))
    bool_add = PointwiseProgram((("load", 0), ("load", 1), ("op", "add", (0, 1), ())), (2,))
    mask = torch.ones(2, 2, dtype=torch.bool, device=DEVICE)
    with pytest.raises(ValueError, match="add on bool tensors"):
        pc.run_fused_pointwise(bool_add, [mask, mask])
    if DEVICE == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(ValueError, match="need CUDA tensors"):
            kernel(x, torch.empty_like(x))


_AOT_SCRIPT = textwrap.dedent("""
    import os, sys, torch, triton
    from triton.backends.compiler import GPUTarget
    from triton.runtime.jit import mangle_type
    import tgraph.ir.ops.fused_pointwise
    from tgraph.ir.ops.fused_pointwise import FUSIBLE_OPS, PointwiseProgram as P
    from tgraph.kernels import pointwise_codegen as pc

    class Capture:  # stands in for the jit function to record one launch's arguments
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                self.args, self.kwargs = args, kwargs
            return launch

    def compile_for_sm90(program, *tensors):
        kernel = pc.compile_pointwise(program, tensors[:program.num_inputs])
        fn, kernel.fn = kernel.fn, Capture()
        os.environ["TRITON_INTERPRET"] = "1"  # lets the launch checks accept CPU tensors
        kernel(*tensors)
        del os.environ["TRITON_INTERPRET"]
        capture, kernel.fn = kernel.fn, fn
        kw = dict(capture.kwargs)
        warps = kw.pop("num_warps")
        values = dict(zip(fn.arg_names, capture.args), **kw)
        sig = {n: "constexpr" if n in kw else mangle_type(values[n]) for n in fn.arg_names}
        src = triton.compiler.ASTSource(fn, sig, constexprs=kw)
        triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
        print("compiled", kernel.name)

    x = torch.randn(3, 5, 24, dtype=torch.bfloat16)
    w = torch.randn(24, dtype=torch.bfloat16)
    s = torch.randn(3, 5, 1, dtype=torch.bfloat16)
    rows = P((("load", 0), ("op", "mul", (0, 0), ()), ("reduce", "mean", 1), ("const", 1e-6),
              ("op", "add", (2, 3), ()), ("op", "rsqrt", (4,), ()), ("op", "mul", (0, 5), ()),
              ("load", 1), ("op", "mul", (6, 7), ()), ("load", 2), ("op", "mul", (8, 9), ()),
              ("reduce", "amax", 10), ("op", "sub", (10, 11), ())), (12, 5))
    compile_for_sm90(rows, x, w, s, torch.empty_like(x), torch.empty(3, 5, 1, dtype=torch.bfloat16))
    ops = sorted(FUSIBLE_OPS - {"where", "logical_not", "add", "eq", "ne", "lt", "le", "gt",
                                   "ge", "pow", "maximum", "minimum", "sub", "mul", "div"})
    instrs = [("load", 0), ("load", 1), ("const", 0.5), ("const", float("inf"))]
    for op in ops:  # a chain through every unary op, then the binary ones and masks
        instrs.append(("op", op, (len(instrs) - 1 if len(instrs) > 4 else 0,), ()))
    last = len(instrs) - 1
    for op in ("add", "sub", "mul", "div", "maximum", "minimum", "pow"):
        instrs.append(("op", op, (last, 1), ()))
        instrs.append(("op", op, (len(instrs) - 1, 2), ()))
        last = len(instrs) - 1
    instrs += [("op", "gt", (last, 3), ()), ("op", "logical_not", (len(instrs),), ()),
               ("cast", len(instrs) + 1, torch.float16)]
    instrs.append(("op", "where", (len(instrs) - 2, last, 2), ()))
    flat = P(tuple(instrs), (len(instrs) - 1, len(instrs) - 3))
    a = torch.randn(4, 6, 10)[..., :5]
    b = torch.randn(5, dtype=torch.float16)
    compile_for_sm90(flat, a, b, torch.empty(4, 6, 5), torch.empty(4, 6, 5, dtype=torch.bool))
""")


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the gpu tests compile and run for real")
def test_generated_kernels_compile_for_sm90_without_a_gpu(tmp_path):
    """Triton's interpreter runs Python, not the compiler: this compiles generated kernels to
    cubin for sm_90 in a clean process (no GPU is needed to compile)."""
    pytest.importorskip("triton.backends.nvidia")
    done = run_without_interpreter(_AOT_SCRIPT, {"TGRAPH_CACHE_DIR": str(tmp_path),
                                                 "TRITON_CACHE_DIR": str(tmp_path / "triton")},
                                   timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.count("compiled fused_") == 2, done.stdout


# ---- GPU: realistic shapes -----------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=SHORT.get)
@pytest.mark.parametrize("case", ["softmax", "rms_norm", "gelu_tanh_masked"])
def test_gpu_4096x4096(case, dtype):
    n = 4096
    if case == "softmax":
        program, _ = _fused(_softmax, {"x": (dtype, ("n", n))})
        make = lambda m: [_randn(m, n, dtype=dtype)]  # noqa: E731
    elif case == "rms_norm":
        program, _ = _fused(_hf_rms_norm, {"x": (dtype, ("n", n)), "w": (dtype, (n,))})
        make = lambda m: [_randn(m, n, dtype=dtype), _randn(n, dtype=dtype)]  # noqa: E731
    else:
        program, names = _fused(_gelu_tanh_masked, {"x": (dtype, ("n", n)),
                                                    "keep": (torch.bool, ("n", n)),
                                                    "b": (dtype, (n,))})

        def make(m):  # the fused node's input order is the recording's, not ours
            data = {"x": _randn(m, n, dtype=dtype), "keep": torch.rand(m, n, device=DEVICE) > 0.3,
                    "b": _randn(n, dtype=dtype)}
            return [data[k] for k in names]
    before = pc.cache_size()
    for rows in (4096, 1, 77):  # prefill, decode, odd: one compiled kernel
        _check(program, make(rows))
    assert pc.cache_size() - before <= 1
