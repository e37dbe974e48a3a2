"""Small-M linear (decode GEMV) with an optional split-K: ``out = x @ weight.T + bias + residual``,
optionally with the RMSNorm before it and the SwiGLU after it fused in.

At decode a linear layer sees a handful of rows (M = batch, 1..32) against a weight of millions of
elements, so its time is the time to stream the weight from HBM once. The kernel is built around
that: each program owns a ``BLOCK_N`` slice of output columns (``BLOCK_N`` contiguous rows of the
``[N, K]`` weight, loaded as vectors along K) and computes it for all M rows, so every weight byte
is read exactly once whatever M is.

When ``N / BLOCK_N`` programs would not fill the GPU, K is split over ``split_k`` programs per
column block. NOTE: the split is deterministic: every split writes its fp32 partial sums into a
``[split_k, M, N]`` workspace, and the partials are summed in split order before the epilogue
(bias, residual, cast), by whichever split of an output tile finishes last (its ticket from a
per-tile arrival counter, :func:`arrival_counters`, which the launch leaves zeroed) or, with
swapped operands and no fused norm (``GemvTuning.split_k_fixup``), by a second, reduce launch.
Either way the bits are the same run to run and between the two, no float atomics are used, and
the grids follow from shapes only, so the launches are CUDA-graph capturable (pass a
preallocated ``workspace`` of :func:`workspace_size` fp32 elements to keep allocation out of the
captured region).

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

- ``BLOCK_M == 1``: elementwise FMA into a ``[BLOCK_N, BLOCK_K]`` fp32 register accumulator,
  reduced across K once after the loop (no cross-lane reduction per iteration).
- ``BLOCK_M >= 16`` (M >= 2): ``tl.dot`` on tensor cores; M is padded to 16/32 which costs
  nothing in a bandwidth-bound kernel. With ``BLOCK_N >= 64`` the operands are swapped
  (``SWAP_AB``): the weight tile is the MMA's M side (``acc[BLOCK_N, BLOCK_M] = w @ x.T``,
  transposed once after the loop), so a program streams a weight tile several times larger than
  the activations' tile instead of one as small as it. On Hopper those weight tiles are read by
  TMA (``GemvTuning.tma_weights``).

Quantized weights (a :class:`~tgraph.quant.QuantizedWeight` as ``weight``): the same kernel with
the same fusions, reading only the packed codes and the fp32 scales; the settings are
``GemvTuning.quant``, the launch rules :mod:`tgraph.kernels.triton.gemv_quant_launch`. The
products run on the codes themselves (an int4 code becomes a bf16 ``128 + q`` by one OR of its
bits) and each K tile folds its scales into the accumulator once
(:mod:`tgraph.kernels.triton.quant_tiles`), so a K tile never straddles a scale group. One row
runs on CUDA cores (int4 and, on 16-bit activations, fp8 as int32 words:
:mod:`tgraph.kernels.triton.gemv_int4_row`, :mod:`tgraph.kernels.triton.gemv_fp8_row`); 2-64 rows
on tensor cores, int4 and fp8 fed from int32 words by a few instructions per word
(:mod:`tgraph.kernels.triton.gemv_words_mma`), int8 and narrow int4 groups from code tiles.

Launch settings come from a :class:`~tgraph.tuning.GemvTuning` (the engine's; the defaults when a
caller gives none).
"""
from __future__ import annotations

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from tgraph import envs
from tgraph.kernels.triton.device_info import sm_count
from tgraph.kernels.triton.gemv_kernels import small_m_linear_kernel, split_k_reduce_kernel
from tgraph.kernels.triton.gemv_quant_launch import (
    check_quantized,
    even_split,
    one_row_block_k,
    prefer_quant_gemv,
    quant_args,
    quant_block_k,
    quant_block_m,
    quant_config,
    quant_rows,
)
from tgraph.kernels.triton.pdl import pdl_kwargs
from tgraph.quant import QuantizedWeight
from tgraph.tuning import GemvTuning

__all__ = ["small_m_linear", "choose_config", "prefer_small_m", "prefer_quant_gemv",
           "quant_block_k", "workspace_size", "arrival_counters", "weight_descriptor"]

