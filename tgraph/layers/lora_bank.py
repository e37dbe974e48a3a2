"""The weight of a LoRA target linear with its adapters' B columns beside it, in one storage.

A LoRA linear runs as one GEMM ``y = [x | xa] @ [W | B blocks].T`` (see ``tgraph.ir.ops.lora``).
Its weight operand must be one row-major matrix, so the adapters' B matrices live *beside* the
base weight: ``storage [N, K + C] = [W | region_0 | region_1 | ...]``, each LoRA feature that
adapts the linear owning one region of columns. The base linear's own weight becomes the view
``storage[:, :K]``, so the weight is held once: the base engine runs on that row-strided view
(cuBLAS and the small-M kernel take a row stride), and a feature's GEMM runs on the prefix
``storage[:, :K + end of its region]``, whose columns before its own region belong to other
features (the feature's shrink writes zeros there).

NOTE: a feature's region is written in place (loading or activating an adapter), so built
engines and captured graphs, which hold views of ``storage``, see new adapters without a rebuild.

A quantized base weight (:class:`~tgraph.quant.QuantizedWeight`) cannot share a dense storage:
its bank holds the B regions alone (``storage [N, C]``, the weight's logical dtype) and the
adapted linear runs two GEMMs, ``x @ W.T + xa @ B.T`` (the quantized one untouched).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from tgraph.errors import ConfigError
from tgraph.quant import is_quantized

__all__ = ["LoraWeightBank", "aligned_width", "attach_bank"]

# Regions are padded to a multiple of this many columns, so that the rows of the concatenated
# operand and weight stay 16-byte aligned for 16-bit dtypes (what tensor-core GEMMs want) when K is.
_ALIGN = 8


def aligned_width(columns: int) -> int:
    """``columns`` rounded up to the region alignment (8)."""
    return -(-columns // _ALIGN) * _ALIGN


def _spans(regions: Sequence[tuple[str, int]]) -> dict[str, tuple[int, int]]:
    spans, start = {}, 0
    for owner, columns in regions:
        spans[owner] = (start, start + columns)
        start += columns
    return spans


class LoraWeightBank:
    """One target linear's weight and its LoRA regions in one ``[N, K + C]`` storage.

    Creating the bank re-lays the linear's weight out: ``linear.weight.data`` becomes
    ``storage[:, :K]``. Engines built before hold the old tensor and must be rebound
    (``Engine.set_weights``) to drop it.

    Args:
        linear: a tgraph linear layer (``weight [N, K]``, loaded).
        regions: ``(owner, columns)`` per feature, in column order; every region starts zeroed.
    """

    def __init__(self, linear: Any, regions: Sequence[tuple[str, int]]) -> None:
        if getattr(linear, "num_parts", 1) > 1:
            raise ConfigError(f"LoRA: the target linear {linear!r} holds differently quantized "
                              "parts; adapters need one weight (quantize its parts alike)")
        weight = linear.weight.data
        if weight is None or weight.dim() != 2:
            raise ConfigError(f"LoRA: the target linear {linear!r} needs a loaded 2-D weight")
        self.quantized = is_quantized(weight)
        owners = [owner for owner, _ in regions]
        if len(set(owners)) != len(owners) or any(c < 0 for _, c in regions):
            raise ValueError(f"LoraWeightBank: regions must have distinct owners and non-negative "
                             f"widths, got {list(regions)}")
        out_features, self.in_features = weight.shape
        # owner -> (first, end) LoRA column, counted from column K
        self.regions: dict[str, tuple[int, int]] = _spans(regions)
        total = max((end for _, end in self.regions.values()), default=0)
        if self.quantized:  # B regions only: the base weight stays packed where it is
            self.base = 0
            self.storage = torch.zeros(out_features, total, dtype=weight.dtype,
                                       device=weight.device)
            return
        self.base = self.in_features
        self.storage = weight.new_zeros(out_features, self.in_features + total)
        self.storage[:, :self.in_features].copy_(weight)
        linear.weight.data = self.storage[:, :self.in_features]

    def _span(self, owner: str) -> tuple[int, int]:
        if owner not in self.regions:
            raise KeyError(f"LoraWeightBank: no region for {owner!r}; regions: "
                           f"{sorted(self.regions)}")
        return self.regions[owner]

    def lead(self, owner: str) -> int:
        """LoRA columns before ``owner``'s region (other features': zeros in its operand)."""
        return self._span(owner)[0]

    def width(self, owner: str) -> int:
        """LoRA columns of ``owner``'s GEMM: up to the end of its region."""
        return self._span(owner)[1]

    def region(self, owner: str) -> torch.Tensor:
        """``owner``'s columns ``[N, region width]``, a view written in place."""
        lo, hi = self._span(owner)
        return self.storage[:, self.base + lo:self.base + hi]

    def prefix(self, owner: str) -> torch.Tensor:
        """The weight of ``owner``'s GEMM: ``[W | regions up to owner's]``, a view (for a
        quantized base, the B regions alone: ``[regions up to owner's]``)."""
        return self.storage[:, :self.base + self.width(owner)]

    def shares_storage(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is a view of this bank's storage."""
        return t.untyped_storage().data_ptr() == self.storage.untyped_storage().data_ptr()


def attach_bank(linear: Any, regions: Sequence[tuple[str, int]]) -> tuple[LoraWeightBank, bool]:
    """The linear's bank, created (re-laying the weight out) unless it has one with ``regions``.

    Returns:
        ``(bank, created)``.

    Raises:
        ConfigError: the linear already has a bank with other regions (its layout is fixed once
            engines may hold views of it).
    """
    bank = linear.__dict__.get("lora_bank")
    if bank is not None:
        spans = _spans(regions)
        if spans != bank.regions:
            raise ConfigError(f"LoRA: linear {linear!r} already holds regions {bank.regions}, "
                              f"asked for {spans}")
        return bank, False
    bank = LoraWeightBank(linear, regions)
    object.__setattr__(linear, "lora_bank", bank)
    return bank, True
