"""The ``moe`` wrapper: the decode kernels of :mod:`tgraph.kernels.triton.moe` for a few tokens
(each reads only its experts' weights), the op's reference for more."""
from __future__ import annotations

import torch

from tgraph.kernels.registry import KernelSpec
from tgraph.kernels.triton_backend.common import Outs, interpreted, reference_into, rows
from tgraph.quant import is_quantized
from tgraph.tuning import Tuning

__all__ = ["KERNELS", "moe_into"]

_reference = reference_into("moe")


def moe_into(outs: Outs, x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor,
             w2: torch.Tensor, *, tuning: Tuning, top_k: int, renormalize: bool) -> torch.Tensor:
    """``outs[0] = moe(x, router_logits, w13, w2)`` (see :mod:`tgraph.ir.ops.moe`)."""
    t = tuning.moe
    fast = (x.is_cuda or interpreted(x)) and x.shape[0] <= t.decode_max_tokens \
        and not is_quantized(w13) and w13.dtype == w2.dtype == x.dtype \
        and w13.is_contiguous() and w2.is_contiguous()
    if not fast:
        return _reference(outs, x, router_logits, w13, w2, top_k=top_k,
                          renormalize=renormalize)
    from tgraph.kernels.triton.moe import moe_decode

    moe_decode(rows(x), rows(router_logits), w13, w2, outs[0], top_k, renormalize,
               block_n=t.block_n, block_k=t.block_k)
    return outs[0]


KERNELS = (KernelSpec("moe", moe_into, tuned=True),)
