"""Helpers shared by the Triton backend's wrappers."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from tgraph import envs
from tgraph.ir.ops import get_op

__all__ = ["Outs", "interpreted", "last_contiguous", "reference_into", "results_into",
           "rows"]

Outs = Sequence[torch.Tensor | None]


def rows(t: torch.Tensor) -> torch.Tensor:
    """``[..., N]`` as ``[M, N]`` with a contiguous last dim (a view when possible)."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    if t.dim() == 2:
        return t
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError:
        return t.reshape(-1, t.shape[-1])


def last_contiguous(t: torch.Tensor) -> torch.Tensor:
    """``t`` with a contiguous last dim (itself when it has one)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def interpreted(t: torch.Tensor) -> bool:
    """Whether Triton kernels run on CPU tensor ``t`` (under the interpreter, as in CI)."""
    return not t.is_cuda and envs.TRITON_INTERPRET


def results_into(outs: Outs, results: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Each result copied into its planned buffer (a ``None`` buffer: the result itself)."""
    final = []
    for buf, r in zip(outs, results):
        if buf is None:
            final.append(r)
        else:
            buf.copy_(r)
            final.append(buf)
    return tuple(final)


def reference_into(op: str) -> Callable[..., Any]:
    """A kernel that runs ``op``'s torch reference and copies its results into the planned
    buffers (outputs that alias an input are returned as the reference gave them)."""
    reference = get_op(op).reference

    def kernel(outs: Outs, *args: Any, **attrs: Any) -> Any:
        result = reference(*args, **attrs)
        final = results_into(outs, result if isinstance(result, tuple) else (result,))
        return final if isinstance(result, tuple) else final[0]

    kernel.__name__ = f"ref_into_{op}"
    return kernel
