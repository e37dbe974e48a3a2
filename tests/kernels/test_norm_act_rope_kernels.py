"""Triton kernels for norms, SwiGLU, rope (+ paged-cache write) and embedding vs torch references.

On CPU these run under ``TRITON_INTERPRET=1`` at small shapes; with CUDA the same tests run on the
device, and the ``gpu`` tests add real LLM shapes (speed is measured by
``python -m tgraph.bench kernels``).

References are computed in fp64 from the same inputs, then rounded the way the kernels round:
to fp32 first, then once to the output dtype. Tolerances are in units of the output dtype's
machine epsilon ``eps`` (the relative spacing of representable values, an upper bound on one
unit in the last place relative to the value):

- a single rounding of an fp32 result: the kernel and the reference may round fp32 values that
  differ in their last bits to neighbouring outputs, so ``rtol = 1 eps``;
- RMSNorm rounds twice (normalised value to the activation dtype, then the weighted result), so
  ``rtol = 2 eps``;
- fp32 outputs: ``rtol = 1e-5`` covers reduction order and the GPU's approximate rsqrt/exp
  (a few fp32 ulps), far below any indexing or formula error;
- pure data movement (residual sum of two half-precision values, pass-through rotary dims, cache
  writes, embedding rows) must be bit-exact.
"""
from __future__ import annotations

import functools

import pytest
import torch
import triton
import triton.language as tl

from tgraph.kernels.triton.activations import swiglu
from tgraph.kernels.triton.embedding import embedding
from tgraph.kernels.triton.norms import add_rms_norm, rms_norm
from tgraph.kernels.triton.rope import reshape_and_cache, rope, rope_and_cache

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
GPU_DTYPES = [torch.bfloat16, torch.float16]
NAN = float("nan")


# --------------------------------------------------------------------------------------------
# Reference helpers


@triton.jit
def _cast_kernel(src, dst):
    tl.store(dst, tl.load(src).to(dst.dtype.element_ty))


@functools.cache
def _bf16_cast_truncates() -> bool:
    """Whether the backend under test rounds fp32 -> bf16 toward zero.

    Triton's interpreter (3.6 to 3.9 at least) truncates; CUDA rounds to nearest even. The
    references follow the backend so that exact comparisons stay exact on both.
    """
    src = torch.tensor([1 + 3 * 2**-9], dtype=torch.float32, device=DEVICE)  # 0.75 ulp above 1
    dst = torch.zeros(1, dtype=torch.bfloat16, device=DEVICE)
    _cast_kernel[(1,)](src, dst)
    return dst.item() == 1.0


