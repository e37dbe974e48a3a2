"""GGUF's quantized types on a GPU: every type of ``QUANTIZED_TYPES`` (Q4_0 to IQ4_XS), repacked at
load into tgraph's layouts (bit-exact, tests/io/test_gguf.py), run by the quantized kernels: the
one-row and tensor-core GEMVs (M = 1, 16) with a fused norm, and the prefill GEMM (M = 300),
against the dense product of the same dequantized weights.

Tolerances as tests/kernels/test_quant_gemv.py: the kernels multiply exact codes and apply fp32
scales, the reference multiplies the weight rounded to bf16; both round the output:
``2**-7 * (|x| @ |w|.T) + 2**-7 * |out|``; one row of int4 codes adds its bf16x2 word sums'
``2**-6 * (|x| @ |s (q - 8)|.T)``.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.io.test_gguf import encode
from tests.kernels.test_quant_gemv import centred_magnitude, packs_words
from tgraph.io.gguf import QUANTIZED_TYPES, repack_blocks
from tgraph.kernels.triton.gemv import prefer_quant_gemv, small_m_linear
from tgraph.kernels.triton.quant_linear import quant_linear

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("qtype", list(QUANTIZED_TYPES), ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 16, 300])
def test_gguf_types_run_on_the_quantized_kernels(qtype, m):
    rng = np.random.default_rng(0)
    n, k = 512, 2048
    w = rng.standard_normal((n, k)).astype(np.float32) * 0.02
    weight = repack_blocks(encode(w, qtype, rng), qtype, (n, k), name="w").to(
        "cuda", torch.bfloat16)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(k, device="cuda", dtype=torch.bfloat16)
    out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    xf = x.float()
    if m <= 64:
        assert prefer_quant_gemv(m, weight)
        small_m_linear(x, weight, out, norm_eps=1e-5, norm_weight=g)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5) * g.float()
    else:
        quant_linear(x, weight, out)
    wd = weight.dequantize(torch.bfloat16).float()
    want = xf @ wd.T
    bound = 2 ** -7 * (xf.abs() @ wd.abs().T) + 2 ** -7 * want.abs() + 1e-6
    if packs_words(m, weight, x.dtype):
        bound += 2 ** -6 * centred_magnitude(xf, weight)
    assert torch.isfinite(out).all()
    assert float(((out.float() - want).abs() - bound).max()) <= 0
