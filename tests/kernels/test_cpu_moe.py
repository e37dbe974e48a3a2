"""The CPU backend's routed experts (:mod:`tgraph.kernels.cpu_backend.moe`) against the ``moe``
op's reference: the same matmuls on the same rows in the same order and the same roundings, so
the results are the reference's bits (``torch.equal``), dense (fp32, bf16) and quantized."""
from __future__ import annotations

import pytest
import torch

from tgraph.ir.ops.moe import moe_add_rms_norm_reference, moe_reference
from tgraph.kernels.backends import select_kernel
from tgraph.kernels.cpu_backend.moe import bind_moe, bind_moe_add_rms_norm, grouped_experts
from tgraph.quant import quantize
from tgraph.tuning import Tuning


def _case(t: int, h: int, inter: int, e: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g).to(dtype)
    logits = torch.randn(t, e, generator=g) * 2
    w13 = (torch.randn(e, 2 * inter, h, generator=g) / h ** 0.5).to(dtype)
    w2 = (torch.randn(e, h, inter, generator=g) / inter ** 0.5).to(dtype)
    return x, logits, w13, w2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t, top_k, experts, renormalize", [(1, 2, 8, True), (5, 3, 6, False),
                                                             (33, 4, 16, True)])
def test_grouped_experts_are_the_references_bits(dtype, t, top_k, experts, renormalize):
    x, logits, w13, w2 = _case(t, 64, 24, experts, dtype, seed=t)
    want = moe_reference(x, logits, w13, w2, top_k=top_k, renormalize=renormalize)
    got = grouped_experts(x, logits, w13, w2, top_k, renormalize)
    assert got.dtype == dtype
    assert torch.equal(got, want)


def test_quantized_experts_are_dequantized_as_the_reference_does():
    x, logits, w13, w2 = _case(7, 64, 32, 4, torch.bfloat16)
    q13 = quantize(w13.reshape(-1, 64).float(), name="w13", kind="int4", group_size=32)
    q2 = quantize(w2.reshape(-1, 32).float(), name="w2", kind="int4", group_size=32)
    want = moe_reference(x, logits, q13, q2, top_k=2, renormalize=True)
    assert torch.equal(grouped_experts(x, logits, q13, q2, 2, True), want)


def test_the_bound_kernels_write_the_planned_buffers():
    x, logits, w13, w2 = _case(6, 64, 24, 8, torch.float32)
    out = torch.full_like(x, float("nan"))
    assert bind_moe((out,), x, logits, w13, w2, top_k=2, renormalize=True)() is out
    assert torch.equal(out, moe_reference(x, logits, w13, w2, top_k=2, renormalize=True))

    residual, weight = torch.randn_like(x), torch.rand(64) + 0.5
    normed, summed = torch.empty_like(x), torch.empty_like(x)
    got = bind_moe_add_rms_norm((normed, summed), x, logits, w13, w2, residual, weight, top_k=2,
                                renormalize=False, eps=1e-6)()
    want = moe_add_rms_norm_reference(x, logits, w13, w2, residual, weight, top_k=2,
                                      renormalize=False, eps=1e-6)
    assert got[0] is normed and got[1] is summed
    assert torch.equal(normed, want[0]) and torch.equal(summed, want[1])


@pytest.mark.parametrize("op", ["moe", "moe_add_rms_norm"])
def test_the_cpu_backend_selects_them(op):
    from types import SimpleNamespace

    node = SimpleNamespace(op=op, inputs=(), attrs={})
    _, name = select_kernel(node, Tuning(), backend="cpu")
    assert name == f"cpu.{op}"
