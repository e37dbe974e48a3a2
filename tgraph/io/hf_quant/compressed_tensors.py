"""compressed-tensors checkpoints (``quant_method: compressed-tensors``, what llm-compressor
writes), read by the compressed-tensors package's own layout:

- ``pack-quantized`` int4 / int8: ``weight_packed`` int32 ``[N, ceil(K * bits / 32)]`` holding
  code ``k`` in bits ``bits * (k % (32 / bits))`` of word ``k // (32 / bits)`` as the unsigned
  ``u = q + 2 ** (bits - 1)`` of the signed code ``q``; ``weight_shape`` ``[N, K]``;
  ``weight_scale``; with ``symmetric: false`` a signed ``weight_zero_point`` ``z``, packed the
  same way along N (int32 ``[ceil(N * bits / 32), groups]``) or, from older versions, int8 of
  the scale's shape. ``w = s * (q - z)``.
- ``int-quantized`` / ``naive-quantized`` int: ``weight`` int8 ``[N, K]`` holding ``q``.
- ``float-quantized`` / ``naive-quantized`` fp8: ``weight`` float8_e4m3fn ``[N, K]``;
  ``w = q * s``.
- ``weight_g_idx`` (activation order ``group``, from older versions): as GPTQ's ``g_idx``, the
  scattered groups are stored contiguously with the weight's ``perm``.

Scales: strategy ``group`` ``[N, K / G]``, ``channel`` ``[N, 1]``, ``tensor`` ``[1]`` (int
weights take it as one scale per channel, exactly), ``block`` ``[ceil(N / bh), ceil(K / bw)]``
(fp8). Zero points become offsets ``b = -s * (z + 8)`` on the int4 codes ``u`` (``b = -s * z``
on int8 ``q``): exact with fp16 / bf16 scales; with fp32 scales ``s * u + b`` may differ from
``s * (q - z)`` by an ulp.

Which modules are quantized, and how, follows ``config_groups``' ``targets`` and ``ignore`` as
compressed-tensors matches them (exact names, then ``re:`` regexes, then class names); a class
target such as ``Linear`` is taken to cover every module whose tensors are quantized, since the
checkpoint does not say a module's class. Input activations may be quantized dynamically (tgraph
runs the weights against unquantized activations); static activation scales, output activation
and KV-cache quantization, sparsity and transforms are refused.
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
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
)
from tgraph.quant import QuantizedWeight, QuantScheme, unpack_int4

__all__ = ["plan_compressed_tensors"]

INT_FORMATS = ("pack-quantized", "int-quantized", "naive-quantized")
FLOAT_FORMATS = ("float-quantized", "naive-quantized")
INT_STRATEGIES = ("group", "channel", "tensor")
FLOAT_STRATEGIES = ("group", "channel", "tensor", "block")
SUPPORTED = ("supported: pack-quantized int4/int8 and int-quantized int8 weights (group, channel "
             "or tensor scales, symmetric or with zero points), float-quantized fp8 e4m3 "
             "weights (channel, tensor, group or block scales)")


@dataclass(frozen=True)
class _Group:
    name: str
    targets: tuple[str, ...]
    weights: Mapping[str, Any] | None
    inputs: Mapping[str, Any] | None
    outputs: Mapping[str, Any] | None
    format: str


def plan_compressed_tensors(ckpt: Checkpoint, qc: Mapping[str, Any],
                            dtype: torch.dtype) -> list[Plan]:
    """The quantized weights of a compressed-tensors checkpoint (every module with a
    ``weight_packed`` or ``weight_scale``), each by the config group that targets it.

    Raises:
        WeightLoadError: an unsupported format, scheme or feature, a quantized module no group
            targets (or one ``ignore`` lists), or tensors that do not fit the layout.
    """
    modules = sorted(set(ckpt.modules("weight_packed")) | set(ckpt.modules("weight_scale")))
    where = f" (tensor '{_data_name(ckpt, modules[0])}')" if modules else ""
    for key, what in (("sparsity_config", "sparse weights"), ("transform_config",
                                                               "weight transforms"),
                      ("kv_cache_scheme", "KV-cache quantization")):
        if qc.get(key):
            raise WeightLoadError(f"compressed-tensors {key} ({what}){where} is not supported; "
                                  + SUPPORTED)
    status = str(qc.get("quantization_status") or "compressed")
    if status != "compressed":
        raise WeightLoadError(f"compressed-tensors quantization_status {status!r}{where} is not "
                              "supported: tgraph reads compressed checkpoints (status "
                              "'compressed', as llm-compressor saves them)")
    groups = _groups(qc)
    ignore = [str(i) for i in qc.get("ignore") or []]
    return [_module(ckpt, prefix, _match(prefix, groups, ignore, ckpt), dtype)
            for prefix in modules]


def _groups(qc: Mapping[str, Any]) -> list[_Group]:
    raw = qc.get("config_groups")
    if not isinstance(raw, Mapping) or not raw:
        raise WeightLoadError("compressed-tensors quantization_config has no config_groups; "
                              "tgraph needs them to know each module's scheme")
    top = str(qc.get("format") or "")
    out = []
    for name, g in raw.items():
        if not isinstance(g, Mapping):
            raise WeightLoadError(f"compressed-tensors config group {name!r} is not an object")
        targets = g.get("targets") or []
        out.append(_Group(str(name), tuple(str(t) for t in targets), g.get("weights"),
                          g.get("input_activations"), g.get("output_activations"),
                          str(g.get("format") or top)))
    return out


def _match(prefix: str, groups: list[_Group], ignore: list[str], ckpt: Checkpoint) -> _Group:
    """The group whose target matches ``prefix`` first, by compressed-tensors' precedence."""
    tensor = _data_name(ckpt, prefix)
    if any(_name_match(prefix, i) for i in ignore):
        raise WeightLoadError(f"tensor '{tensor}' is quantized, but the compressed-tensors "
                              f"ignore list names {prefix}")
    owner: dict[str, _Group] = {}
    for g in groups:  # a target named twice belongs to the later group, as in compressed-tensors
        for t in g.targets:
            owner[t] = g
    ordered = sorted(owner, key=lambda t: ("re:" in t, t))
    hits = [t for t in ordered if _name_match(prefix, t)]
    hits += [t for t in ordered if re.fullmatch(r"[A-Z]\w*", t) and t not in hits]
    if not hits:
        raise WeightLoadError(f"tensor '{tensor}' is quantized, but no compressed-tensors "
                              f"config group targets {prefix} (targets: {sorted(owner)})")
    return owner[hits[0]]


