"""The routed-experts decode kernels against the ``moe`` op's reference (under the interpreter
on CPU; a Qwen3-30B-A3B-shaped layer in a CUDA graph on a GPU).

Tolerances: fp32 differs by summation order only (experts summed in routing order, not expert
order; 1e-5 relative). bf16: the kernels keep the gate|up products in fp32 up to the SwiGLU and
round once, the reference rounds the products to bf16 first; each output may differ by a few
bf16 ulps of the expert outputs' size, bounded by ``2**-6 * max|out|`` per row.
"""
from __future__ import annotations

import pytest
import torch

from tgraph.ir.ops.moe import moe_reference
from tgraph.kernels.triton.moe import moe_decode

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _case(t, h, inter, e, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g)
    logits = torch.randn(t, e, generator=g) * 2
    w13 = torch.randn(e, 2 * inter, h, generator=g) / h ** 0.5
    w2 = torch.randn(e, h, inter, generator=g) / inter ** 0.5
    return [v.to(DEV, dtype) for v in (x, logits, w13, w2)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t, top_k, renormalize", [(1, 2, True), (5, 3, False), (9, 1, True)])
def test_matches_the_reference(dtype, t, top_k, renormalize):
    x, logits, w13, w2 = _case(t, 96, 40, 6, dtype)
    out = torch.full((t, 96), float("nan"), device=DEV, dtype=dtype)
    moe_decode(x, logits, w13, w2, out, top_k, renormalize, block_n=16, block_k=32)
    want = moe_reference(x.float(), logits, w13.float(), w2.float(), top_k=top_k,
                         renormalize=renormalize)
    scale = float(want.abs().max())
    tol = 1e-5 * scale if dtype == torch.float32 else 2 ** -6 * scale
    torch.testing.assert_close(out.float(), want, rtol=0, atol=tol)


def test_bad_input_is_refused():
    x, logits, w13, w2 = _case(2, 32, 16, 4, torch.float32)
    out = torch.empty(2, 32, device=DEV)
    with pytest.raises(ValueError, match="top_k must be between 1 and the 4 experts"):
        moe_decode(x, logits, w13, w2, out, 5, True)
    with pytest.raises(ValueError, match=r"expected x \[T, H\]"):
        moe_decode(x, logits[:, :3], w13, w2, out, 2, True)


@pytest.mark.gpu
def test_gpu_qwen3_30b_layer_in_a_cuda_graph():
    from tests.helpers import capture_cuda_graph

    x, logits, w13, w2 = _case(4, 2048, 768, 128, torch.bfloat16)
    out = torch.empty(4, 2048, device="cuda", dtype=torch.bfloat16)
    graph = capture_cuda_graph(lambda: moe_decode(x, logits, w13, w2, out, 8, True))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    want = moe_reference(x.float(), logits, w13.float(), w2.float(), top_k=8, renormalize=True)
    torch.testing.assert_close(out.float(), want, rtol=0,
                               atol=2 ** -6 * float(want.abs().max()))
