"""A quantized weight that stays quantized: packed data plus fp32 scales (and offsets).

A :class:`QuantizedWeight` stands where a dense ``[N, K]`` weight tensor would: it has the
logical ``shape`` and ``dtype`` (the model's compute dtype) a graph's weight value records, so
shape rules, passes and the engine treat it as any weight, while only its packed bytes are
resident. Reference kernels dequantize it per call (:func:`dense`); the Triton backend runs
quantized kernels on it. Tensor-parallel shards and packed q|k|v / gate|up weights are made with
:meth:`QuantizedWeight.narrow` and :meth:`QuantizedWeight.cat` without ever dequantizing.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from tgraph.errors import WeightLoadError
from tgraph.quant.scheme import QuantScheme

__all__ = ["QuantizedWeight", "dense", "is_quantized", "unpack_int4"]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """``uint8 [..., K/2]`` -> ``uint8 [..., K]``: the low nibble holds the even column."""
    out = torch.empty(*packed.shape[:-1], packed.shape[-1] * 2, dtype=torch.uint8,
                      device=packed.device)
    torch.bitwise_and(packed, 0x0F, out=out[..., 0::2])
    torch.bitwise_right_shift(packed, 4, out=out[..., 1::2])
    return out


class QuantizedWeight:
    """A logical ``[N, K]`` weight held as packed data and fp32 scales (see :class:`QuantScheme`).

    Args:
        scheme: the layout.
        qdata: ``uint8 [N, K/2]`` (int4), ``int8 [N, K]`` or ``float8_e4m3fn [N, K]``.
        scale: fp32 ``[ceil(N / rows), ceil(K / cols)]`` for ``scheme.block == (rows, cols)``.
        offset: fp32, the scale's shape, when ``scheme.offsets``.
        dtype: the logical (compute) dtype the weight stands for.
        name: the checkpoint name, for error messages.
        perm: optional int64 ``[K]``: stored column ``j`` holds logical column ``perm[j]``
            (GPTQ's act-order groups, made contiguous); kernels read ``x[:, perm]``.

    Raises:
        WeightLoadError: a part has the wrong dtype or shape, or the group does not divide K.
    """

    __slots__ = ("scheme", "qdata", "scale", "offset", "shape", "dtype", "name", "perm")

    def __init__(self, scheme: QuantScheme, qdata: torch.Tensor, scale: torch.Tensor,
                 offset: torch.Tensor | None = None, dtype: torch.dtype = torch.float32,
                 name: str = "weight", perm: torch.Tensor | None = None) -> None:
        self.scheme, self.qdata, self.scale, self.offset = scheme, qdata, scale, offset
        self.dtype, self.name, self.perm = dtype, name, perm
        if not isinstance(qdata, torch.Tensor) or qdata.dim() != 2:
            raise WeightLoadError(f"{name}: quantized data must be a 2-D tensor, got "
                                  f"{getattr(qdata, 'shape', type(qdata).__name__)}")
        if qdata.dtype != scheme.storage_dtype:
            raise WeightLoadError(f"{name}: {scheme.kind} data must be {scheme.storage_dtype}, "
                                  f"got {qdata.dtype}")
        n = qdata.shape[0]
        k = qdata.shape[1] * 2 if scheme.kind == "int4" else qdata.shape[1]
        self.shape = (n, k)
        rows, cols = scheme.block
        if scheme.kind != "fp8" and k % cols:
            raise WeightLoadError(f"{name}: group size {cols} does not divide K={k}")
        want = (_cdiv(n, rows), _cdiv(k, cols))
        for label, t in (("scale", scale), ("offset", offset)):
            if t is None:
                continue
            if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 \
                    or tuple(t.shape) != want:
                raise WeightLoadError(
                    f"{name}: {label} must be float32 {list(want)} for a {list(self.shape)} "
                    f"weight with {scheme.describe(self.shape)} scales, got "
                    f"{getattr(t, 'dtype', type(t).__name__)} {list(getattr(t, 'shape', []))}")
            if t.device != qdata.device:
                raise WeightLoadError(f"{name}: {label} is on {t.device}, data on "
                                      f"{qdata.device}")
        if scheme.offsets != (offset is not None):
            raise WeightLoadError(f"{name}: scheme {scheme.describe(self.shape)} "
                                  f"{'needs' if scheme.offsets else 'takes no'} offsets")
        if perm is not None and (not isinstance(perm, torch.Tensor) or perm.dtype != torch.int64
                                 or tuple(perm.shape) != (k,) or perm.device != qdata.device):
            raise WeightLoadError(f"{name}: perm must be int64 [{k}] on {qdata.device}, got "
                                  f"{getattr(perm, 'dtype', type(perm).__name__)} "
                                  f"{list(getattr(perm, 'shape', []))}")

    # ---- what a weight tensor answers ------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.qdata.device

    @property
    def is_cuda(self) -> bool:
        return self.qdata.is_cuda

    @property
    def ndim(self) -> int:
        return 2

    def dim(self) -> int:
        return 2

    @property
    def nbytes(self) -> int:
        """Resident bytes: data, scales and offsets."""
        parts = [t for t in (self.qdata, self.scale, self.offset, self.perm) if t is not None]
        return sum(t.numel() * t.element_size() for t in parts)

    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    def is_floating_point(self) -> bool:
        return True  # it stands for a floating-point weight

    def to(self, device: torch.device | str | None = None,
           dtype: torch.dtype | None = None) -> QuantizedWeight:
        """The weight on ``device`` and/or standing for ``dtype`` (the packed data is unchanged)."""
        if isinstance(device, torch.dtype):
            device, dtype = None, device
        move = (lambda t: t) if device is None else (lambda t: t.to(device))
        return QuantizedWeight(self.scheme, move(self.qdata), move(self.scale),
                               None if self.offset is None else move(self.offset),
                               dtype or self.dtype, self.name,
                               None if self.perm is None else move(self.perm))

    def contiguous(self) -> QuantizedWeight:
        return self

    def __repr__(self) -> str:
        return (f"QuantizedWeight({self.name}: {str(self.dtype).replace('torch.', '')}"
                f"{list(self.shape)} as {self.scheme.describe(self.shape)}, {self.nbytes} B on "
                f"{self.device})")

    # ---- values ---------------------------------------------------------------------------
    def _expand(self, t: torch.Tensor, rows: slice | torch.Tensor | None = None) -> torch.Tensor:
        """Per-block ``t`` broadcast to one value per weight (of the selected rows)."""
        r, c = self.scheme.block
        n, k = self.shape
        full = t.repeat_interleave(r, dim=0)[:n] if r > 1 else t
        if rows is not None:
            full = full[rows]
        return full.repeat_interleave(c, dim=1)[:, :k]

    def _codes(self, rows: slice | torch.Tensor | None = None) -> torch.Tensor:
        q = self.qdata if rows is None else self.qdata[rows]
        if self.scheme.kind == "int4":
            q = unpack_int4(q)
        return q.to(torch.float32)

    def _values(self, rows: slice | torch.Tensor | None = None) -> torch.Tensor:
        q = self._codes(rows)
        r, c = self.scheme.block
        n, k = q.shape
        if r == 1 and k % c == 0:
            # Groups along K: broadcast one scale (offset) per group, no expanded copies.
            q = q.view(n, k // c, c)
            s = (self.scale if rows is None else self.scale[rows])[..., None]
            b = None if self.offset is None else \
                (self.offset if rows is None else self.offset[rows])[..., None]
        else:
            s = self._expand(self.scale, rows)
            b = None if self.offset is None else self._expand(self.offset, rows)
        if b is not None:
            values = s * q + b
        elif self.scheme.kind == "int4":
            values = s * (q - 8.0)
        else:
            values = q * s if self.scheme.kind == "fp8" else s * q
        values = values.reshape(n, k)
        if self.perm is not None:  # stored columns back to their logical places
            logical = torch.empty_like(values)
            logical[:, self.perm] = values
            return logical
        return values

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The dense ``[N, K]`` weight (computed in fp32, then cast to ``dtype``)."""
        return self._values().to(dtype or self.dtype)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Dense rows ``ids`` (an embedding lookup): only those rows are dequantized."""
        if self.scheme.block[0] != 1:
            return self.dequantize(dtype)[ids]
        flat = ids.reshape(-1).long()
        out = self._values(flat).to(dtype or self.dtype)
        return out.reshape(*ids.shape, self.shape[1])

    # ---- shards and packing ----------------------------------------------------------------
    def narrow(self, dim: int, start: int, length: int) -> QuantizedWeight:
        """Rows (``dim=0``) or columns (``dim=1``) ``start .. start + length`` without
        dequantizing; the cut must fall on scale blocks (a block that spans the whole dim, one
        scale per tensor or per channel, takes any cut) and on whole bytes for int4.

        Raises:
            WeightLoadError: the cut splits a scale block (or an int4 byte), or takes columns of
                a weight whose columns are permuted.
        """
        dim %= 2
        if start == 0 and length == self.shape[dim]:
            return self  # the whole weight (a shard of one rank)
        if dim == 1 and self.perm is not None:
            raise WeightLoadError(f"{self.name}: its input columns are permuted (GPTQ act-order):"
                                  " a row-parallel shard of K is not supported")
        size = self.shape[dim]
        unit = self.scheme.block[dim]
        end = start + length
        whole = unit >= size  # one block along this dim: every cut keeps its scale
        odd_int4 = dim == 1 and self.scheme.kind == "int4" and (start % 2 or length % 2)
        if not 0 <= start < end <= size or odd_int4 or (
                not whole and (start % unit or (end % unit and end != size))):
            raise WeightLoadError(
                f"{self.name}: cannot take {'rows' if dim == 0 else 'columns'} {start}..{end} of "
                f"a {list(self.shape)} weight quantized as {self.scheme.describe(self.shape)}: "
                f"tensor-parallel shards must fall on its {unit}-wide scale blocks"
                + (" and whole bytes" if self.scheme.kind == "int4" else ""))
        blocks = slice(0, 1) if whole else slice(start // unit, _cdiv(end, unit))
        block = list(self.scheme.block)
        if whole:
            block[dim] = length
        if dim == 0:
            q, pick = self.qdata[start:end], (blocks, slice(None))
        else:
            pack = 2 if self.scheme.kind == "int4" else 1
            q, pick = self.qdata[:, start // pack:end // pack], (slice(None), blocks)
        scheme = QuantScheme(self.scheme.kind, (block[0], block[1]), self.scheme.offsets)
        return QuantizedWeight(scheme, q.contiguous(), self.scale[pick].contiguous(),
                               None if self.offset is None else self.offset[pick].contiguous(),
                               self.dtype, self.name, self.perm)

    @staticmethod
    def cat(parts: Sequence[QuantizedWeight], name: str | None = None) -> QuantizedWeight:
        """Rows of several weights stacked (packed q|k|v, gate|up) when their schemes agree;
        fp8 per-tensor scales become per-channel ones (exactly) to stack.

        Raises:
            WeightLoadError: the schemes differ, or the parts have different K.
        """
        parts = [p._as_channel_fp8() for p in parts]
        first = parts[0]
        names = "+".join(p.name for p in parts)
        for p in parts[1:]:
            if p.scheme != first.scheme or p.shape[1] != first.shape[1] \
                    or not _same_perm(p.perm, first.perm):
                raise WeightLoadError(
                    f"cannot pack {names}: {first.name} is {first.scheme.describe(first.shape)} "
                    f"{list(first.shape)} but {p.name} is {p.scheme.describe(p.shape)} "
                    f"{list(p.shape)}")
        rows = first.scheme.block[0]
        if rows > 1 and any(p.shape[0] % rows for p in parts[:-1]):
            raise WeightLoadError(f"cannot pack {names}: row blocks of {rows} would straddle parts")
        offset = None if first.offset is None else torch.cat([p.offset for p in parts])
        return QuantizedWeight(first.scheme, torch.cat([p.qdata for p in parts]),
                               torch.cat([p.scale for p in parts]), offset, first.dtype,
                               name or names, first.perm)

    def _as_channel_fp8(self) -> QuantizedWeight:
        if self.scheme.kind != "fp8" or self.scheme.block != self.shape or self.shape[0] == 1:
            return self
        n, k = self.shape
        return QuantizedWeight(QuantScheme("fp8", (1, k)), self.qdata, self.scale.expand(n, 1)
                               .contiguous(), None, self.dtype, self.name)

    @staticmethod
    def stackable(parts: Sequence[Any]) -> bool:
        """Whether :meth:`cat` stacks ``parts`` (quantized alike, row blocks not straddling)."""
        if not parts or not all(isinstance(p, QuantizedWeight) for p in parts):
            return False
        if not all(parts[0].mergeable_with(p) for p in parts[1:]):
            return False
        rows = parts[0]._as_channel_fp8().scheme.block[0]
        return rows == 1 or all(p.shape[0] % rows == 0 for p in parts[:-1])

    def mergeable_with(self, other: Any) -> bool:
        """Whether this weight and ``other`` are quantized alike (same scheme, K and column
        permutation); :meth:`stackable` says whether a list of them stacks."""
        if not isinstance(other, QuantizedWeight) or other.shape[1] != self.shape[1] \
                or not _same_perm(self.perm, other.perm):
            return False
        return self._as_channel_fp8().scheme == other._as_channel_fp8().scheme


def _same_perm(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is b
    if a is b:
        return True
    if a.device.type == "meta" or b.device.type == "meta":  # no values to compare
        return False
    return bool(torch.equal(a, b))


def is_quantized(data: Any) -> bool:
    """Whether a weight's data is a :class:`QuantizedWeight`."""
    return isinstance(data, QuantizedWeight)


def dense(w: Any, dtype: torch.dtype | None = None) -> Any:
    """``w`` as a dense tensor: a quantized weight dequantized (to ``dtype``, default its own
    logical dtype), anything else unchanged."""
    return w.dequantize(dtype) if isinstance(w, QuantizedWeight) else w