# Largest M bucket; larger M adds programs along grid axis 2 (weight re-read per 32 rows).
_MAX_BLOCK_M = 32
_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_REDUCE_BLOCK_N = 1024
_DEFAULT_TUNING = GemvTuning()


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
        counters = _COUNTERS[key] = torch.zeros(max(tiles, 64), dtype=torch.int32,
                                                device=out.device)
    return counters


def _split_in_one_launch(norm: bool, swapped: bool, tuning: GemvTuning) -> bool:
    """Whether a split-K launch reduces its output tiles itself (the kernel's fixup) instead of
    leaving them to a reduce launch."""
    return tuning.split_k_fixup and (norm or not swapped)


def weight_descriptor(weight: torch.Tensor, block_n: int, block_k: int, swapped: bool,
                      tuning: GemvTuning = _DEFAULT_TUNING) -> TensorDescriptor | None:
    """A TMA descriptor of ``weight`` with ``[block_n, block_k]`` blocks, or None to read it
    through pointers: only for swapped operands (``tuning.tma_weights``), on Hopper or later (or
    the Triton interpreter), with 16-byte aligned rows."""
    if not (tuning.tma_weights and swapped):
        return None
    if weight.data_ptr() % 16 or (weight.stride(0) * weight.element_size()) % 16:
        return None
    if block_k * weight.element_size() < 16:
        return None
    if weight.is_cuda and not envs.TRITON_INTERPRET:
        if torch.cuda.get_device_capability(weight.device)[0] < 9:
            return None
    return TensorDescriptor(weight, list(weight.shape), [weight.stride(0), 1], [block_n, block_k])


def _use_f32_dot(dtype: torch.dtype) -> bool:
    """Whether ``tl.dot`` must run on fp32 operands (``input_precision="ieee"``).

    fp32 inputs must not be rounded to TF32. NOTE: Triton's interpreter (3.9) multiplies the raw
    uint16 bits of bf16 operands in ``tl.dot``; upcasting to fp32 there gives the same result as a
    bf16 MMA with fp32 accumulation (bf16 products are exact in fp32).
    """
    return dtype == torch.float32 or (dtype == torch.bfloat16 and envs.TRITON_INTERPRET)


def _block_m(M: int, quantized: bool = False) -> int:
    """M bucket: 1 (CUDA-core FMA) or 16, 32 (``tl.dot`` needs >= 16 rows); quantized weights
    always take tensor cores, up to 64 rows.

    NOTE: 2-4 rows are padded to 16 for ``tl.dot``: they read each weight once just as M=1 does,
    and CUDA-core paths of their own measured far slower.
    """
    if quantized:
        return quant_rows(M)
    if M == 1:
        return 1
    return 16 if M <= 16 else _MAX_BLOCK_M


