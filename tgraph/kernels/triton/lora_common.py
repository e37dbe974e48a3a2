"""What the multi-LoRA shrink kernels share (:mod:`tgraph.kernels.triton.lora`): the second
adapter set and its selection in a kernel, the argument checks, the width of the zero-column chunks.

Two adapter sets in one launch (stacked LoRA features, :class:`AdapterSet`). The operand may
hold a second set's columns after the first set's ``width``: ``[x | set 1 | set 2]``, each set
with its own slots, A, scale and layout, both shrinking the same ``x``. Each kernel runs the
second set as more programs of its grid (see :mod:`tgraph.kernels.triton.lora_tile` and
:mod:`tgraph.kernels.triton.lora_rows`); a program picks its set from its program id
(:func:`select_adapter_set`). A ``SECOND`` constexpr compiles the selection out of one-set
launches.

Tokens whose slot is outside ``[0, L)`` belong to no tile: their rows of ``xcat`` are left
unwritten (checking the values would need a host sync). Callers pass valid slots.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

__all__ = ["ZERO_CHUNK", "AdapterSet", "check_counters", "check_layout", "check_scaling",
           "check_segments", "check_slots", "check_tensor", "select_adapter_set"]

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_SLOT_DTYPES = (torch.int32, torch.int64)
# Width of the column chunks of zeros written beside the slot blocks.
ZERO_CHUNK = 64


class AdapterSet(NamedTuple):
    """A second stack of adapters in the same operand (stacked LoRA features): its LoRA columns
    follow the first set's ``width`` columns, laid out as the first set's are, with its own
    slots; every token gets both sets' shrinks of the same ``x``, in one launch.

    Attributes:
        lora_a: ``[L2, R2, K]`` in ``x``'s dtype.
        scaling: fp32 ``[L2]``.
        token_slots: int32/int64 ``[T]`` (0: no adapter of this set).
        counters: its own zeroed int32 arrival counters (``new_lora_counters``).
        lead: zero columns before its slot 1's block.
        segments: ``lora_segments(token_slots, L2)``, computed when omitted.
    """

    lora_a: torch.Tensor
    scaling: torch.Tensor
    token_slots: torch.Tensor
    counters: torch.Tensor
    lead: int = 0
    segments: tuple[torch.Tensor, torch.Tensor] | None = None


def check_tensor(fn: str, name: str, t: torch.Tensor, dims: int,
                 device: torch.device | None) -> None:
    """``t`` must be a ``dims``-D fp16/bf16/fp32 tensor (on ``device`` unless None) with a
    contiguous last dim; ``fn`` names the caller in the error."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != dims:
        raise ValueError(f"{fn}: {name} must be {dims}-D, got shape {list(t.shape)}")
    if t.dtype not in _SUPPORTED_DTYPES:
        raise TypeError(f"{fn}: {name} must be float16, bfloat16 or float32, got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{fn}: {name} is on {t.device}, expected {device}")
    if t.numel() > 0 and t.stride(-1) != 1:
        raise ValueError(f"{fn}: {name} must have a contiguous last dim, got strides {t.stride()}")


def check_slots(token_slots: torch.Tensor, T: int, device: torch.device) -> None:
    """``token_slots`` must be an int32/int64 ``[T]`` tensor on ``device``."""
    if not isinstance(token_slots, torch.Tensor) or token_slots.dtype not in _SLOT_DTYPES:
        raise TypeError(f"token_slots must be an int32 (or int64) tensor, got "
                        f"{getattr(token_slots, 'dtype', type(token_slots).__name__)}")
    if token_slots.dim() != 1 or token_slots.shape[0] != T:
        raise ValueError(f"token_slots must have shape [{T}], got {list(token_slots.shape)}")
    if token_slots.device != device:
        raise ValueError(f"token_slots is on {token_slots.device}, expected {device}")


def check_segments(segments: tuple[torch.Tensor, torch.Tensor], T: int, L: int,
                   device: torch.device) -> None:
    """``segments`` must be ``(order [T], seg_start [L + 1])`` on ``device``, as
    ``lora_segments`` returns them."""
    order, seg_start = segments
    if tuple(order.shape) != (T,) or tuple(seg_start.shape) != (L + 1,):
        raise ValueError(f"segments must be (order [{T}], seg_start [{L + 1}]) from lora_segments, "
                         f"got ({list(order.shape)}, {list(seg_start.shape)})")
    if order.device != device or seg_start.device != device:
        raise ValueError(f"segments must be on {device}")


def check_scaling(fn: str, scaling: torch.Tensor, L: int, device: torch.device) -> None:
    """``scaling`` must be a float32 ``[L]`` tensor on ``device``."""
    if not isinstance(scaling, torch.Tensor) or scaling.dtype != torch.float32:
        raise TypeError(f"{fn}: scaling must be a float32 tensor [{L}], got "
                        f"{getattr(scaling, 'dtype', type(scaling).__name__)}")
    if tuple(scaling.shape) != (L,) or scaling.device != device:
        raise ValueError(f"{fn}: scaling must have shape [{L}] on {device}, "
                         f"got {list(scaling.shape)} on {scaling.device}")


