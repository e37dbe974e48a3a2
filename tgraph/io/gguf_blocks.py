"""GGUF's quantized blocks repacked, exactly, into :mod:`tgraph.quant` layouts.

Each ggml type keeps its own arithmetic in fp32 (scales are fp16 values or products of an fp16
and a small integer, exact in fp32; codes are small integers), so the repacked weight's
``dequantize()`` equals ``gguf.quants.dequantize`` bit for bit:

| ggml type | tgraph layout | w = |
|---|---|---|
| ``Q4_0`` | int4 g32 sym | ``d * (q - 8)`` |
| ``Q4_1`` | int4 g32 offsets | ``d * q + m`` |
| ``Q5_0`` | int8 g32 sym, codes ``q - 16`` | ``d * (q - 16)`` |
| ``Q5_1`` | int8 g32 offsets | ``d * q + m`` |
| ``Q8_0`` | int8 g32 sym | ``d * q`` |
| ``Q2_K`` | int4 g16 offsets (2-bit codes) | ``(d * sc) * q - dmin * m`` |
| ``Q3_K`` | int4 g16 sym, codes ``q + 8`` | ``(d * (sc - 32)) * q``, ``q`` in [-4, 3] |
| ``Q4_K`` | int4 g32 offsets | ``(d * sc) * q - dmin * m`` |
| ``Q5_K`` | int8 g32 offsets (5-bit codes) | ``(d * sc) * q - dmin * m`` |
| ``Q6_K`` | int8 g16 sym, codes ``q - 32`` | ``(d * sc) * (q - 32)`` |
| ``IQ4_NL`` | int8 g32 sym, codes from its 16-value table | ``d * table[q]`` |
| ``IQ4_XS`` | int8 g32 sym, the same table | ``(d * (sc - 32)) * table[q]`` |

The layouts hold codes of 4 or 8 bits and an fp32 scale (and offset) per group, so the types
below 4 bits, the 5-bit ones and the non-linear IQ4 take more memory than in the file (e.g.
``Q2_K`` 8 bits a weight against 2.6, ``IQ4_XS`` 9 against 4.25): exact, and run by the same
kernels as every other quantized weight. llama.cpp writes ``Q5_0``, ``Q5_1`` and ``IQ4_NL`` in
K-quant files for tensors whose rows are not whole 256-value super-blocks (hidden sizes such as
576 or 896).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from tgraph.errors import WeightLoadError
from tgraph.quant import QuantizedWeight, QuantScheme

__all__ = ["DENSE_TYPES", "QUANTIZED_TYPES", "SUPPORTED_TYPES", "repack_blocks"]

Q = GGMLQuantizationType
DENSE_TYPES: dict[Q, torch.dtype] = {Q.F32: torch.float32, Q.F16: torch.float16,
                                     Q.BF16: torch.bfloat16}
# ggml type -> the tgraph layout it is repacked into (exactly; see repack_blocks).
QUANTIZED_TYPES: dict[Q, QuantScheme] = {
    Q.Q4_0: QuantScheme("int4", (1, 32)),
    Q.Q4_1: QuantScheme("int4", (1, 32), offsets=True),
    Q.Q5_0: QuantScheme("int8", (1, 32)),
    Q.Q5_1: QuantScheme("int8", (1, 32), offsets=True),
    Q.Q8_0: QuantScheme("int8", (1, 32)),
    Q.Q2_K: QuantScheme("int4", (1, 16), offsets=True),
    Q.Q3_K: QuantScheme("int4", (1, 16)),
    Q.Q4_K: QuantScheme("int4", (1, 32), offsets=True),
    Q.Q5_K: QuantScheme("int8", (1, 32), offsets=True),
    Q.Q6_K: QuantScheme("int8", (1, 16)),
    Q.IQ4_NL: QuantScheme("int8", (1, 32)),
    Q.IQ4_XS: QuantScheme("int8", (1, 32)),
}
SUPPORTED_TYPES = tuple(t.name for t in (*DENSE_TYPES, *QUANTIZED_TYPES))
# IQ4_NL / IQ4_XS: the 16 values a 4-bit code stands for (ggml's kvalues_iq4nl).
_IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
                       dtype=np.int8)

Repacked = tuple[np.ndarray, np.ndarray, "np.ndarray | None"]  # codes, scales, offsets


def _f16(b: np.ndarray) -> np.ndarray:
    """``(n, 2)`` uint8 little-endian halves -> ``(n,)`` fp32."""
    return np.ascontiguousarray(b).view(np.float16)[:, 0].astype(np.float32)


def _pack_int4(codes: np.ndarray) -> np.ndarray:
    """``(n, 2m)`` codes in [0, 15] -> ``(n, m)`` bytes, the even column in the low nibble."""
    return codes[:, 0::2] | (codes[:, 1::2] << np.uint8(4))


def _nibbles(qs: np.ndarray, chunk: int) -> np.ndarray:
    """GGUF 4-bit codes of ``(n, bytes)``: each ``chunk`` bytes hold ``chunk`` values in their
    low nibbles, then the next ``chunk`` values in their high nibbles."""
    n = qs.shape[0]
    q = qs.reshape(n, -1, 1, chunk) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (q & np.uint8(0x0F)).reshape(n, -1)


def _crumbs(qs: np.ndarray) -> np.ndarray:
    """GGUF 2-bit codes of ``(n, bytes)``: each 32 bytes hold 128 values, bits 0-1 of the 32
    bytes first, then bits 2-3, 4-5 and 6-7."""
    n = qs.shape[0]
    q = qs.reshape(n, -1, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    return (q & np.uint8(3)).reshape(n, -1)


def _high_bits(mask: np.ndarray, values: int) -> np.ndarray:
    """Bit ``i`` of every byte of ``(n, B)`` masks, ``i`` slowest: value ``i * B + j`` is bit
    ``i`` of byte ``j`` (``values / B`` bits a byte)."""
    n, width = mask.shape
    bits = mask.reshape(n, 1, width) >> np.arange(values // width, dtype=np.uint8).reshape(1, -1,
                                                                                          1)
    return (bits & np.uint8(1)).reshape(n, -1)


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit scales and mins of a Q4_K / Q5_K super-block (12 bytes), as ggml packs them."""
    n = scales.shape[0]
    d, m, m_d = np.split(scales.reshape(n, 3, 4), 3, axis=-2)
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.reshape(n, 8).astype(np.float32), mn.reshape(n, 8).astype(np.float32)


