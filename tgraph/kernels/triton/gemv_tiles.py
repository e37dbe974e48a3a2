"""Device helpers shared by the small-M linear's dense and quantized paths: the activations'
tile (with the fused RMSNorm's sums of squares) and the per-tile product by M bucket (see
:mod:`tgraph.kernels.triton.gemv`)."""
from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["fold_columns", "load_x_tile", "mac"]


@triton.jit
def load_x_tile(x_rows, g_ptr, offs_k, mask_m, mask_k, BLOCK_M: tl.constexpr, NORM: tl.constexpr,
                 HAS_G: tl.constexpr):
    """One ``[BLOCK_M, BLOCK_K]`` tile of ``x`` and its rows' sums of squares (when ``NORM``).

    With ``NORM`` the tile comes back in fp32 and multiplied by the norm weight ``g``; the rows'
    ``1 / rms`` is applied to the accumulator after the loop (it factors out of the dot product).
    """
    xv = tl.load(x_rows + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
    # One return: the compiler wants one signature (the branches are resolved at compile time).
    if NORM:
        xf = xv.to(tl.float32)
        sq = tl.sum(xf * xf, axis=1)
        if HAS_G:
            xf = xf * tl.load(g_ptr + offs_k, mask=mask_k, other=0.0).to(tl.float32)[None, :]
        tile = xf
    else:
        sq = tl.zeros((BLOCK_M,), dtype=tl.float32)
        tile = xv
    return tile, sq


@triton.jit
def mac(acc, w, xv, BLOCK_M: tl.constexpr, F32_DOT: tl.constexpr, SWAP_AB: tl.constexpr):
    """``acc += x_tile . w_tile`` for one K tile, by M bucket (see the module docstring)."""
    if BLOCK_M == 1:
        # acc is [BLOCK_N, BLOCK_K]: elementwise FMA, reduced over K once after the loop.
        return acc + w.to(tl.float32) * xv.to(tl.float32)
    elif SWAP_AB:
        # acc is [BLOCK_N, BLOCK_M]: the weight tile on the MMA's M side.
        if F32_DOT:
            return tl.dot(w.to(tl.float32), tl.trans(xv.to(tl.float32)), acc,
                          input_precision="ieee")
        return tl.dot(w, tl.trans(xv.to(w.dtype)), acc)
    elif F32_DOT:
        # Full-precision fp32 products (not TF32); see _use_f32_dot.
        return tl.dot(xv.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
    else:
        return tl.dot(xv.to(w.dtype), tl.trans(w), acc)


@triton.jit
def fold_columns(prod, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, RUN: tl.constexpr):
    """A ``[BLOCK_N, BLOCK_K]`` tile of products summed in runs of ``RUN`` columns (one thread's
    16-byte load of weights): accumulated so, a one-row GEMV holds ``RUN`` times fewer fp32
    registers than a ``[BLOCK_N, BLOCK_K]`` accumulator, for one addition more per weight."""
    return tl.sum(tl.reshape(prod, [BLOCK_N, BLOCK_K // RUN, RUN]), axis=2)
