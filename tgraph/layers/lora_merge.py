"""One LoRA adapter merged into its target linears' weights in place, and taken out exactly.

Merging ``W <- W + B A`` (the scaling folded into ``B``) makes the adapted model the base model:
its engines, captured graphs and kernels serve the adapter at no cost per step. Taking the
adapter out must give back the base weights bit for bit, which subtracting ``B A`` from the
rounded sum would not, so the first merge into a weight copies that weight to host memory
(pinned for a GPU weight) and every later merge or restore starts from that copy.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch

__all__ = ["MergedAdapter"]

# Rows of a weight merged at once: bounds the fp32 scratch (rows x in_features x 8 bytes).
_MERGE_ROWS = 2048


class MergedAdapter:
    """The base weights of the target linears an adapter was merged into (on the host).

    ``merge`` and ``restore`` take the weights to write by target key: the live tensors the
    engines read (a re-laid-out weight is a new view of the same values, so callers look them
    up at each call rather than keep them).
    """

    def __init__(self) -> None:
        self._base: dict[str, torch.Tensor] = {}

    @property
    def merged(self) -> bool:
        """Whether some weight holds a merged delta now."""
        return bool(self._base)

    @property
    def host_bytes(self) -> int:
        """Bytes of base weights kept on the host."""
        return sum(t.numel() * t.element_size() for t in self._base.values())

    def merge(self, weights: Mapping[str, torch.Tensor],
              deltas: Mapping[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Set each weight to its base plus ``b @ a`` (``deltas[key] = (a [r, K], b [N, r])``),
        summed in fp32 and rounded once to the weight's dtype.

        Raises:
            ValueError: a delta's shape does not match its weight's (nothing is written then).
        """
        for key, weight in weights.items():
            a, b = deltas[key]
            if a.dim() != 2 or b.dim() != 2 or b.shape[1] != a.shape[0] \
                    or (b.shape[0], a.shape[1]) != tuple(weight.shape):
                raise ValueError(f"LoRA merge: {key}: the delta B {list(b.shape)} @ A "
                                 f"{list(a.shape)} does not match the weight {list(weight.shape)}")
        for key, weight in weights.items():
            base = self._base.get(key)
            if base is None:
                base = torch.empty(weight.shape, dtype=weight.dtype, device="cpu",
                                   pin_memory=weight.is_cuda)
                base.copy_(weight)
                self._base[key] = base
            else:
                weight.copy_(base)
            _add_product(weight, *deltas[key])

    def restore(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Give every merged weight among ``weights`` its base bits back and forget them."""
        for key, weight in weights.items():
            base = self._base.pop(key, None)
            if base is not None:
                weight.copy_(base)


def _add_product(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``weight += b @ a`` in fp32, a block of rows at a time."""
    a32 = a.to(weight.device, torch.float32)
    for start in range(0, weight.shape[0], _MERGE_ROWS):
        rows = weight[start:start + _MERGE_ROWS]
        summed = torch.addmm(rows.float(), b[start:start + _MERGE_ROWS].to(a32.device,
                                                                             torch.float32), a32)
        rows.copy_(summed)
