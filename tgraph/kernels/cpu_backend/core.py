"""CPU kernels of the core ops, each writing into the buffers the engine planned in its arena.

Calling convention (see :mod:`tgraph.kernels.registry`): ``kernel(outs, *inputs, **attrs)``.
Every kernel computes as the op's torch reference does, in the same order and dtype where that
is free (fp32 norms, rope and SwiGLU give the reference's bits); GEMMs and attention differ only
by summation order. Inputs the kernels do not take (other dtypes, transposed operands) go to the
reference, copied into the planned buffer.
"""
from __future__ import annotations

from typing import Any

import torch

from tgraph.ir.ops.fused import EPILOGUE_ACTIVATIONS
from tgraph.kernels.cpu_backend.quant import packed_linear
from tgraph.kernels.registry import KernelSpec
from tgraph.kernels.triton_backend.common import Outs, reference_into, rows
from tgraph.quant import is_quantized
from tgraph.tuning import Tuning

__all__ = ["KERNELS", "matmul_into"]

_F32 = torch.float32
_DEFAULT_TUNING = Tuning()


def _rms_into(out2: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor | None,
              eps: float) -> None:
    """``out2 = weight * (x2 * rsqrt(mean(x2^2) + eps))``, fp32, the reference's operation order."""
    r = x2.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()
    torch.mul(x2, r, out=out2)
    if weight is not None:
        out2.mul_(weight)


def _fp32(*ts: Any) -> bool:
    return all(t is None or t.dtype == _F32 for t in ts)


def rms_norm_into(outs: Outs, x, weight=None, *, eps):
    if not _fp32(x, weight):
        return reference_into("rms_norm")(outs, x, weight, eps=eps)
    _rms_into(outs[0].view(-1, x.shape[-1]), rows(x), weight, eps)
    return outs[0]


def add_rms_norm_into(outs: Outs, x, residual, weight, *, eps):
    if not _fp32(x, residual, weight) or residual.shape != x.shape:
        return reference_into("add_rms_norm")(outs, x, residual, weight, eps=eps)
    torch.add(x, residual, out=outs[1])
    n = x.shape[-1]
    _rms_into(outs[0].view(-1, n), outs[1].view(-1, n), weight, eps)
    return outs[0], outs[1]


def _swiglu(out2: torch.Tensor, gate_up2: torch.Tensor) -> None:
    half = gate_up2.shape[-1] // 2
    torch.ops.aten.silu.out(gate_up2[:, :half], out=out2)
    out2.mul_(gate_up2[:, half:])


def swiglu_into(outs: Outs, gate_up):
    if gate_up.dtype != _F32:
        return reference_into("swiglu")(outs, gate_up)
    _swiglu(outs[0].view(-1, outs[0].shape[-1]), rows(gate_up))
    return outs[0]


def embedding_into(outs: Outs, ids, weight):
    if is_quantized(weight):  # the looked-up rows only, dequantized
        outs[0].copy_(weight.rows(ids))
        return outs[0]
    torch.index_select(weight, 0, ids.reshape(-1), out=outs[0].view(-1, weight.shape[1]))
    return outs[0]


def _rotate_into(out: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 interleaved: bool) -> None:
    """``out = rope(x)`` for fp32 ``x [tokens, heads, d]``, as the reference computes it."""
    half = cos.shape[-1]
    rot = 2 * half
    c, s = cos[:, None, :], sin[:, None, :]
    if interleaved:
        x1, x2 = x[..., 0:rot:2], x[..., 1:rot:2]
        o1, o2 = out[..., 0:rot:2], out[..., 1:rot:2]
    else:
        x1, x2 = x[..., :half], x[..., half:rot]
        o1, o2 = out[..., :half], out[..., half:rot]
    torch.mul(x1, c, out=o1)
    o1.sub_(x2 * s)
    torch.mul(x2, c, out=o2)
    o2.add_(x1 * s)
    if rot < x.shape[-1]:
        out[..., rot:].copy_(x[..., rot:])


