"""Attention fusions.

- ``RopeCache``: rotary embedding followed by the write of k/v into the paged cache becomes one
  ``rope_cache`` kernel (rotate q and k, write rotated k and v at their slots_mapping).
- ``RopeAttention``: at decode (one query per sequence), ``rope_cache`` followed by the
  ``paged_attention`` that reads its outputs becomes ``rope_cache_attention``: the attention
  kernel rotates q and the new key itself, stores k/v, and one launch per layer is gone.
- ``QkNormAttention``: the per-head RMSNorms of q and k before it (Qwen3's q_norm / k_norm)
  move into that kernel too (``qk_norm_rope_cache_attention``): two launches fewer per layer.
"""
from __future__ import annotations

from tgraph.ir.network import Network
from tgraph.ir.node import Node
from tgraph.nn import functional as F
from tgraph.nn.network_manager import recording
from tgraph.passes.manager import Pass, rewrite_each
from tgraph.passes.pattern import Match, Pattern, PatternPass


def _check(m: Match) -> bool:
    q, k, v = m.bindings["q"], m.bindings["k"], m.bindings["v"]
    return all(t.dtype is not None and t.dtype.is_floating_point for t in (q, k, v))


def _make(interleaved: bool, keep_k: bool) -> Pattern:
    def pattern(q, k, v, cos, sin, k_cache, v_cache, slots_mapping):
        q_rot, k_rot = F.rope(q, k, cos, sin, interleaved=interleaved)
        kc, vc = F.reshape_and_cache(k_rot, v, k_cache, v_cache, slots_mapping)
        return (q_rot, kc, vc, k_rot) if keep_k else (q_rot, kc, vc)

    def replacement(q, k, v, cos, sin, k_cache, v_cache, slots_mapping):
        return F.record("rope_cache", [q, k, v, cos, sin, k_cache, v_cache, slots_mapping],
                        interleaved=interleaved, **({"keep_k": True} if keep_k else {}))

    name = f"rope_cache_{'interleaved' if interleaved else 'half'}{'_keep_k' if keep_k else ''}"
    return Pattern(name, pattern, replacement, extra_check=_check)


class RopeCache(PatternPass):
    """Rotary embedding + cache write -> ``rope_cache``. The patterns without the rotated k as
    an output come first; the ``keep_k`` ones then take the matches where something else (a
    prefill attention reading the new keys) still reads the rotated k."""

    def __init__(self) -> None:
        super().__init__("RopeCache", [_make(False, False), _make(True, False),
                                       _make(False, True), _make(True, True)])


class RopeAttention(Pass):
    """``rope_cache -> paged_attention`` (decode) becomes ``rope_cache_attention``.

    Only the decode form of attention (no ``query_start_loc``: one query per sequence, at the
    position whose key this step writes) and only when the rotated q feeds nothing else.
    """

    name = "RopeAttention"

    def run(self, net: Network) -> int:
        return rewrite_each(net, "paged_attention", self._fuse)

    @staticmethod
    def _fuse(net: Network, attn: Node) -> int:
        if len(attn.inputs) != 5 and not (len(attn.inputs) == 6 and attn.inputs[5] is None):
            return 0  # prefill: packed queries with query_start_loc
        q_rot, kc, vc, block_table, seq_len = attn.inputs[:5]
        rope = q_rot.producer
        if (rope is None or rope.op != "rope_cache" or q_rot.index != 0
                or kc is not rope.outputs[1] or vc is not rope.outputs[2]
                or net.users(q_rot) != [attn] or net.is_output(q_rot)):
            return 0
        with recording(net), net.inserting_before(attn):
            out, new_kc, new_vc = F.record(
                "rope_cache_attention", [*rope.inputs, block_table, seq_len],
                interleaved=rope.attrs.get("interleaved", False), scale=attn.attrs.get("scale"),
                sliding_window=attn.attrs.get("sliding_window"))
        net.replace_all_uses(attn.outputs[0], out)
        net.replace_all_uses(kc, new_kc)
        net.replace_all_uses(vc, new_vc)
        net.remove_nodes([attn, rope])
        return 1


class QkNormAttention(Pass):
    """``rms_norm(q)`` and ``rms_norm(k)`` (same epsilon, weights in the activations' dtype)
    read only by a ``rope_cache_attention`` become part of it:
    ``qk_norm_rope_cache_attention``."""

    name = "QkNormAttention"

    def run(self, net: Network) -> int:
        return rewrite_each(net, "rope_cache_attention", self._fuse)

    @staticmethod
    def _norm_of(net: Network, value, attn: Node) -> Node | None:
        norm = value.producer
        if (norm is None or norm.op != "rms_norm" or len(norm.inputs) != 2
                or norm.inputs[1] is None or net.users(value) != [attn]
                or net.is_output(value)):
            return None
        x, weight = norm.inputs
        ok = (x.dtype is not None and x.dtype == value.dtype == weight.dtype and weight.rank == 1)
        return norm if ok else None

    @classmethod
    def _fuse(cls, net: Network, attn: Node) -> int:
        q, k = attn.inputs[:2]
        q_norm, k_norm = cls._norm_of(net, q, attn), cls._norm_of(net, k, attn)
        if q_norm is None or k_norm is None or q_norm is k_norm \
                or q_norm.attrs["eps"] != k_norm.attrs["eps"]:
            return 0
        with recording(net), net.inserting_before(attn):
            out, new_kc, new_vc = F.record(
                "qk_norm_rope_cache_attention",
                [q_norm.inputs[0], k_norm.inputs[0], attn.inputs[2], q_norm.inputs[1],
                 k_norm.inputs[1], *attn.inputs[3:]],
                eps=q_norm.attrs["eps"], **attn.attrs)
        for old, new in zip(attn.outputs, (out, new_kc, new_vc)):
            net.replace_all_uses(old, new)
        net.remove_nodes([attn, q_norm, k_norm])
        return 1
