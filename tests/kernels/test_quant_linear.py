"""The quantized linear kernel against the dense reference: every layout, M from decode to
prefill sizes, bias and residual, fp32 and bf16 (under the interpreter on CPU; real shapes and a
CUDA graph on a GPU).

Tolerances: fp32 sums of exact fp32 products differ by summation order only (1e-5 relative at
K <= 512). bf16 rounds the dequantized weight and the output to bf16 as the reference does and
accumulates in fp32; Triton's interpreter truncates fp32 -> bf16 where torch and the GPU round
to nearest (one ulp apart, 2**-7 relative, measured), so each product may differ by 2**-7 of its
size and the output by one ulp: ``2**-7 * (|x| @ |w|.T) + 2**-7 * |out|``.
"""
from __future__ import annotations

import pytest
import torch

from tests.gpu_tiers import sweep
from tests.helpers import capture_cuda_graph
from tgraph.kernels.triton.quant_linear import quant_linear
from tgraph.quant import QuantizedWeight, quantize

DEV = "cuda" if torch.cuda.is_available() else "cpu"
LAYOUTS = [("int4", 32, False, None), ("int4", 16, True, None), ("int4", None, False, None),
           ("int8", 32, False, None), ("int8", 64, True, None), ("fp8", None, False, None),
           ("fp8", None, False, (32, 64))]


def _weight(kind, group, offsets, block, n, k, dtype, seed=0) -> QuantizedWeight:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) / k ** 0.5
    return quantize(w, kind, group, offsets, block).to(DEV, dtype)


def _check(x, w, out, bias=None, residual=None):
    wd = w.dequantize(x.dtype).float()
    want = x.float() @ wd.T
    if bias is not None:
        want += bias.float()
    if residual is not None:
        want += residual.float()
    if x.dtype == torch.float32:
        tol = 1e-5 * max(1.0, float(want.abs().max()))
        torch.testing.assert_close(out.float(), want, rtol=0, atol=tol)
        return
    bound = 2 ** -7 * (x.float().abs() @ wd.abs().T) + 2 ** -7 * want.abs() + 1e-6
    excess = (out.float() - want).abs() - bound
    assert float(excess.max()) <= 0, f"bf16 error above its bound by {float(excess.max()):.3g}"


@pytest.mark.parametrize("kind, group, offsets, block", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 7, 40])
def test_matches_the_dense_reference(kind, group, offsets, block, dtype, m):
    n, k = 70, 192  # ragged against the 64-wide tiles
    w = _weight(kind, group, offsets, block, n, k, dtype)
    x = torch.randn(m, k, device=DEV).to(dtype)
    bias = torch.randn(n, device=DEV).to(dtype)
    residual = torch.randn(m, n, device=DEV).to(dtype)
    out = torch.full((m, n), float("nan"), device=DEV, dtype=dtype)
    quant_linear(x, w, out, bias=bias, residual=residual)
    _check(x, w, out, bias, residual)
    plain = torch.full((m, n), float("nan"), device=DEV, dtype=dtype)
    quant_linear(x, w, plain)
    _check(x, w, plain)


def test_out_may_alias_the_residual():
    w = _weight("int4", 32, True, None, 64, 128, torch.float32)
    x, r = torch.randn(3, 128, device=DEV), torch.randn(3, 64, device=DEV)
    want = x @ w.dequantize().T + r
    quant_linear(x, w, r, residual=r)
    torch.testing.assert_close(r, want, rtol=0, atol=1e-5 * float(want.abs().max()))


@pytest.mark.parametrize("bad, message", [
    (dict(x=torch.randn(2, 100)), r"x is \[2, 100\] but the weight is \[64, 128\]"),
    (dict(out=torch.empty(2, 63)), r"out must be torch.float32 \[2, 64\]"),
    (dict(bias=torch.empty(63)), r"bias must be \[64\]"),
    (dict(weight=torch.randn(64, 128)), "weight must be a QuantizedWeight"),
])
def test_bad_input_is_refused(bad, message):
    args = dict(x=torch.randn(2, 128), weight=_weight("int8", 32, False, None, 64, 128,
                                                      torch.float32).to("cpu"),
                out=torch.empty(2, 64), bias=None)
    args.update(bad)
    with pytest.raises((ValueError, TypeError), match=message):
        quant_linear(args["x"].to(DEV), args["weight"] if not isinstance(args["weight"],
                     QuantizedWeight) else args["weight"].to(DEV), args["out"].to(DEV),
                     bias=None if args["bias"] is None else args["bias"].to(DEV))


REAL = [("int4", 32, True, None), ("int8", 32, False, None), ("fp8", None, False, (128, 128))]


@pytest.mark.parametrize("layout, m, shape", sweep(
    [REAL, [1, 16, 512], [(3072, 2048), (2048, 8192)]],
    fast=[(REAL[0], 1, (3072, 2048)), (REAL[1], 16, (2048, 8192)), (REAL[2], 512, (3072, 2048))],
    ids=(lambda r: r[0], None, lambda s: f"{s[0]}x{s[1]}")))
def test_gpu_real_shapes_and_a_cuda_graph(layout, m, shape):
    n, k = shape
    w = _weight(*layout, n, k, torch.bfloat16)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    graph = capture_cuda_graph(lambda: quant_linear(x, w, out))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    _check(x, w, out)


def test_permuted_input_columns():
    w = _weight("int4", 32, True, None, 70, 192, torch.float32)
    perm = torch.randperm(192, device=DEV)
    p = QuantizedWeight(w.scheme, w.qdata, w.scale, w.offset, w.dtype, "g", perm)
    x = torch.randn(5, 192, device=DEV)
    out = torch.empty(5, 70, device=DEV)
    quant_linear(x, p, out)
    _check(x, p, out)