def _repack_q4_0(b: np.ndarray) -> Repacked:
    return _pack_int4(_nibbles(b[:, 2:], 16)), _f16(b[:, 0:2])[:, None], None


def _repack_q4_1(b: np.ndarray) -> Repacked:
    # w = d * q + m
    return _pack_int4(_nibbles(b[:, 4:], 16)), _f16(b[:, 0:2])[:, None], _f16(b[:, 2:4])[:, None]


def _five_bits(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """Q5_0 / Q5_1 codes in [0, 31]: 16 bytes of nibbles and a little-endian 32-bit mask of
    fifth bits, bit ``i`` for value ``i``."""
    n = qh.shape[0]
    high = np.unpackbits(np.ascontiguousarray(qh), axis=-1, bitorder="little").reshape(n, 32)
    return _nibbles(qs, 16) | (high << np.uint8(4))


def _repack_q5_0(b: np.ndarray) -> Repacked:
    codes = _five_bits(b[:, 2:6], b[:, 6:]).view(np.int8) - np.int8(16)
    return codes, _f16(b[:, 0:2])[:, None], None


def _repack_q5_1(b: np.ndarray) -> Repacked:
    codes = _five_bits(b[:, 4:8], b[:, 8:]).view(np.int8)
    return codes, _f16(b[:, 0:2])[:, None], _f16(b[:, 2:4])[:, None]


def _repack_q8_0(b: np.ndarray) -> Repacked:
    return np.ascontiguousarray(b[:, 2:]).view(np.int8), _f16(b[:, 0:2])[:, None], None


def _repack_q2_k(b: np.ndarray) -> Repacked:
    # 16 scale bytes (scale low nibble, min high), 64 code bytes, d, dmin; per 16 values
    # w = (d * sc) * q - dmin * m
    sc = (b[:, :16] & np.uint8(0x0F)).astype(np.float32)
    mn = (b[:, :16] >> np.uint8(4)).astype(np.float32)
    scale, offset = _f16(b[:, 80:82])[:, None] * sc, -(_f16(b[:, 82:84])[:, None] * mn)
    return _pack_int4(_crumbs(b[:, 16:80])), scale, offset


def _repack_q3_k(b: np.ndarray) -> Repacked:
    # 32 mask bytes, 64 code bytes, 12 bytes of 6-bit scales, d; a value's code is its two low
    # bits less 4 where its mask bit is clear: q in [-4, 3], stored as q + 8
    n = b.shape[0]
    low = _crumbs(b[:, 32:96]).astype(np.int8)
    clear = (_high_bits(b[:, :32], 256) ^ np.uint8(1)).astype(np.int8)
    codes = (low - (clear << np.int8(2)) + np.int8(8)).view(np.uint8)
    packed = b[:, 96:108]
    lo = (packed[:, :8].reshape(n, 1, 8) >> np.array([0, 4], dtype=np.uint8).reshape(1, 2, 1))
    hi = (packed[:, 8:].reshape(n, 1, 4) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 4, 1))
    sc = (lo.reshape(n, 16) & np.uint8(0x0F)) | ((hi.reshape(n, 16) & np.uint8(3)) << np.uint8(4))
    sc = (sc.view(np.int8) - np.int8(32)).astype(np.float32)
    return _pack_int4(codes), _f16(b[:, 108:110])[:, None] * sc, None


