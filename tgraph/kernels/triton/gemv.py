"""Small-M linear (decode GEMV) with an optional split-K: ``out = x @ weight.T + bias + residual``,
optionally with the RMSNorm before it and the SwiGLU after it fused in.

At decode a linear layer sees a handful of rows (M = batch, 1..32) against a weight of millions of
elements, so its time is the time to stream the weight from HBM once. The kernel is built around
that: each program owns a ``BLOCK_N`` slice of output columns (``BLOCK_N`` contiguous rows of the
``[N, K]`` weight, loaded as vectors along K) and computes it for all M rows, so every weight byte
is read exactly once whatever M is.

When ``N / BLOCK_N`` programs would not fill the GPU, K is split over ``split_k`` programs per column
block. NOTE: the split is deterministic: every split writes its fp32 partial sums into a
``[split_k, M, N]`` workspace, and the partials are summed in split order before the epilogue
(bias, residual, cast), by whichever split of an output tile finishes last (its ticket from a
per-tile arrival counter, :func:`arrival_counters`, which the launch leaves zeroed) or, with
swapped operands and no fused norm (see ``SPLIT_K_FIXUP``), by a second, reduce launch. Either way the
bits are the same run to run and between the two, no float atomics are used, and the grids follow
from shapes only, so the launches are CUDA-graph capturable (pass a preallocated ``workspace`` of
:func:`workspace_size` fp32 elements to keep allocation out of the captured region).

Decode fusions (constexpr switches, so a plain linear compiles to the same code as before):

- RMSNorm prologue (``norm_eps``): ``x`` is multiplied by the norm weight as it is streamed and
  the rows' sums of squares are accumulated alongside; ``1 / rms`` factors out of the dot product,
  so it scales the accumulator once after the loop. With split-K each split sums the squares of
  its own K range; the splits of the first column block write them beside their partial sums and
  the reduce applies ``1 / rms`` to the total (no split reads more of ``x`` than its range).
- SwiGLU epilogue (``gated``): on a packed ``[2N, K]`` gate|up weight a program computes the same
  columns of both halves (a second accumulator) and writes ``silu(gate) * up``: the ``[M, 2N]``
  product is never stored and the activation needs no launch.

Inner product by bucket of M (``BLOCK_M``, a constexpr padded from M so one compiled kernel serves
every M of the bucket):

- ``BLOCK_M == 1``: elementwise FMA into a ``[BLOCK_N, BLOCK_K]`` fp32 register accumulator, reduced
  across K once after the loop (no cross-lane reduction per iteration).
- ``BLOCK_M >= 16`` (M >= 2): ``tl.dot`` on tensor cores; M is padded to 16/32 which costs nothing in
  a bandwidth-bound kernel. With ``BLOCK_N >= 64`` the operands are swapped (``SWAP_AB``): the
  weight tile is the MMA's M side (``acc[BLOCK_N, BLOCK_M] = w @ x.T``, transposed once after the
  loop), so a program streams a weight tile several times larger than the activations' tile
  instead of one as small as it. On Hopper those weight tiles are read by TMA (``TMA_WEIGHTS``).
"""
from __future__ import annotations

import os

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from tgraph.kernels.triton.device_info import sm_count
from tgraph.kernels.triton.gemv_kernels import _small_m_linear_kernel, _split_k_reduce_kernel
from tgraph.kernels.triton.pdl import pdl_kwargs

__all__ = ["small_m_linear", "choose_config", "prefer_small_m", "workspace_size", "arrival_counters"]

