"""Mixture-of-experts: the routed experts of a sparse MLP block in one op.

``moe(x, router_logits, w13, w2, top_k, renormalize)``: every token's ``top_k`` experts by the
softmax of its router logits (computed in fp32; with ``renormalize`` the chosen probabilities
are scaled to sum to one, as Mixtral always and Qwen-MoE with ``norm_topk_prob`` do), each
expert a SwiGLU MLP ``w2[e] @ (silu(x @ g) * (x @ u))`` with ``w13[e] = [g; u]``, and the
token's output the probability-weighted sum of its experts' outputs.

The reference runs every expert on every token and weights the unrouted ones by zero: the work
of ``E / top_k`` dense MLPs, but no data-dependent shapes and no host synchronisation, so it
is the CPU kernel, the oracle, and a CUDA-graph-capturable fallback where no fused kernel
runs. Experts are added in index order in fp32, the order transformers' loop adds them in.
"""
from __future__ import annotations

import torch

from tgraph.ir.ops.registry import Meta, OpCategory, register_op, require, require_float
from tgraph.ir.shape import dims_conflict


def moe_infer(x: Meta, router_logits: Meta, w13: Meta, w2: Meta, *, top_k: int,
              renormalize: bool) -> Meta:
    require_float(x, "moe input")
    require(isinstance(top_k, int) and top_k >= 1, f"moe top_k must be a positive int, got "
                                                   f"{top_k!r}")
    if x.shape is None or router_logits.shape is None or w13.shape is None or w2.shape is None:
        return Meta(x.shape, x.dtype)
    require(len(x.shape) == 2, f"moe input must be [tokens, hidden], got {x}")
    require(len(router_logits.shape) == 2, f"router logits must be [tokens, experts], got "
                                           f"{router_logits}")
    require(len(w13.shape) == 3 and len(w2.shape) == 3,
            f"expert weights must be [experts, 2 * inter, hidden] and [experts, hidden, inter], "
            f"got {w13} and {w2}")
    experts, two_inter, hidden = w13.shape
    require(not dims_conflict(x.shape[1], hidden), f"moe input {x} does not match the experts' "
                                                   f"hidden size in {w13}")
    require(not dims_conflict(router_logits.shape[0], x.shape[0]),
            f"router logits {router_logits} and input {x} have different token counts")
    require(not dims_conflict(router_logits.shape[1], experts),
            f"router logits {router_logits} do not have one column per expert of {w13}")
    require(not dims_conflict(w2.shape[0], experts) and not dims_conflict(w2.shape[1], hidden),
            f"down weights {w2} do not match {w13}")
    if isinstance(two_inter, int) and isinstance(w2.shape[2], int):
        require(two_inter == 2 * w2.shape[2], f"gate|up weights {w13} are not twice the down "
                                              f"weights' intermediate size {w2}")
    if isinstance(experts, int):
        require(top_k <= experts, f"moe top_k {top_k} exceeds the {experts} experts")
    return Meta(x.shape, x.dtype)


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 routing weights ``[tokens, top_k]`` and expert ids of each token."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def moe_reference(x, router_logits, w13, w2, *, top_k, renormalize):
    weights, ids = route(router_logits, top_k, renormalize)
    inter = w2.shape[-1]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in range(w13.shape[0]):
        share = (weights * (ids == e)).sum(-1)  # 0 where the token did not pick expert e
        gate_up = x @ w13[e].to(x.dtype).T
        h = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        out += (h @ w2[e].to(x.dtype).T).float() * share[:, None]
    return out.to(x.dtype)


register_op("moe", infer=moe_infer, reference=moe_reference, category=OpCategory.FUSED,
            doc="routed SwiGLU experts: softmax top-k routing and the weighted sum")