def _joined(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """``[tokens, hq + hk, d]``, one view of ``q`` and ``k`` where ``k`` follows ``q`` in memory
    with the same strides (the split of a packed q|k|v output), else ``None``."""
    if q.stride() != k.stride() or q.stride(1) != q.shape[2] or q.stride(2) != 1 \
            or k.data_ptr() != q.data_ptr() + q.shape[1] * q.shape[2] * q.element_size() \
            or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        return None
    return q.as_strided((q.shape[0], q.shape[1] + k.shape[1], q.shape[2]), q.stride())


def _rope_ok(q, k, cos, sin) -> bool:
    return _fp32(q, k, cos, sin)


def _store(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           slots_mapping: torch.Tensor) -> None:
    """Rows ``k``/``v`` into the paged caches at ``slots_mapping`` (negative slots skipped)."""
    flat_k = k_cache.view(-1, *k_cache.shape[2:])
    flat_v = v_cache.view(-1, *v_cache.shape[2:])
    slots = slots_mapping.long()
    if bool((slots < 0).any()):
        keep = slots >= 0
        slots, k, v = slots[keep], k[keep], v[keep]
    flat_k.index_copy_(0, slots, k.to(k_cache.dtype))
    flat_v.index_copy_(0, slots, v.to(v_cache.dtype))


def rope_cache_into(outs: Outs, q, k, v, cos, sin, k_cache, v_cache, slots_mapping, *,
                    interleaved=False, keep_k=False):
    if not _rope_ok(q, k, cos, sin):
        return reference_into("rope_cache")(outs, q, k, v, cos, sin, k_cache, v_cache,
                                            slots_mapping, interleaved=interleaved, keep_k=keep_k)
    _rotate_into(outs[0], q, cos, sin, interleaved)
    k_rot = outs[3] if keep_k else torch.empty_like(k)
    _rotate_into(k_rot, k, cos, sin, interleaved)
    _store(k_cache, v_cache, k_rot, v, slots_mapping)
    return (outs[0], k_cache, v_cache, k_rot) if keep_k else (outs[0], k_cache, v_cache)


def rope_into(outs: Outs, q, k, cos, sin, *, interleaved=False):
    if not _rope_ok(q, k, cos, sin):
        return reference_into("rope")(outs, q, k, cos, sin, interleaved=interleaved)
    _rotate_into(outs[0], q, cos, sin, interleaved)
    _rotate_into(outs[1], k, cos, sin, interleaved)
    return outs[0], outs[1]


def reshape_and_cache_into(outs: Outs, k, v, k_cache, v_cache, slots_mapping):
    _store(k_cache, v_cache, k, v, slots_mapping)
    return k_cache, v_cache


def _runs(blocks: list[int]) -> list[tuple[int, int]]:
    """``(first block, count)`` of each run of consecutive block ids."""
    out: list[tuple[int, int]] = []
    for b in blocks:
        if out and out[-1][0] + out[-1][1] == b:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((b, 1))
    return out


def _attend(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            blocks: list[int], n_keys: int, scale: float, sliding_window: int | None) -> None:
    """``out [n, hq, d]`` = causal attention of the last ``n`` of ``n_keys`` positions, keys read
    in place from the cache: each run of consecutive blocks is one strided view, no gather
    (several queries: one fused SDPA over a single run without a prefix, else masked scores)."""
    n, hq, d = q.shape
    block_size, hk = k_cache.shape[1], k_cache.shape[2]
    group = hq // hk
    flat_k = k_cache.view(-1, hk, d)
    flat_v = v_cache.view(-1, hk, d)
    pieces, start = [], 0
    for first, count in _runs(blocks):
        length = min(count * block_size, n_keys - start)
        base = first * block_size
        pieces.append((flat_k[base:base + length], flat_v[base:base + length]))
        start += length
    if n == 1:
        _decode(out, q, pieces, n_keys, scale, sliding_window, hk, group)
        return
    if len(pieces) == 1 and sliding_window is None and n == n_keys:
        kr, vr = pieces[0]
        ctx = torch.nn.functional.scaled_dot_product_attention(
            q.permute(1, 0, 2)[None], kr.permute(1, 0, 2)[None], vr.permute(1, 0, 2)[None],
            is_causal=True, scale=scale, enable_gqa=group > 1)
        out.copy_(ctx[0].permute(1, 0, 2))
        return
    # (hk, group * n, d): the query rows of one kv head together
    qg = q.reshape(n, hk, group, d).permute(1, 2, 0, 3).reshape(hk, group * n, d)
    scores = torch.cat([torch.matmul(qg, kr.permute(1, 2, 0)) for kr, _ in pieces], dim=-1) \
        if len(pieces) > 1 else torch.matmul(qg, pieces[0][0].permute(1, 2, 0))
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
    for kr, vr in pieces:
        part = torch.matmul(probs[..., start:start + kr.shape[0]], vr.permute(1, 0, 2))
        ctx = part if ctx is None else ctx.add_(part)
        start += kr.shape[0]
    # (hk, group * n, d) -> (n, hk * group, d)
    out.copy_(ctx.view(hk, group, n, d).permute(2, 0, 1, 3).reshape(n, hq, d))


def _decode(out: torch.Tensor, q: torch.Tensor, pieces: list[tuple[torch.Tensor, torch.Tensor]],
            n_keys: int, scale: float, sliding_window: int | None, hk: int, group: int) -> None:
    """One query per sequence: torch's fused CPU attention on each run of blocks (a strided view
    of the cache), the runs merged by their log-sum-exp; a window drops the keys before it."""
    if sliding_window is not None and sliding_window < n_keys:
        drop, kept = n_keys - sliding_window, []
        for kr, vr in pieces:
            if drop >= kr.shape[0]:
                drop -= kr.shape[0]
                continue
            kept.append((kr[drop:], vr[drop:]))
            drop = 0
        pieces = kept
    qg = q.reshape(1, hk, group, q.shape[-1])  # the group's query heads as rows of one kv head
    outs, lses = [], []
    for kr, vr in pieces:
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            qg, kr.permute(1, 0, 2)[None], vr.permute(1, 0, 2)[None], 0.0, False,
            attn_mask=None, scale=scale)[:2]
        outs.append(o)
        lses.append(lse)
    if len(outs) == 1:
        out.copy_(outs[0].view(out.shape))
        return
    weights = torch.softmax(torch.stack(lses), dim=0)  # each run's share of the probability
    ctx = (torch.stack(outs) * weights[..., None]).sum(0)
    out.copy_(ctx.view(out.shape))


