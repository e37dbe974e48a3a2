"""The routed-experts kernels against the ``moe`` op's reference: routing, sorting by expert,
the decode kernels (with and without the split down projection) and the grouped GEMM, on dense
and packed quantized experts (under the interpreter on CPU; Qwen3-30B-A3B-shaped layers in CUDA
graphs on a GPU).

Tolerances: fp32 differs by summation order only (experts summed in routing order, not expert
order; 1e-5 of the output's scale, tf32 is never used for fp32). bf16: the kernels keep the
gate|up products in fp32 up to the SwiGLU and round once, the reference rounds the products to
bf16 first; each output may differ by a few bf16 ulps of the expert outputs' size, bounded by
``2**-6 * max|out|``. Quantized experts: the reference and the grouped GEMM dequantize them to
the activations' dtype (per expert, per tile); the decode kernels multiply the codes and fold the
scales in fp32 (no rounding of the weights), which differs from the reference by less than
the rounding the bf16 bound already allows.
"""
from __future__ import annotations

import pytest
import torch

from tgraph.ir.ops.moe import moe_reference, route
from tgraph.kernels.triton.moe import moe_decode
from tgraph.kernels.triton.moe_grouped import grouped_block_m, moe_grouped
from tgraph.kernels.triton.moe_routing import route_topk, sort_by_expert
from tgraph.kernels.triton_backend.core import add_rms_norm_into
from tgraph.kernels.triton_backend.moe import moe_add_rms_norm_into, moe_into
from tgraph.quant import quantize
from tgraph.tuning import MoeTuning, Tuning

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _case(t, h, inter, e, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g)
    logits = torch.randn(t, e, generator=g) * 2
    w13 = torch.randn(e, 2 * inter, h, generator=g) / h ** 0.5
    w2 = torch.randn(e, h, inter, generator=g) / inter ** 0.5
    return [v.to(DEV, dtype) for v in (x, logits, w13, w2)]


def _check(out, x, logits, w13, w2, top_k, renormalize, dtype):
    want = moe_reference(x.float(), logits, w13, w2, top_k=top_k, renormalize=renormalize)
    scale = float(want.abs().max())
    tol = 1e-5 * scale if dtype == torch.float32 else 2 ** -6 * scale
    torch.testing.assert_close(out.float(), want, rtol=0, atol=tol)


def _flat_quantized(w13, w2, scheme):
    e, two_i, h = w13.shape
    return (quantize(w13.reshape(e * two_i, h).float(), name="w13", **scheme).to(w13.dtype),
            quantize(w2.reshape(e * h, -1).float(), name="w2", **scheme).to(w2.dtype))


@pytest.mark.parametrize("renormalize", [True, False])
def test_routing_matches_the_reference(renormalize):
    _, logits, *_ = _case(37, 8, 8, 10, torch.float32)
    weights, ids = route_topk(logits, 3, renormalize)
    want_w, want_ids = route(logits, 3, renormalize)
    assert torch.equal(ids.long(), want_ids)
    torch.testing.assert_close(weights, want_w, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("one_program", [False, True])
@pytest.mark.parametrize("t, top_k, experts, block_m", [(1, 2, 6, 16), (37, 3, 10, 16),
                                                        (70, 4, 5, 32), (3, 8, 16, 16)])
def test_sorting_groups_every_pair_once_in_blocks_of_one_expert(t, top_k, experts, block_m,
                                                                 one_program):
    _, logits, *_ = _case(t, 8, 8, experts, torch.float32, seed=t)
    _, ids = route_topk(logits, top_k, True)
    blocks = sort_by_expert(ids, experts, block_m,
                            one_program_max_pairs=t * top_k if one_program else 0)
    flat = ids.reshape(-1).cpu()
    order, expert = blocks.order.cpu().long(), blocks.expert.cpu()
    pos, end = blocks.pos.cpu(), blocks.end.cpu()
    assert sorted(order.tolist()) == list(range(t * top_k))
    assert torch.equal(flat[order], torch.sort(flat).values)  # grouped by expert
    if one_program:  # the sort keeps pair order inside an expert
        assert torch.equal(order, torch.sort(flat, stable=True).indices)
    covered = []
    for b in range(blocks.num_blocks):
        if expert[b] == experts:
            continue
        places = range(int(pos[b]), min(int(pos[b]) + block_m, int(end[b])))
        assert len(places) > 0
        assert all(flat[order[p]] == expert[b] for p in places)
        covered += places
    assert sorted(covered) == list(range(t * top_k))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t, top_k, renormalize, split", [(1, 2, True, True), (5, 3, False, False),
                                                          (9, 1, True, True)])
