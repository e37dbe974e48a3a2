"""GPTQ and AWQ checkpoints: int32 words of 4-bit (or 8-bit) codes, fp16 group scales and packed
zero points, repacked into tgraph's ``int4`` / ``int8`` layouts.

GPTQ (``quant_method: gptq``, AutoGPTQ / GPTQModel): ``qweight`` int32 ``[K / (32 / bits), N]``
packed along K (code ``k = (32 / bits) r + i`` in bits ``bits * i`` of word ``r``), ``qzeros``
int32 ``[K / G, N / (32 / bits)]`` packed along N the same way, ``scales`` ``[K / G, N]``,
``g_idx`` ``[K]`` (input feature ``k`` is in group ``g_idx[k]``); ``w = s * (q - z)``.
``checkpoint_format: gptq`` (v1, the default) stores ``z - 1``: the zero point is the stored code
plus one (AutoGPTQ's and vLLM's reading, so a stored 15 is 16); ``gptq_v2`` stores ``z`` itself.
``sym: true`` means every zero point is ``2 ** (bits - 1)``, which is checked when the weight is
read. With activation order (``desc_act: true`` without static groups) ``g_idx`` scatters each
group over the input features: the columns are then stored group by group, with the weight's
``perm`` saying which feature each stored column is (kernels gather ``x[:, perm]``).

AWQ (``quant_method: awq``, ``version: gemm``): ``qweight`` int32 ``[K, N / 8]`` packed along N
in the order ``[0, 2, 4, 6, 1, 3, 5, 7]`` (word ``c`` holds column ``8 c + order[i]`` in bits
``4 i``), ``qzeros`` int32 ``[K / G, N / 8]`` in the same order, ``scales`` ``[K / G, N]``;
``w = s * (q - z)``.

Zero points become fp32 offsets ``b = -s * z`` (``b = s * (128 - z)`` for 8-bit codes stored
as ``q = u - 128``); with fp16 or bf16 scales ``s * q + b`` is exactly ``s * (q - z)`` in fp32.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from tgraph.errors import WeightLoadError
from tgraph.io.hf_quant.common import (
    FLOATS,
    INTS,
    Checkpoint,
    Plan,
    group_perm,
    int32_bytes,
    pack_int4,
    skipped,
)
from tgraph.quant import QuantizedWeight, QuantScheme, unpack_int4

__all__ = ["plan_awq", "plan_gptq"]

# Column c of an AWQ word sits in nibble AWQ_REVERSE[c] (AutoAWQ packs nibble i = column
# [0, 2, 4, 6, 1, 3, 5, 7][i]).
AWQ_REVERSE = (0, 4, 1, 5, 2, 6, 3, 7)
GPTQ_FORMATS = ("gptq", "gptq_v2")


def plan_gptq(ckpt: Checkpoint, qc: Mapping[str, Any], dtype: torch.dtype) -> list[Plan]:
    """The quantized weights of a GPTQ checkpoint (every module with a ``qweight``).

    Raises:
        WeightLoadError: an unsupported bit width or checkpoint format, or a module whose
            tensors do not fit the documented layout.
    """
    bits = int(qc.get("bits", 4))
    fmt = str(qc.get("checkpoint_format") or "gptq").lower()
    if qc.get("is_marlin_format"):
        fmt = "marlin"
    first = f"{ckpt.modules('qweight')[0]}.qweight" if ckpt.modules("qweight") else "qweight"
    if fmt not in GPTQ_FORMATS:
        raise WeightLoadError(f"GPTQ checkpoint_format {fmt!r} (tensor '{first}') is not "
                              f"supported; tgraph reads {' and '.join(GPTQ_FORMATS)}")
    if bits not in (4, 8):
        raise WeightLoadError(f"GPTQ with bits={bits} (tensor '{first}') is not supported; "
                              "tgraph reads 4- and 8-bit GPTQ")
    group = int(qc.get("group_size", 128))
    sym = bool(qc.get("sym", True))
    desc_act = bool(qc.get("desc_act", False))
    skip = list(qc.get("modules_to_not_convert") or [])
    return [_gptq_module(ckpt, prefix, bits, group, sym, fmt == "gptq", desc_act, skip, dtype)
            for prefix in ckpt.modules("qweight")]


def plan_awq(ckpt: Checkpoint, qc: Mapping[str, Any], dtype: torch.dtype) -> list[Plan]:
    """The quantized weights of an AWQ GEMM checkpoint (every module with a ``qweight``).

    Raises:
        WeightLoadError: another AWQ version, bits other than 4, no zero points, or a module
            whose tensors do not fit the documented layout.
    """
    first = f"{ckpt.modules('qweight')[0]}.qweight" if ckpt.modules("qweight") else "qweight"
    version = str(qc.get("version") or "gemm").lower()
    if version != "gemm":
        raise WeightLoadError(f"AWQ version {version!r} (tensor '{first}') is not supported; "
                              "tgraph reads AWQ's GEMM layout (version: gemm)")
    bits = int(qc.get("bits", qc.get("w_bit", 4)))
    if bits != 4:
        raise WeightLoadError(f"AWQ with bits={bits} (tensor '{first}') is not supported; "
                              "tgraph reads 4-bit AWQ")
    if not qc.get("zero_point", True):
        raise WeightLoadError(f"AWQ with zero_point=false (tensor '{first}') is not supported; "
                              "tgraph reads AWQ with zero points (zero_point: true)")
    group = int(qc.get("group_size", qc.get("q_group_size", 128)))
    skip = list(qc.get("modules_to_not_convert") or [])
    return [_awq_module(ckpt, prefix, group, skip, dtype) for prefix in ckpt.modules("qweight")]


# ---- GPTQ ------------------------------------------------------------------------------------
def _gptq_module(ckpt: Checkpoint, prefix: str, bits: int, group: int, sym: bool, v1: bool,
                 desc_act: bool, skip: list[str], dtype: torch.dtype) -> Plan:
    per_word = 32 // bits
    qweight, qzeros, scales, g_idx = (f"{prefix}.{t}" for t in ("qweight", "qzeros", "scales",
                                                                 "g_idx"))
    qshape = ckpt.shape(qweight)
    grain = "channel" if group == -1 else f"g{group}"
    label = f"GPTQ int{bits} {grain} {'sym' if sym else 'asym'}"
    if len(qshape) != 2:
        raise WeightLoadError(f"tensor '{qweight}' ({label}) has shape {list(qshape)}; GPTQ "
                              "packs a linear weight as a 2-D [K / (32 / bits), N] tensor")
    if skipped(prefix, skip):
        raise WeightLoadError(f"tensor '{qweight}' ({label}) is quantized, but config.json's "
                              f"modules_to_not_convert lists {prefix}")
    k, n = qshape[0] * per_word, qshape[1]
    g = _group(k, group, qweight, label)
    if bits == 4 and g % 2:
        raise WeightLoadError(f"tensor '{qweight}' ({label}): tgraph's int4 layout needs an "
                              f"even group size, got {g}")
    groups = k // g
    if n % per_word:
        raise WeightLoadError(f"tensor '{qweight}' ({label}): N={n} output features do not "
                              f"fill whole {bits}-bit qzeros words ({per_word} per int32)")
    ckpt.expect(qweight, (k // per_word, n), (torch.int32,), label, "qweight")
    ckpt.expect(scales, (groups, n), FLOATS, label,
                f"K / group_size = {k} / {g} groups by N = {n}, from qweight {list(qshape)}")
    ckpt.expect(qzeros, (groups, n // per_word), (torch.int32,), label,
                f"{groups} groups by N / {per_word} = {n} / {per_word} int32 words")
    parts = [qweight, qzeros, scales]
    perm = None
    if ckpt.has(g_idx):
        ckpt.expect(g_idx, (k,), INTS, label, f"one group index per input feature, K = {k}")
        perm = group_perm(ckpt, g_idx, k, g, label, desc_act)
        parts.append(g_idx)
    scheme = QuantScheme("int4" if bits == 4 else "int8", (1, g), offsets=not sym)
    name = f"{prefix}.weight"

    def build() -> QuantizedWeight:
        # qweight.T's words run along K, so their bytes are already K-ordered codes.
        codes = int32_bytes(ckpt.read(qweight).t())  # [N, K * bits / 8]
        order = None if perm is None else perm.to(codes.device)
        if order is not None:  # stored column j holds feature perm[j]: groups contiguous
            codes = pack_int4(unpack_int4(codes)[:, order]) if bits == 4 else codes[:, order]
        qdata = (codes if bits == 4 else (codes ^ 0x80).view(torch.int8)).contiguous()
        s = ckpt.read(scales, torch.float32).t().contiguous()  # [N, groups]
        z = int32_bytes(ckpt.read(qzeros))  # [groups, N * bits / 8]
        z = (unpack_int4(z) if bits == 4 else z).t().to(torch.float32)
        if v1:
            z = z + 1.0
        offset = None
        if sym:
            _check_sym(z, 2 ** (bits - 1), qzeros, label, v1)
        else:
            offset = -(s * z) if bits == 4 else s * (128.0 - z)
        return QuantizedWeight(scheme, qdata, s, None if offset is None else offset.contiguous(),
                               dtype, name, order)

    return Plan(name, (n, k), tuple(parts), build)


def _check_sym(z: torch.Tensor, mid: int, qzeros: str, label: str, v1: bool) -> None:
    if z.is_meta or bool((z == mid).all()):
        return
    found = sorted({int(v) for v in z.unique()[:8]})
    stored = "stored code + 1" if v1 else "stored code"
    raise WeightLoadError(f"tensor '{qzeros}' ({label}): config.json says sym=true, but the zero "
                          f"points ({stored}) are {found}, not all {mid}")


def _group(k: int, group: int, tensor: str, label: str) -> int:
    if group == -1:
        return k
    if group <= 0 or k % group:
        raise WeightLoadError(f"tensor '{tensor}' ({label}): group_size {group} does not divide "
                              f"K={k} input features; tgraph needs group_size dividing K (or -1 "
                              "for one group per output channel)")
    return group


# ---- AWQ -------------------------------------------------------------------------------------
def _awq_module(ckpt: Checkpoint, prefix: str, group: int, skip: list[str],
                dtype: torch.dtype) -> Plan:
    qweight, qzeros, scales = (f"{prefix}.{t}" for t in ("qweight", "qzeros", "scales"))
    qshape = ckpt.shape(qweight)
    label = f"AWQ gemm int4 {'channel' if group == -1 else f'g{group}'}"
    if len(qshape) != 2:
        raise WeightLoadError(f"tensor '{qweight}' ({label}) has shape {list(qshape)}; AWQ "
                              "packs a linear weight as a 2-D [K, N / 8] tensor")
    if skipped(prefix, skip):
        raise WeightLoadError(f"tensor '{qweight}' ({label}) is quantized, but config.json's "
                              f"modules_to_not_convert lists {prefix}")
    k, n = qshape[0], qshape[1] * 8
    g = _group(k, group, qweight, label)
    if g % 2:
        raise WeightLoadError(f"tensor '{qweight}' ({label}): tgraph's int4 layout needs an "
                              f"even group size, got {g}")
    groups = k // g
    ckpt.expect(qweight, qshape, (torch.int32,), label, "qweight")
    ckpt.expect(scales, (groups, n), FLOATS, label,
                f"K / group_size = {k} / {g} groups by N = {n}, from qweight {list(qshape)}")
    ckpt.expect(qzeros, (groups, n // 8), (torch.int32,), label,
                f"{groups} groups by N / 8 = {n} / 8 int32 words")
    scheme = QuantScheme("int4", (1, g), offsets=True)
    name = f"{prefix}.weight"
    order = torch.tensor(AWQ_REVERSE)

    def unpack(words: torch.Tensor) -> torch.Tensor:
        """``int32 [R, N / 8]`` in AWQ's order -> ``uint8 [R, N]`` codes in column order."""
        nibbles = unpack_int4(int32_bytes(words))  # nibble i of word c at [.., 8 c + i]
        rows = nibbles.shape[0]
        return nibbles.reshape(rows, -1, 8)[..., order.to(nibbles.device)].reshape(rows, -1)

    def build() -> QuantizedWeight:
        qdata = pack_int4(unpack(ckpt.read(qweight)).t())  # [N, K / 2]
        s = ckpt.read(scales, torch.float32).t().contiguous()  # [N, groups]
        z = unpack(ckpt.read(qzeros)).t().to(torch.float32)
        return QuantizedWeight(scheme, qdata.contiguous(), s, (-(s * z)).contiguous(), dtype,
                               name)

    return Plan(name, (n, k), (qweight, qzeros, scales), build)