def _attention(out, q, k_cache, v_cache, block_table, seq_len, query_start_loc, scale,
               sliding_window) -> None:
    block_size = k_cache.shape[1]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    lens = seq_len.tolist()
    starts = query_start_loc.tolist() if query_start_loc is not None else \
        list(range(len(lens) + 1))
    tables = block_table.tolist()
    for b, n_keys in enumerate(lens):
        s, e = starts[b], starts[b + 1]
        if e == s:
            continue
        if n_keys == 0:
            out[s:e].zero_()
            continue
        blocks = tables[b][:-(-n_keys // block_size)]
        _attend(out[s:e], q[s:e], k_cache, v_cache, blocks, n_keys, scale, sliding_window)


def _attention_ok(q, k_cache) -> bool:
    return q.dtype == _F32 and k_cache.dtype == _F32 and q.shape[1] % k_cache.shape[2] == 0


def paged_attention_into(outs: Outs, q, k_cache, v_cache, block_table, seq_len,
                         query_start_loc=None, k_new=None, v_new=None, *, scale=None,
                         sliding_window=None):
    if not _attention_ok(q, k_cache):
        return reference_into("paged_attention")(
            outs, q, k_cache, v_cache, block_table, seq_len, query_start_loc, k_new, v_new,
            scale=scale, sliding_window=sliding_window)
    _attention(outs[0], q, k_cache, v_cache, block_table, seq_len, query_start_loc, scale,
               sliding_window)
    return outs[0]


def rope_cache_attention_into(outs: Outs, q, k, v, cos, sin, k_cache, v_cache, slots_mapping,
                              block_table, seq_len, *, interleaved=False, scale=None,
                              sliding_window=None):
    if not (_rope_ok(q, k, cos, sin) and _attention_ok(q, k_cache)):
        return reference_into("rope_cache_attention")(
            outs, q, k, v, cos, sin, k_cache, v_cache, slots_mapping, block_table, seq_len,
            interleaved=interleaved, scale=scale, sliding_window=sliding_window)
    hq = q.shape[1]
    qk_rot = torch.empty(q.shape[0], hq + k.shape[1], q.shape[2], dtype=q.dtype)
    qk = _joined(q, k)
    if qk is not None:  # q and k side by side in the qkv output: one pass rotates both
        _rotate_into(qk_rot, qk, cos, sin, interleaved)
    else:
        _rotate_into(qk_rot[:, :hq], q, cos, sin, interleaved)
        _rotate_into(qk_rot[:, hq:], k, cos, sin, interleaved)
    q_rot, k_rot = qk_rot[:, :hq], qk_rot[:, hq:]
    _store(k_cache, v_cache, k_rot, v, slots_mapping)
    _attention(outs[0], q_rot, k_cache, v_cache, block_table, seq_len, None, scale,
               sliding_window)
    return outs[0], k_cache, v_cache


def matmul_into(out2: torch.Tensor, x2: torch.Tensor, w: Any, bias: torch.Tensor | None,
                residual2: torch.Tensor | None, transpose_b: bool = True,
                tuning: Tuning | None = None) -> None:
    """``out2 = x2 @ w(.T) + bias + residual2``: ``addmm`` into the planned buffer (the residual
    as its input), or a quantized weight through its packed CPU kernel."""
    if is_quantized(w):
        if transpose_b:
            bf16 = (tuning or _DEFAULT_TUNING).cpu.bf16_quant_activations
            packed_linear(w, x2.dtype, bf16).run(x2, out2)
            if residual2 is not None:
                out2.add_(residual2)
            if bias is not None:
                out2.add_(bias)
            return
        w = w.dequantize(x2.dtype)  # a transposed quantized operand: no kernel takes it packed
    b = w.t() if transpose_b else w
    n = b.shape[1]
    cpu = (tuning or _DEFAULT_TUNING).cpu
    width = cpu.slice_cols
    if 1 < x2.shape[0] <= cpu.slice_max_rows and n > width:
        # MKL's small-M GEMM streams a wide weight faster in column slices.
        for start in range(0, n, width):
            cols = slice(start, start + width)
            _mm(out2[:, cols], x2, b[:, cols], None if bias is None else bias[cols],
                None if residual2 is None else residual2[:, cols])
        return
    _mm(out2, x2, b, bias, residual2)


def _mm(out2: torch.Tensor, x2: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None,
        residual2: torch.Tensor | None) -> None:
    if residual2 is not None:
        torch.addmm(residual2, x2, b, out=out2)
        if bias is not None:
            out2.add_(bias)
    elif bias is not None:
        torch.addmm(bias, x2, b, out=out2)
    else:
        torch.mm(x2, b, out=out2)


def _linear_ok(x, w, bias=None, residual=None) -> bool:
    return x.dim() >= 1 and _fp32(x, bias, residual) and (is_quantized(w) or w.dtype == _F32)


def linear_into(outs: Outs, x, w, bias=None, *, tuning: Tuning, transpose_a=False,
                transpose_b=True, impl=None):
    if transpose_a or not _linear_ok(x, w, bias):
        return reference_into("linear")(outs, x, w, bias, transpose_a=transpose_a,
                                        transpose_b=transpose_b)
    matmul_into(outs[0].view(-1, outs[0].shape[-1]), rows(x), w, bias, None, transpose_b,
                tuning)
    return outs[0]


def linear_epilogue_into(outs: Outs, x, w, bias=None, residual=None, *, tuning: Tuning,
                         transpose_b=True, act=None):
    if not _linear_ok(x, w, bias, residual) or (
            residual is not None and tuple(residual.shape) != tuple(outs[0].shape)):
        return reference_into("linear_epilogue")(outs, x, w, bias, residual,
                                                 transpose_b=transpose_b, act=act)
    out2 = outs[0].view(-1, outs[0].shape[-1])
    res2 = None if residual is None else rows(residual)
    if act is None:
        matmul_into(out2, rows(x), w, bias, res2, transpose_b, tuning)
        return outs[0]
    matmul_into(out2, rows(x), w, bias, None, transpose_b, tuning)
    out2.copy_(EPILOGUE_ACTIVATIONS[act](out2))
    if res2 is not None:
        out2.add_(res2)
    return outs[0]


def norm_linear_into(outs: Outs, x, norm_weight, w, bias=None, *, tuning: Tuning, eps,
                     act=None):
    if not (_linear_ok(x, w, bias) and _fp32(norm_weight)):
        return reference_into("norm_linear")(outs, x, norm_weight, w, bias, eps=eps, act=act)
    x2 = rows(x)
    out2 = outs[0].view(-1, outs[0].shape[-1])
    # The normed rows are M x K (one token's worth at decode): a scratch this size is free.
    normed = torch.empty_like(x2)
    _rms_into(normed, x2, norm_weight, eps)
    if act is None:
        matmul_into(out2, normed, w, bias, None, True, tuning)
        return outs[0]
    gate_up = torch.empty(x2.shape[0], w.shape[0], dtype=_F32)
    matmul_into(gate_up, normed, w, bias, None, True, tuning)
    _swiglu(out2, gate_up)
    return outs[0]


def matmul_op_into(outs: Outs, a, b):
    torch.matmul(a, b, out=outs[0])
    return outs[0]


def prefetch_into(outs: Outs, x, *weights, halves):
    return x  # no L2 to stage into on the CPU


KERNELS = (
    # A linear a rule asked to run as the torch reference (a quantized weight dequantized per
    # call); tried before the kernel entry below.
    KernelSpec("linear", reference_into("linear"), supports=lambda n: n.attrs.get("impl")
               == "reference", name="torch.linear"),
    KernelSpec("rms_norm", rms_norm_into),
    KernelSpec("add_rms_norm", add_rms_norm_into),
    KernelSpec("swiglu", swiglu_into),
    KernelSpec("embedding", embedding_into),
    KernelSpec("rope", rope_into),
    KernelSpec("reshape_and_cache", reshape_and_cache_into),
    KernelSpec("rope_cache", rope_cache_into),
    KernelSpec("rope_cache_attention", rope_cache_attention_into),
    KernelSpec("paged_attention", paged_attention_into),
    KernelSpec("linear", linear_into, tuned=True),
    KernelSpec("linear_epilogue", linear_epilogue_into, tuned=True),
    KernelSpec("norm_linear", norm_linear_into, tuned=True),
    KernelSpec("matmul", matmul_op_into, name="cpu.matmul"),
    KernelSpec("l2_prefetch", prefetch_into),
)
