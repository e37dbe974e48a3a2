"""Launch rules of the small-M linear (:mod:`tgraph.kernels.triton.gemv`) on quantized weights:
which weights it takes, which path a launch runs (one row on CUDA cores; 2-64 rows on tensor
cores, int4 and fp8 from int32 words, the rest from code tiles), its tiles and K split, and the
kernel's quantized arguments. The settings are ``GemvTuning.quant``.
"""
from __future__ import annotations

import torch
import triton

from tgraph import envs
from tgraph.kernels.triton.device_info import sm_count
from tgraph.kernels.triton.quant_tiles import KIND_IDS, code_base, code_zero
from tgraph.quant import QuantizedWeight
from tgraph.tuning import GemvTuning

__all__ = ["check_quantized", "even_split", "one_row_block_k", "prefer_quant_gemv", "quant_args",
           "quant_block_k", "quant_block_m", "quant_config", "quant_rows"]

_TL_DTYPES = {torch.bfloat16: triton.language.bfloat16, torch.float16: triton.language.float16,
              torch.float32: triton.language.float32}
_DEFAULT_TUNING = GemvTuning()


def quant_rows(M: int) -> int:
    """The tensor-core M bucket of quantized weights: 16, 32 or 64 rows."""
    return 16 if M <= 16 else 32 if M <= 32 else 64


def even_split(k_blocks: int, want: int, most: int) -> int:
    """At most ``want`` splits (and ``most``) of ``k_blocks`` K blocks, every split the same whole
    number of blocks but the last, which may get fewer (never none)."""
    want = max(1, min(want, k_blocks, most))
    per_split = triton.cdiv(k_blocks, want)
    return triton.cdiv(k_blocks, per_split)


def quant_block_k(weight: QuantizedWeight, want: int) -> int:
    """The K tile for ``weight``: at most ``want``, a power of two, and one that keeps every tile
    inside one scale block (it divides the block's columns unless one block spans K); 0 when
    that is below the 16 a tensor-core step needs."""
    cols, k = weight.scheme.block[1], weight.shape[1]
    block_k = min(triton.next_power_of_2(max(want, 1)), triton.next_power_of_2(max(k, 16)))
    if cols < k:
        block_k = min(block_k, cols & -cols)  # the largest power of two dividing the group
    return block_k if block_k >= 16 else 0


def prefer_quant_gemv(M: int, weight: QuantizedWeight,
                      tuning: GemvTuning = _DEFAULT_TUNING) -> bool:
    """Whether :func:`small_m_linear` runs ``x [M, K] @ weight.T`` on a quantized weight: up to
    ``tuning.quant.small_m_max`` rows, columns in stored order (no act-order ``perm``) and scale
    groups of at least 16 columns."""
    return (1 <= M <= tuning.quant.small_m_max and weight.perm is None
            and quant_block_k(weight, tuning.quant.block_k) > 0)


def one_row_block_k(weight: QuantizedWeight, want: int) -> int:
    """The one-row (CUDA-core) K tile: whole scale groups when they are a power of two no wider
    than ``want``, else inside one group (see :func:`quant_block_k`)."""
    cols, k = weight.scheme.block[1], weight.shape[1]
    block_k = min(triton.next_power_of_2(max(want, 1)), triton.next_power_of_2(max(k, 16)))
    if cols < k and not (cols & (cols - 1) == 0 and block_k >= cols):
        block_k = min(block_k, cols & -cols)
    return block_k if block_k >= 16 else 0


def _rows_of_words(weight: QuantizedWeight, per_word: int) -> bool:
    """Whether the codes' rows read as whole, aligned int32 words of ``per_word`` codes."""
    q = weight.qdata
    return weight.shape[1] % per_word == 0 and q.data_ptr() % 4 == 0 and q.stride(0) % 4 == 0


