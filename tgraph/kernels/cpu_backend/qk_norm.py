"""``qk_norm_rope_cache_attention`` on the CPU: the per-head q and k RMSNorms into scratch made
at bind time, then the CPU's ``rope_cache_attention`` on them: the unfused ops' CPU kernels in
one step."""
from __future__ import annotations

import torch

from tgraph.kernels.cpu_backend.attention import bind_rope_cache_attention
from tgraph.kernels.cpu_backend.common import BoundKernel, Thunk, reference_thunk, returning
from tgraph.kernels.cpu_backend.core import bind_rms_norm
from tgraph.kernels.registry import KernelSpec
from tgraph.kernels.triton_backend.common import Outs
from tgraph.tuning import Tuning

__all__ = ["KERNELS", "bind_qk_norm_rope_cache_attention"]


def bind_qk_norm_rope_cache_attention(outs: Outs, q, k, v, q_weight, k_weight, cos, sin,
                                      k_cache, v_cache, slots_mapping, block_table, seq_len, *,
                                      eps, interleaved=False, scale=None, sliding_window=None,
                                      tuning: Tuning | None = None) -> Thunk:
    attrs = dict(interleaved=interleaved, scale=scale, sliding_window=sliding_window)
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        return reference_thunk("qk_norm_rope_cache_attention", outs, q, k, v, q_weight,
                               k_weight, cos, sin, k_cache, v_cache, slots_mapping, block_table,
                               seq_len, eps=eps, **attrs)
    q_n, k_n = torch.empty(q.shape, dtype=q.dtype), torch.empty(k.shape, dtype=k.dtype)
    norm_q = bind_rms_norm((q_n,), q, q_weight, eps=eps, tuning=tuning)
    norm_k = bind_rms_norm((k_n,), k, k_weight, eps=eps, tuning=tuning)
    attend = bind_rope_cache_attention(outs, q_n, k_n, v, cos, sin, k_cache, v_cache,
                                       slots_mapping, block_table, seq_len, tuning=tuning,
                                       **attrs)

    def run() -> None:
        norm_q()
        norm_k()
        attend()
    return returning(run, (outs[0], k_cache, v_cache))


KERNELS = (KernelSpec("qk_norm_rope_cache_attention",
                      BoundKernel(bind_qk_norm_rope_cache_attention), tuned=True),)
