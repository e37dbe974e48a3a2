"""Programmatic dependent launch (PDL): let a kernel start while the one before it drains.

On Hopper and later, a kernel launched with the PDL attribute may be scheduled as soon as every
program of the previous kernel has signalled ``gdc_launch_dependents`` (or exited), instead of
after the previous kernel has completed. Inside a CUDA graph this removes most of the gap between
two dependent launches, which is what bounds a decode step made of ~150 short kernels.

The contract every PDL-launched kernel here keeps: before its first access to memory that an
earlier kernel may write or read (activations, outputs, workspaces) it calls ``gdc_wait``, which
blocks until the previous kernel has completed and its writes are visible. Before the wait a
kernel reads only memory that no other kernel of the step writes:

- model weights (the GEMV and the LoRA shrink prefetch their first weight tile);
- the step's inputs (sequence lengths, block table, slots, rope tables), which are copied in
  before the step's first kernel (a capture prologue, or stream-ordered copies);
- decode attention with the new key folded in reads its first K/V tile of its layer's cache:
  in that step only the attention kernel itself writes the cache (the new key's slot, which it
  never reads).

Because every PDL kernel waits for its predecessor, which waited for its own, any earlier kernel
is complete too. Kernels launched without PDL (cuBLAS, torch ops) keep ordinary stream order, so
mixing is safe.

``TGRAPH_PDL=0`` turns PDL off; it is also off under the Triton interpreter, before Hopper, and on
Triton builds without ``launch_pdl``.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from tgraph import envs

__all__ = ["pdl_kwargs", "pdl_enabled", "pdl_wait"]


@functools.cache
def _triton_supports_pdl() -> bool:
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    fields = getattr(CUDAOptions, "__dataclass_fields__", {})
    return "launch_pdl" in fields and hasattr(tl.extra.cuda, "gdc_wait")


@functools.cache
def _device_supports_pdl(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_enabled(t: torch.Tensor) -> bool:
    """Whether kernels working on ``t`` are launched with PDL."""
    if not t.is_cuda or not envs.TGRAPH_PDL:
        return False
    if envs.TRITON_INTERPRET:
        return False
    return _triton_supports_pdl() and _device_supports_pdl(t.device.index or 0)


def pdl_kwargs(t: torch.Tensor) -> dict:
    """Launch keyword arguments: ``PDL`` (the kernels' constexpr) and, when on, ``launch_pdl``."""
    if pdl_enabled(t):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """Wait for the previous kernel (its writes become visible), then let the next one launch."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