def _int4_words_ok(weight: QuantizedWeight) -> bool:
    """Whether an int4 weight's codes read as int32 words of eight, each inside one scale
    group (the one-row kernel's layout)."""
    k, cols = weight.shape[1], weight.scheme.block[1]
    return _rows_of_words(weight, 8) and (cols >= k or cols % 8 == 0)


def quant_block_m(M: int, weight: QuantizedWeight, tuning: GemvTuning) -> int:
    """1 (CUDA cores) for one row where the layout allows, else the tensor-core bucket."""
    one_row = M == 1 and tuning.quant.m1_fma and (weight.scheme.kind != "int4"
                                                  or _int4_words_ok(weight))
    return 1 if one_row else quant_rows(M)


def _words_mma(weight: QuantizedWeight, block_m: int, block_k: int, swapped: bool,
               tuning: GemvTuning) -> bool:
    """Whether 2-64 rows of int4 or fp8 codes take the MMAs on code pairs from int32 words
    (:mod:`tgraph.kernels.triton.gemv_words_mma`): rows of whole aligned words, swapped operands
    and K tiles that give every MMA (four a tile for int4, two for fp8) 16 columns or more."""
    kind = weight.scheme.kind
    if kind == "int4":
        fits = block_k >= 64 and _int4_words_ok(weight)
    elif kind == "fp8":
        fits = block_k >= 32 and _rows_of_words(weight, 4)
    else:
        fits = False
    return fits and block_m >= 16 and swapped and tuning.quant.words


def _fp8_row_words(weight: QuantizedWeight, dtype: torch.dtype, tuning: GemvTuning) -> bool:
    """Whether one row of fp8 codes takes the fp16x2 products on int32 words
    (:mod:`tgraph.kernels.triton.gemv_fp8_row`): 16-bit activations, rows of whole aligned
    units of eight codes."""
    return (weight.scheme.kind == "fp8" and dtype in (torch.bfloat16, torch.float16)
            and _rows_of_words(weight, 8) and tuning.quant.m1_fp8_words)


def _int4_register_cap(norm: bool, gated: bool, tuning: GemvTuning) -> int:
    """Registers per thread of a one-row int4 launch (0: the compiler's choice): a fused norm
    without the gate is capped, its registers costing a q|k|v grid a second wave."""
    return tuning.quant.m1_int4_norm_registers if norm and not gated else 0


def quant_config(M: int, N: int, weight: QuantizedWeight, device: torch.device,
                  tuning: GemvTuning, norm: bool = False,
                  gated: bool = False) -> tuple[int, int, int, int, int]:
    """The launch on a quantized weight: ``GemvTuning.quant``'s tiles, K split until the grid
    has ``programs_per_sm`` programs per SM (one row: its own tiles, no split)."""
    q = tuning.quant
    if quant_block_m(M, weight, tuning) == 1:
        kind = weight.scheme.kind
        fp8_n = q.m1_fp8_words_block_n if _fp8_row_words(weight, weight.dtype, tuning) else \
            q.m1_fp8_block_n
        block_n = {"int8": q.m1_int8_block_n, "fp8": fp8_n}.get(kind, q.m1_block_n)
        # under the register cap the wide int4 tile spills
        int4_k = q.m1_block_k if _int4_register_cap(norm, gated, tuning) else q.m1_int4_block_k
        block_k = {"int4": int4_k, "fp8": q.m1_fp8_block_k}.get(kind, q.m1_block_k)
        return (block_n, one_row_block_k(weight, block_k), 1, q.m1_num_warps,
                q.m1_num_stages)
    block_k = quant_block_k(weight, q.block_k)
    block_n, warps, stages = q.block_n, q.num_warps, q.num_stages
    words_n = q.words_block_n_m64 if M > 32 else \
        q.words_fp8_block_n if weight.scheme.kind == "fp8" else q.words_block_n
    words_k = quant_block_k(weight, q.words_block_k)
    if _words_mma(weight, 16, words_k, words_n >= tuning.swap_min_block_n, tuning):
        block_n, block_k, warps, stages = words_n, words_k, q.words_num_warps, q.words_num_stages
    n_blocks = triton.cdiv(N, block_n) * triton.cdiv(M, quant_rows(M))
    want = triton.cdiv(q.programs_per_sm * sm_count(device), n_blocks)
    split_k = even_split(triton.cdiv(weight.shape[1], block_k), want, tuning.max_split_k)
    return block_n, block_k, split_k, warps, stages


