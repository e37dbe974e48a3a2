"""Rotary position embedding, optionally fused with the paged KV-cache write.

Layouts:

- ``q [T, Hq, D]``, ``k``/``v [T, Hk, D]``: token-major, last dim contiguous; token and head
  strides are free, so views into a packed qkv projection work without a copy.
- ``cos``/``sin [T, R/2]`` fp32, already gathered per token by position; ``R <= D`` dims rotate,
  dims ``[R, D)`` pass through unchanged (partial rotary, e.g. GPT-NeoX / Phi).
- Paged cache ``[num_blocks, block_size, Hk, D]``; token ``t`` goes to flat slot
  ``slots_mapping[t]`` (block ``slot // block_size``, offset ``slot % block_size``). Slots outside
  ``[0, num_blocks * block_size)`` - negative ones mark padding - are not written.

Pairs: half-rotation (HF ``rotate_half``, GPT-NeoX, Llama) rotates ``(i, i + R/2)``; interleaved
(GPT-J) rotates ``(2i, 2i + 1)``. For a pair ``(x1, x2)`` and angle ``theta_i``::

    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin

computed in fp32 and rounded once to the output dtype (HF rounds ``cos``/``sin`` to the
activation dtype first and rounds each product; the difference is about one unit in the last
place).

Grid: one program per (token, block of heads). Programs ``[0, n_q_blocks)`` of a token rotate
q heads; the rest rotate k heads and, with a cache, also store the same block of k and v heads
into the cache, so q, k and the cache write are a single launch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tgraph.kernels.triton.checks import check_device as _check_device
from tgraph.kernels.triton.checks import check_tensor as _check_tensor
from tgraph.kernels.triton.checks import memory_overlaps as _overlaps
from tgraph.kernels.triton.pdl import pdl_kwargs, pdl_wait

__all__ = ["rope", "rope_and_cache", "reshape_and_cache"]

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_SLOT_DTYPES = (torch.int32, torch.int64)

# Elements of q per program to aim for: 8 heads of 128 dims (2 KiB each way in bf16). A kv program
# moves k and v (and writes both to the cache), so it takes half as many heads. H100 sweep
# (tgraph.bench.tune_attention --only rope, docs/bench/h100-tune-rope.json; 4096 tokens, 32/8
# heads, d=128): (8, 4) heads at 2 warps 83% of copy bandwidth, (16, 8) below 79%.
_TARGET_TILE = 1024


@triton.jit
def _rope_heads(
    src,
    src_sh,
    dst,
    dst_sh,
    cache,
    cache_sh,
    cache_heads,
    heads,
    n_heads,
    cos,
    sin,
    HALF: tl.constexpr,
    D: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    WRITE_DST: tl.constexpr,
    WRITE_CACHE: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_PASS: tl.constexpr,
    IN_PLACE: tl.constexpr,
):
    """Rotate dims ``[0, 2*HALF)`` and copy dims ``[2*HALF, D)`` of a block of heads of one token.

    ``src``/``dst``/``cache`` point at the token's row (the cache: at its slot); the result goes
    to ``dst`` when ``WRITE_DST`` and, for heads below ``cache_heads`` (0 for a skipped slot),
    to ``cache`` when ``WRITE_CACHE``.
    """
    head_mask = (heads < n_heads)[:, None]
    h64 = heads.to(tl.int64)[:, None]
    src_rows = src + h64 * src_sh
    dst_rows = dst + h64 * dst_sh
    cache_rows = cache + h64 * cache_sh
    cache_mask = (heads < cache_heads)[:, None]

    if BLOCK_PASS > 0:
        p = 2 * HALF + tl.arange(0, BLOCK_PASS)[None, :]
        p_mask = head_mask & (p < D)
        x_pass = tl.load(src_rows + p, mask=p_mask)
    if HALF > 0:
        if INTERLEAVED:
            # Load [heads, HALF, 2] contiguously (full-width vectors) and split the pairs.
            i = tl.arange(0, BLOCK_HALF)[None, :, None]
            rot_off = 2 * i + tl.arange(0, 2)[None, None, :]
            rot_mask = head_mask[:, :, None] & (i < HALF)
            x = tl.load(src_rows[:, :, None] + rot_off, mask=rot_mask, other=0.0).to(tl.float32)
            x1, x2 = tl.split(x)
        else:
            i = tl.arange(0, BLOCK_HALF)[None, :]
            rot_mask = head_mask & (i < HALF)
            x1 = tl.load(src_rows + i, mask=rot_mask, other=0.0).to(tl.float32)
            x2 = tl.load(src_rows + HALF + i, mask=rot_mask, other=0.0).to(tl.float32)
        o1 = x1 * cos - x2 * sin
        o2 = x2 * cos + x1 * sin

    if IN_PLACE:
        # dst aliases src: every load above must complete in every thread before any store
        # below, or a thread could read an element another has already rotated. (A barrier per
        # program costs ~4% of the kernel's bandwidth, so only in-place launches pay it.)
        tl.debug_barrier()

    if HALF > 0:
        if INTERLEAVED:
            o = tl.join(o1, o2)
            if WRITE_DST:
                tl.store(dst_rows[:, :, None] + rot_off, o.to(dst.dtype.element_ty), mask=rot_mask)
            if WRITE_CACHE:
                cache_rot_mask = rot_mask & cache_mask[:, :, None]
                o = o.to(cache.dtype.element_ty)
                tl.store(cache_rows[:, :, None] + rot_off, o, mask=cache_rot_mask)
        else:
            if WRITE_DST:
                tl.store(dst_rows + i, o1.to(dst.dtype.element_ty), mask=rot_mask)
                tl.store(dst_rows + HALF + i, o2.to(dst.dtype.element_ty), mask=rot_mask)
            if WRITE_CACHE:
                cache_rot_mask = rot_mask & cache_mask
                tl.store(cache_rows + i, o1.to(cache.dtype.element_ty), mask=cache_rot_mask)
                tl.store(cache_rows + HALF + i, o2.to(cache.dtype.element_ty), mask=cache_rot_mask)
    if BLOCK_PASS > 0:
        if WRITE_DST:
            tl.store(dst_rows + p, x_pass.to(dst.dtype.element_ty), mask=p_mask)
        if WRITE_CACHE:
            tl.store(cache_rows + p, x_pass.to(cache.dtype.element_ty), mask=p_mask & cache_mask)


@triton.jit
def _rope_cache_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    cos_ptr,
    sin_ptr,
    q_out_ptr,
    k_out_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slots_ptr,
    n_q_heads,
    n_kv_heads,
    n_q_blocks,
    block_size,
    n_slots,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cos,
    stride_sin,
    stride_qot,
    stride_qoh,
    stride_kot,
    stride_koh,
    stride_kcb,
    stride_kco,
    stride_kch,
    stride_vcb,
    stride_vco,
    stride_vch,
    HALF: tl.constexpr,
    D: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    WRITE_K_OUT: tl.constexpr,
    WRITE_CACHE: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_PASS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IN_PLACE: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    head_block = tl.program_id(1)
    if HALF > 0:
        i = tl.arange(0, BLOCK_HALF)[None, :]
        cos = tl.load(cos_ptr + t * stride_cos + i, mask=i < HALF, other=0.0)
        sin = tl.load(sin_ptr + t * stride_sin + i, mask=i < HALF, other=0.0)
    else:
        cos = 0.0
        sin = 0.0

    if head_block < n_q_blocks:
        _rope_heads(
            q_ptr + t * stride_qt, stride_qh, q_out_ptr + t * stride_qot, stride_qoh,
            q_out_ptr, 0, 0,
            head_block * BLOCK_HQ + tl.arange(0, BLOCK_HQ), n_q_heads, cos, sin,
            HALF, D, INTERLEAVED, True, False, BLOCK_HALF, BLOCK_PASS, IN_PLACE,
        )  # fmt: skip
    else:
        if WRITE_CACHE:
            slot = tl.load(slots_ptr + t).to(tl.int64)
            slot_ok = (slot >= 0) & (slot < n_slots)
            slot = tl.where(slot_ok, slot, 0)
            # A skipped slot writes no head (an int bound rather than a scalar-bool mask).
            cache_heads = tl.where(slot_ok, n_kv_heads, 0)
            block = slot // block_size
            offset = slot % block_size
            k_slot = k_cache_ptr + block * stride_kcb + offset * stride_kco
            v_slot = v_cache_ptr + block * stride_vcb + offset * stride_vco
        else:
            cache_heads = 0
            k_slot = k_cache_ptr
            v_slot = v_cache_ptr
        kv_heads = (head_block - n_q_blocks) * BLOCK_HK + tl.arange(0, BLOCK_HK)
        _rope_heads(
            k_ptr + t * stride_kt, stride_kh, k_out_ptr + t * stride_kot, stride_koh,
            k_slot, stride_kch, cache_heads, kv_heads, n_kv_heads, cos, sin,
            HALF, D, INTERLEAVED, WRITE_K_OUT, WRITE_CACHE, BLOCK_HALF, BLOCK_PASS, IN_PLACE,
        )  # fmt: skip
        if WRITE_CACHE:
            # v is not rotated: the same helper with no rotary dims is a masked row copy.
            _rope_heads(
                v_ptr + t * stride_vt, stride_vh, v_slot, 0,
                v_slot, stride_vch, cache_heads, kv_heads, n_kv_heads, cos, sin,
                0, D, False, False, True, 1, BLOCK_D, False,
            )  # fmt: skip


def launch_config(head_dim: int, n_q_heads: int, n_kv_heads: int) -> tuple[int, int, int]:
    """Pick ``(BLOCK_HQ, BLOCK_HK, num_warps)`` from head counts and size (never from T)."""
    max_heads = max(1, _TARGET_TILE // triton.next_power_of_2(head_dim))
    block_hq = min(triton.next_power_of_2(max(n_q_heads, 1)), max_heads)
    block_hk = min(triton.next_power_of_2(max(n_kv_heads, 1)), max(1, max_heads // 2))
    # 2 warps: more small programs resident per SM keep more bytes in flight (a sweep's best).
    return block_hq, block_hk, 2


def _check_shape(op: str, name: str, t: torch.Tensor, shape: tuple[int, ...], why: str) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{op}: {name}: expected shape {tuple(shape)} ({why}), "
                         f"got {tuple(t.shape)}")




def _check_qk(op: str, q, k, cos, sin, q_out, k_out, interleaved) -> None:
    _check_tensor(op, "q", q, 3)
    _check_tensor(op, "k", k, 3)
    _check_tensor(op, "q_out", q_out, 3)
    if k_out is not None:
        _check_tensor(op, "k_out", k_out, 3)
    _check_tensor(op, "cos", cos, 2, (torch.float32,))
    _check_tensor(op, "sin", sin, 2, (torch.float32,))
    t, _, d = q.shape
    _check_shape(op, "k", k, (t, k.shape[1], d), "tokens and head_dim as q")
    _check_shape(op, "q_out", q_out, tuple(q.shape), "as q")
    if k_out is not None:
        _check_shape(op, "k_out", k_out, tuple(k.shape), "as k")
    half = cos.shape[1]
    if cos.shape[0] != t or not 1 <= 2 * half <= d:
        raise ValueError(
            f"{op}: cos: expected shape ({t}, R/2) with 2 <= R <= head_dim={d}, "
            f"got {tuple(cos.shape)}"
        )
    _check_shape(op, "sin", sin, tuple(cos.shape), "as cos")
    if not isinstance(interleaved, bool):
        raise TypeError(f"{op}: interleaved: expected a bool, got {type(interleaved).__name__}")


def _check_cache(op: str, k, v, k_cache, v_cache, slots_mapping) -> None:
    _check_tensor(op, "v", v, 3)
    _check_tensor(op, "k_cache", k_cache, 4)
    _check_tensor(op, "v_cache", v_cache, 4)
    _check_tensor(op, "slots_mapping", slots_mapping, 1, _SLOT_DTYPES)
    t, h, d = k.shape
    _check_shape(op, "v", v, (t, h, d), "as k")
    paged = (k_cache.shape[0], k_cache.shape[1], h, d)
    _check_shape(op, "k_cache", k_cache, paged, "[num_blocks, block_size, Hk, D]")
    _check_shape(op, "v_cache", v_cache, tuple(k_cache.shape), "as k_cache")
    _check_shape(op, "slots_mapping", slots_mapping, (t,), "one slot per token")


def _launch(
    q, k, v, cos, sin, q_out, k_out, k_cache, v_cache, slots_mapping, interleaved, has_q,
    write_k_out, write_cache, config: tuple[int, int, int] | None = None,
) -> None:
    t, n_kv, d = k.shape
    n_q = q.shape[1] if has_q else 0
    if t == 0:
        return
    half = cos.shape[1] if cos is not None else 0
    block_hq, block_hk, num_warps = config or launch_config(d, n_q, n_kv)
    n_q_blocks = triton.cdiv(n_q, block_hq)
    grid = (t, n_q_blocks + triton.cdiv(n_kv, block_hk))
    # Unused operands get a harmless stand-in (never dereferenced: their code is compiled out).
    q = q if has_q else k
    q_out = q_out if has_q else k
    cos = cos if half else k
    sin = sin if half else k
    k_cache = k_cache if write_cache else k
    v_cache = v_cache if write_cache else k
    v = v if write_cache else k
    slots_mapping = slots_mapping if write_cache else k
    n_blocks, block_size = (k_cache.shape[0], k_cache.shape[1]) if write_cache else (0, 1)
    _rope_cache_kernel[grid](
        q, k, v, cos, sin, q_out, k_out, k_cache, v_cache, slots_mapping,
        n_q, n_kv, n_q_blocks, block_size, n_blocks * block_size,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos.stride(0), sin.stride(0),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        HALF=half, D=d, INTERLEAVED=interleaved, WRITE_K_OUT=write_k_out, WRITE_CACHE=write_cache,
        BLOCK_HQ=block_hq, BLOCK_HK=block_hk, BLOCK_HALF=triton.next_power_of_2(max(half, 1)),
        BLOCK_PASS=triton.next_power_of_2(d - 2 * half) if d > 2 * half else 0,
        BLOCK_D=triton.next_power_of_2(d),
        IN_PLACE=(has_q and _overlaps(q_out, q)) or (write_k_out and _overlaps(k_out, k)),
        num_warps=num_warps, **pdl_kwargs(q),
    )  # fmt: skip


def rope(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_out: torch.Tensor,
    k_out: torch.Tensor,
    interleaved: bool,
) -> None:
    """Apply rotary position embedding to q and k in one launch.

    Args:
        q: ``[T, Hq, D]`` queries (fp32/fp16/bf16), last dim contiguous.
        k: ``[T, Hk, D]`` keys (``Hk`` may differ from ``Hq``: GQA/MQA).
        cos: ``[T, R/2]`` fp32 cosines of each token's angles, ``2 <= R <= D``.
        sin: ``[T, R/2]`` fp32 sines.
        q_out: ``[T, Hq, D]`` output; may alias ``q``.
        k_out: ``[T, Hk, D]`` output; may alias ``k``.
        interleaved: rotate pairs ``(2i, 2i+1)`` (GPT-J) instead of ``(i, i + R/2)`` (HF
            ``rotate_half``, GPT-NeoX, Llama).

    Returns:
        None; dims ``[0, R)`` are rotated and ``[R, D)`` copied into ``q_out``/``k_out``.
    """
    op = "rope"
    _check_qk(op, q, k, cos, sin, q_out, k_out, interleaved)
    _check_device(op, {"q": q, "k": k, "cos": cos, "sin": sin, "q_out": q_out, "k_out": k_out})
    _launch(q, k, None, cos, sin, q_out, k_out, None, None, None, interleaved, True, True, False)


def rope_and_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots_mapping: torch.Tensor,
    q_out: torch.Tensor,
    k_out: torch.Tensor | None,
    interleaved: bool,
    config: tuple[int, int, int] | None = None,
) -> None:
    """Rotary embedding of q and k plus the paged KV-cache write, in one launch.

    Args:
        q: ``[T, Hq, D]`` queries (fp32/fp16/bf16), last dim contiguous.
        k: ``[T, Hk, D]`` keys.
        v: ``[T, Hk, D]`` values, stored into ``v_cache`` unrotated.
        cos: ``[T, R/2]`` fp32 cosines of each token's angles, ``2 <= R <= D``.
        sin: ``[T, R/2]`` fp32 sines.
        k_cache: ``[num_blocks, block_size, Hk, D]`` paged key cache; receives rotated k.
        v_cache: same shape as ``k_cache``.
        slots_mapping: ``[T]`` int32/int64 flat slot per token; slots_mapping outside
            ``[0, num_blocks * block_size)`` (negative = padding) are skipped.
        q_out: ``[T, Hq, D]`` rotated queries; may alias ``q``.
        k_out: ``[T, Hk, D]`` rotated keys; may alias ``k``. ``None``: the rotated keys only
            go to the cache (what a model needs; saves a write of k).
        interleaved: GPT-J pairs ``(2i, 2i+1)`` instead of ``(i, i + R/2)``.
        config: ``(BLOCK_HQ, BLOCK_HK, num_warps)`` instead of :func:`launch_config`'s (for
            tuning sweeps).

    Returns:
        None; writes ``q_out``, ``k_out`` (if given) and the cache rows at ``slots_mapping``.
    """
    op = "rope_and_cache"
    _check_qk(op, q, k, cos, sin, q_out, k_out, interleaved)
    _check_cache(op, k, v, k_cache, v_cache, slots_mapping)
    _check_device(op, {
        "q": q, "k": k, "v": v, "cos": cos, "sin": sin, "k_cache": k_cache, "v_cache": v_cache,
        "slots_mapping": slots_mapping, "q_out": q_out,
        **({"k_out": k_out} if k_out is not None else {}),
    })  # fmt: skip
    _launch(q, k, v, cos, sin, q_out, k if k_out is None else k_out, k_cache, v_cache,
            slots_mapping, interleaved, True, k_out is not None, True, config)


def reshape_and_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots_mapping: torch.Tensor,
) -> None:
    """Store k and v (no rotation) into the paged KV cache.

    Args:
        k: ``[T, Hk, D]`` keys (fp32/fp16/bf16), last dim contiguous.
        v: ``[T, Hk, D]`` values.
        k_cache: ``[num_blocks, block_size, Hk, D]`` paged key cache.
        v_cache: same shape as ``k_cache``.
        slots_mapping: ``[T]`` int32/int64 flat slot per token; slots_mapping outside
            ``[0, num_blocks * block_size)`` (negative = padding) are skipped.

    Returns:
        None; writes the cache rows at ``slots_mapping``.
    """
    op = "reshape_and_cache"
    _check_tensor(op, "k", k, 3)
    _check_cache(op, k, v, k_cache, v_cache, slots_mapping)
    _check_device(op, {"k": k, "v": v, "k_cache": k_cache, "v_cache": v_cache,
                       "slots_mapping": slots_mapping})
    _launch(None, k, v, None, None, None, k, k_cache, v_cache, slots_mapping,
            False, False, False, True)