def test_decode_matches_the_reference(dtype, t, top_k, renormalize, split):
    x, logits, w13, w2 = _case(t, 96, 40, 6, dtype)
    out = torch.full((t, 96), float("nan"), device=DEV, dtype=dtype)
    moe_decode(x, logits, w13, w2, out, top_k, renormalize, block_n=16, block_k=32, split=split)
    _check(out, x, logits, w13.float(), w2.float(), top_k, renormalize, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t, top_k, renormalize, tma", [(1, 2, True, False), (23, 3, False, True),
                                                        (40, 2, True, True)])
def test_grouped_matches_the_reference(dtype, t, top_k, renormalize, tma):
    # inter 40 is not a multiple of the 32-row tile: TMA reads rows past an expert's slice.
    x, logits, w13, w2 = _case(t, 64, 40, 6, dtype, seed=t)
    out = torch.full((t, 64), float("nan"), device=DEV, dtype=dtype)
    moe_grouped(x, logits, w13, w2, out, top_k, renormalize, block_m=32, block_n=32,
                block_k=32, one_program_max_pairs=64,  # 23 x 3 pairs: atomics, the rest sorted
                tma_weights=tma)
    _check(out, x, logits, w13.float(), w2.float(), top_k, renormalize, dtype)


QUANT_SCHEMES = {
    "int4-g32": dict(kind="int4", group_size=32),
    "int4-g32-offsets": dict(kind="int4", group_size=32, offsets=True),
    "int4-g16-offsets": dict(kind="int4", group_size=16, offsets=True),  # GGUF Q2_K
    "int8-channel": dict(kind="int8"),
    "fp8-channel": dict(kind="fp8"),
}


@pytest.mark.parametrize("scheme", QUANT_SCHEMES)
@pytest.mark.parametrize("path", ["decode", "decode-split", "grouped"])
def test_packed_quantized_experts(scheme, path):
    dtype = torch.float32
    x, logits, w13, w2 = _case(6, 64, 32, 4, dtype, seed=3)
    qw13, qw2 = _flat_quantized(w13, w2, QUANT_SCHEMES[scheme])
    out = torch.full((6, 64), float("nan"), device=DEV, dtype=dtype)
    if path == "grouped":
        moe_grouped(x, logits, qw13, qw2, out, 2, True, block_m=16, block_n=32, block_k=64)
    else:
        moe_decode(x, logits, qw13, qw2, out, 2, True, block_n=16, block_k=64,
                   split=path == "decode-split")
    _check(out, x, logits, qw13, qw2, 2, True, dtype)


def test_block_m_follows_the_pairs_per_expert():
    assert grouped_block_m(8, 128, 64) == 16
    assert grouped_block_m(16384, 128, 64) == 64
    assert grouped_block_m(16384, 128, 32) == 32
    assert grouped_block_m(40 * 8, 8, 64) == 64


@pytest.mark.parametrize("t, split_max, grouped", [
    (1, 8, {}), (5, 8, {}), (3, 2, {}), (12, 8, {}),
    (12, 8, dict(group_one_program_max_pairs=64, grouped_tma_weights=True))],
    ids=["decode-split", "decode-split-5", "decode-per-token", "grouped",
         "grouped-one-program-tma"])
