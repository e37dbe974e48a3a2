"""What the CPU kernels share: bound kernels and their thunks, row views, dtype checks.

A CPU kernel is written as its ``bind(outs, *inputs, **attrs)``: the checks, views and scratch
buffers that depend only on the arguments' shapes, dtypes and memory are made there, and the
returned thunk does the step's work and returns its results. :class:`BoundKernel` calls both at
once (the engine's calling convention, :mod:`tgraph.kernels.registry`) and keeps ``bind`` for
the engine's step programs (:mod:`tgraph.engine.program`), which bind every step of a binding
once and then run only the thunks. A thunk may read host values of its inputs (sequence
lengths, cache slots) when it runs, never when it is bound.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from tgraph.kernels.triton_backend.common import Outs, reference_into
from tgraph.tuning import Tuning

__all__ = ["F32", "BoundKernel", "Thunk", "as_rows", "fp32", "held_or_per_call",
           "reference_thunk", "returning", "serial"]

F32 = torch.float32
Thunk = Callable[[], Any]
_DEFAULT_TUNING = Tuning()


class BoundKernel:
    """A kernel (``kernel(outs, *inputs, **attrs)``) made of its ``bind``, which returns the
    thunk that does the work (see the module docstring)."""

    def __init__(self, bind: Callable[..., Thunk]) -> None:
        self.bind = bind
        self.__name__ = bind.__name__.removeprefix("bind_")

    def __call__(self, outs: Outs, *inputs: Any, **attrs: Any) -> Any:
        return self.bind(outs, *inputs, **attrs)()

    def __repr__(self) -> str:
        return f"<cpu kernel {self.__name__}>"


def reference_thunk(op: str, outs: Outs, *inputs: Any, **attrs: Any) -> Thunk:
    """The op's torch reference on these arguments, copied into the planned buffers."""
    return functools.partial(reference_into(op), outs, *inputs, **attrs)


def returning(run: Callable[[], Any], result: Any) -> Thunk:
    """A thunk that calls ``run`` and returns ``result`` (the step's planned buffers)."""
    def thunk() -> Any:
        run()
        return result
    return thunk


def held_or_per_call(bind: Callable[[], Thunk], scratch_bytes: int,
                     tuning: Tuning | None) -> Thunk:
    """``bind()``, whose thunk keeps the scratch it made, when that is at most
    ``CpuTuning.held_scratch_kb``; else a thunk that binds anew at each call, so that a large
    step (a prefill) holds no scratch between calls."""
    if scratch_bytes <= (tuning or _DEFAULT_TUNING).cpu.held_scratch_kb * 1024:
        return bind()
    return lambda: bind()()


def as_rows(t: torch.Tensor) -> torch.Tensor | None:
    """``[..., N]`` as a ``[M, N]`` view with a contiguous last dim, or ``None`` when no view
    is (a bound thunk must read the tensor's own memory, never a copy made at bind time)."""
    if t.stride(-1) != 1:
        return None
    if t.dim() == 2:
        return t
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError:
        return None


def fp32(*ts: torch.Tensor | None) -> bool:
    """Whether every tensor given (``None`` aside) is fp32."""
    for t in ts:
        if t is not None and t.dtype != F32:
            return False
    return True


def serial(run: Callable[[], Any]) -> Any:
    """``run()`` with torch's intra-op threads set to one on this thread (OpenMP's and MKL's
    thread counts are per calling thread), then set back."""
    threads = torch.get_num_threads()
    if threads == 1:
        return run()
    torch.set_num_threads(1)
    try:
        return run()
    finally:
        torch.set_num_threads(threads)
