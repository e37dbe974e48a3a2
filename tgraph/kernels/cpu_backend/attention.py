"""CPU kernels of rope, the paged KV-cache write and paged attention (see
:mod:`tgraph.kernels.cpu_backend.common` for how a kernel binds once and runs as a thunk).

- Rope computes what the reference does, in its order (``x1 c - x2 s``, ``x2 c + x1 s``, each
  product rounded: the fp32 reference's bits), with the pairs as one dim of a view, so four torch
  calls rotate q and k together when they sit side by side in the q|k|v output.
- The new keys and values go into the cache with one ``index_copy_`` each.
- Decode attention: one sequence whose keys are one run of consecutive blocks reads them in
  place (one strided view) with torch's fused CPU attention; otherwise every sequence's keys are
  gathered (padded to the longest, the padding masked) for one fused call per layer. Prefill:
  torch SDPA when a sequence is one run without a cached prefix, else masked scores.
- What a step's thunks derive from its host-side inputs (cache rows, runs of blocks) is made by
  the first layer and reused by the others while those inputs' values are unchanged.
- ``rope_cache_attention`` on fp32 caches with int32 slots, tables and lengths runs as one call of
  the compiled kernel (:mod:`tgraph.kernels.cpu_backend.native`) when it loads and
  ``CpuTuning.native_kernels`` is on: the rope and the cache write as here (the reference's bits),
  the attention walking the block table in place with an online softmax.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from tgraph.kernels.cpu_backend.common import (
    F32,
    BoundKernel,
    Thunk,
    fp32,
    held_or_per_call,
    reference_thunk,
    returning,
    serial,
)
from tgraph.kernels.cpu_backend.native import library
from tgraph.kernels.triton_backend.common import Outs
from tgraph.tuning import Tuning

__all__ = ["paged_attention_into", "reshape_and_cache_into", "rope_cache_attention_into",
           "rope_cache_into", "rope_into"]

_DEFAULT_TUNING = Tuning()
_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default


# ---- rope -----------------------------------------------------------------------------------
def _bind_rotate(out: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 interleaved: bool) -> Thunk:
    """``out = rope(x)`` for fp32 ``x [tokens, heads, d]`` (``out`` may be ``x``)."""
    tokens, half = cos.shape
    rot = 2 * half
    tail = None
    if rot < x.shape[-1]:
        tail = (out[..., rot:], x[..., rot:])
        x, out = x[..., :rot], out[..., :rot]
    # (tokens, heads, 2, half), interleaved (tokens, heads, half, 2): x1 and x2 along `pair`
    if interleaved:
        split, pair = (half, 2), 3
        c, s = cos.unsqueeze(1).unsqueeze(-1), sin.unsqueeze(1).unsqueeze(-1)
    else:
        split, pair = (2, half), 2
        c, s = cos.unsqueeze(1).unsqueeze(1), sin.unsqueeze(1).unsqueeze(1)
    xp, op = x.unflatten(-1, split), out.unflatten(-1, split)
    xs = torch.empty(xp.shape, dtype=xp.dtype)  # (x1 s, x2 s), made before out is written
    o1, o2, xs1, xs2 = op.select(pair, 0), op.select(pair, 1), xs.select(pair, 0), \
        xs.select(pair, 1)

    def run() -> None:
        if tail is not None:
            tail[0].copy_(tail[1])
        torch.mul(xp, s, out=xs)
        torch.mul(xp, c, out=op)  # (x1 c, x2 c)
        o1.sub_(xs2)
        o2.add_(xs1)
    return run


def _joined(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """``[tokens, hq + hk, d]``, one view of ``q`` and ``k`` where ``k`` follows ``q`` in memory
    with the same strides (the split of a packed q|k|v output), else ``None``."""
    tokens, hq, d = q.shape
    if k.shape[0] != tokens or k.shape[2] != d or q.stride(1) != d or q.stride(2) != 1 \
            or k.stride(1) != d or k.stride(2) != 1 \
            or (tokens > 1 and q.stride(0) != k.stride(0)) \
            or k.data_ptr() != q.data_ptr() + hq * d * q.element_size():
        return None
    try:  # refused when k lies outside q's storage
        return q.as_strided((tokens, hq + k.shape[1], d), (q.stride(0), d, 1))
    except RuntimeError:
        return None


def _bind_rotated(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  interleaved: bool) -> tuple[Thunk, torch.Tensor, torch.Tensor]:
    """A thunk writing ``rope(q)``, ``rope(k)`` into the two parts of one new ``[tokens,
    hq + hk, d]`` scratch, and the parts (one pass when q and k sit side by side)."""
    hq = q.shape[1]
    qk_rot = torch.empty(q.shape[0], hq + k.shape[1], q.shape[2], dtype=q.dtype)
    q_rot, k_rot = qk_rot.narrow(1, 0, hq), qk_rot.narrow(1, hq, k.shape[1])
    qk = _joined(q, k)
    if qk is not None:
        return _bind_rotate(qk_rot, qk, cos, sin, interleaved), q_rot, k_rot
    rotate_q = _bind_rotate(q_rot, q, cos, sin, interleaved)
    rotate_k = _bind_rotate(k_rot, k, cos, sin, interleaved)

    def run() -> None:
        rotate_q()
        rotate_k()
    return run, q_rot, k_rot


def _rope_ok(q, k, cos, sin) -> bool:
    return fp32(q, k, cos, sin)


def _scratch_bytes(*ts: torch.Tensor) -> int:
    """At most the bytes of the scratch a rotation of these fp32 inputs makes (its products and
    the rotated rows)."""
    return 2 * sum(t.numel() for t in ts) * 4


def _bind_rope(outs: Outs, q, k, cos, sin, interleaved: bool) -> Thunk:
    rotate_q = _bind_rotate(outs[0], q, cos, sin, interleaved)
    rotate_k = _bind_rotate(outs[1], k, cos, sin, interleaved)

    def run() -> None:
        rotate_q()
        rotate_k()
    return returning(run, (outs[0], outs[1]))


def bind_rope(outs: Outs, q, k, cos, sin, *, interleaved=False,
              tuning: Tuning | None = None) -> Thunk:
    if not _rope_ok(q, k, cos, sin):
        return reference_thunk("rope", outs, q, k, cos, sin, interleaved=interleaved)
    return held_or_per_call(functools.partial(_bind_rope, outs, q, k, cos, sin, interleaved),
                            _scratch_bytes(q, k), tuning)


# ---- the cache write ------------------------------------------------------------------------
class _StepMemo:
    """One entry: what ``make`` derives from a step's host-side inputs (cache slots, sequence
    lengths, block tables), made by the step's first layer and reused by the others while the
    inputs' values, the key, are unchanged."""

    def __init__(self, make: Callable[[Any], Any]) -> None:
        self._make = make
        self._entry: tuple[Any, Any] = (None, None)

    def __call__(self, key: Any) -> Any:
        entry = self._entry  # read once: another engine's thread may replace it
        if entry[0] != key:
            entry = (key, self._make(key))
            self._entry = entry
        return entry[1]