def check_counters(fn: str, counters: torch.Tensor, device: torch.device) -> None:
    """``counters`` must be a contiguous 1-D int32 tensor on ``device``
    (``new_lora_counters``)."""
    if (not isinstance(counters, torch.Tensor) or counters.dtype != torch.int32
            or counters.dim() != 1):
        raise TypeError(f"{fn}: counters must be a 1-D int32 tensor (new_lora_counters), got "
                        f"{getattr(counters, 'dtype', type(counters).__name__)}"
                        f"{list(getattr(counters, 'shape', []))}")
    if counters.device != device or (counters.numel() > 1 and counters.stride(0) != 1):
        raise ValueError(f"{fn}: counters must be contiguous on {device}, got {counters.device} "
                         f"strides {counters.stride()}")


def check_layout(fn: str, x: torch.Tensor, lora_a: torch.Tensor, scaling: torch.Tensor,
                 token_slots: torch.Tensor, out: torch.Tensor, lead: int, width: int | None,
                 second: AdapterSet | None) -> tuple[int, int]:
    """Check the operand's layout; returns ``(width, width2)``: the first set's LoRA columns and
    the second's (0 without one)."""
    T, K = x.shape
    device = x.device
    L, R = lora_a.shape[:2]
    check_tensor(fn, "out", out, 2, device)
    if out.dtype != x.dtype:
        raise TypeError(f"{fn}: out must be {x.dtype} (x's dtype), got {out.dtype}")
    if not isinstance(lead, int) or lead < 0:
        raise ValueError(f"{fn}: lead must be a non-negative int, got {lead!r}")
    need = K + lead + max(L - 1, 0) * R
    if out.shape[0] != T or out.shape[1] < need:
        raise ValueError(f"{fn}: out must be [{T}, >= {need}] (K {K} + lead {lead} + (L - 1) * R "
                         f"{max(L - 1, 0) * R}), got {list(out.shape)}")
    check_scaling(fn, scaling, L, device)
    check_slots(token_slots, T, device)
    if second is None:
        if width is not None and width != out.shape[1] - K:
            raise ValueError(f"{fn}: width {width} must be out's {out.shape[1] - K} columns after "
                             "x (without a second adapter set)")
        return out.shape[1] - K, 0
    if not isinstance(second, AdapterSet):
        raise TypeError(f"{fn}: second must be an AdapterSet, got {type(second).__name__}")
    if not isinstance(width, int) or width < need - K:
        raise ValueError(f"{fn}: with a second adapter set, width (the first set's columns) must "
                         f"be an int >= {need - K}, got {width!r}")
    a2 = second.lora_a
    check_tensor(fn, "second.lora_a", a2, 3, device)
    L2, R2, K2 = a2.shape
    if K2 != K or a2.dtype != x.dtype:
        raise ValueError(f"{fn}: second.lora_a must be {x.dtype} [L2, R2, {K}], got {a2.dtype} "
                         f"{list(a2.shape)}")
    if not isinstance(second.lead, int) or second.lead < 0:
        raise ValueError(f"{fn}: second.lead must be a non-negative int, got {second.lead!r}")
    need2 = K + width + second.lead + max(L2 - 1, 0) * R2
    if out.shape[1] < need2:
        raise ValueError(f"{fn}: out must have >= {need2} columns (K {K} + width {width} + "
                         f"second.lead {second.lead} + (L2 - 1) * R2 {max(L2 - 1, 0) * R2}), "
                         f"got {list(out.shape)}")
    check_scaling(fn, second.scaling, L2, device)
    check_slots(second.token_slots, T, device)
    check_counters(fn, second.counters, device)
    if second.segments is not None:
        check_segments(second.segments, T, L2, device)
    return width, out.shape[1] - K - width


@triton.jit
def select_adapter_set(second, K, a_ptr, scale_ptr, R, L, lead, width, stride_al, stride_ar,
                       a2_ptr, scale2_ptr, R2, L2, lead2, width2, stride_a2l, stride_a2r):
    """The adapter set a program runs: the second set's values where ``second``, else the
    first's.

    Returns:
        ``(a_ptr, scale_ptr, R, L, lead, col0, width, stride_al, stride_ar)`` of the set,
        ``col0`` its first column in the operand (after ``x``, the second's after the first's
        ``width``).
    """
    return (tl.where(second, a2_ptr, a_ptr), tl.where(second, scale2_ptr, scale_ptr),
            tl.where(second, R2, R), tl.where(second, L2, L), tl.where(second, lead2, lead),
            tl.where(second, K + width, K), tl.where(second, width2, width),
            tl.where(second, stride_a2l, stride_al), tl.where(second, stride_a2r, stride_ar))
