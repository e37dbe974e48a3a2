"""Device code shared by the quantized kernels: reading a tile of a
:class:`~tgraph.quant.QuantizedWeight`'s codes and its per-row scales, and folding a tile's
products on codes back into real products.

Every layout of :mod:`tgraph.quant.scheme` reads as ``w = s * (v - ZERO) + b`` per weight, where
``v`` is the tile :func:`load_codes` returns, ``s`` / ``b`` the block's scale and offset and
``ZERO`` a constant of the layout (:func:`code_zero` on the host):

- int4 on 16-bit activations: ``v = BASE + q`` built from the nibble's bits in one OR
  (``0x4300 | q`` is the bf16 ``128 + q``, ``0x6400 | q`` the fp16 ``1024 + q``), which is
  exact and needs no integer-to-float conversion; ``ZERO = BASE (+ 8 symmetric)``.
- int4 on fp32 (the CUDA-core GEMV of one row): ``v = 2**23 + q`` by the same OR on fp32 bits,
  ``ZERO = 2**23 (+ 8)``; ``v - ZERO`` is exact. Under the interpreter ``v = q``.
- int8: ``v = q``; ``ZERO = 8`` (int4 symmetric) or 0.
- fp8: ``v`` is the e4m3 value (a hardware conversion, or decoded from its bits where the
  interpreter runs); ``ZERO = 0``.

Two ways to use it: a GEMV multiplies ``v`` directly (``part = x . v``) and folds once per tile
with :func:`fold_part` (``s * (part - ZERO * sum(x)) + b * sum(x)``), so dequantization costs
one OR per weight; a large-M GEMM dequantizes the tile with :func:`dequantize_tile`, whose cost
is shared by all its rows.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["KIND_FP8", "KIND_INT4", "KIND_INT8", "code_base", "code_zero", "dequantize_groups",
           "dequantize_tile", "fold_part", "fp8_e4m3_value", "load_codes", "load_scale_tile",
           "load_scales"]

KIND_INT4: tl.constexpr = tl.constexpr(0)
KIND_INT8: tl.constexpr = tl.constexpr(1)
KIND_FP8: tl.constexpr = tl.constexpr(2)
KIND_IDS = {"int4": 0, "int8": 1, "fp8": 2}

# The float whose bits OR a nibble into the mantissa: 128 + q (bf16), 1024 + q (fp16),
# 2**23 + q (fp32).
_MAGIC = {torch.bfloat16: (0x4300, 128.0), torch.float16: (0x6400, 1024.0),
          torch.float32: (0x4B000000, 8388608.0)}


def code_base(kind: str, dtype: torch.dtype, native: bool) -> tuple[int, float]:
    """``(bits, value)`` of the magic base of int4 codes read as ``dtype`` (``(0, 0.0)``: a
    plain conversion); ``native``: on a GPU (the interpreter converts instead)."""
    if kind == "int4" and native and dtype in _MAGIC:
        return _MAGIC[dtype]
    return 0, 0.0


def code_zero(kind: str, offsets: bool, base: float) -> float:
    """``ZERO`` of ``w = s * (v - ZERO) + b`` for codes read with magic base ``base``."""
    return base + (8.0 if kind == "int4" and not offsets else 0.0)


@triton.jit
def fp8_e4m3_value(bits):
    """The fp32 value of e4m3 codes given as uint8 bits (0x7F / 0xFF are NaN)."""
    b = bits.to(tl.int32)
    mag = b & 0x7F
    exp = mag >> 3
    man = (mag & 7).to(tl.float32)
    normal = (1.0 + man * 0.125) * tl.exp2((exp - 7).to(tl.float32))
    sub = man * 0.001953125  # man / 8 * 2**-6
    val = tl.where(exp == 0, sub, normal)
    val = tl.where(mag == 0x7F, float("nan"), val)
    return tl.where((b & 0x80) != 0, -val, val)


@triton.jit
def load_codes(q_rows, k0, k_end, mask_n, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               KIND: tl.constexpr, BASE_BITS: tl.constexpr, NATIVE_FP8: tl.constexpr,
               DTYPE: tl.constexpr):
    """The ``[BLOCK_N, BLOCK_K]`` tile of codes at logical column ``k0`` as ``v`` in ``DTYPE``
    (see the module docstring); columns from ``k_end`` and masked rows read as code 0.

    ``q_rows``: ``[BLOCK_N, 1]`` pointers to the rows' packed data (bytes; fp8 as uint8 bits
    unless ``NATIVE_FP8``, where they point at float8e4nv).
    """
    if KIND == KIND_INT4:
        offs_b = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        byte = tl.load(q_rows + offs_b[None, :],
                       mask=mask_n[:, None] & (offs_b < k_end // 2)[None, :], other=0)
        # Even columns in the low nibble: join + reshape interleaves them back in order.
        codes = tl.reshape(tl.join(byte & 0xF, byte >> 4), [BLOCK_N, BLOCK_K])
        if BASE_BITS > 0xFFFF:  # fp32: 0x4B000000 | q is 2**23 + q
            v = (codes.to(tl.int32) | BASE_BITS).to(tl.float32, bitcast=True)
        elif BASE_BITS != 0:
            v = (codes.to(tl.int16) | BASE_BITS).to(DTYPE, bitcast=True)
        else:
            v = codes.to(DTYPE)
    else:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask = mask_n[:, None] & (offs_k < k_end)[None, :]
        if KIND == KIND_FP8 and NATIVE_FP8:
            v = tl.load(q_rows + offs_k[None, :], mask=mask, other=0.0).to(DTYPE)
        elif KIND == KIND_FP8:
            v = fp8_e4m3_value(tl.load(q_rows + offs_k[None, :], mask=mask, other=0)).to(DTYPE)
        else:
            v = tl.load(q_rows + offs_k[None, :], mask=mask, other=0).to(DTYPE)
    return v


@triton.jit
def load_scales(s_ptr, b_ptr, offs_n, mask_n, k0, stride_sn, ROWS: tl.constexpr,
                COLS: tl.constexpr, OFFSETS: tl.constexpr):
    """The fp32 scale (and offset; zeros without ``OFFSETS``) of rows ``offs_n`` for the tile at
    ``k0``: one per row, as the launch makes every K tile lie in one scale block."""
    idx = (offs_n // ROWS).to(tl.int64) * stride_sn + k0 // COLS
    s = tl.load(s_ptr + idx, mask=mask_n, other=0.0)
    if OFFSETS:
        b = tl.load(b_ptr + idx, mask=mask_n, other=0.0)
    else:
        b = tl.zeros_like(s)
    return s, b


@triton.jit
def load_scale_tile(s_ptr, b_ptr, offs_n, mask_n, k0, k_end, stride_sn, ROWS: tl.constexpr,
                    COLS: tl.constexpr, NG: tl.constexpr, OFFSETS: tl.constexpr):
    """The fp32 ``[BLOCK_N, NG]`` scales (and offsets) of a K tile spanning ``NG`` whole scale
    blocks of ``COLS`` columns each, from column ``k0`` (``NG == 1``: one block, any width);
    blocks from ``k_end`` on read as 0."""
    groups = tl.arange(0, NG)
    idx = (offs_n // ROWS).to(tl.int64)[:, None] * stride_sn + (k0 // COLS + groups)[None, :]
    mask = mask_n[:, None] & (k0 + groups * COLS < k_end)[None, :]
    s = tl.load(s_ptr + idx, mask=mask, other=0.0)
    if OFFSETS:
        b = tl.load(b_ptr + idx, mask=mask, other=0.0)
    else:
        b = tl.zeros_like(s)
    return s, b


@triton.jit
def dequantize_groups(v, s, b, ZERO: tl.constexpr, OFFSETS: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, NG: tl.constexpr):
    """``w = s * (v - ZERO) + b`` in fp32 for a ``[BLOCK_N, BLOCK_K]`` tile of ``NG`` scale
    blocks along K (``s``, ``b``: ``[BLOCK_N, NG]``), each block's scale broadcast over it."""
    w = tl.reshape(v.to(tl.float32), [BLOCK_N, NG, BLOCK_K // NG])
    if ZERO != 0.0:
        w = w - ZERO
    w = w * s[:, :, None]
    if OFFSETS:
        w = w + b[:, :, None]
    return tl.reshape(w, [BLOCK_N, BLOCK_K])


@triton.jit
def fold_part(acc, part, s, b, sx, ZERO: tl.constexpr, OFFSETS: tl.constexpr,
              SWAP_AB: tl.constexpr):
    """``acc += s * (part - ZERO * sx) + b * sx`` for one tile's products on codes.

    ``part`` is ``[BLOCK_N, BLOCK_M]`` (``SWAP_AB``) or ``[BLOCK_M, BLOCK_N]``; ``s`` / ``b``
    per output column ``[BLOCK_N]``; ``sx`` the tile's row sums of ``x`` ``[BLOCK_M]``.
    """
    if SWAP_AB:
        s2 = s[:, None]
        b2 = b[:, None]
        sx2 = sx[None, :]
    else:
        s2 = s[None, :]
        b2 = b[None, :]
        sx2 = sx[:, None]
    if ZERO != 0.0:
        part = part - ZERO * sx2
    acc += s2 * part
    if OFFSETS:
        acc += b2 * sx2
    return acc


@triton.jit
def dequantize_tile(v, s, b, ZERO: tl.constexpr, OFFSETS: tl.constexpr):
    """``w = s * (v - ZERO) + b`` in fp32 for a ``[BLOCK_N, BLOCK_K]`` tile, per-row ``s``/``b``."""
    w = v.to(tl.float32)
    if ZERO != 0.0:
        w = w - ZERO
    w = w * s[:, None]
    if OFFSETS:
        w = w + b[:, None]
    return w
