"""Round-to-nearest quantization of a dense weight into a :class:`QuantizedWeight` layout.

Checkpoints arrive quantized; this is for making quantized weights from dense ones (tests,
experiments): per-block absmax scales for symmetric codes, min/max scales and offsets otherwise.
"""
from __future__ import annotations

import torch

from tgraph.quant.scheme import QuantScheme
from tgraph.quant.weight import QuantizedWeight

__all__ = ["quantize"]

_FP8_MAX = 448.0


def _blocks(w: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """``w [N, K]`` as ``[N/rows, K/cols, rows * cols]`` (zero-padded to whole blocks)."""
    n, k = w.shape
    nb, kb = -(-n // rows), -(-k // cols)
    padded = torch.zeros(nb * rows, kb * cols, dtype=w.dtype, device=w.device)
    padded[:n, :k] = w
    return padded.view(nb, rows, kb, cols).permute(0, 2, 1, 3).reshape(nb, kb, rows * cols)


def quantize(w: torch.Tensor, kind: str, group_size: int | None = None, offsets: bool = False,
             block: tuple[int, int] | None = None, name: str = "weight") -> QuantizedWeight:
    """Quantize ``w [N, K]`` to ``kind`` with round-to-nearest.

    Args:
        w: the dense weight.
        kind: ``"int4"``, ``"int8"`` or ``"fp8"``.
        group_size: int kinds: columns per scale (``None``: one per output channel).
        offsets: int kinds: min/max scales with a per-group offset instead of symmetric ones.
        block: fp8: ``(rows, cols)`` per scale (default one per output channel).
        name: for error messages.

    Returns:
        The quantized weight (logical dtype: ``w``'s).
    """
    n, k = w.shape
    wf = w.detach().to(torch.float32)
    if kind == "fp8":
        rows, cols = block or (1, k)
        scheme = QuantScheme("fp8", (rows, cols))
        amax = _blocks(wf.abs(), rows, cols).amax(-1)
        scale = torch.where(amax > 0, amax / _FP8_MAX, torch.ones_like(amax))
        full = scale.repeat_interleave(rows, 0)[:n].repeat_interleave(cols, 1)[:, :k]
        q = (wf / full).clamp(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn)
        return QuantizedWeight(scheme, q, scale.contiguous(), None, w.dtype, name)
    cols = group_size or k
    scheme = QuantScheme(kind, (1, cols), offsets)
    groups = wf.view(n, k // cols, cols)
    top = 15 if kind == "int4" else 255
    if offsets:
        lo, hi = groups.amin(-1), groups.amax(-1)
        scale = torch.where(hi > lo, (hi - lo) / top, torch.ones_like(hi))
        codes = ((groups - lo[..., None]) / scale[..., None]).round().clamp(0, top)
        offset = lo.contiguous()
        if kind == "int8":  # stored signed: q = u - 128, so b absorbs 128 * s
            codes, offset = codes - 128, offset + 128 * scale
    else:
        half = 7 if kind == "int4" else 127
        amax = groups.abs().amax(-1)
        scale = torch.where(amax > 0, amax / half, torch.ones_like(amax))
        codes = (groups / scale[..., None]).round().clamp(-half - 1, half)
        if kind == "int4":
            codes = codes + 8
        offset = None
    codes = codes.reshape(n, k)
    if kind == "int4":
        c = codes.to(torch.uint8)
        q = (c[:, 0::2] | (c[:, 1::2] << 4)).contiguous()
    else:
        q = codes.to(torch.int8)
    return QuantizedWeight(scheme, q, scale.contiguous(), offset, w.dtype, name)