def _k_scales(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    # w = (d * sc) * q - (dmin * m), per 32 values
    sc, mn = _k_scale_min(b[:, 4:16])
    return _f16(b[:, 0:2])[:, None] * sc, -(_f16(b[:, 2:4])[:, None] * mn)


def _repack_q4_k(b: np.ndarray) -> Repacked:
    scale, offset = _k_scales(b)
    return _pack_int4(_nibbles(b[:, 16:], 32)), scale, offset


def _repack_q5_k(b: np.ndarray) -> Repacked:
    scale, offset = _k_scales(b)
    low = _nibbles(b[:, 48:], 32)
    return (low | (_high_bits(b[:, 16:48], 256) << np.uint8(4))).view(np.int8), scale, offset


def _repack_q6_k(b: np.ndarray) -> Repacked:
    # w = (d * scale) * (q - 32), per 16 values
    low = _nibbles(b[:, :128], 64)
    codes = (low | (_crumbs(b[:, 128:192]) << np.uint8(4))).view(np.int8) - np.int8(32)
    scales = np.ascontiguousarray(b[:, 192:208]).view(np.int8).astype(np.float32)
    return codes, _f16(b[:, 208:210])[:, None] * scales, None


def _repack_iq4_nl(b: np.ndarray) -> Repacked:
    return _IQ4_VALUES[_nibbles(b[:, 2:], 16)], _f16(b[:, 0:2])[:, None], None


def _repack_iq4_xs(b: np.ndarray) -> Repacked:
    # d, 16 bits of 2-bit high scale parts, 4 bytes of low nibbles, 128 code bytes; per 32
    # values w = (d * (sc - 32)) * table[q]
    n = b.shape[0]
    high = np.ascontiguousarray(b[:, 2:4]).view(np.uint16).reshape(n, 1) >> np.arange(
        0, 16, 2, dtype=np.uint16).reshape(1, 8)
    low = _nibbles(b[:, 4:8], 4).reshape(n, 2, 4).swapaxes(1, 2).reshape(n, 8)
    sc = (low | ((high & np.uint16(3)).astype(np.uint8) << np.uint8(4))).view(np.int8)
    sc = (sc - np.int8(32)).astype(np.float32)
    return _IQ4_VALUES[_nibbles(b[:, 8:], 16)], _f16(b[:, 0:2])[:, None] * sc, None


_REPACK = {Q.Q4_0: _repack_q4_0, Q.Q4_1: _repack_q4_1, Q.Q5_0: _repack_q5_0,
           Q.Q5_1: _repack_q5_1, Q.Q8_0: _repack_q8_0, Q.Q2_K: _repack_q2_k,
           Q.Q3_K: _repack_q3_k, Q.Q4_K: _repack_q4_k, Q.Q5_K: _repack_q5_k,
           Q.Q6_K: _repack_q6_k, Q.IQ4_NL: _repack_iq4_nl, Q.IQ4_XS: _repack_iq4_xs}


def _repack_in_threads(repack: Callable[[np.ndarray], Repacked], blocks: np.ndarray,
                       rows: int, piece_bytes: int) -> Repacked:
    """``repack(blocks)``, the rows split over torch's intra-op thread count (numpy releases
    the interpreter lock in its loops), each piece at least ``piece_bytes``."""
    workers = min(torch.get_num_threads(), rows, blocks.nbytes // max(piece_bytes, 1))
    if workers <= 1:
        return repack(blocks)
    per_row = blocks.shape[0] // rows
    bounds = np.linspace(0, rows, workers + 1).astype(int) * per_row
    pieces = [blocks[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    with ThreadPoolExecutor(workers) as pool:
        codes, scales, offsets = zip(*pool.map(repack, pieces), strict=True)
    return (np.concatenate(codes), np.concatenate(scales),
            None if offsets[0] is None else np.concatenate(offsets))


def repack_blocks(data: np.ndarray, ggml_type: Q, shape: Sequence[int],
                  rows: np.ndarray | None = None, dtype: torch.dtype = torch.float32,
                  name: str = "weight", piece_bytes: int = 1 << 20) -> QuantizedWeight:
    """GGUF blocks of a ``[N, K]`` weight as a :class:`QuantizedWeight`, exactly (the module's
    table: ``dequantize()`` equals ``gguf.quants.dequantize`` bit for bit).

    Args:
        data: the tensor's bytes, ``uint8`` (any shape holding ``N * K / block * type_size``).
        ggml_type: one of :data:`QUANTIZED_TYPES`.
        shape: the logical ``[N, K]``.
        rows: optional row order (``out[i] = in[rows[i]]``), e.g. to undo a permutation.
        dtype: the logical (compute) dtype of the weight.
        name: the weight's name, for errors.
        piece_bytes: the blocks are repacked by torch's threads in row pieces of at least this
            many bytes (threads cost small weights more than they save).

    Returns:
        The weight, on the CPU.

    Raises:
        WeightLoadError: an unsupported type, or data of the wrong size.
    """
    if ggml_type not in _REPACK:
        raise WeightLoadError(f"tensor '{name}' is {getattr(ggml_type, 'name', ggml_type)}; "
                              f"supported types: {', '.join(SUPPORTED_TYPES)}")
    n, k = (int(s) for s in shape)
    block, type_size = GGML_QUANT_SIZES[ggml_type]
    want = n * k // block * type_size
    if k % block or data.size != want:
        raise WeightLoadError(f"tensor '{name}' ({ggml_type.name} [{n}, {k}]) has {data.size} "
                              f"bytes, expected {want}")
    blocks = data.reshape(n * (k // block), type_size)
    qdata, scale, offset = _repack_in_threads(_REPACK[ggml_type], blocks, n, piece_bytes)
    scheme = QUANTIZED_TYPES[ggml_type]
    group = scheme.block[1]
    parts = [qdata.reshape(n, -1), scale.reshape(n, k // group),
             None if offset is None else offset.reshape(n, k // group)]
    if rows is not None:
        parts = [None if p is None else p[rows] for p in parts]
    qt, st, ot = (None if p is None else torch.from_numpy(np.ascontiguousarray(p)) for p in parts)
    return QuantizedWeight(scheme, qt, st, ot, dtype, name)