_MAX_SPLIT_K = 16
# Largest M bucket; larger M adds programs along grid axis 2 (weight re-read per 32 rows).
_MAX_BLOCK_M = 32
_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_REDUCE_BLOCK_N = 1024
# Largest M that prefer_small_m sends to this kernel; TGRAPH_SMALL_M_MAX overrides it (read once,
# for A/B measurements of whole decode steps; tgraph.bench.ab can also set it).
_SMALL_M_MAX = int(os.environ.get("TGRAPH_SMALL_M_MAX", "16"))
# Launch parameters at M = 1 and at 16-row blocks, measured with cold weights on an H200
# (tgraph.bench.tune_gemv, docs/bench/h200-gemv-tune-cold*.json|txt); module constants so that
# tgraph.bench.ab can compare whole decode steps with other values (docs/bench/h100-ab-gemv.txt:
# the M=1 values below against the earlier 16/8 rows and 2 stages, Llama-3.2-1B batch 1 1.02 vs
# 1.07 ms per replay, Qwen2.5-0.5B 0.61 vs 0.68).
_M1_BLOCK_N = 4            # output rows per program
_M1_GATED_BLOCK_N = 2      # a gated gate|up program reads two weight rows per output column
_M1_STAGES = 3
# An unfused M=1 linear (no norm, no gate) with K >= _M1_WIDE_K takes 2048-wide K tiles, with 8
# warps from K >= _M1_WIDE_K_8_WARPS (the same 32 weight elements per thread and tile), and halves
# its output rows per program when the grid would have fewer than _M1_MIN_PROGRAMS_PER_SM programs
# per SM. Values from a cold-weight sweep on an H100 (docs/bench/h100-gemv-tune-m1.txt).
_M1_WIDE_K = 2048
_M1_WIDE_K_8_WARPS = 4096
_M1_MIN_PROGRAMS_PER_SM = 2
_M16_BLOCK_K = 256
_M16_STAGES = 4
# K from which a 16-row linear without fusions takes the swapped long-K configuration.
_M16_LONG_K = 8192
# 16-row blocks with the norm or the gate fused: output columns per program (64 or more swaps the
# MMA operands, SWAP_AB) and K tile.
_M16_FUSED_BLOCK_N = 64
_M16_FUSED_BLOCK_K = 256
# Narrowest output block of a 16-row program that swaps the MMA operands (SWAP_AB); narrower
# blocks keep the activations as the MMA's M side.
_SWAP_MIN_BLOCK_N = 64
# Split K in one launch: the last split of each output tile sums the partials (_fixup_tile) instead
# of a second, reduce launch; with the fused norm it also sums the splits' sums of squares for
# 1 / rms. Not with swapped operands without the norm (the long-K down projections), which keep
# the reduce launch. NOTE: same-process A/Bs on an H100 (2026-11-25, tgraph.bench.ab, ms per
# replay, rounds 1-3, with / without): Qwen2.5-0.5B batch 16 (o and down in 16-column blocks, 2-3
# splits) 1.008 / 0.985 / 0.987 against 1.011 / 1.013 / 1.011; Llama-3.2-1B batch 16 (down
# swapped, 4 splits) 1.287 / 1.276 / 1.271 against 1.268 / 1.269 / 1.268.
SPLIT_K_FIXUP = True
# Launch configurations by shape that replace the heuristic's: (BLOCK_M bucket, N, K, gated, norm)
# -> (BLOCK_N, BLOCK_K, split_k, num_warps, num_stages), each measured in whole decode steps
# (tgraph.bench.ab can set this table, e.g.
# --set "tgraph.kernels.triton.gemv.CONFIG_OVERRIDES={(16, 2048, 8192, False, False): (64, 128, 4, 4, 4)}").
CONFIG_OVERRIDES: dict[tuple[int, int, int, bool, bool], tuple[int, int, int, int, int]] = {}
# Swapped-operand programs (16-row blocks of 64+ weight rows) read their weight tiles by TMA
# (Hopper tensor descriptors) instead of through pointers: the same tiles, the same bits. NOTE:
# same-process A/Bs on an H100 (2026-11-25, tgraph.bench.ab, batch 16, ms per replay, rounds 1-3,
# with / without): Llama-3.2-1B 1.248 / 1.248 / 1.262 against 1.269 / 1.262 / 1.265,
# Qwen2.5-0.5B 0.985 / 0.986 / 0.984 against 1.009 / 0.989 / 0.989, Llama-3-8B 6.302 / 6.287
# against 6.328 / 6.309. Off: pointers everywhere (also before Hopper).
TMA_WEIGHTS = True


# Arrival counters of the one-launch split-K, by (device, output address): see arrival_counters.
_COUNTERS: dict[tuple[int, int], torch.Tensor] = {}
_RETIRED_COUNTERS: list[torch.Tensor] = []


