"""FP8 checkpoints (``quant_method: fp8``, as Qwen3-FP8 and DeepSeek-V3 ship them): ``weight``
float8_e4m3fn ``[N, K]`` and ``weight_scale_inv`` fp32 ``[ceil(N / bh), ceil(K / bw)]`` for
``weight_block_size: [bh, bw]`` (the multiplier, despite its name: ``w = q * s``); without
``weight_block_size``, one scale per tensor (``weight_scale`` or ``weight_scale_inv``, shape
``[]``, ``[1]`` or ``[1, 1]``). ``scale_fmt: ue8m0`` scales (powers of two stored as
float8_e8m0fnu) widen to fp32 exactly.

Only ``activation_scheme: dynamic`` is read: tgraph runs these weights against unquantized
activations (a static scheme's ``input_scale`` would be ignored, so it is refused).
Modules in ``modules_to_not_convert`` (or ``ignored_layers``) are dense.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from tgraph.errors import WeightLoadError
from tgraph.io.hf_quant.common import Checkpoint, Plan, skipped
from tgraph.quant import QuantizedWeight, QuantScheme

__all__ = ["plan_fp8"]

SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e8m0fnu)


def plan_fp8(ckpt: Checkpoint, qc: Mapping[str, Any], dtype: torch.dtype) -> list[Plan]:
    """The quantized weights of an FP8 checkpoint (every module with a ``weight_scale_inv`` or
    ``weight_scale``).

    Raises:
        WeightLoadError: a static activation scheme, another fp8 format, a bad block size, or
            a module whose tensors do not fit the layout.
    """
    modules = sorted(set(ckpt.modules("weight_scale_inv")) | set(ckpt.modules("weight_scale")))
    first = f"{modules[0]}.weight" if modules else "weight"
    act = str(qc.get("activation_scheme") or "dynamic").lower()
    if act != "dynamic":
        raise WeightLoadError(f"FP8 activation_scheme {act!r} (tensor '{first}') is not "
                              "supported; tgraph reads FP8 checkpoints with activation_scheme "
                              "'dynamic' (weights only: activations stay unquantized)")
    fmt = str(qc.get("fmt") or "e4m3").lower()
    if fmt != "e4m3":
        raise WeightLoadError(f"FP8 fmt {fmt!r} (tensor '{first}') is not supported; tgraph "
                              "reads float8 e4m3 weights")
    scale_fmt = str(qc.get("scale_fmt") or "float").lower()
    if scale_fmt not in ("float", "ue8m0"):
        raise WeightLoadError(f"FP8 scale_fmt {scale_fmt!r} (tensor '{first}') is not "
                              "supported; tgraph reads 'float' and 'ue8m0' scales")
    block = qc.get("weight_block_size")
    if block is not None:
        if not (isinstance(block, (list, tuple)) and len(block) == 2
                and all(isinstance(b, int) and b >= 1 for b in block)):
            raise WeightLoadError(f"FP8 weight_block_size {block!r} (tensor '{first}') is not "
                                  "two positive ints, e.g. [128, 128]")
        block = (int(block[0]), int(block[1]))
    skip = list(qc.get("modules_to_not_convert") or qc.get("ignored_layers") or [])
    return [_module(ckpt, prefix, block, skip, dtype) for prefix in modules]


def _module(ckpt: Checkpoint, prefix: str, block: tuple[int, int] | None, skip: list[str],
            dtype: torch.dtype) -> Plan:
    weight = f"{prefix}.weight"
    inv, plain = f"{prefix}.weight_scale_inv", f"{prefix}.weight_scale"
    scale = inv if ckpt.has(inv) else plain
    label = "FP8 " + (f"block {block[0]}x{block[1]}" if block else "tensor")
    if ckpt.has(inv) and ckpt.has(plain):
        raise WeightLoadError(f"tensor '{plain}' ({label}): the module also has "
                              f"'{inv}'; an FP8 weight has one scale tensor")
    if skipped(prefix, skip):
        raise WeightLoadError(f"tensor '{scale}' ({label}): the module is quantized, but "
                              f"config.json's modules_to_not_convert lists {prefix}")
    if not ckpt.has(weight):
        raise WeightLoadError(f"tensor '{weight}' ({label}) is missing next to '{scale}'")
    wshape = ckpt.shape(weight)
    if len(wshape) != 2:
        raise WeightLoadError(f"tensor '{weight}' ({label}) has shape {list(wshape)}; tgraph "
                              "reads FP8 linear weights [N, K]")
    n, k = wshape
    ckpt.expect(weight, wshape, (torch.float8_e4m3fn,), label, "the weight")
    sshape = ckpt.shape(scale)
    if block is None:
        if sshape not in ((), (1,), (1, 1)):
            raise WeightLoadError(
                f"tensor '{scale}' ({label}) has shape {list(sshape)}; without "
                "weight_block_size an FP8 weight has one scale ([], [1] or [1, 1]); per-block "
                "scales need weight_block_size in config.json")
        scheme = QuantScheme("fp8", (n, k))
    else:
        bh, bw = block
        ckpt.expect(scale, (-(-n // bh), -(-k // bw)), SCALE_DTYPES, label,
                    f"ceil(N / {bh}) by ceil(K / {bw}) blocks for a [{n}, {k}] weight")
        scheme = QuantScheme("fp8", block)
    ckpt.expect(scale, sshape, SCALE_DTYPES, label, "its scale")
    ckpt.check_raw_reads((weight,), weight)

    def build() -> QuantizedWeight:
        q = ckpt.read(weight, torch.float8_e4m3fn)
        s = ckpt.read(scale, torch.float32)
        return QuantizedWeight(scheme, q, s.reshape(-(-n // scheme.block[0]),
                                                    -(-k // scheme.block[1])).contiguous(),
                               None, dtype, weight)

    return Plan(weight, (n, k), (weight, scale), build)
