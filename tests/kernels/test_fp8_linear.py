"""FP8 prefill: the per-token e4m3 quantization of activations and the e4m3 GEMM (Triton, and
cuBLAS's row-wise scaled GEMM on Hopper), under the interpreter on CPU and at real shapes on a
GPU.

Oracles: the activation codes and scales equal torch's ``(x / s).to(float8_e4m3fn)`` with
``s = max|x| / 448`` bit for bit (the kernel rounds to nearest even on the e4m3 grid itself). The
GEMM is compared with the fp32 product of the same codes times both scales: they differ by
summation order and the output's rounding, so within ``2**-7 * |out| + 2**-7 * (|xq| @ |w|.T)``
in bf16 (the GPU's e4m3 tensor cores accumulate with fewer bits than fp32, which the second term
covers). Against the unquantized activations the relative error is e4m3's, ~2%, checked < 4%.
"""
from __future__ import annotations

import pytest
import torch

from tests.gpu_tiers import sweep
from tests.helpers import capture_cuda_graph
from tgraph.kernels.triton.fp8_linear import fp8_linear, fp8_linear_supported, quantize_rows_fp8
from tgraph.quant import quantize
from tgraph.tuning import QuantGemmTuning

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _reference_codes(x: torch.Tensor, group: int | None):
    m, k = x.shape
    g = group or k
    xf = x.float().view(m, k // g, g)
    s = xf.abs().amax(-1) / 448
    s = torch.where(s > 0, s, torch.ones_like(s))
    return (xf / s[..., None]).to(torch.float8_e4m3fn).view(m, k), s


@pytest.mark.parametrize("group", [None, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activation_codes_and_scales_are_torchs(group, dtype):
    x = (torch.randn(37, 256, device=DEV) * 3).to(dtype)
    x[3] = 0  # an all-zero row keeps scale 1
    x[5, :7] = torch.tensor([448.0, -0.4955, 1.9627, 5.5566e-3, 1e-9, -7.9708, 0.0])
    q, s = quantize_rows_fp8(x, group)
    want_q, want_s = _reference_codes(x, group)
    assert torch.equal(s, want_s)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


def _check(x, w, out, group, bias=None, residual=None):
    q, s = _reference_codes(x, group)
    m, k = x.shape
    g = group or k
    xd = (q.float().view(m, k // g, g) * s[..., None]).view(m, k)
    wd = w.dequantize(torch.float32)
    want = xd @ wd.T
    if bias is not None:
        want += bias.float()
    if residual is not None:
        want += residual.float()
    bound = 2 ** -7 * want.abs() + 2 ** -7 * (xd.abs() @ wd.abs().T) + 1e-6
    assert float(((out.float() - want).abs() - bound).max()) <= 0
    exact = x.float() @ wd.T + (0 if bias is None else bias.float()) + (
        0 if residual is None else residual.float())
    assert float((out.float() - exact).norm() / exact.norm()) < 4e-2


@pytest.mark.parametrize("block", [None, (32, 64), (70, 192)])
@pytest.mark.parametrize("m", [1, 40])
def test_matches_the_quantized_activations_product(block, m):
    n, k = 70, 192
    w = quantize(torch.randn(n, k) / k ** 0.5, "fp8", block=block).to(DEV, torch.bfloat16)
    x = torch.randn(m, k, device=DEV).to(torch.bfloat16)
    bias = torch.randn(n, device=DEV).to(torch.bfloat16)
    r = torch.randn(m, n, device=DEV).to(torch.bfloat16)
    out = torch.full((m, n), float("nan"), device=DEV, dtype=torch.bfloat16)
    fp8_linear(x, w, out, bias=bias, residual=r)
    group = 64 if block == (32, 64) else None
    _check(x, w, out, group, bias, r)


def test_what_it_refuses():
    w = quantize(torch.randn(64, 128), "fp8").to(DEV, torch.bfloat16)
    assert not fp8_linear_supported(torch.randn(2, 128, device=DEV), w)  # fp32 activations
    int8 = quantize(torch.randn(64, 128), "int8").to(DEV, torch.bfloat16)
    x = torch.randn(2, 128, device=DEV).to(torch.bfloat16)
    assert not fp8_linear_supported(x, int8)
    with pytest.raises(ValueError, match="needs an fp8 weight"):
        fp8_linear(x, int8, torch.empty(2, 64, device=DEV, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"out must be torch.bfloat16 \[2, 64\]"):
        fp8_linear(x, w, torch.empty(2, 63, device=DEV, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="group must be a multiple of 16"):
        quantize_rows_fp8(x, 24)


@pytest.mark.parametrize("block, cublas, m", sweep(
    [[None, (128, 128)], [True, False], [512, 4096]],
    fast=[(None, True, 512), (None, False, 512), ((128, 128), False, 4096)],
    ids=(lambda b: "channel" if b is None else "block", lambda c: "cublas" if c else "triton",
         None)))
def test_gpu_real_shapes_in_a_cuda_graph(block, cublas, m):
    n, k = 6144, 4096
    w = quantize(torch.randn(n, k, device="cuda") / k ** 0.5, "fp8", block=block).to(
        "cuda", torch.bfloat16)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    r = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    tuning = QuantGemmTuning(fp8_cublas=cublas)
    graph = capture_cuda_graph(lambda: fp8_linear(x, w, out, residual=r, tuning=tuning))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    _check(x, w, out, None if block is None else 128, residual=r)