def arrival_counters(out: torch.Tensor, tiles: int) -> torch.Tensor:
    """Zeroed int32 arrival counters, at least ``tiles`` of them, for a split-K launch writing
    ``out``; every launch leaves them zeroed.

    NOTE: keyed by ``out``'s address: two launches that could run at the same time on different
    streams write different outputs (the same output would be a race already), so they never
    share a counter, while the launches of one stream reuse theirs. A buffer outgrown by a larger
    grid stays allocated: a captured CUDA graph may still point at it.
    """
    key = (out.device.index if out.device.index is not None else -1, out.data_ptr())
    counters = _COUNTERS.get(key)
    if counters is None or counters.numel() < tiles:
        if counters is not None:
            _RETIRED_COUNTERS.append(counters)
        counters = _COUNTERS[key] = torch.zeros(max(tiles, 64), dtype=torch.int32, device=out.device)
    return counters


def _split_in_one_launch(norm: bool, swapped: bool) -> bool:
    """Whether a split-K launch reduces its output tiles itself (:func:`_fixup_tile`) instead of
    leaving them to a reduce launch (see ``SPLIT_K_FIXUP``)."""
    return SPLIT_K_FIXUP and (norm or not swapped)


def _weight_descriptor(weight: torch.Tensor, block_n: int, block_k: int,
                       swapped: bool) -> TensorDescriptor | None:
    """A TMA descriptor of ``weight`` with ``[block_n, block_k]`` blocks, or None to read it
    through pointers: only for swapped operands (``TMA_WEIGHTS``), on Hopper or later (or the
    Triton interpreter), with 16-byte aligned rows."""
    if not (TMA_WEIGHTS and swapped):
        return None
    if weight.data_ptr() % 16 or (weight.stride(0) * weight.element_size()) % 16:
        return None
    if block_k * weight.element_size() < 16:
        return None
    if weight.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        if torch.cuda.get_device_capability(weight.device)[0] < 9:
            return None
    return TensorDescriptor(weight, list(weight.shape), [weight.stride(0), 1], [block_n, block_k])


