"""What launch heuristics need to know about the device: its SM count."""
from __future__ import annotations

import functools

import torch

__all__ = ["DEFAULT_SM_COUNT", "sm_count"]

# SM count assumed when not running on CUDA (H100 SXM and H200 have 132), so that heuristics
# give the same launch shapes in CPU tests as on those GPUs.
DEFAULT_SM_COUNT = 132


@functools.cache
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device | str | None) -> int:
    """Streaming multiprocessors of ``device`` (:data:`DEFAULT_SM_COUNT` off CUDA).

    Args:
        device: a device, its name, or None (the CPU).

    Returns:
        The SM count.
    """
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type != "cuda":
        return DEFAULT_SM_COUNT
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())
