"""Input checks shared by the Triton kernel wrappers (clear errors instead of bad launches)."""
from __future__ import annotations

import torch

from tgraph import envs

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_tensor(op: str, name: str, t: object, ndim: int,
                 dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES,
                 contiguous_last: bool = True) -> None:
    """``t`` must be a ``ndim``-D tensor of one of ``dtypes`` (with a unit-stride last dim)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{op}: {name}: expected a {ndim}-D tensor, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        if dtypes == FLOAT_DTYPES:
            raise ValueError(f"{op}: {name}: expected float32, float16 or bfloat16, got {t.dtype}")
        names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"{op}: {name}: expected dtype {names}, got {t.dtype}")
    if contiguous_last and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{op}: {name}: the last dim must be contiguous, got strides {t.stride()}")


def check_device(op: str, tensors: dict[str, torch.Tensor]) -> None:
    """All tensors on one device, and that device CUDA (or CPU under ``TRITON_INTERPRET=1``)."""
    devices = {t.device for t in tensors.values()}
    if len(devices) != 1:
        where = ", ".join(f"{k}: {t.device}" for k, t in tensors.items())
        raise ValueError(f"{op}: all tensors must be on one device, got {where}")
    device = devices.pop()
    interpreted = device.type == "cpu" and envs.TRITON_INTERPRET
    if device.type != "cuda" and not interpreted:
        raise ValueError(
            f"{op}: Triton kernels need CUDA tensors, got {device} "
            "(CPU works only under TRITON_INTERPRET=1)"
        )


def memory_overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the memory ``a`` spans (first to last element, strides included) intersects the
    memory ``b`` spans; an empty tensor spans nothing."""
    def span(t: torch.Tensor) -> tuple[int, int]:
        last = sum((n - 1) * st for n, st in zip(t.shape, t.stride()) if n > 0)
        return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()

    if a.numel() == 0 or b.numel() == 0:
        return False
    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1