def check_quantized(weight: QuantizedWeight, K: int, device: torch.device,
                    tuning: GemvTuning) -> None:
    """Refuse a quantized weight the small-M linear cannot take, saying why."""
    if weight.shape[1] != K:
        raise ValueError(f"small_m_linear: weight must have shape [N, {K}], got "
                         f"{list(weight.shape)}")
    if weight.device != device:
        raise ValueError(f"small_m_linear: weight is on {weight.device}, expected {device} "
                         f"(the device of x)")
    if weight.perm is not None:
        raise ValueError(f"small_m_linear: {weight.name} has permuted (act-order) columns; "
                         "tgraph.kernels.triton.quant_linear takes those")
    if quant_block_k(weight, tuning.quant.block_k) == 0:
        raise ValueError(f"small_m_linear: {weight.scheme.describe(weight.shape)} groups are "
                         "too narrow for a 16-wide K step; tgraph.kernels.triton.quant_linear "
                         "takes them")


def quant_args(weight: QuantizedWeight, x: torch.Tensor, common: dict,
                tuning: GemvTuning) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """The kernel's quantized-weight arguments (codes, scales, offsets, scale row stride); adds
    its constexprs to ``common``."""
    scheme = weight.scheme
    on_gpu = x.is_cuda and not envs.TRITON_INTERPRET
    one_row = common["BLOCK_M"] == 1
    # Codes as fp32 for one row (CUDA cores), else as x's dtype (fp32 under the interpreter).
    dtype = torch.float32 if one_row or common["F32_DOT"] else x.dtype
    codes = weight.qdata
    if scheme.kind == "fp8" and not on_gpu:
        codes = codes.view(torch.uint8)  # decoded from its bits (see quant_tiles.fp8_e4m3_value)
    bits, base = code_base(scheme.kind, dtype, on_gpu)
    words = _words_mma(weight, common["BLOCK_M"], common["BLOCK_K"], common["SWAP_AB"], tuning)
    if one_row and scheme.kind == "int4":  # int32 words; ZERO as for codes read as 2**23 + q
        codes, bits, base = codes.view(torch.int32), 0, 8388608.0
    elif one_row and _fp8_row_words(weight, x.dtype, tuning):  # int32 words of four codes
        codes, words = codes.view(torch.int32), True
    elif words:  # int32 words: int4 pairs under a 16-bit magic, fp8 pairs as fp16 (by PTX)
        codes = codes.view(torch.int32)
        if dtype == torch.float32:  # the codes' values, fp32 MMAs
            bits, base = 0, 0.0
        elif scheme.kind == "fp8":
            dtype = torch.float16
    rows, cols = scheme.block
    n, k = weight.shape
    block_k = common["BLOCK_K"]
    common.update(
        QKIND=KIND_IDS[scheme.kind], QOFFSETS=scheme.offsets, QBASE_BITS=bits,
        QZERO=code_zero(scheme.kind, scheme.offsets, base), ON_GPU=on_gpu,
        # One block spanning the dim: the same constexpr for every shape (fewer compiles).
        QROWS=rows if rows < n else 1 << 30, QCOLS=cols if cols < k else 1 << 30,
        QNG=block_k // cols if one_row and cols < k and block_k > cols else 1,
        QDTYPE=_TL_DTYPES[dtype], QWORDS=words,
    )
    cap = _int4_register_cap(common["NORM"], common["GATED"], tuning)
    if one_row and scheme.kind == "int4" and cap:
        common["maxnreg"] = cap
    offsets = weight.offset if weight.offset is not None else weight.scale
    return codes, weight.scale, offsets, weight.scale.stride(0)
