"""The ``moe`` and ``moe_add_rms_norm`` wrappers: the decode kernels of
:mod:`tgraph.kernels.triton.moe` for a few tokens (each reads only its experts' weights), the
grouped GEMM of :mod:`tgraph.kernels.triton.moe_grouped` for more, both writing per-(token,
expert) shares that a combine (or the norm) adds; the op's reference where neither runs (CPU,
quantized experts the kernels cannot read packed)."""
from __future__ import annotations

import torch

from tgraph.kernels.registry import KernelSpec
from tgraph.kernels.triton_backend.common import Outs, interpreted, reference_into, rows
from tgraph.quant import is_quantized
from tgraph.tuning import Tuning

__all__ = ["KERNELS", "moe_add_rms_norm_into", "moe_into"]

_reference = reference_into("moe")
_fused_reference = reference_into("moe_add_rms_norm")


def _kernels_take(x: torch.Tensor, w13, w2) -> bool:
    from tgraph.kernels.triton.moe_tiles import packed_experts_ok

    if not (x.is_cuda or interpreted(x)):
        return False
    if is_quantized(w13) != is_quantized(w2):
        return False
    if is_quantized(w13):
        return packed_experts_ok(w13) and packed_experts_ok(w2)
    return w13.dtype == w2.dtype == x.dtype and w13.is_contiguous() and w2.is_contiguous()


def _per_token(x: torch.Tensor, tuning: Tuning) -> bool:
    """Whether a decode program per token adds its experts itself (no shares, no combine)."""
    return tuning.moe.split_max_tokens < x.shape[0] <= tuning.moe.decode_max_tokens


def _decode_tiles(w13, tuning: Tuning) -> dict[str, int]:
    """The decode kernels' tiles: quantized experts' or 16-bit experts' settings."""
    t = tuning.moe
    if is_quantized(w13):
        return {"block_n": t.block_n, "block_k": t.block_k}
    return {"block_n": t.dense_block_n, "block_k": t.dense_block_k}


def _per_token_moe(x: torch.Tensor, router_logits: torch.Tensor, w13, w2, out: torch.Tensor,
                   tuning: Tuning, top_k: int, renormalize: bool) -> None:
    from tgraph.kernels.triton.moe import moe_decode

    moe_decode(x, router_logits, w13, w2, out, top_k, renormalize, split=False,
               **_decode_tiles(w13, tuning))


def _shares(x: torch.Tensor, router_logits: torch.Tensor, w13, w2, tuning: Tuning, top_k: int,
            renormalize: bool) -> torch.Tensor:
    """The experts' fp32 weighted shares ``[T * top_k, H]``, before any combine."""
    t = tuning.moe
    if x.shape[0] <= t.decode_max_tokens:
        from tgraph.kernels.triton.moe import moe_decode_shares

        return moe_decode_shares(x, router_logits, w13, w2, top_k, renormalize,
                                 **_decode_tiles(w13, tuning))
    from tgraph.kernels.triton.moe_grouped import moe_grouped_shares

    return moe_grouped_shares(x, router_logits, w13, w2, top_k, renormalize,
                              block_m=t.grouped_block_m, block_n=t.grouped_block_n,
                              block_k=t.grouped_block_k, num_warps=t.grouped_num_warps,
                              num_stages=t.grouped_num_stages,
                              one_program_max_pairs=t.group_one_program_max_pairs,
                              tma_weights=t.grouped_tma_weights)


def moe_add_rms_norm_into(outs: Outs, x: torch.Tensor, router_logits: torch.Tensor, w13, w2,
                          residual: torch.Tensor, weight: torch.Tensor, *, tuning: Tuning,
                          top_k: int, renormalize: bool, eps: float):
    """``outs = add_rms_norm(moe(x, ...), residual, weight)`` with the experts' shares added in
    the norm's kernel (no combine launch), except where the decode kernels give each token's
    sum directly (a program per token, beyond ``MoeTuning.split_max_tokens``)."""
    if not _kernels_take(x, w13, w2) or weight.dtype != x.dtype:
        return _fused_reference(outs, x, router_logits, w13, w2, residual, weight, top_k=top_k,
                                renormalize=renormalize, eps=eps)
    from tgraph.kernels.triton.norms import add_parts_rms_norm, add_rms_norm

    x, router_logits, residual = rows(x), rows(router_logits), rows(residual)
    n = x.shape[1]
    normed, summed = outs[0].view(-1, n), outs[1].view(-1, n)
    if _per_token(x, tuning):
        moe_out = torch.empty_like(x)
        _per_token_moe(x, router_logits, w13, w2, moe_out, tuning, top_k, renormalize)
        add_rms_norm(moe_out, residual, weight, eps, normed, summed)
    else:
        shares = _shares(x, router_logits, w13, w2, tuning, top_k, renormalize)
        add_parts_rms_norm(shares, top_k, residual, weight, eps, normed, summed)
    return outs[0], outs[1]


def moe_into(outs: Outs, x: torch.Tensor, router_logits: torch.Tensor, w13, w2, *,
             tuning: Tuning, top_k: int, renormalize: bool) -> torch.Tensor:
    """``outs[0] = moe(x, router_logits, w13, w2)`` (see :mod:`tgraph.ir.ops.moe`)."""
    if not _kernels_take(x, w13, w2):
        return _reference(outs, x, router_logits, w13, w2, top_k=top_k,
                          renormalize=renormalize)
    from tgraph.kernels.triton.moe import combine_pairs

    x, router_logits = rows(x), rows(router_logits)
    if _per_token(x, tuning):
        _per_token_moe(x, router_logits, w13, w2, outs[0], tuning, top_k, renormalize)
    else:
        combine_pairs(_shares(x, router_logits, w13, w2, tuning, top_k, renormalize), outs[0],
                      top_k)
    return outs[0]


KERNELS = (KernelSpec("moe", moe_into, tuned=True),
           KernelSpec("moe_add_rms_norm", moe_add_rms_norm_into, tuned=True))
