"""``moe`` and ``moe_add_rms_norm`` on the CPU: the routed experts grouped by expert.

The op's reference (:func:`tgraph.ir.ops.moe.moe_reference`) finds each picked expert's tokens
with half a dozen small torch ops per expert, which cost more than the expert's two matmuls at
decode sizes. Here the pairs (token, choice) are sorted by expert once; the gathered token rows
then take one ``gate|up`` and one ``down`` matmul per picked expert, each written straight into
its slice of one buffer, with SwiGLU over all pairs at once and one weighted scatter-add. The
arithmetic is the reference's, step for step: the same rows in the same order per expert, the
same roundings to the activations' dtype, and each token's shares added in ascending expert
order, so the result equals the reference's.

This is what runs routed experts that a rule placed on the CPU (``device: cpu`` on
``mlp.experts``), and the experts of a model on the CPU.
"""
from __future__ import annotations

import torch

from tgraph.ir.ops.fused import add_rms_norm_reference
from tgraph.ir.ops.moe import expert_weights, route
from tgraph.kernels.cpu_backend.common import BoundKernel, Thunk, returning
from tgraph.kernels.registry import KernelSpec
from tgraph.kernels.triton_backend.common import Outs
from tgraph.tuning import Tuning

__all__ = ["KERNELS", "bind_moe", "bind_moe_add_rms_norm", "grouped_experts"]


def grouped_experts(x: torch.Tensor, router_logits: torch.Tensor, w13, w2, top_k: int,
                    renormalize: bool) -> torch.Tensor:
    """``moe(x, router_logits, w13, w2)`` in ``x``'s dtype, equal to the op's reference."""
    weights, ids = route(router_logits, top_k, renormalize)
    experts = router_logits.shape[1]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # by expert, pairs (so tokens) ascending inside
    counts = torch.bincount(flat, minlength=experts).tolist()
    tokens = order.div(top_k, rounding_mode="floor")
    xs = x.index_select(0, tokens)
    pairs, inter = xs.shape[0], _rows(w13, experts) // 2
    gate_up = torch.empty(pairs, 2 * inter, dtype=x.dtype)
    y = torch.empty(pairs, x.shape[1], dtype=x.dtype)
    picked = [(e, c) for e, c in enumerate(counts) if c]
    start = 0
    for e, c in picked:
        torch.mm(xs[start:start + c], expert_weights(w13, e, experts, x.dtype).T,
                 out=gate_up[start:start + c])
        start += c
    h = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    start = 0
    for e, c in picked:
        torch.mm(h[start:start + c], expert_weights(w2, e, experts, x.dtype).T,
                 out=y[start:start + c])
        start += c
    out = torch.zeros(x.shape, dtype=torch.float32)
    out.index_add_(0, tokens, y.float() * weights.reshape(-1)[order, None])
    return out.to(x.dtype)


def _rows(w, experts: int) -> int:
    """Rows of one expert of ``w`` (3-D dense experts, or flat quantized ones)."""
    return w.shape[1] if w.dim() == 3 else w.shape[0] // experts


def bind_moe(outs: Outs, x, router_logits, w13, w2, *, top_k, renormalize,
             tuning: Tuning | None = None) -> Thunk:
    out = outs[0]

    def run() -> None:
        out.copy_(grouped_experts(x, router_logits, w13, w2, top_k, renormalize))
    return returning(run, out)


def bind_moe_add_rms_norm(outs: Outs, x, router_logits, w13, w2, residual, weight, *, top_k,
                          renormalize, eps, tuning: Tuning | None = None) -> Thunk:
    def run() -> tuple:
        moe = grouped_experts(x, router_logits, w13, w2, top_k, renormalize)
        normed, summed = add_rms_norm_reference(moe, residual, weight, eps=eps)
        return tuple(_into(buf, r) for buf, r in zip(outs, (normed, summed)))
    return run


def _into(buf: torch.Tensor | None, r: torch.Tensor) -> torch.Tensor:
    if buf is None:
        return r
    buf.copy_(r)
    return buf


KERNELS = (KernelSpec("moe", BoundKernel(bind_moe), tuned=True),
           KernelSpec("moe_add_rms_norm", BoundKernel(bind_moe_add_rms_norm), tuned=True))