@pytest.mark.parametrize("quantized", [False, True])
def test_combine_in_the_norm_equals_combine_then_norm(t, split_max, grouped, quantized):
    """moe_add_rms_norm (the experts' shares added by the norm's kernel) gives the bits of the
    moe kernels' combine followed by add_rms_norm, on every path a token count takes."""
    dtype = torch.float16 if DEV == "cpu" else torch.bfloat16
    x, logits, w13, w2 = _case(t, 64, 32, 6, dtype, seed=t)
    if quantized:
        w13, w2 = _flat_quantized(w13, w2, QUANT_SCHEMES["int4-g32"])
    g = torch.Generator().manual_seed(7)
    residual = torch.randn(t, 64, generator=g).to(DEV, dtype)
    weight = (torch.rand(64, generator=g) + 0.5).to(DEV, dtype)
    tuning = Tuning(moe=MoeTuning(split_max_tokens=split_max, **grouped))
    kw = dict(top_k=3, renormalize=True)
    fused = (torch.empty_like(x), torch.empty_like(x))
    moe_add_rms_norm_into(fused, x, logits, w13, w2, residual, weight, tuning=tuning, eps=1e-6,
                          **kw)
    moe_out = moe_into((torch.empty_like(x),), x, logits, w13, w2, tuning=tuning, **kw)
    want = add_rms_norm_into((torch.empty_like(x), torch.empty_like(x)), moe_out, residual,
                             weight, eps=1e-6)
    assert torch.equal(fused[0], want[0]) and torch.equal(fused[1], want[1])
    _check(moe_out, x, logits, w13, w2, 3, True, dtype)  # and the combine is the op's


def test_add_parts_rms_norm_refuses_mismatched_parts():
    from tgraph.kernels.triton.norms import add_parts_rms_norm

    r = torch.zeros(2, 8, device=DEV)
    with pytest.raises(ValueError, match=r"expected fp32 parts \[2 \* 3, 8\]"):
        add_parts_rms_norm(torch.zeros(5, 8, device=DEV), 3, r, torch.ones(8, device=DEV),
                           1e-6, torch.empty_like(r), torch.empty_like(r))


def test_bad_input_is_refused():
    x, logits, w13, w2 = _case(2, 32, 16, 4, torch.float32)
    out = torch.empty(2, 32, device=DEV)
    with pytest.raises(ValueError, match="top_k must be between 1 and the 4 experts"):
        moe_decode(x, logits, w13, w2, out, 5, True)
    with pytest.raises(ValueError, match=r"expected x \[T, H\]"):
        moe_grouped(x, logits[:, :3], w13, w2, out, 2, True)
    qw13, qw2 = _flat_quantized(w13, w2, QUANT_SCHEMES["int8-channel"])
    with pytest.raises(ValueError, match="both quantized"):
        moe_decode(x, logits, qw13, w2, out, 2, True)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 4, 64, 512])
@pytest.mark.parametrize("scheme", [None, "fp8-channel", "int4-g128"])
def test_gpu_qwen3_30b_layer_in_a_cuda_graph(t, scheme):
    from tests.helpers import capture_cuda_graph

    x, logits, w13, w2 = _case(t, 2048, 768, 128, torch.bfloat16)
    if scheme == "int4-g128":
        w13, w2 = _flat_quantized(w13, w2, dict(kind="int4", group_size=128))
    elif scheme is not None:
        w13, w2 = _flat_quantized(w13, w2, QUANT_SCHEMES[scheme])
    out = torch.empty(t, 2048, device="cuda", dtype=torch.bfloat16)
    if t <= 64:
        run = lambda: moe_decode(x, logits, w13, w2, out, 8, True, split=t <= 4)  # noqa: E731
    else:
        run = lambda: moe_grouped(x, logits, w13, w2, out, 8, True)  # noqa: E731
    graph = capture_cuda_graph(run)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    _check(out, x, logits, w13 if scheme else w13.float(), w2 if scheme else w2.float(), 8,
           True, torch.bfloat16)
