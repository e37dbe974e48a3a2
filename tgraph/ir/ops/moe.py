"""Mixture-of-experts: the routed experts of a sparse MLP block in one op.

``moe(x, router_logits, w13, w2, top_k, renormalize)``: every token's ``top_k`` experts by the
softmax of its router logits (computed in fp32; with ``renormalize`` the chosen probabilities
are scaled to sum to one, as Mixtral always and Qwen-MoE with ``norm_topk_prob`` do), each
expert a SwiGLU MLP ``w2[e] @ (silu(x @ g) * (x @ u))`` with ``w13[e] = [g; u]``, and the
token's output the probability-weighted sum of its experts' outputs.

The experts come as ``w13 [E, 2I, H]`` and ``w2 [E, H, I]``, or quantized and held flat
(``[E * 2I, H]`` and ``[E * H, I]`` :class:`~tgraph.quant.QuantizedWeight` s, expert after
expert; the router's ``E`` columns count them).

The reference is the CPU kernel and the oracle: on the CPU it runs only the experts some token
picked, each on its own tokens (as transformers' loop does); on other devices it runs every
expert on every token and weights the unrouted ones by zero, the work of ``E / top_k`` dense
MLPs but with no data-dependent shapes and no host synchronisation, so it can be captured.
Experts are added in index order in fp32, the order transformers' loop adds them in.

``moe_add_rms_norm(x, router_logits, w13, w2, residual, weight, top_k, renormalize, eps)`` is
``add_rms_norm(moe(...), residual, weight)``, the block boundary after a sparse MLP (the
``MoeAddRmsNorm`` pass makes it): the experts' weighted shares are added inside the norm's
kernel instead of by a combine kernel of their own. Its reference is that composition.
"""
from __future__ import annotations

import torch

from tgraph.ir.ops.fused import add_rms_norm_infer, add_rms_norm_reference
from tgraph.ir.ops.registry import Meta, OpCategory, register_op, require, require_float
from tgraph.ir.shape import dims_conflict
from tgraph.quant import QuantizedWeight, is_quantized


def _expert_dims(router_logits: Meta, w13: Meta, w2: Meta) -> tuple:
    """``(experts, 2 * inter, hidden, w2's hidden, inter)`` of 3-D experts, or of quantized
    ones held flat (``[E * 2I, H]`` and ``[E * H, I]``, the experts counted by the router)."""
    if len(w13.shape) == 3 and len(w2.shape) == 3:
        return (*w13.shape, w2.shape[1], w2.shape[2])
    require(len(w13.shape) == 2 and len(w2.shape) == 2,
            f"expert weights must be [experts, 2 * inter, hidden] and [experts, hidden, inter] "
            f"(quantized: [experts * 2 * inter, hidden] and [experts * hidden, inter]), got "
            f"{w13} and {w2}")
    experts = router_logits.shape[1]
    if not all(isinstance(d, int) for d in (experts, *w13.shape, *w2.shape)):
        return experts, None, w13.shape[1], None, w2.shape[1]
    require(w13.shape[0] % experts == 0 and w2.shape[0] % experts == 0,
            f"flat expert weights {w13} and {w2} do not hold whole experts for the router's "
            f"{experts}")
    return experts, w13.shape[0] // experts, w13.shape[1], w2.shape[0] // experts, w2.shape[1]


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
    experts, two_inter, hidden, hidden2, inter = _expert_dims(router_logits, w13, w2)
    require(not dims_conflict(x.shape[1], hidden), f"moe input {x} does not match the experts' "
                                                   f"hidden size in {w13}")
    require(not dims_conflict(router_logits.shape[0], x.shape[0]),
            f"router logits {router_logits} and input {x} have different token counts")
    if len(w13.shape) == 3:
        require(not dims_conflict(router_logits.shape[1], experts),
                f"router logits {router_logits} do not have one column per expert of {w13}")
        require(not dims_conflict(w2.shape[0], experts), f"down weights {w2} do not match {w13}")
    require(not dims_conflict(hidden2, hidden), f"down weights {w2} do not match {w13}")
    if isinstance(two_inter, int) and isinstance(inter, int):
        require(two_inter == 2 * inter, f"gate|up weights {w13} are not twice the down "
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


def expert_weights(w: torch.Tensor | QuantizedWeight, e: int, experts: int,
                   dtype: torch.dtype) -> torch.Tensor:
    """Expert ``e``'s dense weight in ``dtype`` from 3-D experts or flat quantized ones (only
    that expert's rows are dequantized)."""
    if not is_quantized(w):
        return w[e].to(dtype)
    rows = w.shape[0] // experts
    return w.narrow(0, e * rows, rows).dequantize(dtype)


def moe_reference(x, router_logits, w13, w2, *, top_k, renormalize):
    weights, ids = route(router_logits, top_k, renormalize)
    experts = router_logits.shape[1]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    # Only the experts some token picked run, each on its tokens (the host synchronises once);
    # inside a CUDA graph capture, which cannot synchronise, every expert runs on every token,
    # weighted 0 where unpicked.
    sparse = not (x.is_cuda and torch.cuda.is_current_stream_capturing())
    chosen = ids.unique().tolist() if sparse else range(experts)
    for e in chosen:
        share = (weights * (ids == e)).sum(-1)  # 0 where the token did not pick expert e
        rows = (ids == e).any(-1).nonzero().squeeze(1) if sparse else None
        xs = x if rows is None else x.index_select(0, rows)
        gate_up = xs @ expert_weights(w13, e, experts, x.dtype).T
        inter = gate_up.shape[1] // 2
        h = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        y = (h @ expert_weights(w2, e, experts, x.dtype).T).float()
        if rows is None:
            out += y * share[:, None]
        else:
            out.index_add_(0, rows, y * share[rows, None])
    return out.to(x.dtype)


register_op("moe", infer=moe_infer, reference=moe_reference, category=OpCategory.FUSED,
            doc="routed SwiGLU experts: softmax top-k routing and the weighted sum")


def moe_add_rms_norm_infer(x: Meta, router_logits: Meta, w13: Meta, w2: Meta, residual: Meta,
                           weight: Meta, *, top_k: int, renormalize: bool, eps: float):
    out = moe_infer(x, router_logits, w13, w2, top_k=top_k, renormalize=renormalize)
    return add_rms_norm_infer(out, residual, weight, eps=eps)


def moe_add_rms_norm_reference(x, router_logits, w13, w2, residual, weight, *, top_k,
                               renormalize, eps):
    out = moe_reference(x, router_logits, w13, w2, top_k=top_k, renormalize=renormalize)
    return add_rms_norm_reference(out, residual, weight, eps=eps)


register_op("moe_add_rms_norm", infer=moe_add_rms_norm_infer,
            reference=moe_add_rms_norm_reference, category=OpCategory.FUSED,
            doc="add_rms_norm(moe(x, ...), residual, weight): the experts' combine in the norm")