def _data_name(ckpt: Checkpoint, prefix: str) -> str:
    """The module's quantized data tensor (for messages)."""
    packed = f"{prefix}.weight_packed"
    return packed if ckpt.has(packed) else f"{prefix}.weight"


def _name_match(name: str, target: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == name


# ---- one module -------------------------------------------------------------------------------
def _module(ckpt: Checkpoint, prefix: str, group: _Group, dtype: torch.dtype) -> Plan:
    w = group.weights
    tensor = _data_name(ckpt, prefix)
    if not isinstance(w, Mapping):
        raise WeightLoadError(f"tensor '{tensor}' is quantized, but its compressed-tensors "
                              f"group {group.name!r} quantizes no weights; " + SUPPORTED)
    bits = int(w.get("num_bits", 8))
    kind = str(w.get("type") or "int")
    sym = bool(w.get("symmetric", True))
    strategy, gsize = _strategy(w)
    block = w.get("block_structure")
    grain = f"group {gsize}" if strategy == "group" else strategy
    if strategy == "block" and block:
        grain = f"block {block[0]}x{block[1]}"
    label = (f"compressed-tensors {group.format} {kind}{bits} {grain} "
             f"{'sym' if sym else 'asym'}, group {group.name!r}")

    def refuse(problem: str) -> WeightLoadError:
        return WeightLoadError(f"tensor '{tensor}' ({label}): {problem}; {SUPPORTED}")

    if group.outputs:
        raise refuse("output activation quantization is not supported")
    inputs = group.inputs
    if inputs and inputs.get("dynamic") not in (True, "local"):
        raise refuse("static input activation scales are not supported (tgraph runs weights "
                     "against unquantized activations; dynamic activation schemes are read)")
    if w.get("dynamic") not in (None, False):
        raise refuse("dynamic weight quantization is not supported")
    if kind == "int":
        if group.format not in INT_FORMATS or bits not in (4, 8) \
                or strategy not in INT_STRATEGIES:
            raise refuse(f"format {group.format!r} with {bits}-bit int weights and strategy "
                         f"{strategy!r} is not supported")
        return _int_module(ckpt, prefix, bits, sym, strategy, gsize, group, label, refuse,
                           dtype)
    if kind == "float" and bits == 8 and group.format in FLOAT_FORMATS \
            and strategy in FLOAT_STRATEGIES and sym:
        return _fp8_module(ckpt, prefix, strategy, gsize, block, label, refuse, dtype)
    raise refuse(f"format {group.format!r} with {bits}-bit {kind} weights, strategy "
                 f"{strategy!r}, {'symmetric' if sym else 'asymmetric'} is not supported")


def _strategy(w: Mapping[str, Any]) -> tuple[str, int | None]:
    """The weights' strategy (inferred as compressed-tensors does when absent) and group size."""
    gsize = w.get("group_size")
    strategy = w.get("strategy")
    if strategy is None:
        strategy = "tensor" if gsize is None else "channel" if gsize == -1 else "group"
    return str(strategy), None if gsize is None else int(gsize)


def _scale_shape(strategy: str, n: int, k: int, gsize: int | None,
                 block: Any) -> tuple[tuple[int, ...], ...]:
    """The scale shapes a strategy allows (a tensor scale may be stored [1], [] or [1, 1])."""
    if strategy == "group":
        return ((n, k // gsize),)
    if strategy == "channel":
        return ((n, 1),)
    if strategy == "tensor":
        return ((1,), (), (1, 1))
    return ((-(-n // block[0]), -(-k // block[1])),)


def _check_scale(ckpt: Checkpoint, scale: str, shapes: tuple[tuple[int, ...], ...],
                 label: str, why: str) -> None:
    got = ckpt.shape(scale) if ckpt.has(scale) else None
    ckpt.expect(scale, got if got in shapes else shapes[0], FLOATS, label, why)


def _per_channel(s: torch.Tensor, n: int, cols: int) -> torch.Tensor:
    """Scales (or zero points) as ``[N, cols]``; one per tensor repeats down the channels."""
    return s.reshape(-1, cols).expand(n, cols).contiguous()


def _int_module(ckpt: Checkpoint, prefix: str, bits: int, sym: bool, strategy: str,
                gsize: int | None, group: _Group, label: str, refuse: Any,
                dtype: torch.dtype) -> Plan:
    packed = group.format == "pack-quantized"
    data = f"{prefix}.weight_packed" if packed else f"{prefix}.weight"
    scale, zp, g_idx = (f"{prefix}.{t}" for t in ("weight_scale", "weight_zero_point",
                                                   "weight_g_idx"))
    shape_name = f"{prefix}.weight_shape"
    dshape = ckpt.shape(data) if ckpt.has(data) else ()
    if len(dshape) != 2:
        raise refuse(f"expected a 2-D '{data}', got {list(dshape) if dshape else 'none'}")
    per_word = 32 // bits
    if packed:
        ckpt.expect(shape_name, (2,), INTS, label, "the weight's [N, K]")
        stored = ckpt.small(shape_name)
        if stored is not None:
            n, k = (int(v) for v in stored.tolist())
        else:  # no values (meta): the data's own shape says N and, to a word, K
            n, k = dshape[0], dshape[1] * per_word
        ckpt.expect(data, (n, -(-k // per_word)), (torch.int32,), label,
                    f"weight_shape [{n}, {k}] packs into ceil({k} / {per_word}) int32 words "
                    "per row")
    else:
        n, k = dshape
        ckpt.expect(data, (n, k), (torch.int8,), label, "the weight")
    gcols = k if strategy != "group" else gsize
    if strategy == "group" and (gsize is None or gsize <= 0 or k % gsize):
        raise refuse(f"group_size {gsize} does not divide K={k} input features")
    if bits == 4 and (k % 2 or gcols % 2):
        raise refuse(f"tgraph's int4 layout needs an even K and group size, got K={k}, "
                     f"group {gcols}")
    cols = k // gcols
    shapes = _scale_shape(strategy, n, k, gsize, None)
    _check_scale(ckpt, scale, shapes, label, f"{strategy} scales of a [{n}, {k}] weight")
    parts = [data, scale] + ([shape_name] if packed else [])
    zp_packed = False
    if not sym:
        zshape = ckpt.shape(zp) if ckpt.has(zp) else None
        packed_shape = (-(-n // per_word), cols)
        zp_packed = ckpt.dtype(zp) == torch.int32 or (
            ckpt.dtype(zp) is None and zshape == packed_shape and strategy != "tensor")
        if zp_packed:
            ckpt.expect(zp, packed_shape, (torch.int32,), label,
                        f"zero points packed along N: ceil({n} / {per_word}) words by {cols}")
        else:
            ckpt.expect(zp, zshape if zshape in shapes else shapes[0], (torch.int8,), label,
                        "zero points of the scale's shape")
        parts.append(zp)
    elif ckpt.has(zp):  # older versions stored zeros for symmetric schemes too
        ckpt.expect(zp, ckpt.shape(zp) if ckpt.shape(zp) in shapes else shapes[0], (torch.int8,),
                    label, "zero points of the scale's shape")
        parts.append(zp)
    perm = None
    if ckpt.has(g_idx):
        ckpt.expect(g_idx, (k,), INTS, label, f"one group index per input feature, K = {k}")
        perm = group_perm(ckpt, g_idx, k, gcols, label,
                          str(group.weights.get("actorder")) in ("group", "dynamic"))
        parts.append(g_idx)
    if not packed:
        ckpt.check_raw_reads(parts, f"{prefix}.weight")
    scheme = QuantScheme("int4" if bits == 4 else "int8", (1, gcols), offsets=not sym)
    name = f"{prefix}.weight"
    mid = 2 ** (bits - 1)

    def build() -> QuantizedWeight:
        if packed:
            codes = int32_bytes(ckpt.read(data))  # [N, words * 4], u = q + mid
            codes = codes[:, : k // 2 if bits == 4 else k].contiguous()
            qdata = codes if bits == 4 else (codes ^ 0x80).view(torch.int8)
        else:
            q = ckpt.read(data)
            _check_range(q, bits, data, label)
            qdata = pack_int4((q.to(torch.int16) + mid).to(torch.uint8)) if bits == 4 else q
        order = None if perm is None else perm.to(qdata.device)
        if order is not None:  # stored column j holds feature perm[j]: groups contiguous
            qdata = pack_int4(unpack_int4(qdata)[:, order]) if bits == 4 else qdata[:, order]
        s = _per_channel(ckpt.read(scale, torch.float32), n, cols)
        offset = None
        if sym and zp in parts:
            _check_zero(ckpt.read(zp), zp, label)
        elif not sym:
            z = ckpt.read(zp)
            if zp_packed:  # the words run along N: unpack them as rows of z.T
                zb = int32_bytes(z.t())
                z = (unpack_int4(zb) if bits == 4 else zb)[:, :n].t().to(torch.float32) - mid
            z = _per_channel(z.to(torch.float32), n, cols)
            offset = -(s * (z + mid)) if bits == 4 else -(s * z)
        return QuantizedWeight(scheme, qdata.contiguous(), s, offset, dtype, name, order)

    return Plan(name, (n, k), tuple(parts), build)


def _check_zero(z: torch.Tensor, tensor: str, label: str) -> None:
    if not z.is_meta and bool((z != 0).any()):
        raise WeightLoadError(f"tensor '{tensor}' ({label}): the scheme is symmetric, but its "
                              "zero points are not all 0")


def _check_range(q: torch.Tensor, bits: int, tensor: str, label: str) -> None:
    lo, hi = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    if bits == 8 or q.is_meta:
        return
    if bool(((q < lo) | (q > hi)).any()):
        raise WeightLoadError(f"tensor '{tensor}' ({label}) holds codes outside the "
                              f"{bits}-bit range [{lo}, {hi}]")


def _fp8_module(ckpt: Checkpoint, prefix: str, strategy: str, gsize: int | None, block: Any,
                label: str, refuse: Any, dtype: torch.dtype) -> Plan:
    weight, scale = f"{prefix}.weight", f"{prefix}.weight_scale"
    wshape = ckpt.shape(weight) if ckpt.has(weight) else ()
    if len(wshape) != 2:
        raise refuse(f"expected a 2-D '{weight}', got {list(wshape) if wshape else 'none'}")
    n, k = wshape
    ckpt.expect(weight, wshape, (torch.float8_e4m3fn,), label, "the weight")
    if strategy == "group" and (gsize is None or gsize <= 0 or k % gsize):
        raise refuse(f"group_size {gsize} does not divide K={k} input features")
    if strategy == "block" and not (isinstance(block, (list, tuple)) and len(block) == 2
                                    and all(isinstance(b, int) and b >= 1 for b in block)):
        raise refuse(f"block_structure {block!r} is not two positive ints")
    _check_scale(ckpt, scale, _scale_shape(strategy, n, k, gsize, block), label,
                 f"{strategy} scales of a [{n}, {k}] weight")
    ckpt.check_raw_reads((weight,), weight)
    rows, cols = {"channel": (1, k), "tensor": (n, k), "group": (1, gsize)}.get(
        strategy, tuple(block) if block else (n, k))
    scheme = QuantScheme("fp8", (rows, cols))

    def build() -> QuantizedWeight:
        q = ckpt.read(weight, torch.float8_e4m3fn)
        s = ckpt.read(scale, torch.float32).reshape(-(-n // rows), -(-k // cols))
        return QuantizedWeight(scheme, q, s.contiguous(), None, dtype, weight)

    return Plan(weight, (n, k), (weight, scale), build)