def _slot_rows(slots: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The cache rows of ``slots`` and, when some are negative (padding), the rows kept."""
    if min(slots, default=0) >= 0:
        return torch.tensor(slots, dtype=torch.long), None
    keep = [i for i, s in enumerate(slots) if s >= 0]
    return (torch.tensor([slots[i] for i in keep], dtype=torch.long),
            torch.tensor(keep, dtype=torch.long))


_SLOT_ROWS = _StepMemo(_slot_rows)


def _cache_ok(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    return k_cache.is_contiguous() and v_cache.is_contiguous()


def _bind_store(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                slots_mapping: torch.Tensor) -> Thunk:
    """Rows ``k``/``v`` into the (contiguous) paged caches at ``slots_mapping``, negative slots
    skipped."""
    _, _, heads, d = k_cache.shape
    flat_k, flat_v = k_cache.view(-1, heads, d), v_cache.view(-1, heads, d)
    cast = k.dtype != k_cache.dtype or v.dtype != v_cache.dtype

    def run() -> None:
        rows, keep = _SLOT_ROWS(slots_mapping.tolist())
        kr, vr = (k, v) if keep is None else (k.index_select(0, keep), v.index_select(0, keep))
        if cast:
            kr, vr = kr.to(k_cache.dtype), vr.to(v_cache.dtype)
        flat_k.index_copy_(0, rows, kr)
        flat_v.index_copy_(0, rows, vr)
    return run


def bind_reshape_and_cache(outs: Outs, k, v, k_cache, v_cache, slots_mapping) -> Thunk:
    if not _cache_ok(k_cache, v_cache):
        return reference_thunk("reshape_and_cache", outs, k, v, k_cache, v_cache, slots_mapping)
    return returning(_bind_store(k_cache, v_cache, k, v, slots_mapping), (k_cache, v_cache))


def _bind_rope_cache(outs: Outs, q, k, v, cos, sin, k_cache, v_cache, slots_mapping,
                     interleaved: bool, keep_k: bool) -> Thunk:
    rotate_q = _bind_rotate(outs[0], q, cos, sin, interleaved)
    k_rot = outs[3] if keep_k else torch.empty_like(k)
    rotate_k = _bind_rotate(k_rot, k, cos, sin, interleaved)
    store = _bind_store(k_cache, v_cache, k_rot, v, slots_mapping)

    def run() -> None:
        rotate_q()
        rotate_k()
        store()
    return returning(run, (outs[0], k_cache, v_cache, k_rot) if keep_k
                     else (outs[0], k_cache, v_cache))


def bind_rope_cache(outs: Outs, q, k, v, cos, sin, k_cache, v_cache, slots_mapping, *,
                    interleaved=False, keep_k=False, tuning: Tuning | None = None) -> Thunk:
    if not (_rope_ok(q, k, cos, sin) and _cache_ok(k_cache, v_cache)):
        return reference_thunk("rope_cache", outs, q, k, v, cos, sin, k_cache, v_cache,
                               slots_mapping, interleaved=interleaved, keep_k=keep_k)
    return held_or_per_call(
        functools.partial(_bind_rope_cache, outs, q, k, v, cos, sin, k_cache, v_cache,
                          slots_mapping, interleaved, keep_k), _scratch_bytes(q, k, k), tuning)


# ---- attention ------------------------------------------------------------------------------
def _runs(blocks: list[int]) -> list[tuple[int, int]]:
    """``(first block, count)`` of each run of consecutive block ids."""
    out: list[tuple[int, int]] = []
    for b in blocks:
        if out and out[-1][0] + out[-1][1] == b:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((b, 1))
    return out


# One sequence of a step: its query rows [start, end), its keys, and where they lie in the
# cache as (first row, rows) per run of consecutive blocks (a cache row: block * size + offset).
_Seq = tuple[int, int, int, list[tuple[int, int]]]


class _Layout:
    """Where a step's sequences read their keys in the paged cache (the same for every layer).

    Attributes:
        seqs: each sequence with queries in the step.
        decode: one query per sequence, sequence ``b`` at row ``b``, every one with keys: the
            step can attend with one fused call over keys gathered per sequence.
    """

    def __init__(self, seqs: list[_Seq]) -> None:
        self.seqs = seqs
        self.decode = all(e - s == 1 and s == b and n_keys > 0
                          for b, (s, e, n_keys, _) in enumerate(seqs))
        self.keys = sum(seq[2] for seq in seqs)
        self._gathers: dict[int | None, tuple[torch.Tensor, torch.Tensor | None, int]] = {}

    def pieces(self, seq: _Seq, window: int | None) -> list[tuple[int, int]]:
        """The runs of ``seq``'s keys a query reads, after a sliding ``window``."""
        n_keys, pieces = seq[2], seq[3]
        if window is not None and window < n_keys:
            return _windowed(pieces, n_keys - window)
        return pieces

    def gather(self, window: int | None) -> tuple[torch.Tensor, torch.Tensor | None, int]:
        """For a decode step: the cache rows of every sequence's keys, each padded to the
        longest (``[sequences * width]``), the additive mask of the padding (``[sequences, 1,
        1, width]``, ``None`` without padding) and the width."""
        made = self._gathers.get(window)
        if made is None:
            per_seq = [[row for base, length in self.pieces(seq, window)
                        for row in range(base, base + length)] for seq in self.seqs]
            width = max(len(rows) for rows in per_seq)
            mask = None
            if any(len(rows) < width for rows in per_seq):
                mask = torch.zeros(len(per_seq), 1, 1, width)
                for b, rows in enumerate(per_seq):
                    mask[b, :, :, len(rows):] = float("-inf")
            index = torch.tensor([rows + [rows[0]] * (width - len(rows)) for rows in per_seq],
                                 dtype=torch.long).view(-1)
            made = self._gathers[window] = (index, mask, width)
        return made


def _layout(key: tuple[int, list[int], list[list[int]], list[int] | None]) -> _Layout:
    """The layout of a step from ``(block size, seq_len, block_table, query_start_loc)`` as
    lists (``None``: one query per sequence)."""
    block_size, lens, tables, starts = key
    if starts is None:
        starts = list(range(len(lens) + 1))
    seqs: list[_Seq] = []
    for b, n_keys in enumerate(lens):
        s, e = starts[b], starts[b + 1]
        if e == s:
            continue
        pieces, start = [], 0
        for first, count in _runs(tables[b][:-(-n_keys // block_size)] if n_keys > 0 else []):
            length = min(count * block_size, n_keys - start)
            pieces.append((first * block_size, length))
            start += length
        seqs.append((s, e, n_keys, pieces))
    return _Layout(seqs)


_LAYOUT = _StepMemo(_layout)


def _windowed(pieces: list[tuple[int, int]], drop: int) -> list[tuple[int, int]]:
    """``pieces`` without their first ``drop`` keys."""
    kept = []
    for base, length in pieces:
        if drop >= length:
            drop -= length
            continue
        kept.append((base + drop, length - drop))
        drop = 0
    return kept


def _decode(out: torch.Tensor, qg: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            pieces: list[tuple[int, int]], scale: float) -> None:
    """One query: ``out`` and ``qg`` ``[1, hk, group, d]`` (a kv head's query heads as its rows):
    torch's fused CPU attention on each run of cache rows, a strided view of the contiguous
    cache, the runs merged by their log-sum-exps."""
    _, _, hk, d = k_cache.shape
    row = hk * d
    k_at, v_at = k_cache.storage_offset(), v_cache.storage_offset()
    parts = []
    for base, length in pieces:
        shape, stride = (1, hk, length, d), (length * row, d, row, 1)
        parts.append(_FLASH(qg, k_cache.as_strided(shape, stride, k_at + base * row),
                            v_cache.as_strided(shape, stride, v_at + base * row), 0.0, False,
                            attn_mask=None, scale=scale))
    if len(parts) == 1:
        out.copy_(parts[0][0])
        return
    weights = torch.softmax(torch.stack([p[1] for p in parts]), dim=0)  # each run's share
    out.copy_((torch.stack([p[0] for p in parts]) * weights[..., None]).sum(0))


def _prefill(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             pieces: list[tuple[int, int]], n_keys: int, scale: float,
             sliding_window: int | None) -> None:
    """``out [n, hq, d]`` = causal attention of the last ``n`` of ``n_keys`` positions: one fused
    SDPA over a single run without a prefix, else masked scores over the runs."""
    n, hq, d = q.shape
    hk = k_cache.shape[2]
    group = hq // hk
    flat_k, flat_v = k_cache.view(-1, hk, d), v_cache.view(-1, hk, d)
    views = [(flat_k[base:base + length], flat_v[base:base + length]) for base, length in pieces]
    if len(views) == 1 and sliding_window is None and n == n_keys:
        kr, vr = views[0]
        ctx = torch.nn.functional.scaled_dot_product_attention(
            q.permute(1, 0, 2)[None], kr.permute(1, 0, 2)[None], vr.permute(1, 0, 2)[None],
            is_causal=True, scale=scale, enable_gqa=group > 1)
        out.copy_(ctx[0].permute(1, 0, 2))
        return
    # (hk, group * n, d): the query rows of one kv head together
    qg = q.reshape(n, hk, group, d).permute(1, 2, 0, 3).reshape(hk, group * n, d)
    scores = torch.cat([torch.matmul(qg, kr.permute(1, 2, 0)) for kr, _ in views], dim=-1) \
        if len(views) > 1 else torch.matmul(qg, views[0][0].permute(1, 2, 0))
    scores.mul_(scale)
    q_pos = torch.arange(n_keys - n, n_keys).repeat(group)[:, None]
    k_pos = torch.arange(n_keys)[None, :]
    mask = k_pos > q_pos
    if sliding_window is not None:
        mask |= q_pos - k_pos >= sliding_window
    scores.masked_fill_(mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    ctx = None
    start = 0
    for kr, vr in views:
        part = torch.matmul(probs[..., start:start + kr.shape[0]], vr.permute(1, 0, 2))
        ctx = part if ctx is None else ctx.add_(part)
        start += kr.shape[0]
    # (hk, group * n, d) -> (n, hk * group, d)
    out.copy_(ctx.view(hk, group, n, d).permute(2, 0, 1, 3).reshape(n, hq, d))


def _attention_ok(q, k_cache, v_cache) -> bool:
    return q.dtype == F32 and k_cache.dtype == F32 and v_cache.dtype == F32 \
        and q.shape[1] % k_cache.shape[2] == 0 and q.stride(2) == 1 \
        and q.stride(1) == q.shape[2] and _cache_ok(k_cache, v_cache)


def _bind_attention(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, block_table: torch.Tensor, seq_len: torch.Tensor,
                    query_start_loc: torch.Tensor | None, scale: float | None,
                    sliding_window: int | None, tuning: Tuning | None) -> Thunk:
    """``out [tokens, hq, d]`` = each sequence's queries attending to its cached keys. A decode
    step reads one sequence's keys in place when they are one run, else gathers every
    sequence's keys (padded to the longest, the padding masked) for one fused call; a small
    one runs on one thread (``CpuTuning.serial_attention_scores``)."""
    serial_keys = (tuning or _DEFAULT_TUNING).cpu.serial_attention_scores // q.shape[1]
    tokens, hq, d = q.shape
    block_size, hk = k_cache.shape[1], k_cache.shape[2]
    scale = d ** -0.5 if scale is None else scale
    # (tokens, hk, group, d): each kv head's query heads as its rows
    out4, q4 = out.view(tokens, hk, hq // hk, d), q.view(tokens, hk, hq // hk, d)
    flat_k, flat_v = k_cache.view(-1, hk, d), v_cache.view(-1, hk, d)

    def gathered(layout: _Layout) -> None:
        index, mask, width = layout.gather(sliding_window)
        k = flat_k.index_select(0, index).view(tokens, width, hk, d).permute(0, 2, 1, 3)
        v = flat_v.index_select(0, index).view(tokens, width, hk, d).permute(0, 2, 1, 3)
        out4.copy_(_FLASH(q4, k, v, 0.0, False, attn_mask=mask, scale=scale)[0])

    def run() -> None:
        layout = _LAYOUT((block_size, seq_len.tolist(), block_table.tolist(),
                          None if query_start_loc is None else query_start_loc.tolist()))
        seqs = layout.seqs
        if layout.decode and len(seqs) == tokens:
            pieces = layout.pieces(seqs[0], sliding_window) if tokens == 1 else None
            if pieces is not None and len(pieces) == 1:
                attend = functools.partial(_decode, out4, q4, k_cache, v_cache, pieces, scale)
            else:
                attend = functools.partial(gathered, layout)
            if layout.keys <= serial_keys:
                serial(attend)
            else:
                attend()
            return
        for seq in seqs:
            s, e, n_keys, _ = seq
            if n_keys == 0:
                out[s:e].zero_()
            elif e - s > 1:
                _prefill(out[s:e], q[s:e], k_cache, v_cache, seq[3], n_keys, scale,
                         sliding_window)
            else:
                _decode(out4[s:e], q4[s:e], k_cache, v_cache,
                        layout.pieces(seq, sliding_window), scale)
    return run


def bind_paged_attention(outs: Outs, q, k_cache, v_cache, block_table, seq_len,
                         query_start_loc=None, k_new=None, v_new=None, *, scale=None,
                         sliding_window=None, tuning: Tuning | None = None) -> Thunk:
    if not (_attention_ok(q, k_cache, v_cache) and outs[0].is_contiguous()):
        return reference_thunk("paged_attention", outs, q, k_cache, v_cache, block_table,
                               seq_len, query_start_loc, k_new, v_new, scale=scale,
                               sliding_window=sliding_window)
    return returning(_bind_attention(outs[0], q, k_cache, v_cache, block_table, seq_len,
                                     query_start_loc, scale, sliding_window, tuning), outs[0])


def _bind_rope_cache_attention(outs: Outs, q, k, v, cos, sin, k_cache, v_cache,
                               slots_mapping, block_table, seq_len, interleaved: bool,
                               scale: float | None, sliding_window: int | None,
                               tuning: Tuning | None) -> Thunk:
    rotate, q_rot, k_rot = _bind_rotated(q, k, cos, sin, interleaved)
    store = _bind_store(k_cache, v_cache, k_rot, v, slots_mapping)
    attend = _bind_attention(outs[0], q_rot, k_cache, v_cache, block_table, seq_len, None,
                             scale, sliding_window, tuning)

    def run() -> None:
        rotate()
        store()
        attend()
    return returning(run, (outs[0], k_cache, v_cache))


def bind_rope_cache_attention(outs: Outs, q, k, v, cos, sin, k_cache, v_cache, slots_mapping,
                              block_table, seq_len, *, interleaved=False, scale=None,
                              sliding_window=None, tuning: Tuning | None = None) -> Thunk:
    if not (_rope_ok(q, k, cos, sin) and _attention_ok(q, k_cache, v_cache)
            and outs[0].is_contiguous()):
        return reference_thunk("rope_cache_attention", outs, q, k, v, cos, sin, k_cache,
                               v_cache, slots_mapping, block_table, seq_len,
                               interleaved=interleaved, scale=scale,
                               sliding_window=sliding_window)
    cpu = (tuning or _DEFAULT_TUNING).cpu
    lib = library() if cpu.native_kernels else None
    if lib is not None:
        native = lib.bind_rope_cache_attention(
            outs[0], q, k, v, cos, sin, k_cache, v_cache, slots_mapping, block_table, seq_len,
            interleaved, scale, sliding_window, cpu.serial_attention_scores,
            torch.get_num_threads())
        if native is not None:
            return returning(native, (outs[0], k_cache, v_cache))
    return held_or_per_call(
        functools.partial(_bind_rope_cache_attention, outs, q, k, v, cos, sin, k_cache, v_cache,
                          slots_mapping, block_table, seq_len, interleaved, scale,
                          sliding_window, tuning), _scratch_bytes(q, k), tuning)


rope_into = BoundKernel(bind_rope)
reshape_and_cache_into = BoundKernel(bind_reshape_and_cache)
rope_cache_into = BoundKernel(bind_rope_cache)
paged_attention_into = BoundKernel(bind_paged_attention)
rope_cache_attention_into = BoundKernel(bind_rope_cache_attention)