def _use_f32_dot(dtype: torch.dtype) -> bool:
    """Whether ``tl.dot`` must run on fp32 operands (``input_precision="ieee"``).

    fp32 inputs must not be rounded to TF32. NOTE: Triton's interpreter (3.9) multiplies the raw
    uint16 bits of bf16 operands in ``tl.dot``; upcasting to fp32 there gives the same result as a
    bf16 MMA with fp32 accumulation (bf16 products are exact in fp32).
    """
    return dtype == torch.float32 or (dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1")


def _block_m(M: int) -> int:
    """M bucket: 1 (CUDA-core FMA) or 16, 32 (``tl.dot`` needs >= 16 rows).

    NOTE: 2-4 rows padded to 16 for ``tl.dot`` read each weight once just as M=1 does. They had
    CUDA-core paths of their own, both slower by far on an H100 (2026-11-25, Llama-3.2-1B batch
    4, ms per replay): a product reduced over K at every tile 7.0 (gate|up 158 us per layer), an
    FMA accumulator of M=1's registers 2.89, against 1.15-1.19 padded to 16 (batch 2: 1.50 /
    1.14; Qwen2.5-0.5B batch 4 1.66-1.73 / 0.94; Llama-3-8B batch 4 14.2-14.4 / 5.84-5.98).
    """
    if M == 1:
        return 1
    return 16 if M <= 16 else _MAX_BLOCK_M


def prefer_small_m(M: int, N: int, K: int, fused: bool = True) -> bool:
    """Whether :func:`small_m_linear` should run a linear instead of a cuBLAS GEMM.

    Up to 16 rows the product is bound by reading the weight and a GEMM tiled for large M wastes
    most of its tile (and often leaves SMs idle), and the kernel fuses the norm before the linear,
    the SwiGLU after it and the residual; beyond that cuBLAS's tensor-core tiles win.

    Args:
        M: rows of ``x`` (tokens in the batch).
        N: output features.
        K: input features.
        fused: the call fuses a norm, a gate or a residual, which cuBLAS would run as separate
            kernels. A plain linear of more than 4 rows goes to cuBLAS unless K is long.

    Returns:
        True when the small-M kernel is the better choice.
    """
    # Measured (tgraph.bench.tune_gemv, H200): at M=1 the tuned kernel beats cuBLAS on every
    # Llama/Qwen linear. At M=16 it lost whole steps while its fused norm and gate ran 16-column
    # blocks (Llama-3.2-1B batch 16: 1.74 against 1.38 ms with cuBLAS, H100, 2026-11-22); with
    # swapped operands for those and for long K it wins them (docs/bench/h100-ab-small-m16.txt).
    # Plain 16-row linears: the multi-LoRA GEMMs on [x | shrink] (the norm sits in the shrink's
    # prologue) ran slower as 16-column blocks than on cuBLAS (tgraph bench lora, H100,
    # 2026-11-25: mixed batch 1.24x the base step, 1.12-1.15x with cuBLAS).
    if M > 4 and not fused and K < _M16_LONG_K:
        return False
    return 1 <= M <= _SMALL_M_MAX and N >= 16 and K >= 16


def choose_config(M: int, N: int, K: int, device: torch.device | str | None = None,
                  gated: bool = False, norm: bool = False,
                  itemsize: int = 2) -> tuple[int, int, int, int, int]:
    """Pick the launch configuration of :func:`small_m_linear`.

    Args:
        M: rows of ``x``.
        N: output features (rows of ``weight``; with ``gated``, half of them).
        K: input features.
        device: device the kernel runs on; its SM count decides split-K (132 when not CUDA).
        gated: the program also reads the "up" rows (two weight tiles per step), so the M=1
            path halves its output block to keep the same registers and bytes in flight.
        norm: the RMSNorm is fused (the activations' tile is scaled in registers every K step).
        itemsize: bytes per element of ``x`` and ``weight`` (the swapped path's shared-memory
            budget halves its K tile for fp32).

    Returns:
        ``(BLOCK_N, BLOCK_K, split_k, num_warps, num_stages)``, the ``config`` argument of
        :func:`small_m_linear`: the entry of ``CONFIG_OVERRIDES`` for this shape if there is one,
        else the heuristic's, where every split gets the same whole number of ``BLOCK_K``
        blocks except the last, which may get fewer (never none).
    """
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    block_m = _block_m(M)
    override = CONFIG_OVERRIDES.get((block_m, N, K, gated, norm))
    if override is not None:
        return override
    k_pow2 = triton.next_power_of_2(max(K, 16))
    if block_m == 1:
        return _m1_config(N, K, gated, norm, sm_count(device))
    if gated or norm:
        # 16 rows with a fused norm or gate: swapped operands, 64 weight rows per program, no
        # split (the gated grid fills the GPU, and splitting q|k|v with the norm measured slower:
        # Llama-3.2-1B 8.3 us against 8.9 / 10.3 / 9.4 with 2 / 3 / 4 splits and the reduce
        # launch, H100, 2026-11-25, tune_gemv --m 16 --fusion norm; split in one launch, whole
        # batch-16 steps, ms per replay, rounds 1-3 with / without: Llama-3.2-1B (48 blocks) 2
        # splits 1.268 / 1.269 / 1.268 against 1.274 / 1.258 / 1.262, 4 splits 1.314-1.321
        # against 1.256-1.278; Qwen2.5-0.5B (18 blocks) 2 splits 0.989 / 0.986 / 0.987 against
        # 1.008 / 0.993 / 0.991, 4 splits 0.990 / 0.991 / 0.990 against 1.016 / 0.994 / 0.995:
        # within the spread, not taken). Cold-weight sweep on an H100
        # (docs/bench/h100-gemv-tune-m16-fused.txt): q|k|v with the norm 8.4 us against 14.7 for 16-column blocks; gate|up with norm and SwiGLU
        # 26.9 us against 37.5 (cuBLAS alone, without the norm and SwiGLU kernels: 7.5 and 27.1);
        # gate|up without the norm 25.7 us with 128-wide K tiles. Shared memory (227 KB) takes 4
        # stages of one 64 x 256 weight tile, 3 of two; without the norm the activations' tile is
        # staged in shared memory too, and two weight tiles need the K tile halved.
        block_k = _M16_FUSED_BLOCK_K if norm or not gated else _M16_FUSED_BLOCK_K // 2
        block_k = max(min(block_k * 2 // max(itemsize, 2), k_pow2), 16)
        return _M16_FUSED_BLOCK_N, block_k, 1, 4, 3 if gated and norm else 4
    elif K >= _M16_LONG_K:
        # 16 rows, long K (down projections): swapped operands, 64 weight rows per program,
        # 128-wide K tiles, split-K up to one wave. Llama-3.2-1B batch 16, whole steps
        # (tgraph.bench.ab, H100, 2026-11-25): 1.260-1.267 ms per replay against 1.402-1.403 with
        # 32-column blocks in 3 splits (192 programs), and 1.521-1.523 with 2 splits.
        block_n = _M16_FUSED_BLOCK_N
        block_k = max(min(128, k_pow2), 16)
        n_blocks = triton.cdiv(N, block_n) * triton.cdiv(M, block_m)
        split_k = _even_split(triton.cdiv(K, block_k), sm_count(device) // n_blocks)
        return block_n, block_k, split_k, 4, 4
    else:
        # 16 rows: 256-wide K tiles, narrow outputs in 16-column blocks so that every SM gets a
        # program (cold-weight sweep at M=16, docs/bench/h200-gemv-tune-cold-m16.txt).
        block_k = max(min(_M16_BLOCK_K, k_pow2), 16)
        block_n = 16 if N <= 2048 else 32
        stages = _M16_STAGES

    # Tensor-core tiles keep enough bytes in flight with one program per SM: split only below
    # half a wave, up to one wave.
    n_blocks = triton.cdiv(N, block_n) * triton.cdiv(M, block_m)
    sms = sm_count(device)
    split_k = 1
    if n_blocks < sms // 2:
        split_k = _even_split(triton.cdiv(K, block_k), triton.cdiv(sms, n_blocks))
    return block_n, block_k, split_k, 4, stages


def _m1_config(N: int, K: int, gated: bool, norm: bool, sms: int) -> tuple[int, int, int, int, int]:
    """The M=1 configuration: elementwise FMA over ``[BLOCK_N, BLOCK_K]`` tiles, no split-K.

    Cold-weight sweeps (tgraph.bench.tune_gemv): 1024-wide K tiles, no split and 4 output rows per
    program (2 when gated: two weight rows per output) were best or within 3% for every
    Llama-3.2-1B / Qwen2.5-0.5B shape on an H200 (docs/bench/h200-gemv-tune-cold.json), and
    still are for the norm and gate fusions on an H100. Without fusions, longer K tiles shorten
    each program's chain of dependent loads (docs/bench/h100-gemv-tune-m1.txt): Llama-3.2-1B
    down 13.9 -> 12.3 us, o 4.3 -> 3.9 us, Qwen2.5-0.5B down 5.5 -> 4.5 us.
    """
    k_pow2 = triton.next_power_of_2(max(K, 16))
    if gated or norm:
        block_n = _M1_GATED_BLOCK_N if gated else _M1_BLOCK_N
        return block_n, max(min(1024, k_pow2), 16), 1, 4, _M1_STAGES
    block_n = _M1_BLOCK_N
    if triton.cdiv(N, block_n) < _M1_MIN_PROGRAMS_PER_SM * sms:
        block_n = max(block_n // 2, 1)
    wide = K >= _M1_WIDE_K
    block_k = max(min(2048 if wide else 1024, k_pow2), 16)
    warps = 8 if wide and K >= _M1_WIDE_K_8_WARPS else 4
    return block_n, block_k, 1, warps, _M1_STAGES


def _even_split(k_blocks: int, want: int) -> int:
    """At most ``want`` splits (and ``_MAX_SPLIT_K``) of ``k_blocks`` K blocks, every split the
    same whole number of blocks but the last, which may get fewer (never none)."""
    want = max(1, min(want, k_blocks, _MAX_SPLIT_K))
    per_split = triton.cdiv(k_blocks, want)
    return triton.cdiv(k_blocks, per_split)


def workspace_size(M: int, N: int, split_k: int, gated: bool = False, norm: bool = False) -> int:
    """Number of fp32 elements of the split-K workspace (0 when ``split_k == 1``).

    Args:
        M: rows of ``x``.
        N: output features.
        split_k: the split chosen by :func:`choose_config` (or forced by the caller).
        gated: a gated linear keeps the gate and the up partial sums (twice the space).
        norm: a fused RMSNorm keeps each split's sums of squares too (``split_k * M`` more).

    Returns:
        ``split_k * M * (N (2N when gated) + (1 when norm))`` when ``split_k > 1``, else 0.
    """
    if split_k <= 1:
        return 0
    return split_k * M * (N * (2 if gated else 1) + (1 if norm else 0))


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
    *,
    norm_eps: float | None = None,
    norm_weight: torch.Tensor | None = None,
    gated: bool = False,
) -> torch.Tensor:
    """``out = act(norm(x) @ weight.T + bias) + residual`` for small M, reading the weight once.

    The plain call is ``out = x @ weight.T (+ bias) (+ residual)``. Two fusions for decode:

    - ``norm_eps`` given: ``x`` is replaced by ``rms_norm(x) * norm_weight`` computed on the fly
      (the RMSNorm that precedes the linear, without its own launch or output).
    - ``gated``: ``weight`` is a packed ``[2N, K]`` gate|up weight and ``out`` gets
      ``silu(x @ gate.T) * (x @ up.T)`` (SwiGLU, without writing the ``[M, 2N]`` product).

    Args:
        x: ``[M, K]`` activations (fp16/bf16/fp32, same dtype as ``weight``); rows may be strided.
        weight: ``[N, K]`` (``[2N, K]`` when gated) in torch ``Linear`` layout (row-major along K).
        out: ``[M, N]`` output (any supported dtype; written, never allocated). May alias
            ``residual`` (each element is read and then written by the same program); must not
            overlap ``x``.
        bias: optional ``[N]`` (``[2N]`` when gated, added before the gate).
        residual: optional ``[M, N]`` added last.
        workspace: optional fp32 tensor with at least :func:`workspace_size` elements, used when
            ``split_k > 1``; allocated here when omitted (pass one under CUDA-graph capture to keep
            the allocation out of the captured region).
        split_k: force the number of K splits (>= 1); default from :func:`choose_config`.
        config: ``(BLOCK_N, BLOCK_K, split_k, num_warps, num_stages)`` instead of the heuristic
            (for tuning; see ``tgraph.bench.tune_gemv``). ``BLOCK_N >= 64`` at 5 or more rows
            swaps the MMA operands.
        norm_eps: RMSNorm epsilon; fuses the norm of ``x`` when given.
        norm_weight: optional ``[K]`` RMSNorm weight in ``x``'s dtype (needs ``norm_eps``).
        gated: SwiGLU on a packed gate|up weight.

    Returns:
        ``out``.
    """
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"small_m_linear: x must be a 2-D [M, K] tensor, got {getattr(x, 'shape', type(x))}")
    M, K = x.shape
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"small_m_linear: weight must be a 2-D [N, K] tensor, got {getattr(weight, 'shape', type(weight))}")
    if gated and weight.shape[0] % 2:
        raise ValueError(f"small_m_linear: a gated weight packs gate|up rows, so needs an even row count, "
                         f"got {list(weight.shape)}")
    N = weight.shape[0] // 2 if gated else weight.shape[0]
    device = x.device
    _check_matrix("x", x, (M, K), device)
    _check_matrix("weight", weight, (weight.shape[0], K), device)
    _check_matrix("out", out, (M, N), device)
    if weight.dtype != x.dtype:
        raise TypeError(f"small_m_linear: weight dtype {weight.dtype} must match x dtype {x.dtype}")
    if bias is not None:
        _check_matrix("bias", bias, (weight.shape[0],), device)
    if residual is not None:
        _check_matrix("residual", residual, (M, N), device)
        if residual.data_ptr() == out.data_ptr() and residual.stride() != out.stride():
            raise ValueError("small_m_linear: out aliases residual with different strides")
    if norm_weight is not None:
        if norm_eps is None:
            raise ValueError("small_m_linear: norm_weight needs norm_eps (the RMSNorm epsilon)")
        _check_matrix("norm_weight", norm_weight, (K,), device)
        if norm_weight.dtype != x.dtype:
            raise TypeError(f"small_m_linear: norm_weight dtype {norm_weight.dtype} must match x dtype {x.dtype}")
    if norm_eps is not None and not (isinstance(norm_eps, (int, float)) and norm_eps >= 0):
        raise ValueError(f"small_m_linear: norm_eps must be a non-negative number, got {norm_eps!r}")
    if out.numel() > 0 and x.numel() > 0 and out.data_ptr() == x.data_ptr():
        raise ValueError("small_m_linear: out must not alias x")
    if split_k is not None and (not isinstance(split_k, int) or split_k < 1):
        raise ValueError(f"small_m_linear: split_k must be a positive int, got {split_k!r}")
    if M == 0 or N == 0:
        return out

    if config is None:  # the heuristic, or a CONFIG_OVERRIDES entry (checked the same way)
        config = choose_config(M, N, K, device, gated=gated, norm=norm_eps is not None,
                               itemsize=x.element_size())
    if not isinstance(config, tuple) or len(config) != 5 or not all(
            isinstance(v, int) and v >= 1 for v in config):
        raise ValueError("small_m_linear: config must be a tuple of 5 positive ints (BLOCK_N, "
                         f"BLOCK_K, split_k, num_warps, num_stages), got {config!r}")
    block_n, block_k, auto_split, num_warps, num_stages = config
    split = auto_split if split_k is None else split_k
    k_blocks = max(triton.cdiv(K, block_k), 1)
    split = min(split, k_blocks)
    # Each split covers a whole number of BLOCK_K tiles so only the last one is ragged.
    k_per_split = triton.cdiv(k_blocks, split) * block_k
    split = triton.cdiv(max(K, 1), k_per_split)

    block_m = _block_m(M)
    grid_m = triton.cdiv(M, block_m)
    pdl = pdl_kwargs(x)
    dummy = out  # stands in for absent optional pointers (never read)
    common = dict(
        NORM=norm_eps is not None, HAS_G=norm_weight is not None,
        GATED=gated, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, F32_DOT=_use_f32_dot(x.dtype),
        SWAP_AB=block_m >= 16 and block_n >= _SWAP_MIN_BLOCK_N,
        num_warps=num_warps, num_stages=num_stages, **pdl,
    )
    g = norm_weight if norm_weight is not None else dummy
    eps = float(norm_eps) if norm_eps is not None else 0.0
    desc = _weight_descriptor(weight, block_n, block_k, common["SWAP_AB"])
    common["W_DESC"] = desc is not None
    w_desc = desc if desc is not None else weight  # stands in when unused (never read)
    res_stride = residual.stride(0) if residual is not None else 0

    if split == 1:
        _small_m_linear_kernel[(triton.cdiv(N, block_n), 1, grid_m)](
            x, weight, w_desc, g, bias if bias is not None else dummy, residual if residual is not None else dummy,
            out, dummy, dummy,
            M, N, K, k_per_split, N, eps,
            x.stride(0), weight.stride(0), res_stride, out.stride(0),
            HAS_BIAS=bias is not None, HAS_RES=residual is not None, WRITE_PARTIAL=False, **common,
        )
        return out

    need = workspace_size(M, N, split, gated, norm=norm_eps is not None)
    if workspace is None:
        workspace = torch.empty(need, dtype=torch.float32, device=device)
    else:
        if workspace.dtype != torch.float32 or workspace.device != device:
            raise TypeError(f"small_m_linear: workspace must be float32 on {device}, got {workspace.dtype} on {workspace.device}")
        if workspace.numel() < need or not workspace.is_contiguous():
            raise ValueError(f"small_m_linear: workspace must be contiguous with >= {need} elements "
                             f"(split_k={split}, M={M}, N={N}), got {workspace.numel()} elements")

    grid = (triton.cdiv(N, block_n), split, grid_m)
    if _split_in_one_launch(norm_eps is not None, common["SWAP_AB"]):
        # One launch: the last split of each output tile reduces it (see _fixup_tile).
        _small_m_linear_kernel[grid](
            x, weight, w_desc, g, bias if bias is not None else dummy,
            residual if residual is not None else dummy, out, workspace,
            arrival_counters(out, grid[0] * grid_m),
            M, N, K, k_per_split, N, eps,
            x.stride(0), weight.stride(0), res_stride, out.stride(0),
            HAS_BIAS=bias is not None, HAS_RES=residual is not None, WRITE_PARTIAL=True,
            FIXUP=True, **common,
        )
        return out
    _small_m_linear_kernel[grid](
        x, weight, w_desc, g, dummy, dummy, dummy, workspace, dummy,
        M, N, K, k_per_split, N, eps,
        x.stride(0), weight.stride(0), 0, out.stride(0),
        HAS_BIAS=False, HAS_RES=False, WRITE_PARTIAL=True, **common,
    )
    _split_k_reduce_kernel[(triton.cdiv(N, _REDUCE_BLOCK_N), M)](
        workspace, bias if bias is not None else dummy, residual if residual is not None else dummy, out,
        M, N, K, split, N, eps,
        res_stride, out.stride(0),
        HAS_BIAS=bias is not None, HAS_RES=residual is not None, GATED=gated,
        NORM=norm_eps is not None, BLOCK_N=_REDUCE_BLOCK_N, num_warps=4, **pdl,
    )
    return out