def prefer_small_m(M: int, N: int, K: int, fused: bool = True,
                   tuning: GemvTuning = _DEFAULT_TUNING) -> bool:
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
        tuning: the launch settings (``small_m_max``, ``m16_long_k``).

    Returns:
        True when the small-M kernel is the better choice.
    """
    # NOTE: plain 16-row linears (the multi-LoRA GEMMs on [x | shrink]) measured slower on this
    # kernel than on cuBLAS; fused ones and long K win here (docs/performance.md).
    if M > 4 and not fused and K < tuning.m16_long_k:
        return False
    return 1 <= M <= tuning.small_m_max and N >= 16 and K >= 16


def choose_config(M: int, N: int, K: int, device: torch.device | str | None = None,
                  gated: bool = False, norm: bool = False, itemsize: int = 2,
                  tuning: GemvTuning = _DEFAULT_TUNING) -> tuple[int, int, int, int, int]:
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
        tuning: the launch settings, including per-shape ``overrides``.

    Returns:
        ``(BLOCK_N, BLOCK_K, split_k, num_warps, num_stages)``, the ``config`` argument of
        :func:`small_m_linear`: the override of ``tuning`` for this shape if there is one, else
        the heuristic's, where every split gets the same whole number of ``BLOCK_K`` blocks
        except the last, which may get fewer (never none).
    """
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    block_m = _block_m(M)
    override = tuning.override_for((block_m, N, K, gated, norm))
    if override is not None:
        return (override.block_n, override.block_k, override.split_k, override.num_warps,
                override.num_stages)
    k_pow2 = triton.next_power_of_2(max(K, 16))
    if block_m == 1:
        return _m1_config(N, K, gated, norm, sm_count(device), tuning)
    if gated or norm:
        # 16 rows with a fused norm or gate: swapped operands, no split (the gated grid fills the
        # GPU, and splitting q|k|v with the norm measured no faster). Shared memory takes 4
        # stages of one weight tile, 3 of two; without the norm the activations' tile is staged
        # too, and two weight tiles need the K tile halved.
        block_k = tuning.m16_fused_block_k if norm or not gated else tuning.m16_fused_block_k // 2
        block_k = max(min(block_k * 2 // max(itemsize, 2), k_pow2), 16)
        return tuning.m16_fused_block_n, block_k, 1, 4, 3 if gated and norm else 4
    elif K >= tuning.m16_long_k:
        # 16 rows, long K (down projections): swapped operands, 128-wide K tiles, split-K up to
        # one wave.
        block_n = tuning.m16_fused_block_n
        block_k = max(min(128, k_pow2), 16)
        n_blocks = triton.cdiv(N, block_n) * triton.cdiv(M, block_m)
        split_k = even_split(triton.cdiv(K, block_k), sm_count(device) // n_blocks,
                              tuning.max_split_k)
        return block_n, block_k, split_k, 4, 4
    else:
        # 16 rows: narrow outputs in 16-column blocks so that every SM gets a program.
        block_k = max(min(tuning.m16_block_k, k_pow2), 16)
        block_n = 16 if N <= 2048 else 32
        stages = tuning.m16_stages

    # Tensor-core tiles keep enough bytes in flight with one program per SM: split only below
    # half a wave, up to one wave.
    n_blocks = triton.cdiv(N, block_n) * triton.cdiv(M, block_m)
    sms = sm_count(device)
    split_k = 1
    if n_blocks < sms // 2:
        split_k = even_split(triton.cdiv(K, block_k), triton.cdiv(sms, n_blocks),
                              tuning.max_split_k)
    return block_n, block_k, split_k, 4, stages


def _m1_config(N: int, K: int, gated: bool, norm: bool, sms: int,
               tuning: GemvTuning) -> tuple[int, int, int, int, int]:
    """The M=1 configuration: elementwise FMA over ``[BLOCK_N, BLOCK_K]`` tiles, no split-K;
    1024-wide K tiles with the norm or gate fused, wider ones without (see ``GemvTuning``)."""
    k_pow2 = triton.next_power_of_2(max(K, 16))
    if gated or norm:
        block_n = tuning.m1_gated_block_n if gated else tuning.m1_block_n
        return block_n, max(min(1024, k_pow2), 16), 1, 4, tuning.m1_stages
    block_n = tuning.m1_block_n
    if triton.cdiv(N, block_n) < tuning.m1_min_programs_per_sm * sms:
        block_n = max(block_n // 2, 1)
    wide = K >= tuning.m1_wide_k
    block_k = max(min(2048 if wide else 1024, k_pow2), 16)
    warps = 8 if wide and K >= tuning.m1_wide_k_8_warps else 4
    return block_n, block_k, 1, warps, tuning.m1_stages


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
        raise ValueError(f"small_m_linear: {name} must have shape {list(shape)}, "
                         f"got {list(t.shape)}")
    if t.dtype not in _SUPPORTED_DTYPES:
        raise TypeError(f"small_m_linear: {name} must be float16, bfloat16 or float32, "
                        f"got {t.dtype}")
    if t.device != device:
        raise ValueError(f"small_m_linear: {name} is on {t.device}, expected {device} "
                         f"(the device of x)")
    if t.numel() > 0 and t.stride(-1) != 1:
        raise ValueError(f"small_m_linear: {name} must have a contiguous last dim, "
                         f"got strides {t.stride()}")


def small_m_linear(
    x: torch.Tensor,
    weight: torch.Tensor | QuantizedWeight,
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
    tuning: GemvTuning = _DEFAULT_TUNING,
) -> torch.Tensor:
    """``out = act(norm(x) @ weight.T + bias) + residual`` for small M, reading the weight once.

    The plain call is ``out = x @ weight.T (+ bias) (+ residual)``. Two fusions for decode:

    - ``norm_eps`` given: ``x`` is replaced by ``rms_norm(x) * norm_weight`` computed on the fly
      (the RMSNorm that precedes the linear, without its own launch or output).
    - ``gated``: ``weight`` is a packed ``[2N, K]`` gate|up weight and ``out`` gets
      ``silu(x @ gate.T) * (x @ up.T)`` (SwiGLU, without writing the ``[M, 2N]`` product).

    Args:
        x: ``[M, K]`` activations (fp16/bf16/fp32, same dtype as ``weight``); rows may be strided.
        weight: ``[N, K]`` (``[2N, K]`` when gated) in torch ``Linear`` layout (row-major along K),
            or a :class:`~tgraph.quant.QuantizedWeight` standing for one (its logical dtype
            ``x``'s; see :func:`prefer_quant_gemv` for which it takes).
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
        tuning: the launch settings (the engine's; the defaults otherwise).

    Returns:
        ``out``.
    """
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"small_m_linear: x must be a 2-D [M, K] tensor, "
                         f"got {getattr(x, 'shape', type(x))}")
    M, K = x.shape
    quantized = isinstance(weight, QuantizedWeight)
    if not (quantized or isinstance(weight, torch.Tensor)) or weight.dim() != 2:
        raise ValueError(f"small_m_linear: weight must be a 2-D [N, K] tensor, "
                         f"got {getattr(weight, 'shape', type(weight))}")
    if gated and weight.shape[0] % 2:
        raise ValueError(f"small_m_linear: a gated weight packs gate|up rows, so needs an even "
                         f"row count, got {list(weight.shape)}")
    N = weight.shape[0] // 2 if gated else weight.shape[0]
    device = x.device
    _check_matrix("x", x, (M, K), device)
    if quantized:
        check_quantized(weight, K, device, tuning)
    else:
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
            raise TypeError(f"small_m_linear: norm_weight dtype {norm_weight.dtype} must match "
                            f"x dtype {x.dtype}")
    if norm_eps is not None and not (isinstance(norm_eps, (int, float)) and norm_eps >= 0):
        raise ValueError(f"small_m_linear: norm_eps must be a non-negative number, "
                         f"got {norm_eps!r}")
    if out.numel() > 0 and x.numel() > 0 and out.data_ptr() == x.data_ptr():
        raise ValueError("small_m_linear: out must not alias x")
    if split_k is not None and (not isinstance(split_k, int) or split_k < 1):
        raise ValueError(f"small_m_linear: split_k must be a positive int, got {split_k!r}")
    if M == 0 or N == 0:
        return out

    if config is None and quantized:
        config = quant_config(M, N, weight, device, tuning, norm=norm_eps is not None,
                               gated=gated)
    elif config is None:  # the heuristic, or an override of the tuning (checked the same way)
        config = choose_config(M, N, K, device, gated=gated, norm=norm_eps is not None,
                               itemsize=x.element_size(), tuning=tuning)
    if not isinstance(config, tuple) or len(config) != 5 or not all(
            isinstance(v, int) and v >= 1 for v in config):
        raise ValueError("small_m_linear: config must be a tuple of 5 positive ints (BLOCK_N, "
                         f"BLOCK_K, split_k, num_warps, num_stages), got {config!r}")
    block_n, block_k, auto_split, num_warps, num_stages = config
    if any(v & (v - 1) for v in (block_n, block_k, num_warps)):
        raise ValueError("small_m_linear: BLOCK_N, BLOCK_K and num_warps must be powers of two "
                         f"(Triton tiles and warp groups), got {config!r} (a config argument "
                         "or a GemvTuning setting)")
    if quantized:
        fits = one_row_block_k if quant_block_m(M, weight, tuning) == 1 else quant_block_k
        if block_k != fits(weight, block_k):
            raise ValueError(f"small_m_linear: a K tile of {block_k} straddles the scale blocks "
                             f"of {weight.scheme.describe(weight.shape)}; use "
                             f"{fits(weight, block_k)}")
    split = auto_split if split_k is None else split_k
    k_blocks = max(triton.cdiv(K, block_k), 1)
    split = min(split, k_blocks)
    # Each split covers a whole number of BLOCK_K tiles so only the last one is ragged.
    k_per_split = triton.cdiv(k_blocks, split) * block_k
    split = triton.cdiv(max(K, 1), k_per_split)

    block_m = quant_block_m(M, weight, tuning) if quantized else _block_m(M)
    grid_m = triton.cdiv(M, block_m)
    pdl = pdl_kwargs(x)
    dummy = out  # stands in for absent optional pointers (never read)
    common = dict(
        NORM=norm_eps is not None, HAS_G=norm_weight is not None,
        GATED=gated, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        F32_DOT=_use_f32_dot(x.dtype),
        SWAP_AB=block_m >= 16 and block_n >= tuning.swap_min_block_n,
        num_warps=num_warps, num_stages=num_stages, **pdl,
    )
    g = norm_weight if norm_weight is not None else dummy
    eps = float(norm_eps) if norm_eps is not None else 0.0
    if quantized:
        codes, scales, offsets, stride_qs = quant_args(weight, x, common, tuning)
        desc = None
        if common["QWORDS"]:  # words of 2-64 rows: TMA tiles as for dense weights
            per_word = 8 if weight.scheme.kind == "int4" else 4
            desc = weight_descriptor(codes, block_n, block_k // per_word, True, tuning)
    else:
        codes, scales, offsets, stride_qs = weight, dummy, dummy, 0
        desc = weight_descriptor(weight, block_n, block_k, common["SWAP_AB"], tuning)
    common["W_DESC"] = desc is not None
    w_desc = desc if desc is not None else codes  # stands in when unused (never read)
    res_stride = residual.stride(0) if residual is not None else 0

    if split == 1:
        small_m_linear_kernel[(triton.cdiv(N, block_n), 1, grid_m)](
            x, codes, w_desc, g, bias if bias is not None else dummy,
            residual if residual is not None else dummy, out, dummy, dummy, scales, offsets,
            M, N, K, k_per_split, N, eps,
            x.stride(0), codes.stride(0), res_stride, out.stride(0), stride_qs,
            HAS_BIAS=bias is not None, HAS_RES=residual is not None, WRITE_PARTIAL=False, **common,
        )
        return out

    need = workspace_size(M, N, split, gated, norm=norm_eps is not None)
    if workspace is None:
        workspace = torch.empty(need, dtype=torch.float32, device=device)
    else:
        if workspace.dtype != torch.float32 or workspace.device != device:
            raise TypeError(f"small_m_linear: workspace must be float32 on {device}, "
                            f"got {workspace.dtype} on {workspace.device}")
        if workspace.numel() < need or not workspace.is_contiguous():
            raise ValueError(f"small_m_linear: workspace must be contiguous with >= {need} "
                             f"elements (split_k={split}, M={M}, N={N}), "
                             f"got {workspace.numel()} elements")

    grid = (triton.cdiv(N, block_n), split, grid_m)
    if _split_in_one_launch(norm_eps is not None, common["SWAP_AB"], tuning):
        # One launch: the last split of each output tile reduces it (the kernel's fixup).
        small_m_linear_kernel[grid](
            x, codes, w_desc, g, bias if bias is not None else dummy,
            residual if residual is not None else dummy, out, workspace,
            arrival_counters(out, grid[0] * grid_m), scales, offsets,
            M, N, K, k_per_split, N, eps,
            x.stride(0), codes.stride(0), res_stride, out.stride(0), stride_qs,
            HAS_BIAS=bias is not None, HAS_RES=residual is not None, WRITE_PARTIAL=True,
            FIXUP=True, **common,
        )
        return out
    small_m_linear_kernel[grid](
        x, codes, w_desc, g, dummy, dummy, dummy, workspace, dummy, scales, offsets,
        M, N, K, k_per_split, N, eps,
        x.stride(0), codes.stride(0), 0, out.stride(0), stride_qs,
        HAS_BIAS=False, HAS_RES=False, WRITE_PARTIAL=True, **common,
    )
    split_k_reduce_kernel[(triton.cdiv(N, _REDUCE_BLOCK_N), M)](
        workspace, bias if bias is not None else dummy,
        residual if residual is not None else dummy, out,
        M, N, K, split, N, eps,
        res_stride, out.stride(0),
        HAS_BIAS=bias is not None, HAS_RES=residual is not None, GATED=gated,
        NORM=norm_eps is not None, BLOCK_N=_REDUCE_BLOCK_N, num_warps=4, **pdl,
    )
    return out