def rnd(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round ``x`` to fp32, then to ``dtype`` as the kernels' final cast does."""
    x32 = x.float()
    if dtype == torch.bfloat16 and _bf16_cast_truncates():
        return (x32.view(torch.int32) & -65536).view(torch.float32).to(dtype)
    return x32.to(dtype)


def rtol_for(dtype: torch.dtype, roundings: int = 1) -> float:
    return 1e-5 if dtype == torch.float32 else roundings * torch.finfo(dtype).eps


def assert_close(
    actual: torch.Tensor, expected: torch.Tensor, rtol: float, atol: float = 1e-5,
    same_rounding: bool = True,
) -> None:
    """Within ``rtol``/``atol``; and for half-precision outputs of a reference that rounds like
    the kernel (``same_rounding``), bit-identical in all but a few elements."""
    torch.testing.assert_close(actual.double(), expected.double(), rtol=rtol, atol=atol)
    if same_rounding and actual.dtype != torch.float32:
        assert_rounded_like_reference(actual, expected.to(actual.dtype))


def assert_rounded_like_reference(
    actual: torch.Tensor, expected: torch.Tensor, max_mismatch: float = 0.01
) -> None:
    """Most elements must be bit-identical to the reference.

    The tolerance alone can't tell a rounding-order mistake (e.g. skipping HF's cast to the
    activation dtype before the weight) from fp32 noise: both stay within an ulp or two. With the
    right rounding sequence only the rare values whose fp32 result sits on a rounding boundary
    differ (well under 1%, plus 2 elements of slack for tiny tensors); a wrong sequence changes
    a large fraction of them.
    """
    mismatches = int((actual != expected).sum())
    allowed = 2 + max_mismatch * actual.numel()
    assert mismatches <= allowed, (
        f"{mismatches} of {actual.numel()} elements differ from the reference"
    )


def nan_like(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    return torch.full_like(t, NAN, dtype=dtype)


def strided_rows(
    m: int, n: int, dtype: torch.dtype, pad: int = 24, fill: float | None = None
) -> torch.Tensor:
    """An ``[m, n]`` view with a row stride of ``n + pad`` (a slice of a wider buffer)."""
    buf = torch.randn(m, n + pad, dtype=torch.float32, device=DEVICE).to(dtype)
    if fill is not None:
        buf.fill_(fill)
    return buf[:, pad // 2 : pad // 2 + n]


def ref_rms_norm(x, weight, eps, out_dtype, norm_dtype):
    xd = x.double()
    normed = rnd(xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps), norm_dtype)
    return rnd(normed.double() * weight.double(), out_dtype)


def ref_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool
) -> torch.Tensor:
    """fp64 rotary embedding of ``x [T, H, D]`` with per-token ``cos/sin [T, R/2]``."""
    half = cos.shape[1]
    xd = x.double()
    c, s = cos.double()[:, None, :], sin.double()[:, None, :]
    if interleaved:
        i1, i2 = slice(0, 2 * half, 2), slice(1, 2 * half, 2)
    else:
        i1, i2 = slice(0, half), slice(half, 2 * half)
    out = xd.clone()
    out[..., i1] = xd[..., i1] * c - xd[..., i2] * s
    out[..., i2] = xd[..., i2] * c + xd[..., i1] * s
    return out


def rope_tables(t: int, half: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos/sin at random positions, as the engine gathers them from the tables."""
    pos = torch.randint(0, 4096, (t,), dtype=torch.float64)
    inv_freq = 1.0 / 10000 ** (torch.arange(half, dtype=torch.float64) / half)
    angles = pos[:, None] * inv_freq
    return angles.cos().float().to(DEVICE), angles.sin().float().to(DEVICE)


def randn(*shape: int, dtype: torch.dtype = torch.float32, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, device=DEVICE) * scale).to(dtype)


# --------------------------------------------------------------------------------------------
# RMSNorm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,scale", [(1, 64, 1.0), (37, 200, 1e-3), (5, 1000, 10.0)])
def test_rms_norm(dtype, m, n, scale):
    # scale 1e-3 puts the mean square at eps, so a misplaced eps shows.
    x, w = randn(m, n, dtype=dtype, scale=scale), randn(n, dtype=dtype)
    out = nan_like(x)
    rms_norm(x, w, 1e-6, out)
    assert_close(out, ref_rms_norm(x, w, 1e-6, dtype, dtype), rtol_for(dtype, 2))


def test_rms_norm_fp32_weight_promotes_like_hf():
    # HF: fp32 weight * bf16-normalised x -> fp32 output; the cast to x's dtype still happens.
    x, w = randn(9, 96, dtype=torch.bfloat16), randn(96)
    out = nan_like(x, torch.float32)
    rms_norm(x, w, 1e-5, out)
    assert_close(out, ref_rms_norm(x, w, 1e-5, torch.float32, torch.bfloat16), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_strided_rows_in_place(dtype):
    x = strided_rows(19, 160, dtype)
    w = randn(160, dtype=dtype)
    expected = ref_rms_norm(x, w, 1e-6, dtype, dtype)
    rms_norm(x, w, 1e-6, x)
    assert_close(x, expected, rtol_for(dtype, 2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rms_norm_matches_hf_llama(dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    hf = LlamaRMSNorm(128, eps=1e-6).to(DEVICE, dtype)
    with torch.no_grad():
        hf.weight.copy_(randn(128, dtype=dtype))
        x = randn(12, 128, dtype=dtype, scale=3.0)
        expected = hf(x)
    out = nan_like(x)
    rms_norm(x, hf.weight.detach(), 1e-6, out)
    assert_close(out, expected, rtol_for(dtype, 2))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("alias", ["none", "residual_out=residual", "residual_out=x", "out=x"])
def test_add_rms_norm(dtype, alias):
    m, n = 21, 200
    x, res, w = randn(m, n, dtype=dtype), randn(m, n, dtype=dtype), randn(n, dtype=dtype)
    x0, res0 = x.clone(), res.clone()
    out = x if alias == "out=x" else nan_like(x)
    res_out = {"residual_out=residual": res, "residual_out=x": x}.get(alias, nan_like(x))
    add_rms_norm(x, res, w, 1e-6, out, res_out)
    summed = rnd(x0.double() + res0.double(), dtype)
    assert torch.equal(res_out, summed)
    assert_close(out, ref_rms_norm(summed, w, 1e-6, dtype, dtype), rtol_for(dtype, 2))


def test_add_rms_norm_strided_residual_normalises_rounded_sum():
    dtype = torch.bfloat16
    x, res = strided_rows(13, 128, dtype), strided_rows(13, 128, dtype, pad=40)
    w = randn(128, dtype=dtype)
    out, res_out = nan_like(x), strided_rows(13, 128, dtype, pad=8, fill=NAN)
    add_rms_norm(x, res, w, 1e-6, out, res_out)
    summed = rnd(x.double() + res.double(), dtype)
    assert torch.equal(res_out, summed)
    # Normalising the unrounded fp32 sum instead would be off by up to an ulp of the sum.
    assert_close(out, ref_rms_norm(summed, w, 1e-6, dtype, dtype), rtol_for(dtype, 2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norms_long_rows_use_chunked_path(dtype):
    # Rows longer than the in-register limit take the two-pass loop; n is not a chunk multiple.
    m, n = 3, 16400
    x, res, w = randn(m, n, dtype=dtype), randn(m, n, dtype=dtype), randn(n, dtype=dtype)
    out = nan_like(x)
    rms_norm(x, w, 1e-6, out)
    assert_close(out, ref_rms_norm(x, w, 1e-6, dtype, dtype), rtol_for(dtype, 2))
    summed = rnd(x.double() + res.double(), dtype)
    add_rms_norm(x, res, w, 1e-6, out, res)  # residual updated in place
    assert torch.equal(res, summed)
    assert_close(out, ref_rms_norm(summed, w, 1e-6, dtype, dtype), rtol_for(dtype, 2))


# --------------------------------------------------------------------------------------------
# SwiGLU


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n", [(1, 64), (33, 100), (5, 1100)])
def test_swiglu(dtype, m, n):
    gate_up = randn(m, 2 * n, dtype=dtype, scale=4.0)
    out = nan_like(gate_up[:, :n])
    swiglu(gate_up, out)
    g, u = gate_up[:, :n].double(), gate_up[:, n:].double()
    assert_close(out, rnd(torch.nn.functional.silu(g) * u, dtype), rtol_for(dtype), atol=1e-6)


# The interpreter evaluates exp in numpy, which warns where it saturates to inf.
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_strided_rows_and_saturation(dtype):
    n = 48
    gate_up = strided_rows(6, 2 * n, dtype)
    gate_up[0, :n] = torch.linspace(-120.0, 120.0, n)  # exp(-g) overflows for g << 0: silu -> -0
    out = strided_rows(6, n, dtype, pad=16, fill=NAN)
    swiglu(gate_up, out)
    g, u = gate_up[:, :n].double(), gate_up[:, n:].double()
    assert_close(out, rnd(torch.nn.functional.silu(g) * u, dtype), rtol_for(dtype), atol=1e-6)


# --------------------------------------------------------------------------------------------
# Rope


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("t,hq,hk,d,r", [(5, 4, 2, 32, 32), (5, 4, 2, 32, 16), (3, 20, 4, 80, 32)])
def test_rope(dtype, interleaved, t, hq, hk, d, r):
    q, k = randn(t, hq, d, dtype=dtype), randn(t, hk, d, dtype=dtype)
    cos, sin = rope_tables(t, r // 2)
    q_out, k_out = nan_like(q), nan_like(k)
    rope(q, k, cos, sin, q_out, k_out, interleaved)
    for x, out in ((q, q_out), (k, k_out)):
        assert_close(out, rnd(ref_rope(x, cos, sin, interleaved), dtype), rtol_for(dtype))
        assert torch.equal(out[..., r:], x[..., r:])  # pass-through dims are copied bit-exactly


@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
def test_rope_in_place_on_packed_qkv_views(interleaved):
    t, hq, hk, d, r, dtype = 6, 4, 2, 64, 48, torch.bfloat16
    width = (hq + 2 * hk) * d
    qkv = strided_rows(t, width, dtype)  # [T, (Hq + 2 Hk) D] with a row stride > width
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d : (hq + hk) * d].view(t, hk, d)
    before = qkv.clone()
    cos, sin = rope_tables(t, r // 2)
    q_ref = rnd(ref_rope(q, cos, sin, interleaved), dtype)
    k_ref = rnd(ref_rope(k, cos, sin, interleaved), dtype)
    rope(q, k, cos, sin, q, k, interleaved)
    assert_close(q, q_ref, rtol_for(dtype))
    assert_close(k, k_ref, rtol_for(dtype))
    assert torch.equal(qkv[:, (hq + hk) * d :], before[:, (hq + hk) * d :])  # v untouched


def test_rope_matches_hf_llama_rotate_half():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    t, hq, hk, d = 7, 4, 2, 64
    q, k = randn(t, hq, d), randn(t, hk, d)
    cos, sin = rope_tables(t, d // 2)
    # HF layout: q [B, H, T, D], cos/sin [B, T, D] holding the angles twice (cat(freqs, freqs)).
    cos_hf, sin_hf = torch.cat([cos, cos], -1)[None], torch.cat([sin, sin], -1)[None]
    q_hf, k_hf = apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos_hf, sin_hf
    )
    q_out, k_out = nan_like(q), nan_like(k)
    rope(q, k, cos, sin, q_out, k_out, False)
    assert_close(q_out, q_hf[0].transpose(0, 1), rtol=1e-5, same_rounding=False)
    assert_close(k_out, k_hf[0].transpose(0, 1), rtol=1e-5, same_rounding=False)


def test_rope_matches_hf_gptj_interleaved_partial():
    from transformers.models.gptj.modeling_gptj import apply_rotary_pos_emb

    t, h, d, r = 5, 3, 64, 32
    q = randn(t, h, d)
    cos, sin = rope_tables(t, r // 2)
    # GPT-J rotates the first rotary_dim dims of [B, T, H, D] with sin/cos [B, T, R/2].
    rot = apply_rotary_pos_emb(q[None, ..., :r], sin[None], cos[None])[0]
    q_out, k_out = nan_like(q), nan_like(q)
    rope(q, q, cos, sin, q_out, k_out, True)
    assert_close(q_out, torch.cat([rot, q[..., r:]], -1), rtol=1e-5, same_rounding=False)


def _check_cache(cache: torch.Tensor, slots: torch.Tensor, expected: torch.Tensor) -> None:
    """Valid slots hold ``expected`` rows bit-exactly; every other slot is still NaN."""
    flat = cache.reshape(-1, *cache.shape[2:])
    valid = (slots >= 0) & (slots < flat.shape[0])
    assert torch.equal(flat[slots[valid].long()], expected[valid])
    untouched = torch.ones(flat.shape[0], dtype=torch.bool, device=cache.device)
    untouched[slots[valid].long()] = False
    assert untouched.sum() == flat.shape[0] - int(valid.sum())
    assert flat[untouched].isnan().all()


def _slots(block_size: int, num_blocks: int, slot_dtype: torch.dtype = torch.int64) -> torch.Tensor:
    n = block_size * num_blocks
    # Both ends of the cache, slots in several blocks, one past the end, and padding (-1) after
    # slot 0 so that a padding write clamped to slot 0 would clobber it.
    return torch.tensor(
        [5, 0, block_size + 2, n - 1, n, -1, 2 * block_size - 1], dtype=slot_dtype, device=DEVICE
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("block_size", [16, 32])
def test_rope_and_cache(dtype, interleaved, block_size):
    num_blocks, hq, hk, d, r = 3, 4, 2, 32, 16
    slots = _slots(block_size, num_blocks, torch.int32 if block_size == 16 else torch.int64)
    t = slots.shape[0]
    q, k, v = (randn(t, hq, d, dtype=dtype), randn(t, hk, d, dtype=dtype),
               randn(t, hk, d, dtype=dtype))
    cos, sin = rope_tables(t, r // 2)
    k_cache = torch.full((num_blocks, block_size, hk, d), NAN, dtype=dtype, device=DEVICE)
    v_cache = k_cache.clone()
    q_out, k_out = nan_like(q), nan_like(k)
    rope_and_cache(q, k, v, cos, sin, k_cache, v_cache, slots, q_out, k_out, interleaved)
    # Padding tokens are still rotated; only their cache write is skipped.
    assert_close(q_out, rnd(ref_rope(q, cos, sin, interleaved), dtype), rtol_for(dtype))
    assert_close(k_out, rnd(ref_rope(k, cos, sin, interleaved), dtype), rtol_for(dtype))
    _check_cache(k_cache, slots, k_out)
    _check_cache(v_cache, slots, v)
    # Without k_out (the model's call: rotated keys only go to the cache) the same bits land.
    k_cache2, v_cache2 = torch.full_like(k_cache, NAN), torch.full_like(v_cache, NAN)
    q_out2 = nan_like(q)
    rope_and_cache(q, k, v, cos, sin, k_cache2, v_cache2, slots, q_out2, None, interleaved)
    for got, want in ((q_out2, q_out), (k_cache2, k_cache), (v_cache2, v_cache)):
        assert torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0))


@pytest.mark.parametrize("block_size", [16, 32])
def test_reshape_and_cache_into_strided_kv_pair(block_size):
    # One allocation [num_blocks, 2, block_size, Hk, D]: k and v caches are strided views of it.
    num_blocks, hk, d, dtype = 3, 3, 48, torch.float16
    slots = _slots(block_size, num_blocks)
    t = slots.shape[0]
    k, v = randn(t, hk, d, dtype=dtype), randn(t, hk, d, dtype=dtype)
    kv = torch.full((num_blocks, 2, block_size, hk, d), NAN, dtype=dtype, device=DEVICE)
    reshape_and_cache(k, v, kv[:, 0], kv[:, 1], slots)
    _check_cache(kv[:, 0], slots, k)
    _check_cache(kv[:, 1], slots, v)


# --------------------------------------------------------------------------------------------
# Embedding


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("h", [100, 5000])
def test_embedding(dtype, ids_dtype, h):
    v = 50
    weight = strided_rows(v, h, dtype)
    raw = torch.randint(0, v, (2 * 11,), dtype=ids_dtype, device=DEVICE)
    raw[[2, 6, 10]] = torch.tensor([-1, v, v + 7], dtype=ids_dtype)
    ids = raw[::2]  # strided ids; three of them out of range
    out = strided_rows(ids.shape[0], h, dtype, fill=NAN)
    embedding(ids, weight, out)
    valid = (ids >= 0) & (ids < v)
    assert torch.equal(out[valid], weight[ids[valid].long()])
    assert (out[~valid] == 0).all()  # masked, not clamped to a real row


# --------------------------------------------------------------------------------------------
# Input validation


def _bad_calls() -> dict:
    """case -> (call, expected exception, regex its message must contain)."""
    x, w, out = randn(4, 8), randn(8), randn(4, 8)
    q, k, cos = randn(3, 4, 16), randn(3, 2, 16), randn(3, 8)
    cache, slots = randn(2, 16, 2, 16), torch.zeros(3, dtype=torch.int64, device=DEVICE)
    wide_cache = randn(2, 16, 4, 16)
    meta = torch.empty(4, 8, device="meta")
    return {
        "not_a_tensor": (lambda: rms_norm(x.cpu().numpy(), w, 1e-6, out), TypeError,
                         "rms_norm: x: .*torch.Tensor"),
        "norm_int_dtype": (lambda: rms_norm(x.int(), w, 1e-6, out), ValueError,
                           "rms_norm: x: expected float32"),
        "norm_weight_len": (lambda: rms_norm(x, randn(7), 1e-6, out), ValueError,
                            r"weight: expected shape \(8,\)"),
        "norm_out_shape": (lambda: rms_norm(x, w, 1e-6, randn(4, 9)), ValueError,
                           r"out: expected shape \(4, 8\)"),
        "norm_3d": (lambda: rms_norm(x[None], w, 1e-6, out), ValueError,
                    "x: expected a 2-D tensor"),
        "norm_last_dim": (lambda: rms_norm(randn(8, 4).t(), w, 1e-6, out), ValueError,
                          "x: the last dim .*contiguous"),
        "add_norm_alias": (lambda: add_rms_norm(x, x.clone(), w, 1e-6, out, out), ValueError,
                           "out must not alias residual_out"),
        "swiglu_odd": (lambda: swiglu(randn(4, 7), randn(4, 3)), ValueError,
                       "swiglu: gate_up: expected an even"),
        "swiglu_out_shape": (lambda: swiglu(randn(4, 8), randn(4, 8)), ValueError,
                             r"out: expected shape \(4, 4\)"),
        "rope_cos_fp16": (lambda: rope(q, k, cos.half(), cos, q, k, False), ValueError,
                          "cos: expected dtype float32"),
        "rope_r_gt_d": (lambda: rope(q, k, randn(3, 9), randn(3, 9), q, k, False), ValueError,
                        "R <= head_dim=16"),
        "rope_cos_tokens": (lambda: rope(q, k, cos[:2], cos[:2], q, k, False), ValueError,
                            r"cos: expected shape \(3,"),
        "rope_head_dim": (lambda: rope(q, randn(3, 2, 8), cos, cos, q, randn(3, 2, 8), False),
                          ValueError, "rope: k: expected shape"),
        "rope_interleaved_int": (lambda: rope(q, k, cos, cos, q, k, 1), TypeError,
                                 "interleaved: expected a bool"),
        "cache_slots_float": (
            lambda: rope_and_cache(q, k, k, cos, cos, cache, cache, slots.float(), q, k, False),
            ValueError,
            "rope_and_cache: slots_mapping: expected dtype int32, int64",
        ),
        "cache_heads": (lambda: reshape_and_cache(k, k, wide_cache, wide_cache, slots), ValueError,
                        "k_cache: expected shape"),
        "cache_slots_len": (lambda: reshape_and_cache(k, k, cache, cache, slots[:2]), ValueError,
                            "slots_mapping: .*one slot per token"),
        "embedding_ids": (lambda: embedding(randn(3), w[None], randn(3, 8)), ValueError,
                          "embedding: ids: expected"),
        "embedding_out": (lambda: embedding(slots, randn(5, 8), randn(3, 7)), ValueError,
                          "out: expected shape"),
        "meta_device": (lambda: rms_norm(meta, w.to("meta"), 1e-6, meta), ValueError,
                        "need CUDA tensors"),
        "mixed_devices": (lambda: rms_norm(x, w.to("meta"), 1e-6, out), ValueError,
                          "all tensors must be on one"),
    }


@pytest.mark.parametrize("case", list(_bad_calls()))
def test_bad_input_is_rejected(case):
    call, exc, match = _bad_calls()[case]
    with pytest.raises(exc, match=match):
        call()


# --------------------------------------------------------------------------------------------
# GPU: real LLM shapes


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
# The last shape is a q/k norm: many rows of one head's dims.
@pytest.mark.parametrize("m,n", [(4096, 4096), (7, 4096), (4096, 8192), (4096 * 32, 128)])
def test_gpu_norms(dtype, m, n):
    x, res, w = randn(m, n, dtype=dtype), randn(m, n, dtype=dtype), randn(n, dtype=dtype)
    out = nan_like(x)
    rms_norm(x, w, 1e-6, out)
    assert_close(out, ref_rms_norm(x, w, 1e-6, dtype, dtype), rtol_for(dtype, 2))
    summed = rnd(x.double() + res.double(), dtype)
    add_rms_norm(x, res, w, 1e-6, out, res)
    assert torch.equal(res, summed)
    assert_close(out, ref_rms_norm(summed, w, 1e-6, dtype, dtype), rtol_for(dtype, 2))


@pytest.mark.gpu
def test_gpu_rms_norm_matches_hf_llama_bf16():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    hf = LlamaRMSNorm(4096, eps=1e-5).to(DEVICE, torch.bfloat16)
    with torch.no_grad():
        hf.weight.copy_(randn(4096, dtype=torch.bfloat16))
        x = randn(512, 4096, dtype=torch.bfloat16, scale=3.0)
        expected = hf(x)
    out = nan_like(x)
    rms_norm(x, hf.weight.detach(), 1e-5, out)
    assert_close(out, expected, rtol_for(torch.bfloat16, 2))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("m", [1, 4096])
def test_gpu_swiglu(dtype, m):
    n = 14336
    gate_up = randn(m, 2 * n, dtype=dtype, scale=4.0)
    out = nan_like(gate_up[:, :n])
    swiglu(gate_up, out)
    g, u = gate_up[:, :n].double(), gate_up[:, n:].double()
    assert_close(out, rnd(torch.nn.functional.silu(g) * u, dtype), rtol_for(dtype), atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("block_size", [16, 32])
def test_gpu_rope_and_cache(dtype, interleaved, block_size):
    t, hq, hk, d = 4096, 32, 8, 128
    num_blocks = t // block_size + 4
    slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:t]
    slots[::97] = -1
    q, k, v = (randn(t, hq, d, dtype=dtype), randn(t, hk, d, dtype=dtype),
               randn(t, hk, d, dtype=dtype))
    cos, sin = rope_tables(t, d // 2)
    k_cache = torch.full((num_blocks, block_size, hk, d), NAN, dtype=dtype, device=DEVICE)
    v_cache = k_cache.clone()
    q_ref = rnd(ref_rope(q, cos, sin, interleaved), dtype)
    k_ref = rnd(ref_rope(k, cos, sin, interleaved), dtype)
    rope_and_cache(q, k, v, cos, sin, k_cache, v_cache, slots, q, k, interleaved)  # in place
    assert_close(q, q_ref, rtol_for(dtype))
    assert_close(k, k_ref, rtol_for(dtype))
    _check_cache(k_cache, slots, k)
    _check_cache(v_cache, slots, v)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_gpu_rope_partial_rotary(dtype):
    t, hq, hk, d, r = 4096, 32, 32, 80, 32  # Phi-2 style: 32 of 80 dims rotate
    q, k = randn(t, hq, d, dtype=dtype), randn(t, hk, d, dtype=dtype)
    cos, sin = rope_tables(t, r // 2)
    q_out, k_out = nan_like(q), nan_like(k)
    rope(q, k, cos, sin, q_out, k_out, False)
    assert_close(q_out, rnd(ref_rope(q, cos, sin, False), dtype), rtol_for(dtype))
    assert_close(k_out, rnd(ref_rope(k, cos, sin, False), dtype), rtol_for(dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_gpu_embedding(dtype):
    v, h, t = 128256, 4096, 4096
    weight = randn(v, h, dtype=dtype)
    ids = torch.randint(0, v, (t,), device=DEVICE)
    ids[:3] = torch.tensor([-1, v, 2**40], device=DEVICE)
    out = nan_like(weight[:t])
    embedding(ids, weight, out)
    assert torch.equal(out[3:], weight[ids[3:]])
    assert (out[:3] == 0).all()


_COMPILE_SCRIPT = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from tgraph.kernels.triton import activations, embedding, norms, rope


def compile_sm90(fn, consts, num_warps, ptr_types=None, floats=()):
    # Pointers 16-byte aligned and sizes/strides divisible by 16, as the launcher specialises
    # real LLM tensors; that is what enables the vectorised paths.
    ptr_types = ptr_types or {}
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = ptr_types.get(name, "*bf16")
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = "fp32" if name in floats else "i32"
    triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                   options={"num_warps": num_warps})


for n, residual in ((4096, False), (128, True), (20000, True)):
    rows, block_n, warps, single = norms.launch_config(n)
    # PARTS=8: the norm adds a MoE token's eight expert shares (moe_add_rms_norm).
    for parts in (0, 8) if residual else (0,):
        consts = dict(HAS_RESIDUAL=residual, PARTS=parts, ROWS=rows, BLOCK_N=block_n,
                      SINGLE_PASS=single)
        compile_sm90(norms._rms_norm_kernel, consts, warps,
                     {"x_ptr": "*fp32"} if parts else None, floats=("eps",))
rows, block_n, warps = activations.launch_config(14336)
compile_sm90(activations._swiglu_kernel, dict(ROWS=rows, BLOCK_N=block_n), warps)
rows, block_h, warps = embedding.launch_config(4096)
compile_sm90(embedding._embedding_kernel, dict(ROWS=rows, BLOCK_H=block_h), warps,
             {"ids_ptr": "*i64"})
tables = {"cos_ptr": "*fp32", "sin_ptr": "*fp32", "slots_ptr": "*i64"}
for half, d, interleaved, cache, k_out in ((64, 128, True, True, True),
                                           (16, 80, False, False, True),
                                           (0, 128, False, True, False),
                                           (64, 128, False, True, False)):
    bhq, bhk, warps = rope.launch_config(d, 32, 8)
    consts = dict(
        HALF=half, D=d, INTERLEAVED=interleaved, WRITE_K_OUT=k_out, WRITE_CACHE=cache, BLOCK_HQ=bhq,
        BLOCK_HK=bhk, BLOCK_HALF=triton.next_power_of_2(max(half, 1)),
        BLOCK_PASS=triton.next_power_of_2(d - 2 * half) if d > 2 * half else 0,
        BLOCK_D=triton.next_power_of_2(d),
        IN_PLACE=not cache,
    )
    compile_sm90(rope._rope_cache_kernel, consts, warps, tables)
print("compiled")
"""


@pytest.mark.slow
def test_kernels_compile_for_sm90_without_a_gpu():
    # The interpreter accepts code the compiler rejects (types across branches, layouts of
    # split/join, barriers); compiling for an H100 target with the bundled ptxas catches that on
    # a CPU-only machine. It needs a process where TRITON_INTERPRET was never set.
    from tests.helpers import run_without_interpreter

    done = run_without_interpreter(_COMPILE_SCRIPT)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-4000:]


def test_rope_in_place_detection():
    # Only launches whose output overlaps its input pay the load/store barrier.
    from tgraph.kernels.triton.rope import _overlaps

    qkv = torch.zeros(4, 6, 8)
    q, k = qkv[:, :4], qkv[:, 4:]
    assert _overlaps(q, q) and _overlaps(qkv, k)
    assert not _overlaps(torch.zeros(4, 4, 8), q)
    assert not _overlaps(qkv[:2], qkv[2:])
    assert _overlaps(q, k)  # interleaved rows of one buffer: spans intersect (conservative)
    assert not _overlaps(torch.zeros(0, 4, 8), q)
