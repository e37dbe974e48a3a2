"""Small-M linear (decode GEMV) with an optional split-K: ``out = x @ weight.T + bias + residual``.

At decode a linear layer sees a handful of rows (M = batch, 1..32) against a weight of millions of
elements, so its time is the time to stream the weight from HBM once. The kernel is built around
that: each program owns a ``BLOCK_N`` slice of output columns (``BLOCK_N`` contiguous rows of the
``[N, K]`` weight, loaded as vectors along K) and computes it for all M rows, so every weight byte
is read exactly once whatever M is.

When ``N / BLOCK_N`` programs would not fill the GPU, K is split over ``split_k`` programs per column
block. NOTE: the split is deterministic and two-phase: phase 1 writes fp32 partial sums into a
``[split_k, M, N]`` workspace, phase 2 sums the partials in a fixed order and applies the epilogue
(bias, residual, cast). It costs one extra small launch, but needs no zeroing of the workspace and no
atomics, gives bit-identical results run to run, and both launches take their grids from shapes
only, so the pair is CUDA-graph capturable (pass a preallocated ``workspace`` of
:func:`workspace_size` fp32 elements to keep allocation out of the captured region).

Inner product by bucket of M (``BLOCK_M``, a constexpr padded from M so one compiled kernel serves
every M of the bucket):

- ``BLOCK_M == 1``: elementwise FMA into a ``[BLOCK_N, BLOCK_K]`` fp32 register accumulator, reduced
  across K once after the loop (no cross-lane reduction per iteration).
- ``BLOCK_M in (2, 4)``: broadcast product ``[BLOCK_M, BLOCK_N, BLOCK_K]`` reduced per iteration.
- ``BLOCK_M >= 16`` (M >= 5): ``tl.dot`` on tensor cores; M is padded to 16/32 which costs nothing in
  a bandwidth-bound kernel.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from tgraph.kernels.triton.pdl import pdl_kwargs, pdl_wait

__all__ = ["small_m_linear", "choose_config", "prefer_small_m", "workspace_size"]

# SM count assumed when not running on CUDA (H100 SXM / H200 have 132 SMs).
_DEFAULT_SM_COUNT = 132
# Split-K aims at this many programs per SM: several resident programs per SM keep enough weight
# bytes in flight to cover HBM latency (no shared memory is used on the M <= 4 path, so occupancy
# is bounded by registers only).
_PROGRAMS_PER_SM = 2
_MAX_SPLIT_K = 16
# Largest M bucket; larger M adds programs along grid axis 2 (weight re-read per 32 rows).
_MAX_BLOCK_M = 32
_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_REDUCE_BLOCK_N = 1024


@triton.jit
def _small_m_linear_kernel(
    x_ptr, w_ptr, bias_ptr, res_ptr, out_ptr, ws_ptr,
    M, N, K, k_per_split,
    stride_xm, stride_wn, stride_rm, stride_om,
    HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, WRITE_PARTIAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    F32_DOT: tl.constexpr, PDL: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    # int64 row offsets: a vocabulary projection can exceed 2**31 weight elements.
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm

    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)

    if BLOCK_M == 1:
        acc2 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        first = k_start
        if PDL:
            # The weight is never written by an earlier kernel: stream its first tile while the
            # previous kernel drains, then wait for the activations (see tgraph.kernels.triton.pdl).
            offs_k = k_start + tl.arange(0, BLOCK_K)
            mask_k = offs_k < k_end
            w = tl.load(w_rows + offs_k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
            pdl_wait(PDL)
            xv = tl.load(x_rows + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            acc2 += w.to(tl.float32) * xv.to(tl.float32)
            first = k_start + BLOCK_K
        for k0 in range(first, k_end, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < k_end
            w = tl.load(w_rows + offs_k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
            xv = tl.load(x_rows + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            acc2 += w.to(tl.float32) * xv.to(tl.float32)
        acc = tl.sum(acc2, axis=1)[None, :]
    elif BLOCK_M < 16:
        pdl_wait(PDL)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < k_end
            w = tl.load(w_rows + offs_k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
            xv = tl.load(x_rows + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            prod = xv.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
            acc += tl.sum(prod, axis=2)
    else:
        pdl_wait(PDL)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < k_end
            w = tl.load(w_rows + offs_k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
            xv = tl.load(x_rows + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            if F32_DOT:
                # Full-precision fp32 products (not TF32); see _use_f32_dot.
                acc += tl.dot(xv.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
            else:
                acc += tl.dot(xv, tl.trans(w))

    mask_mn = mask_m[:, None] & mask_n[None, :]
    if WRITE_PARTIAL:
        ws = ws_ptr + (pid_k * M + offs_m.to(tl.int64))[:, None] * N + offs_n[None, :]
        tl.store(ws, acc, mask=mask_mn)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        if HAS_RES:
            res = res_ptr + offs_m.to(tl.int64)[:, None] * stride_rm + offs_n[None, :]
            acc += tl.load(res, mask=mask_mn, other=0.0).to(tl.float32)
        out = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_mn)


@triton.jit
def _split_k_reduce_kernel(
    ws_ptr, bias_ptr, res_ptr, out_ptr,
    M, N, split_k,
    stride_rm, stride_om,
    HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr,
):
    pdl_wait(PDL)
    pid_n = tl.program_id(0)
    m = tl.program_id(1).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    # Fixed summation order over the splits: deterministic results.
    for s in range(0, split_k):
        acc += tl.load(ws_ptr + (s * M + m) * N + offs_n, mask=mask_n, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    if HAS_RES:
        acc += tl.load(res_ptr + m * stride_rm + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_om + offs_n, acc.to(out_ptr.dtype.element_ty), mask=mask_n)


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return _DEFAULT_SM_COUNT


def _use_f32_dot(dtype: torch.dtype) -> bool:
    """Whether ``tl.dot`` must run on fp32 operands (``input_precision="ieee"``).

    fp32 inputs must not be rounded to TF32. NOTE: Triton's interpreter (3.9) multiplies the raw
    uint16 bits of bf16 operands in ``tl.dot``; upcasting to fp32 there gives the same result as a
    bf16 MMA with fp32 accumulation (bf16 products are exact in fp32).
    """
    return dtype == torch.float32 or (dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1")


def _block_m(M: int) -> int:
    """M bucket: 1, 2, 4 (CUDA-core paths) or 16, 32 (``tl.dot`` needs >= 16 rows)."""
    if M <= 4:
        return triton.next_power_of_2(max(M, 1))
    return 16 if M <= 16 else _MAX_BLOCK_M


def prefer_small_m(M: int, N: int, K: int) -> bool:
    """Whether :func:`small_m_linear` should run a linear instead of a cuBLAS GEMM.

    Up to 16 rows the product is bound by reading the weight and a GEMM tiled for large M wastes
    most of its tile (and often leaves SMs idle); beyond that cuBLAS's tensor-core tiles win.

    Args:
        M: rows of ``x`` (tokens in the batch).
        N: output features.
        K: input features.

    Returns:
        True when the small-M kernel is the better choice.
    """
    # Measured on an H200 (tgraph.bench.tune_gemv, 2026-11-21): at M=1 the tuned kernel beats
    # cuBLAS on every Llama/Qwen linear; at M=16 cuBLAS ties or wins, so it takes M > 4.
    return 1 <= M <= 4 and N >= 16 and K >= 16


def choose_config(M: int, N: int, K: int, device: torch.device | str | None = None) -> tuple[int, int, int, int]:
    """Pick the launch configuration of :func:`small_m_linear`.

    Args:
        M: rows of ``x``.
        N: output features (rows of ``weight``).
        K: input features.
        device: device the kernel runs on; its SM count decides split-K (132 when not CUDA).

    Returns:
        ``(BLOCK_N, BLOCK_K, split_k, num_warps)``. Every split gets the same whole number of
        ``BLOCK_K`` blocks except the last, which may get fewer (never none).
    """
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    block_m = _block_m(M)
    k_pow2 = triton.next_power_of_2(max(K, 16))
    if block_m == 1:
        # Sweep on an H200: 1024-wide K tiles and no split-K were best at every model shape
        # (8 rows of output per program for narrow outputs, 16 otherwise).
        block_n = 8 if N <= 2048 else 16
        block_k = min(1024, k_pow2)
        return block_n, max(block_k, 16), 1, 4
    elif block_m < 16:
        # The [BLOCK_M, BLOCK_N, BLOCK_K] product lives in registers: keep it at 8K elements.
        block_n, block_k, num_warps = 16, min(512 // block_m, k_pow2), 4
    else:
        block_n, block_k, num_warps = 32, min(128, k_pow2), 4
    block_k = max(block_k, 16)

    n_blocks = triton.cdiv(N, block_n) * triton.cdiv(M, block_m)
    k_blocks = triton.cdiv(K, block_k)
    target = _PROGRAMS_PER_SM * _sm_count(device)
    split_k = 1
    if n_blocks < target and k_blocks > 1:
        want = min(triton.cdiv(target, n_blocks), k_blocks, _MAX_SPLIT_K)
        # Even distribution of K blocks: a split never gets a short or empty range.
        per_split = triton.cdiv(k_blocks, want)
        split_k = triton.cdiv(k_blocks, per_split)
    return block_n, block_k, split_k, num_warps


def workspace_size(M: int, N: int, split_k: int) -> int:
    """Number of fp32 elements of the split-K workspace (0 when ``split_k == 1``).

    Args:
        M: rows of ``x``.
        N: output features.
        split_k: the split chosen by :func:`choose_config` (or forced by the caller).

    Returns:
        ``split_k * M * N`` when ``split_k > 1``, else 0.
    """
    return split_k * M * N if split_k > 1 else 0


def _check_matrix(name: str, t: torch.Tensor, shape: tuple[int, ...], device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"small_m_linear: {name} must be a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != shape:
        raise ValueError(f"small_m_linear: {name} must have shape {list(shape)}, got {list(t.shape)}")
    if t.dtype not in _SUPPORTED_DTYPES:
        raise TypeError(f"small_m_linear: {name} must be float16, bfloat16 or float32, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"small_m_linear: {name} is on {t.device}, expected {device} (the device of x)")
    if t.numel() > 0 and t.stride(-1) != 1:
        raise ValueError(f"small_m_linear: {name} must have a contiguous last dim, got strides {t.stride()}")


def small_m_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
    split_k: int | None = None,
    config: tuple[int, int, int, int, int] | None = None,
) -> torch.Tensor:
    """``out = x @ weight.T + bias + residual`` for small M, reading the weight once.

    Args:
        x: ``[M, K]`` activations (fp16/bf16/fp32, same dtype as ``weight``); rows may be strided.
        weight: ``[N, K]`` in torch ``Linear`` layout (row-major along K).
        out: ``[M, N]`` output (any supported dtype; written, never allocated). May alias
            ``residual`` (each element is read and then written by the same program); must not
            overlap ``x``.
        bias: optional ``[N]``.
        residual: optional ``[M, N]`` added in the epilogue.
        workspace: optional fp32 tensor with at least :func:`workspace_size` elements, used when
            ``split_k > 1``; allocated here when omitted (pass one under CUDA-graph capture to keep
            the allocation out of the graph).
        split_k: force the number of K splits (>= 1); default from :func:`choose_config`.
        config: ``(BLOCK_N, BLOCK_K, split_k, num_warps, num_stages)`` instead of the heuristic
            (for tuning; see ``tgraph.bench.tune_gemv``).

    Returns:
        ``out``.
    """
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"small_m_linear: x must be a 2-D [M, K] tensor, got {getattr(x, 'shape', type(x))}")
    M, K = x.shape
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"small_m_linear: weight must be a 2-D [N, K] tensor, got {getattr(weight, 'shape', type(weight))}")
    N = weight.shape[0]
    device = x.device
    _check_matrix("x", x, (M, K), device)
    _check_matrix("weight", weight, (N, K), device)
    _check_matrix("out", out, (M, N), device)
    if weight.dtype != x.dtype:
        raise TypeError(f"small_m_linear: weight dtype {weight.dtype} must match x dtype {x.dtype}")
    if bias is not None:
        _check_matrix("bias", bias, (N,), device)
    if residual is not None:
        _check_matrix("residual", residual, (M, N), device)
        if residual.data_ptr() == out.data_ptr() and residual.stride() != out.stride():
            raise ValueError("small_m_linear: out aliases residual with different strides")
    if out.numel() > 0 and x.numel() > 0 and out.data_ptr() == x.data_ptr():
        raise ValueError("small_m_linear: out must not alias x")
    if split_k is not None and (not isinstance(split_k, int) or split_k < 1):
        raise ValueError(f"small_m_linear: split_k must be a positive int, got {split_k!r}")
    if M == 0 or N == 0:
        return out

    if config is not None:
        block_n, block_k, auto_split, num_warps, num_stages = config
    else:
        block_n, block_k, auto_split, num_warps = choose_config(M, N, K, device)
        num_stages = None
    split = auto_split if split_k is None else split_k
    k_blocks = max(triton.cdiv(K, block_k), 1)
    split = min(split, k_blocks)
    # Each split covers a whole number of BLOCK_K tiles so only the last one is ragged.
    k_per_split = triton.cdiv(k_blocks, split) * block_k
    split = triton.cdiv(max(K, 1), k_per_split)

    block_m = _block_m(M)
    grid_m = triton.cdiv(M, block_m)
    f32_dot = _use_f32_dot(x.dtype)
    if num_stages is None:
        num_stages = 3 if block_m >= 16 or K >= 4096 else 2
    pdl = pdl_kwargs(x)

    if split == 1:
        _small_m_linear_kernel[(triton.cdiv(N, block_n), 1, grid_m)](
            x, weight, bias if bias is not None else out, residual if residual is not None else out,
            out, out,
            M, N, K, k_per_split,
            x.stride(0), weight.stride(0),
            residual.stride(0) if residual is not None else 0, out.stride(0),
            HAS_BIAS=bias is not None, HAS_RES=residual is not None, WRITE_PARTIAL=False,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, F32_DOT=f32_dot,
            num_warps=num_warps, num_stages=num_stages, **pdl,
        )
        return out

    need = workspace_size(M, N, split)
    if workspace is None:
        workspace = torch.empty(need, dtype=torch.float32, device=device)
    else:
        if workspace.dtype != torch.float32 or workspace.device != device:
            raise TypeError(f"small_m_linear: workspace must be float32 on {device}, got {workspace.dtype} on {workspace.device}")
        if workspace.numel() < need or not workspace.is_contiguous():
            raise ValueError(f"small_m_linear: workspace must be contiguous with >= {need} elements "
                             f"(split_k={split}, M={M}, N={N}), got {workspace.numel()} elements")

    _small_m_linear_kernel[(triton.cdiv(N, block_n), split, grid_m)](
        x, weight, out, out, out, workspace,
        M, N, K, k_per_split,
        x.stride(0), weight.stride(0), 0, out.stride(0),
        HAS_BIAS=False, HAS_RES=False, WRITE_PARTIAL=True,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, F32_DOT=f32_dot,
        num_warps=num_warps, num_stages=num_stages, **pdl,
    )
    _split_k_reduce_kernel[(triton.cdiv(N, _REDUCE_BLOCK_N), M)](
        workspace, bias if bias is not None else out, residual if residual is not None else out, out,
        M, N, split,
        residual.stride(0) if residual is not None else 0, out.stride(0),
        HAS_BIAS=bias is not None, HAS_RES=residual is not None, BLOCK_N=_REDUCE_BLOCK_N,
        num_warps=4, **pdl,
    )
    return out
