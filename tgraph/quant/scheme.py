"""How a quantized weight is laid out: the :class:`QuantScheme`.

Every format tgraph reads (GGUF, compressed-tensors, GPTQ, AWQ, FP8 checkpoints) is repacked at
load into one of three layouts, all of them a logical ``[N, K]`` weight (``torch.nn.Linear``'s
layout) with fp32 scales:

- ``int4``: ``uint8 [N, K / 2]``, two values per byte (even k in the low nibble), each ``q`` in
  ``[0, 15]``. Symmetric: ``w = s * (q - 8)``; with offsets: ``w = s * q + b``.
- ``int8``: ``int8 [N, K]``. Symmetric: ``w = s * q``; with offsets: ``w = s * q + b``.
- ``fp8``: ``float8_e4m3fn [N, K]``; ``w = q * s``.

``s`` (and ``b``) are fp32 per block of ``block = (rows, cols)`` weights: ``(1, G)`` for a group
size ``G`` along K, ``(1, K)`` for one scale per output channel, ``(N, K)`` for one per tensor, or
``(128, 128)`` tiles. fp32 scales keep every format's own arithmetic exact: a GGUF ``Q4_K`` scale
``d * sc`` (fp16 times a 6-bit integer) or a zero point folded into ``b = -s * z`` both fit.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tgraph.errors import WeightLoadError

__all__ = ["KINDS", "QuantScheme", "STORAGE_DTYPES"]

KINDS = ("int4", "int8", "fp8")
STORAGE_DTYPES = {"int4": torch.uint8, "int8": torch.int8, "fp8": torch.float8_e4m3fn}


@dataclass(frozen=True)
class QuantScheme:
    """The layout of one quantized weight.

    Attributes:
        kind: ``"int4"``, ``"int8"`` or ``"fp8"`` (e4m3).
        block: ``(rows, cols)`` of weights that share one scale (and offset).
        offsets: ``w = s * q + b`` with a per-block fp32 ``b`` (zero points, GGUF mins); int only.
    """

    kind: str
    block: tuple[int, int]
    offsets: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise WeightLoadError(f"quantization kind {self.kind!r} is not supported; expected "
                                  f"one of {KINDS}")
        rows, cols = self.block
        if not (isinstance(rows, int) and isinstance(cols, int) and rows >= 1 and cols >= 1):
            raise WeightLoadError(f"quantization block must be two positive ints, got "
                                  f"{self.block!r}")
        if self.offsets and self.kind == "fp8":
            raise WeightLoadError("fp8 weights take scales only, not offsets")
        if self.kind != "fp8" and rows != 1:
            raise WeightLoadError(f"{self.kind} scales are per group along K (block (1, G)), got "
                                  f"{self.block}")
        if self.kind == "int4" and cols % 2:
            raise WeightLoadError(f"int4 groups hold whole bytes (an even group size), got {cols}")

    @property
    def storage_dtype(self) -> torch.dtype:
        return STORAGE_DTYPES[self.kind]

    @property
    def bits(self) -> int:
        return 4 if self.kind == "int4" else 8

    def packed_cols(self, k: int) -> int:
        """Columns of the packed data for ``k`` logical columns."""
        return k // 2 if self.kind == "int4" else k

    def describe(self, shape: tuple[int, int] | None = None) -> str:
        """A short name, e.g. ``int4 g32 offsets`` or ``fp8 block 128x128``."""
        rows, cols = self.block
        if self.kind == "fp8":
            if shape is not None and self.block == tuple(shape):
                grain = "tensor"
            elif rows == 1 and shape is not None and cols == shape[1]:
                grain = "channel"
            else:
                grain = f"block {rows}x{cols}"
            return f"fp8 {grain}"
        grain = "channel" if shape is not None and cols == shape[1] else f"g{cols}"
        return f"{self.kind} {grain}" + (" offsets" if self.offsets else " sym")
