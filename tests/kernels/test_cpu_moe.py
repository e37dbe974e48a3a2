"""The CPU backend's routed experts (:mod:`tgraph.kernels.cpu_backend.moe`) against the ``moe``
op's reference. Dense experts (fp32, bf16) and quantized ones in the exact mode on torch's
matmuls: the same matmuls on the same rows in the same order and the same roundings, so the
results are the reference's bits (``torch.equal``). On the compiled CPU kernels (fp32 rows) the
products are summed in another order: within 1e-5 of the output's scale (sums of <= 64 O(1)
products), and a quantized model's experts give its dequantized twin's bits. Quantized experts
on torch's packed kernels (the default) take bf16
activations and scales, as the CPU backend's quantized linears do: each linear within about
``3 * 2**-9`` of its output's scale; through SwiGLU and the down projection the test allows
``2**-6`` of the output's largest value."""
from __future__ import annotations

import pytest
import torch

from tgraph.ir.ops.moe import moe_add_rms_norm_reference, moe_reference
from tgraph.kernels.backends import select_kernel
from tgraph.kernels.cpu_backend.moe import bind_moe, bind_moe_add_rms_norm, grouped_experts
from tgraph.kernels.cpu_backend.quant import cached_forms, packed_how, packed_linear
from tgraph.quant import quantize
from tgraph.tuning import CpuTuning, Tuning

TORCH = CpuTuning(native_kernels=False)  # torch's matmuls: the reference's bits


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
    got = grouped_experts(x, logits, w13, w2, top_k, renormalize, TORCH)
    assert got.dtype == dtype
    assert torch.equal(got, want)
    # With the compiled kernels (fp32 rows): sums of 64 / 24 products in another order.
    got = grouped_experts(x, logits, w13, w2, top_k, renormalize)
    tol = 1e-5 if dtype == torch.float32 else 0.0
    torch.testing.assert_close(got, want, rtol=0, atol=tol * float(want.abs().max()))


def _quantized(w13, w2, **scheme):
    h, inter = w13.shape[2], w2.shape[2]
    return (quantize(w13.reshape(-1, h).float(), name="w13", **scheme),
            quantize(w2.reshape(-1, inter).float(), name="w2", **scheme))


SCHEMES = [dict(kind="int4", group_size=32), dict(kind="int4", group_size=32, offsets=True),
           dict(kind="int8"), dict(kind="int8", group_size=16), dict(kind="fp8"),
           dict(kind="int4", group_size=16, offsets=True)]  # GGUF Q2_K


@pytest.mark.parametrize("scheme", SCHEMES)
def test_quantized_experts_in_the_exact_mode_are_the_references_bits(scheme):
    x, logits, w13, w2 = _case(7, 64, 32, 4, torch.float32)
    q13, q2 = _quantized(w13, w2, **scheme)
    want = moe_reference(x, logits, q13, q2, top_k=2, renormalize=True)
    exact = CpuTuning(bf16_quant_activations=False, native_kernels=False)
    assert torch.equal(grouped_experts(x, logits, q13, q2, 2, True, exact), want)


@pytest.mark.parametrize("native", [False, True])
@pytest.mark.parametrize("tokens", [3, 20])  # rows per expert within and past native_max_rows
@pytest.mark.parametrize("scheme", SCHEMES[1:])
def test_dequantized_experts_keep_their_dense_twins_bits(scheme, tokens, native):
    x, logits, w13, w2 = _case(tokens, 64, 32, 4, torch.float32, seed=tokens)
    q13, q2 = _quantized(w13, w2, **scheme)
    twin13 = q13.dequantize().reshape(w13.shape)
    twin2 = q2.dequantize().reshape(w2.shape)
    for cpu in (CpuTuning(native_kernels=native),
                CpuTuning(bf16_quant_activations=False, native_kernels=native)):
        if packed_how(q13, torch.float32, cpu.bf16_quant_activations) != "dense":
            continue  # packed on bf16 activations: not the twin's arithmetic
        assert torch.equal(grouped_experts(x, logits, q13, q2, 2, True, cpu),
                           grouped_experts(x, logits, twin13, twin2, 2, True, cpu))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scheme", [dict(kind="int4", group_size=32),
                                    dict(kind="int4", group_size=64, offsets=True),
                                    dict(kind="int8")])
def test_packed_experts_are_made_once_and_match_the_reference(dtype, scheme):
    x, logits, w13, w2 = _case(9, 128, 64, 6, torch.float32, seed=3)
    q13, q2 = _quantized(w13, w2, **scheme)
    want = moe_reference(x, logits, q13, q2, top_k=3, renormalize=False).float()
    x = x.to(dtype)
    before = {id(f) for f in cached_forms()}
    got = grouped_experts(x, logits, q13, q2, 3, False)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want, rtol=0,
                               atol=2 ** -6 * float(want.abs().max()))
    made = [f for f in cached_forms() if id(f) not in before]
    picked = sorted(set(torch.topk(logits, 3).indices.flatten().tolist()))
    # Exactly the picked experts were packed, gate|up and down each.
    assert len(made) == 2 * len(picked) and all(f.how != "dense" for f in made)
    rows = q13.shape[0] // 6
    assert all(any(f is packed_linear(q13, torch.float32, True, False, rows=(e * rows, rows))
                   for f in made) for e in picked)
    grouped_experts(x, logits, q13, q2, 3, False)
    assert [f for f in cached_forms() if id(f) not in before] == made  # kept, not packed again


def test_the_bound_kernels_write_the_planned_buffers():
    x, logits, w13, w2 = _case(6, 64, 24, 8, torch.float32)
    out = torch.full_like(x, float("nan"))
    torch_only = Tuning(cpu=TORCH)
    assert bind_moe((out,), x, logits, w13, w2, top_k=2, renormalize=True,
                    tuning=torch_only)() is out
    assert torch.equal(out, moe_reference(x, logits, w13, w2, top_k=2, renormalize=True))

    residual, weight = torch.randn_like(x), torch.rand(64) + 0.5
    normed, summed = torch.empty_like(x), torch.empty_like(x)
    got = bind_moe_add_rms_norm((normed, summed), x, logits, w13, w2, residual, weight, top_k=2,
                                renormalize=False, eps=1e-6, tuning=torch_only)()
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_gate_up_and_dequantized_down_mix(dtype):
    # GGUF Q4_K_M's experts: gate|up in Q4_K (packed), down in Q6_K (int8 groups of 16).
    x, logits, w13, w2 = _case(5, 64, 32, 4, torch.float32, seed=5)
    q13, _ = _quantized(w13, w2, kind="int4", group_size=32, offsets=True)
    _, q2 = _quantized(w13, w2, kind="int8", group_size=16)
    want = moe_reference(x, logits, q13, q2, top_k=2, renormalize=True).float()
    got = grouped_experts(x.to(dtype), logits, q13, q2, 2, True)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want, rtol=0,
                               atol=2 ** -6 * float(want.abs().max()))
