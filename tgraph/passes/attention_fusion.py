"""``RopeCache``: rotary embedding followed by the write of k/v into the paged cache becomes one
``rope_cache`` kernel (rotate q and k, write rotated k and v at their slots)."""
from __future__ import annotations

from tgraph.nn import functional as F
from tgraph.passes.pattern import Match, Pattern, PatternPass


def _check(m: Match) -> bool:
    q, k, v = m.bindings["q"], m.bindings["k"], m.bindings["v"]
    return all(t.dtype is not None and t.dtype.is_floating_point for t in (q, k, v))


def _make(interleaved: bool) -> Pattern:
    def pattern(q, k, v, cos, sin, k_cache, v_cache, slots):
        q_rot, k_rot = F.rope(q, k, cos, sin, interleaved=interleaved)
        kc, vc = F.reshape_and_cache(k_rot, v, k_cache, v_cache, slots)
        return q_rot, kc, vc

    def replacement(q, k, v, cos, sin, k_cache, v_cache, slots):
        return F.record("rope_cache", [q, k, v, cos, sin, k_cache, v_cache, slots],
                        interleaved=interleaved)

    return Pattern(f"rope_cache_{'interleaved' if interleaved else 'half'}", pattern, replacement,
                   extra_check=_check)


class RopeCache(PatternPass):
    def __init__(self) -> None:
        super().__init__("RopeCache", [_make(False), _make(True)])
