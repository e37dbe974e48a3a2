"""Paged attention kernels (varlen prefill, split-KV decode) against a dense torch reference.

The reference never touches the paged cache: each sequence's K/V are generated dense, the
reference attends over those, and only the kernel reads them back through a shuffled block table.
Cache slots and pages no sequence owns are filled with NaN, and outputs are poisoned with NaN, so
reading a wrong page/slot or leaving an output element unwritten fails the comparison.

Tolerances (kernel vs. fp64 reference fed the same rounded inputs):
- fp32: 1e-5 abs/rel. Products are exact-ish fp32 (``input_precision="ieee"``); error is fp32
  accumulation over <= a few hundred keys (~1e-7 relative), with margin.
- fp16: 1e-2. The kernel rounds softmax probabilities to fp16 for the P@V MMA (2^-11 relative)
  and rounds the output to fp16; outputs are O(1).
- bf16: 2e-2. Same, with bf16's 2^-8 rounding of P and of the output.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import pytest
import torch

from tests.gpu_tiers import sweep
from tests.helpers import capture_cuda_graph
from tgraph.kernels.triton import attention_decode, attention_prefill
from tgraph.kernels.triton.attention import (
    NewKey,
    choose_num_splits,
    decode_workspace_numel,
    paged_attention_decode,
    paged_attention_prefill,
)
from tgraph.tuning import DecodeAttentionTuning, DecodeTiles

TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=1e-2, rtol=1e-2),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@dataclass
class PagedCase:
    """A batch of sequences with dense K/V (for the reference) and the same K/V paged."""

    q: torch.Tensor  # [T, Hq, D] packed queries (the last q_len of each sequence)
    k_dense: list[torch.Tensor]  # per seq [seq_len, Hk, D]
    v_dense: list[torch.Tensor]
    k_cache: torch.Tensor  # [num_blocks, block_size, Hk, D]
    v_cache: torch.Tensor
    block_table: torch.Tensor  # int32 [B, max_blocks]
    seq_len: torch.Tensor  # int32 [B]
    query_start_loc: torch.Tensor  # int32 [B + 1]
    q_lens: list[int]


def make_case(
    q_lens: list[int],
    seq_len: list[int],
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: str = DEVICE,
    extra_blocks: int = 2,
    strided: bool = False,
) -> PagedCase:
    """Random sequences scattered into shuffled pages; unowned pages and slots hold NaN.

    Args:
        strided: make q a view of a wider (qkv-like) buffer and the block table a column-strided
            view, to check that kernels honour strides.
    """
    assert len(q_lens) == len(seq_len) and all(q <= kv for q, kv in zip(q_lens, seq_len))
    pages = [math.ceil(n / block_size) for n in seq_len]
    max_blocks = max(max(pages), 1) + extra_blocks  # columns past a seq's pages are never read
    num_blocks = sum(pages) + 1  # + one all-NaN page that unused table entries point at
    nan_page = num_blocks - 1
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    v_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    order = torch.randperm(num_blocks - 1).tolist()  # shuffled physical pages
    table = torch.full((len(seq_len), max_blocks), nan_page, dtype=torch.int32)
    k_dense, v_dense = [], []
    for b, n in enumerate(seq_len):
        ids = [order.pop() for _ in range(pages[b])]
        table[b, : pages[b]] = torch.tensor(ids, dtype=torch.int32)
        k = torch.randn(n, num_kv_heads, head_dim, device=device).to(dtype)
        v = torch.randn(n, num_kv_heads, head_dim, device=device).to(dtype)
        tok = torch.arange(n)
        page_of_tok = torch.tensor(ids, dtype=torch.long)[tok // block_size] if n else tok
        k_cache[page_of_tok.to(device), (tok % block_size).to(device)] = k
        v_cache[page_of_tok.to(device), (tok % block_size).to(device)] = v
        k_dense.append(k)
        v_dense.append(v)
    total_q = sum(q_lens)
    if strided:
        # q is the first Hq heads of a [T, Hq + 2 Hk, D] buffer, like a fused qkv projection.
        buf = torch.randn(total_q, num_q_heads + 2 * num_kv_heads, head_dim, device=device)
        q = buf.to(dtype)[:, :num_q_heads]
        wide = torch.full((len(seq_len), 2 * max_blocks), nan_page, dtype=torch.int32)
        wide[:, ::2] = table
        block_table = wide.to(device)[:, ::2]
        assert not block_table.is_contiguous()
    else:
        q = torch.randn(total_q, num_q_heads, head_dim, device=device).to(dtype)
        block_table = table.to(device)
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(q_lens).cumsum(0)
    return PagedCase(
        q=q, k_dense=k_dense, v_dense=v_dense, k_cache=k_cache, v_cache=v_cache,
        block_table=block_table, seq_len=torch.tensor(seq_len, dtype=torch.int32, device=device),
        query_start_loc=qsl.to(device), q_lens=list(q_lens),
    )


def reference_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
    scale: float, window: int | None, compute_dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """Dense causal (+ window) GQA attention of ``q [n, Hq, D]`` at ``positions`` over ``k, v``.

    Query chunks of 512 bound the score memory at long contexts. Rows with no visible key
    (seq_len 0) give zeros, the kernels' convention.
    """
    n, num_q_heads, _ = q.shape
    group = num_q_heads // k.shape[1]
    out = torch.zeros(q.shape, dtype=compute_dtype, device=q.device)
    if k.shape[0] == 0:
        return out
    kk = k.to(compute_dtype).repeat_interleave(group, dim=1)
    vv = v.to(compute_dtype).repeat_interleave(group, dim=1)
    keys = torch.arange(k.shape[0], device=q.device)
    for s in range(0, n, 512):
        qc = q[s : s + 512].to(compute_dtype)
        pos = positions[s : s + 512]
        scores = torch.einsum("qhd,khd->hqk", qc, kk) * scale
        visible = keys[None, :] <= pos[:, None]
        if window is not None:
            visible &= pos[:, None] - keys[None, :] < window
        scores = scores.masked_fill(~visible, float("-inf"))
        out[s : s + 512] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vv)
    return out


def reference_prefill(
    case: PagedCase, scale: float, window: int | None, compute_dtype=torch.float64
) -> torch.Tensor:
    outs = []
    for b, q_len in enumerate(case.q_lens):
        seq_len = case.k_dense[b].shape[0]
        start = int(case.query_start_loc[b])
        positions = torch.arange(seq_len - q_len, seq_len, device=case.q.device)
        outs.append(reference_attention(
            case.q[start : start + q_len], case.k_dense[b], case.v_dense[b], positions, scale,
            window, compute_dtype,
        ))
    return torch.cat(outs)


def decode_query(case: PagedCase, num_q_heads: int, head_dim: int) -> torch.Tensor:
    batch = len(case.k_dense)
    q = torch.randn(batch, num_q_heads, head_dim, device=case.k_cache.device)
    return q.to(case.k_cache.dtype)


def reference_decode(case: PagedCase, q: torch.Tensor, scale: float, window: int | None,
                     compute_dtype=torch.float64):
    outs = []
    for b, k in enumerate(case.k_dense):
        positions = torch.tensor([k.shape[0] - 1], device=q.device)
        outs.append(reference_attention(q[b : b + 1], k, case.v_dense[b], positions, scale, window,
                                        compute_dtype))
    return torch.cat(outs)


def run_prefill(case: PagedCase, scale=None, window=None, max_query_len=None) -> torch.Tensor:
    out = torch.full_like(case.q, float("nan"))
    paged_attention_prefill(case.q, case.k_cache, case.v_cache, case.block_table, case.seq_len,
                            case.query_start_loc, scale, window, out, max_query_len)
    return out


def run_decode(case: PagedCase, q: torch.Tensor, scale=None, window=None, num_splits=None,
               workspace=None) -> torch.Tensor:
    out = torch.full_like(q, float("nan"))
    paged_attention_decode(q, case.k_cache, case.v_cache, case.block_table, case.seq_len, scale,
                           window, out, num_splits, workspace=workspace)
    return out


def assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    torch.testing.assert_close(out.double(), ref.double(), **TOL[out.dtype])


# ----------------------------------------------------------------------------- prefill (CPU)

# Ragged lengths: 1, exact multiples of the page and tile (16, 32), and lengths that are not.
PLAIN_LENS = [37, 1, 16, 5]


# (dtype, GQA ratio, sliding window): every ratio/window pair in fp32, the extremes in bf16 (the
# interpreter is slow, and bf16 only changes the MMA operand rounding, not the indexing).
COMBOS = [
    *[(torch.float32, gqa, window) for gqa in (1, 2, 4) for window in (None, 6)],
    (torch.bfloat16, 1, None),
    (torch.bfloat16, 4, 6),
]
COMBO_IDS = [f"{str(d).split('.')[1]}-gqa{g}-w{w}" for d, g, w in COMBOS]


@pytest.mark.parametrize("dtype, gqa, window", COMBOS, ids=COMBO_IDS)
def test_prefill_matches_reference(dtype, gqa, window):
    num_kv_heads, head_dim = 2, 16
    case = make_case(PLAIN_LENS, PLAIN_LENS, num_kv_heads * gqa, num_kv_heads, head_dim, 16, dtype)
    out = run_prefill(case, window=window)
    assert_close(out, reference_prefill(case, 1 / math.sqrt(head_dim), window))


# Window 31 = BLOCK_M + BLOCK_N - 1 on CPU: the smallest window for which a 16-row tile has keys
# inside every row's window (the unmasked middle range), with its lower edge exactly on a tile.
@pytest.mark.parametrize("window, block_size", [(None, 16), (20, 32), (31, 16)])
def test_chunked_prefill_with_cached_context(window, block_size):
    # (q_len, seq_len): chunk after context, a single-token chunk, chunk straddling pages, plain.
    q_lens, seq_len = [7, 1, 19, 37], [40, 23, 50, 37]
    case = make_case(q_lens, seq_len, 4, 2, 32, block_size, torch.float32)
    out = run_prefill(case, scale=0.3, window=window)
    assert_close(out, reference_prefill(case, 0.3, window))


PrefillConfig = attention_prefill.PrefillConfig
M16N32 = PrefillConfig(block_m=16, block_n=32, num_warps=4, num_stages=1)


@pytest.mark.parametrize(
    "config, window",
    [
        (None, None),
        (None, 3),
        (M16N32, 3),
        (PrefillConfig(32, 16, 4, 1, pack_gqa=True, single_loop=False), 3),
    ],
    ids=["default", "default-w3", "m16n32-w3", "packed-m32n16-3loops-w3"],
)
def test_prefill_every_chunk_alignment(config, window):
    # Cached context of every length 0..33, so chunk starts hit every residue mod BLOCK_N: the
    # unmasked/diagonal split of the key loop must be exact for all of them. Hq / Hk = 2, so the
    # default (and the packed config) put 2 heads in a tile: BLOCK_P = BLOCK_M / 2 positions.
    ctx = list(range(34))
    q_lens = [1 + c % 3 for c in ctx]
    seq_len = [c + n for c, n in zip(ctx, q_lens)]
    case = make_case(q_lens, seq_len, 2, 1, 16, 16, torch.float32)
    if config is None:
        out = run_prefill(case, window=window)
    else:
        out = torch.full_like(case.q, float("nan"))
        attention_prefill.launch_prefill(case.q, case.k_cache, case.v_cache, case.block_table,
                                         case.seq_len, case.query_start_loc, 0.25, window, out,
                                         config)
    assert_close(out, reference_prefill(case, 0.25, window))


def test_prefill_strided_q_and_block_table():
    case = make_case([9, 30], [9, 41], 4, 1, 16, 16, torch.float32, strided=True)
    out_buf = torch.full((case.q.shape[0], 6, 16), float("nan"))
    out = out_buf[:, 1:5]  # row-strided output view
    paged_attention_prefill(case.q, case.k_cache, case.v_cache, case.block_table, case.seq_len,
                            case.query_start_loc, None, None, out)
    assert_close(out, reference_prefill(case, 0.25, None))
    # Heads outside the view must stay untouched.
    assert torch.isnan(out_buf[:, 0]).all() and torch.isnan(out_buf[:, 5]).all()


def test_prefill_single_sequence_and_empty_chunks():
    # B = 1 (binary search of zero steps), then sequences with no queries in the batch.
    case = make_case([13], [13], 2, 2, 16, 16, torch.float32)
    assert_close(run_prefill(case), reference_prefill(case, 0.25, None))
    case = make_case([0, 6, 0, 3], [0, 6, 9, 3], 2, 1, 16, 16, torch.float32)
    assert_close(run_prefill(case), reference_prefill(case, 0.25, None))


@pytest.mark.parametrize("new_keys", [False, True], ids=["cache", "new-keys"])
def test_prefill_padded_to_a_captured_signature(new_keys):
    # What a captured prefill graph runs (tgraph.models.base.batch.pad_prefill_arrays): pad
    # token rows after the real ones that belong to no sequence, and empty pad sequences
    # (query_start_loc stays at the real token count, seq_len 0). Real rows must equal the
    # unpadded reference and no program may write a pad row (they stay NaN).
    case = make_case([5, 9], [5, 12], 4, 2, 16, 16, torch.float32)
    ref = reference_prefill(case, 0.25, None)
    pad_tokens, pad_seqs = 7, 2
    q = torch.cat([case.q, torch.full((pad_tokens,) + case.q.shape[1:], float("nan"),
                                      dtype=case.q.dtype, device=case.q.device)])
    nan_page = case.k_cache.shape[0] - 1
    table = torch.cat([case.block_table, torch.full((pad_seqs, case.block_table.shape[1]),
                                                    nan_page, dtype=torch.int32,
                                                    device=case.q.device)])
    seq_len = torch.cat([case.seq_len, case.seq_len.new_zeros(pad_seqs)])
    qsl = torch.cat([case.query_start_loc, case.query_start_loc[-1:].repeat(pad_seqs)])
    new_kv = None
    if new_keys:
        k_new, v_new = new_kv_rows(case)
        pad = torch.full((pad_tokens,) + k_new.shape[1:], float("nan"), dtype=k_new.dtype,
                         device=k_new.device)
        new_kv = (torch.cat([k_new, pad]), torch.cat([v_new, pad]))
    out = torch.full_like(q, float("nan"))
    paged_attention_prefill(q, case.k_cache, case.v_cache, table, seq_len, qsl, 0.25, None, out,
                            new_kv=new_kv)
    real = case.q.shape[0]
    assert_close(out[:real], ref)
    assert torch.isnan(out[real:]).all()


def new_kv_rows(case: PagedCase, strided: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's new keys/values in query order (``[T, Hk, D]``), as the model passes them.

    Rows of sequences with cached context are NaN: the kernel must read those sequences from
    the cache. ``strided``: k and v are views of one wider (qkv-like) buffer.
    """
    heads, d = case.k_cache.shape[2], case.k_cache.shape[3]
    total = sum(case.q_lens)
    width = 3 * heads if strided else heads
    buf_k = torch.full((total, width, d), float("nan"), dtype=case.k_cache.dtype,
                       device=case.q.device)
    buf_v = buf_k.clone()
    k_new, v_new = (buf_k[:, heads:2 * heads], buf_v[:, 2 * heads:]) if strided else (buf_k, buf_v)
    for b, q_len in enumerate(case.q_lens):
        seq_len = case.k_dense[b].shape[0]
        start = int(case.query_start_loc[b])
        if seq_len == q_len:
            k_new[start:start + q_len] = case.k_dense[b]
            v_new[start:start + q_len] = case.v_dense[b]
    return k_new, v_new


def poison_new_slots_of_fresh_sequences(case: PagedCase) -> None:
    """NaN in the cache where sequences without context keep their keys: reading the cache
    instead of the new rows for them fails the comparison."""
    block_size = case.k_cache.shape[1]
    for b, q_len in enumerate(case.q_lens):
        if q_len and case.k_dense[b].shape[0] == q_len:
            for pos in range(q_len):
                page = int(case.block_table[b, pos // block_size])
                case.k_cache[page, pos % block_size] = float("nan")
                case.v_cache[page, pos % block_size] = float("nan")


# Configs of the new-keys path: the interpreter default (one loop), three loops, GQA packing;
# each with TMA descriptors and with pointer loads.
NEW_KV_CONFIGS = [
    PrefillConfig(16, 16, 4, 1, pack_gqa=True),
    PrefillConfig(32, 16, 4, 1, single_loop=False),
    PrefillConfig(32, 16, 4, 1, pack_gqa=True, single_loop=False, prefetch_pages=False),
]


@pytest.mark.parametrize("tma", [True, False], ids=["tma", "pointers"])
@pytest.mark.parametrize("config", NEW_KV_CONFIGS, ids=["1loop-packed", "3loops", "3loops-packed"])
@pytest.mark.parametrize("window", [None, 6, 31])
def test_prefill_reads_new_keys_of_fresh_sequences(config, tma, window):
    # Fresh sequences (context 0) of ragged lengths next to chunks after cached context and an
    # empty chunk; the fresh ones' cache slots are NaN, the others' new rows are NaN.
    q_lens, seq_len = [37, 7, 1, 0, 16, 21], [37, 40, 1, 9, 16, 50]
    case = make_case(q_lens, seq_len, 4, 2, 16, 16, torch.float32)
    ref = reference_prefill(case, 0.25, window)
    k_new, v_new = new_kv_rows(case, strided=True)
    poison_new_slots_of_fresh_sequences(case)
    out = torch.full_like(case.q, float("nan"))
    attention_prefill.launch_prefill(case.q, case.k_cache, case.v_cache, case.block_table,
                                     case.seq_len, case.query_start_loc, 0.25, window, out,
                                     dataclasses.replace(config, tma=tma), (k_new, v_new))
    assert_close(out, ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_prefill_new_keys_half_precision(dtype):
    case = make_case([40, 9], [40, 9], 8, 2, 32, 16, dtype)
    ref = reference_prefill(case, 32 ** -0.5, None)
    k_new, v_new = new_kv_rows(case)
    poison_new_slots_of_fresh_sequences(case)
    out = torch.full_like(case.q, float("nan"))
    paged_attention_prefill(case.q, case.k_cache, case.v_cache, case.block_table, case.seq_len,
                            case.query_start_loc, None, None, out, new_kv=(k_new, v_new))
    assert_close(out, ref)


@pytest.mark.parametrize(
    "config",
    [
        attention_prefill.PrefillConfig(block_m=32, block_n=16, num_warps=4, num_stages=1),
        attention_prefill.PrefillConfig(block_m=16, block_n=32, num_warps=4, num_stages=1),
        attention_prefill.PrefillConfig(block_m=64, block_n=64, num_warps=4, num_stages=1),
    ],
    ids=lambda c: f"m{c.block_m}n{c.block_n}",
)
@pytest.mark.parametrize("window", [None, 9])
def test_prefill_tile_shapes(config, window):
    # The GPU heuristics use tiles larger than pages and BLOCK_M != BLOCK_N; check those paths.
    q_lens, seq_len = [70, 3, 17], [70, 40, 17]
    case = make_case(q_lens, seq_len, 2, 1, 16, 16, torch.float32)
    out = torch.full_like(case.q, float("nan"))
    attention_prefill.launch_prefill(case.q, case.k_cache, case.v_cache, case.block_table,
                                     case.seq_len, case.query_start_loc, 0.25, window, out, config)
    assert_close(out, reference_prefill(case, 0.25, window))


def test_prefill_config_heuristic():
    # GPU defaults: the sweep's winner (three loops, unpacked, no page prefetch; see
    # prefill_config), with smaller tiles for short query runs.
    big = attention_prefill.prefill_config(128, None, is_cuda=True)
    assert (big.block_m, big.block_n, big.num_warps, big.num_stages) == (64, 64, 4, 2)
    assert not big.pack_gqa and not big.prefetch_pages and not big.single_loop
    assert not attention_prefill.prefill_config(128, None, is_cuda=True, group=4).pack_gqa
    assert attention_prefill.prefill_config(128, 5, is_cuda=True).block_m == 16
    assert attention_prefill.prefill_config(128, 33, is_cuda=True).block_m == 64
    assert attention_prefill.prefill_config(128, 20, is_cuda=True).block_m == 32
    assert attention_prefill.prefill_config(64, 4096, is_cuda=True).block_m == 128
    assert attention_prefill.prefill_config(256, None, is_cuda=True).block_n == 32
    # The interpreter runs the packed, prefetching single loop, so the tests cover it; packed
    # tiles count positions x heads (2 tokens x 4 heads = 8 rows: the 16-row minimum).
    cpu = attention_prefill.prefill_config(16, None, is_cuda=False, group=2)
    assert cpu.pack_gqa and cpu.prefetch_pages and cpu.single_loop and cpu.block_m == 16
    assert attention_prefill.prefill_config(16, 2, is_cuda=False, group=4).block_m == 16


@pytest.mark.parametrize(
    "group, block_m, heads",
    [(1, 16, 1), (4, 64, 4), (8, 16, 8), (7, 128, 7), (6, 16, 6), (24, 16, 12), (32, 16, 16),
     (5, 4, 1)],
)
def test_heads_per_tile(group, block_m, heads):
    assert attention_prefill.heads_per_tile(group, block_m) == heads


def _launch_prefill(case: PagedCase, config, scale: float, window: int | None) -> torch.Tensor:
    out = torch.full_like(case.q, float("nan"))
    attention_prefill.launch_prefill(case.q, case.k_cache, case.v_cache, case.block_table,
                                     case.seq_len, case.query_start_loc, scale, window, out,
                                     config)
    return out


# Ragged batch: plain prefills (37, 16 = one page) and chunks after cached context (1 of 23,
# 7 of 40, 19 of 50), so query runs start at every kind of offset inside a tile. Ratios >= 16
# (one position per tile: many programs) get a shorter batch of the same kinds.
VARIANT_LENS = ([37, 1, 16, 7, 19], [37, 23, 16, 40, 50])
SHORT_VARIANT_LENS = ([9, 1, 6], [9, 23, 40])
# (GQA ratio, Hk, window, block size, config, dtype). HEADS = heads_per_tile(GQA, BLOCK_M):
# 3 and 6 leave idle rows (BLOCK_M = 16 holds 5 x 3 and 2 x 6), 24 splits a group over two
# tiles of 12 heads (4 idle rows each); group 1 with pack_gqa is the unpacked kernel.
PACKED_VARIANTS = [
    (1, 2, None, 16, PrefillConfig(16, 16, 4, 1, pack_gqa=True), torch.float32),
    (4, 2, None, 16, PrefillConfig(16, 16, 4, 1, pack_gqa=True), torch.float32),
    (4, 2, 6, 32, PrefillConfig(32, 16, 4, 1, pack_gqa=True), torch.float32),
    (4, 2, 20, 16, PrefillConfig(16, 32, 4, 1, pack_gqa=True, prefetch_pages=False),
     torch.float32),
    (4, 2, 9, 16, PrefillConfig(64, 32, 4, 1, pack_gqa=True, single_loop=False), torch.float32),
    (4, 2, 6, 16, PrefillConfig(16, 16, 4, 1, pack_gqa=False, prefetch_pages=False,
                                single_loop=False), torch.float32),
    (8, 1, None, 32, PrefillConfig(32, 32, 4, 1, pack_gqa=True, single_loop=False),
     torch.float32),
    (8, 1, 9, 16, PrefillConfig(16, 16, 4, 1, pack_gqa=True), torch.bfloat16),
    (3, 2, 9, 16, PrefillConfig(16, 16, 4, 1, pack_gqa=True), torch.float32),
    (6, 1, None, 32, PrefillConfig(16, 16, 4, 1, pack_gqa=True, single_loop=False),
     torch.float16),
    (24, 1, 5, 16, PrefillConfig(16, 16, 4, 1, pack_gqa=True), torch.float32),
]


def _variant_id(v) -> str:
    gqa, hk, window, bs, c, dtype = v
    flags = ("pack" if c.pack_gqa else "nopack") + ("" if c.prefetch_pages else "-nopf") + (
        "" if c.single_loop else "-3loops")
    return f"gqa{gqa}-w{window}-bs{bs}-m{c.block_m}n{c.block_n}-{flags}-{str(dtype)[6:]}"


@pytest.mark.parametrize("gqa, num_kv_heads, window, block_size, config, dtype", PACKED_VARIANTS,
                         ids=[_variant_id(v) for v in PACKED_VARIANTS])
def test_prefill_variants_match_reference(gqa, num_kv_heads, window, block_size, config, dtype):
    """GQA packing, page prefetch and the one-/three-loop walks, on ragged chunked batches."""
    q_lens, seq_len = VARIANT_LENS if gqa < 16 else SHORT_VARIANT_LENS
    case = make_case(q_lens, seq_len, gqa * num_kv_heads, num_kv_heads, 16, block_size, dtype)
    out = _launch_prefill(case, config, 0.3, window)
    assert_close(out, reference_prefill(case, 0.3, window))


# ----------------------------------------------------- decode with the step's rope and cache write


def new_key_case(lens, num_q_heads, num_kv_heads, head_dim, block_size, dtype, rot_half,
                 interleaved, device=DEVICE):
    """A decode case whose last key per sequence arrives unrotated with the step (``NewKey``).

    The cache holds NaN where this step's key goes, so reading it back instead of using the new
    key would show; the dense reference gets the key rotated and rounded as the cache stores it.
    Sequences of length 0 get slot -1 (padding), which must write nothing.
    """
    from tgraph.ir.ops.attention import rope_reference

    case = make_case(lens, lens, num_q_heads, num_kv_heads, head_dim, block_size, dtype, device)
    batch = len(lens)
    q_raw = torch.randn(batch, num_q_heads, head_dim, device=device).to(dtype)
    k_raw = torch.randn(batch, num_kv_heads, head_dim, device=device).to(dtype)
    v_new = torch.randn(batch, num_kv_heads, head_dim, device=device).to(dtype)
    angles = torch.rand(batch, rot_half, device=device) * 6.28
    cos, sin = angles.cos(), angles.sin()
    q_rot, k_rot = rope_reference(q_raw, k_raw, cos, sin, interleaved=interleaved)
    slots = []
    for b, n in enumerate(lens):
        if n == 0:
            slots.append(-1)
            continue
        page = int(case.block_table[b, (n - 1) // block_size])
        slot = page * block_size + (n - 1) % block_size
        slots.append(slot)
        case.k_cache.view(-1, num_kv_heads, head_dim)[slot] = float("nan")
        case.v_cache.view(-1, num_kv_heads, head_dim)[slot] = float("nan")
        case.k_dense[b][-1] = k_rot[b]
        case.v_dense[b][-1] = v_new[b]
    slots_t = torch.tensor(slots, dtype=torch.int32, device=device)
    new_key = NewKey(k_raw, v_new, cos, sin, slots_t, interleaved)
    return case, q_raw, q_rot, k_rot, new_key


def check_new_key(case, q_raw, q_rot, k_rot, new_key, window, num_splits, compute_dtype,
                  tuning=None, k_ulps=1):
    k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
    out = torch.full_like(q_raw, float("nan"))
    paged_attention_decode(q_raw, k_cache, v_cache, case.block_table, case.seq_len, None, window,
                           out, num_splits, new_key=new_key, tuning=tuning)
    head_dim = q_raw.shape[-1]
    assert_close(out, reference_decode(case, q_rot, head_dim ** -0.5, window, compute_dtype))
    flat_k = k_cache.view(-1, *k_cache.shape[2:])
    flat_v = v_cache.view(-1, *v_cache.shape[2:])
    # The step's v is copied into the cache bit for bit, its k rotated to within one rounding
    # of the cache dtype: the kernel may contract x*c - y*s into an FMA, and Triton's interpreter
    # rounds fp32 -> bf16 differently from torch (measured: 1 ulp apart at most).
    ulp = {torch.float32: 2 ** -22, torch.float16: 2 ** -10,
           torch.bfloat16: 2 ** -7}[q_raw.dtype] * k_ulps
    for b, slot in enumerate(new_key.slots_mapping.tolist()):
        if slot >= 0:
            assert torch.equal(flat_v[slot], new_key.v[b])
            torch.testing.assert_close(flat_k[slot], k_rot[b], rtol=ulp, atol=ulp)
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool, device=flat_k.device)
    untouched[[s for s in new_key.slots_mapping.tolist() if s >= 0]] = False
    ref_k = case.k_cache.view(-1, *k_cache.shape[2:])
    assert torch.equal(flat_k[untouched].isnan(), ref_k[untouched].isnan())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rot_half, window, num_splits", [(8, None, 1), (8, 6, 3), (4, None, 3)],
                         ids=["full-s1", "window-s3", "partial-s3"])
@pytest.mark.parametrize("early_kv", [True, False], ids=["early-kv", "kv-after-wait"])
def test_decode_new_key_matches_rope_then_cache_then_attention(dtype, interleaved, rot_half,
                                                                window, num_splits, early_kv):
    # EARLY_KV: each split's first K/V tile is loaded apart from the loop (before the PDL wait
    # on a GPU); both launch variants must give the same function.
    tuning = DecodeAttentionTuning(early_kv_max_programs_per_sm=1000 if early_kv else 0)
    case, q_raw, q_rot, k_rot, nk = new_key_case([37, 1, 0, 16, 5], 4, 2, 16, 4, dtype,
                                                 rot_half, interleaved)
    check_new_key(case, q_raw, q_rot, k_rot, nk, window, num_splits, torch.float64, tuning)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("interleaved, num_splits", [(False, 1), (True, 3)])
def test_decode_new_key_with_the_qk_norm(dtype, interleaved, num_splits):
    """Qwen3's per-head q/k RMSNorm folded into the kernel equals norm, then rope, cache write
    and attention (qk_norm_rope_cache_attention)."""
    from tgraph.ir.ops.attention import rope_reference
    from tgraph.ir.ops.norms import rms_norm_reference

    lens = [37, 1, 0, 16, 5]
    case, q_raw, _, _, nk = new_key_case(lens, 4, 2, 16, 4, dtype, 8, interleaved)
    g = torch.Generator().manual_seed(5)
    wq, wk = ((torch.rand(16, generator=g) + 0.5).to(DEVICE, dtype) for _ in range(2))
    q_n = rms_norm_reference(q_raw, wq, eps=1e-6)
    k_n = rms_norm_reference(nk.k, wk, eps=1e-6)
    q_rot, k_rot = rope_reference(q_n, k_n, nk.cos, nk.sin, interleaved=interleaved)
    for b, n in enumerate(lens):
        if n:
            case.k_dense[b][-1] = k_rot[b]
    nk = dataclasses.replace(nk, q_norm=wq, k_norm=wk, norm_eps=1e-6)
    # The norm rounds twice more before the rotation (normed, then times its weight): where the
    # interpreter's bf16 rounding departs from torch's by an ulp, the key may move by ~3 ulps.
    check_new_key(case, q_raw, q_rot, k_rot, nk, None, num_splits, torch.float64, k_ulps=4)


def test_decode_new_key_rejects_bad_input():
    case, q_raw, _, _, nk = new_key_case([5, 3], 4, 2, 16, 4, torch.float32, 8, False)
    out = torch.empty_like(q_raw)

    def run(**over):
        paged_attention_decode(q_raw, case.k_cache, case.v_cache, case.block_table, case.seq_len,
                               None, None, out, new_key=dataclasses.replace(nk, **over))

    with pytest.raises(ValueError, match=r"new_key.k must be \[B, Hk, D\]"):
        run(k=nk.k[:1])
    with pytest.raises(ValueError, match="new_key.cos must be float32"):
        run(cos=nk.cos.double())
    with pytest.raises(ValueError, match="2 <= R <= D=16"):
        run(cos=torch.zeros(2, 9), sin=torch.zeros(2, 9))
    with pytest.raises(ValueError, match="new_key.slots_mapping must be int32/int64"):
        run(slots_mapping=nk.slots_mapping.float())
    with pytest.raises(ValueError, match="new_key.v must be"):
        run(v=nk.v.half())
    with pytest.raises(ValueError, match="q_norm and k_norm come together"):
        run(q_norm=torch.ones(16, device=DEVICE))
    with pytest.raises(ValueError, match=r"new_key.k_norm must be a float \[D=16\] weight"):
        run(q_norm=torch.ones(16, device=DEVICE), k_norm=torch.ones(8, device=DEVICE))



# ------------------------------------------------------------------------------ decode (CPU)

DECODE_LENS = [37, 1, 16, 5]


# The same combinations, alternating the direct (1 split) and split + reduce paths.
DECODE_COMBOS = [(*combo, 1 + 2 * (i % 2)) for i, combo in enumerate(COMBOS)]
DECODE_IDS = [f"{name}-s{combo[-1]}" for name, combo in zip(COMBO_IDS, DECODE_COMBOS)]


@pytest.mark.parametrize("dtype, gqa, window, num_splits", DECODE_COMBOS, ids=DECODE_IDS)
def test_decode_matches_reference(dtype, gqa, window, num_splits):
    num_kv_heads, head_dim = 2, 16
    num_q_heads = num_kv_heads * gqa
    case = make_case(DECODE_LENS, DECODE_LENS, num_q_heads, num_kv_heads, head_dim, 16, dtype)
    q = decode_query(case, num_q_heads, head_dim)
    out = run_decode(case, q, window=window, num_splits=num_splits)
    assert_close(out, reference_decode(case, q, 1 / math.sqrt(head_dim), window))


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("window", [None, 6])
def test_decode_page_prefetch_matches_reference(window, num_splits):
    # The decode config the GPU sweep may pick: page ids carried one step ahead.
    lens = [37, 1, 16, 50]
    case = make_case(lens, lens, 8, 2, 16, 16, torch.float32)
    q = decode_query(case, 8, 16)
    out = torch.full_like(q, float("nan"))
    config = attention_decode.DecodeConfig(block_n=16, num_warps=4, num_stages=1,
                                           prefetch_pages=True)
    attention_decode.launch_decode(q, case.k_cache, case.v_cache, case.block_table, case.seq_len,
                                   0.25, window, out, num_splits, None, config)
    assert_close(out, reference_decode(case, q, 0.25, window))


def test_decode_num_splits_agree():
    lens = [90, 3]
    case = make_case(lens, lens, 4, 2, 32, 32, torch.float32)
    q = decode_query(case, 4, 32)
    ref = reference_decode(case, q, 0.2, None)
    outs = [run_decode(case, q, scale=0.2, num_splits=s) for s in (1, 2, 5)]
    for out in outs:
        assert_close(out, ref)
        # Splits only reorder fp32 sums: agreement is far tighter than the reference tolerance.
        torch.testing.assert_close(out, outs[0], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_zero_length_sequence_writes_zeros(num_splits):
    lens = [0, 21, 0]
    case = make_case(lens, lens, 4, 2, 16, 16, torch.float32)
    q = decode_query(case, 4, 16)
    out = run_decode(case, q, num_splits=num_splits)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert torch.equal(out[2], torch.zeros_like(out[2]))
    assert_close(out, reference_decode(case, q, 0.25, None))


def test_decode_strided_inputs_and_workspace():
    lens = [25, 48]
    case = make_case(lens, lens, 4, 2, 16, 16, torch.float32, strided=True)
    q = torch.randn(2, 8, 16)[:, 2:6]  # row-strided query view
    splits = 3
    workspace = torch.full((decode_workspace_numel(2, 4, 16, splits),), float("nan"))
    out = run_decode(case, q, num_splits=splits, workspace=workspace)
    assert_close(out, reference_decode(case, q, 0.25, None))
    assert not torch.isnan(workspace).any()  # every partial (incl. empty splits) was written
    with pytest.raises(ValueError, match="workspace has"):
        run_decode(case, q, num_splits=splits, workspace=workspace[:-1])


def test_decode_default_splits_uses_heuristic():
    lens = [600, 9]  # 600 keys -> max_context 640 -> up to 2 splits of >= 256 keys
    case = make_case(lens, lens, 2, 1, 16, 32, torch.float32, extra_blocks=0)
    assert choose_num_splits(2, 1, case.block_table.shape[1] * 32) == 2
    q = decode_query(case, 2, 16)
    assert_close(run_decode(case, q), reference_decode(case, q, 0.25, None))


def test_choose_num_splits():
    for batch in (1, 3, 32, 256):
        for ctx in (16, 512, 4096, 131072):
            s = choose_num_splits(batch, 8, ctx)
            assert s >= 1 and s & (s - 1) == 0 and s <= DecodeAttentionTuning().max_splits
            assert s == 1 or ctx // s >= DecodeAttentionTuning().min_keys_per_split
    assert choose_num_splits(256, 8, 4096) == 1  # 2048 programs already fill 132 SMs
    assert choose_num_splits(32, 8, 4096) >= 2  # 256 programs: < 2 per SM without splitting
    assert choose_num_splits(16, 8, 4096) == 4  # 512 programs: one wave (measured, see the NOTE)
    assert choose_num_splits(1, 8, 8192) == 32  # batch 1: split long contexts widely
    assert choose_num_splits(1, 8, 100) == 1  # too short to be worth splitting
    assert choose_num_splits(1, 8, 8192, num_sms=16) < choose_num_splits(1, 8, 8192)


def test_decode_config_by_grid():
    cfg = attention_decode.decode_config
    # One program per SM or fewer (batch 1): 32-key tiles, so each split of a short context
    # holds a tile; a larger grid keeps 64-key tiles in 3 stages; the interpreter keeps 16.
    assert cfg(64, True, programs=2 * 16, num_sms=132) == attention_decode.DecodeConfig(32, 4, 2)
    assert cfg(128, True, programs=132, num_sms=132).block_n == 32
    assert cfg(64, True, programs=512, num_sms=132) == attention_decode.DecodeConfig(64, 4, 3)
    assert cfg(64, True) == attention_decode.DecodeConfig(64, 4, 3)  # grid not known
    assert cfg(256, True, programs=8, num_sms=132).block_n == 32 == cfg(256, True).block_n
    assert cfg(64, False, programs=8).block_n == 16
    # Tiles come from the tuning: an override wins on CUDA, the interpreter keeps its tiles.
    override = DecodeAttentionTuning(override=DecodeTiles(block_n=128, num_warps=8, num_stages=2))
    assert cfg(64, True, programs=8, tuning=override) == attention_decode.DecodeConfig(128, 8, 2)
    assert cfg(64, False, programs=8, tuning=override).block_n == 16
    wide = DecodeAttentionTuning(programs_per_sm=8)
    assert choose_num_splits(16, 8, 4096, tuning=wide) > choose_num_splits(16, 8, 4096)


# --------------------------------------------------------------------------- argument checks

def _decode_args(**over):
    case = make_case([5], [5], 4, 2, 16, 16, torch.float32)
    args = dict(q=torch.randn(1, 4, 16), k_cache=case.k_cache, v_cache=case.v_cache,
                block_table=case.block_table, seq_len=case.seq_len, scale=None,
                sliding_window=None, out=torch.empty(1, 4, 16))
    args.update(over)
    return args


@pytest.mark.parametrize(
    "over, exc, match",
    [
        (dict(q=torch.randn(1, 4, 16, dtype=torch.float64)), TypeError, "float32, float16"),
        (dict(out=torch.empty(1, 4, 16, dtype=torch.float16)), TypeError, "out must have q's"),
        (dict(block_table=torch.zeros(1, 3, dtype=torch.int64)), TypeError, "must be int32"),
        (dict(seq_len=torch.tensor([5, 5], dtype=torch.int32)), ValueError, "seq_len must be 1-D"),
        (dict(q=torch.randn(1, 3, 16), out=torch.empty(1, 3, 16)), ValueError, "multiple of Hk"),
        (dict(q=torch.randn(1, 4, 24), out=torch.empty(1, 4, 24)), ValueError, "head_dim"),
        (dict(out=torch.empty(2, 4, 16)), ValueError, "out must have q's shape"),
        (dict(q=torch.randn(1, 4, 32)[..., ::2]), ValueError, "contiguous in its last dim"),
        (dict(sliding_window=0), ValueError, "sliding_window"),
        (dict(num_splits=0), ValueError, "num_splits"),
        (dict(scale=torch.tensor(0.5)), TypeError, "scale"),
        (dict(q=torch.randn(1, 4, 16, device="meta")), ValueError, "is on cpu but q is on meta"),
    ],
)
def test_decode_rejects_bad_input(over, exc, match):
    with pytest.raises(exc, match=match):
        paged_attention_decode(**_decode_args(**over))


def test_prefill_rejects_bad_input():
    case = make_case([5], [5], 4, 2, 16, 16, torch.float32)
    out = torch.empty_like(case.q)
    with pytest.raises(TypeError, match="query_start_loc must be int32"):
        paged_attention_prefill(case.q, case.k_cache, case.v_cache, case.block_table, case.seq_len,
                                case.query_start_loc.long(), None, None, out)
    with pytest.raises(ValueError, match=r"\[B \+ 1\]"):
        paged_attention_prefill(case.q, case.k_cache, case.v_cache, case.block_table, case.seq_len,
                                case.query_start_loc[:1], None, None, out)
    with pytest.raises(ValueError, match="v_cache shape"):
        paged_attention_prefill(case.q, case.k_cache, case.v_cache[:, :8], case.block_table,
                                case.seq_len, case.query_start_loc, None, None, out)
    with pytest.raises(ValueError, match="q must be 3-D"):
        paged_attention_prefill(case.q[0], case.k_cache, case.v_cache, case.block_table,
                                case.seq_len, case.query_start_loc, None, None, out[0])
    k_new, v_new = new_kv_rows(case)
    bad_new_kv = [
        ((k_new,), TypeError, "pair"),
        ((k_new[:3], v_new), ValueError, r"new k must be \[T, Hk, D\]"),
        ((k_new, v_new.double()), TypeError, "cache's dtype"),
        ((k_new, v_new.transpose(1, 2).contiguous().transpose(1, 2)), ValueError, "last dim"),
    ]
    for new_kv, exc, match in bad_new_kv:
        with pytest.raises(exc, match=match):
            paged_attention_prefill(case.q, case.k_cache, case.v_cache, case.block_table,
                                    case.seq_len, case.query_start_loc, None, None, out,
                                    new_kv=new_kv)


# ------------------------------------------------------------------------ GPU, real shapes

BF16, FP16 = torch.bfloat16, torch.float16
GPU_DTYPES = [BF16, FP16]
# (Hq, Hk): GQA ratios 1, 4, 8.
GPU_HEADS = [(32, 32), (32, 8), (32, 4)]
_IDS = (lambda d: str(d).replace("torch.", ""), lambda h: f"gqa{h[0] // h[1]}", None, None, None)
# Every dtype, GQA ratio, head dim, block size and window appears in the gpu tier's cases.
ATTENTION_SWEEP = sweep(
    [GPU_DTYPES, GPU_HEADS, [64, 128], [16, 32], [None, 1024]],
    fast=[(BF16, (32, 32), 64, 16, None), (BF16, (32, 8), 128, 32, 1024),
          (BF16, (32, 4), 128, 16, None), (FP16, (32, 4), 64, 32, 1024),
          (FP16, (32, 8), 64, 16, None), (FP16, (32, 32), 128, 32, 1024)],
    ids=_IDS)


@pytest.mark.parametrize("dtype, heads, head_dim, block_size, window", ATTENTION_SWEEP)
def test_gpu_prefill(dtype, heads, head_dim, block_size, window):
    # Plain prefills up to 2048 plus a 512-token chunk after 7680 tokens of context (8192 total).
    q_lens, seq_len = [2048, 1, 333, 512], [2048, 1, 333, 8192]
    case = make_case(q_lens, seq_len, heads[0], heads[1], head_dim, block_size, dtype)
    out = run_prefill(case, window=window, max_query_len=max(q_lens))
    ref = reference_prefill(case, 1 / math.sqrt(head_dim), window, torch.float32)
    assert_close(out, ref)
    # The fresh sequences read from the new rows (TMA), their cache slots poisoned.
    new_kv = new_kv_rows(case, strided=True)
    poison_new_slots_of_fresh_sequences(case)
    out = torch.full_like(case.q, float("nan"))
    paged_attention_prefill(case.q, case.k_cache, case.v_cache, case.block_table, case.seq_len,
                            case.query_start_loc, None, window, out, max(q_lens), new_kv=new_kv)
    assert_close(out, ref)


@pytest.mark.parametrize("dtype, heads, head_dim, block_size, window", ATTENTION_SWEEP)
def test_gpu_decode(dtype, heads, head_dim, block_size, window):
    lens = [8192, 1, 4095, 0, 777, 2048, 16, 5000]
    case = make_case(lens, lens, heads[0], heads[1], head_dim, block_size, dtype)
    q = decode_query(case, heads[0], head_dim)
    ref = reference_decode(case, q, 1 / math.sqrt(head_dim), window, torch.float32)
    for splits in (None, 1, 8):
        assert_close(run_decode(case, q, window=window, num_splits=splits), ref)
    # Page prefetch (the variant the sweep compares with the default), direct and split.
    for config in GPU_DECODE_CONFIGS:
        for splits in (1, 8):
            out = torch.full_like(q, float("nan"))
            attention_decode.launch_decode(q, case.k_cache, case.v_cache, case.block_table,
                                           case.seq_len, 1 / math.sqrt(head_dim), window, out,
                                           splits, None, config)
            assert_close(out, ref)


GPU_DECODE_CONFIGS = [
    attention_decode.DecodeConfig(block_n=64, num_warps=4, num_stages=3, prefetch_pages=True),
    attention_decode.DecodeConfig(block_n=128, num_warps=8, num_stages=4, prefetch_pages=True),
]
# Prefill variants at real shapes: the schedule before GQA packing / page prefetch / one loop,
# and the packed shapes the sweep ranks (BLOCK_M 128 on 8 warps, BLOCK_N 32..128, 2-4 stages).
GPU_PREFILL_CONFIGS = [
    PrefillConfig(64, 64, 4, 2, pack_gqa=False, prefetch_pages=False, single_loop=False),
    PrefillConfig(64, 64, 4, 3, pack_gqa=True),
    PrefillConfig(128, 64, 8, 3, pack_gqa=True),
    PrefillConfig(128, 128, 8, 2, pack_gqa=True),
    PrefillConfig(128, 32, 8, 4, pack_gqa=True, single_loop=False),
    PrefillConfig(64, 32, 8, 3, pack_gqa=True, prefetch_pages=False),
    PrefillConfig(128, 64, 8, 3, pack_gqa=False),
]


# GQA 4 (Llama-3-8B), 7 (Qwen2.5-7B: 28/4, a group that does not divide a tile) and 1. The gpu
# tier runs the non-dividing group through the page table; each new-keys case (block size 16)
# compiles 15 kernels (~30 s on an H100), so those are the slow tier's.
@pytest.mark.parametrize("dtype, heads, block_size, window", sweep(
    [GPU_DTYPES, [(32, 8), (28, 4), (32, 32)], [16, 64], [None, 1024]],
    fast=[(BF16, (28, 4), 64, 1024)],
    ids=(_IDS[0], lambda h: f"{h[0]}q{h[1]}kv", None, None)))
def test_gpu_prefill_variants(dtype, heads, block_size, window):
    """Each kernel variant (packing, prefetch, loop structure, tiles) at d=128, 8k context."""
    d = 128
    q_lens, seq_len = [2048, 1, 333, 512], [2048, 100, 333, 8192]
    case = make_case(q_lens, seq_len, heads[0], heads[1], d, block_size, dtype)
    ref = reference_prefill(case, d ** -0.5, window, torch.float32)
    for config in GPU_PREFILL_CONFIGS:
        out = _launch_prefill(case, config, d ** -0.5, window)
        assert_close(out, ref)
    # The new-keys path of each variant, by TMA and by pointers (cache slots of the fresh
    # sequences poisoned from here on). Fresh sequences read no pages, so one block size covers
    # it (compiles dominate this test: 15 kernels per parameter set, ~30 s on an H100).
    if block_size != 16:
        return
    new_kv = new_kv_rows(case)
    poison_new_slots_of_fresh_sequences(case)
    for config in GPU_PREFILL_CONFIGS:
        for tma in (True, False):
            out = torch.full_like(case.q, float("nan"))
            attention_prefill.launch_prefill(
                case.q, case.k_cache, case.v_cache, case.block_table, case.seq_len,
                case.query_start_loc, d ** -0.5, window, out,
                dataclasses.replace(config, tma=tma), new_kv)
            assert_close(out, ref)


@pytest.mark.slow_gpu
def test_gpu_sweep_candidates_are_correct():
    """Whatever tgraph.bench.tune_attention ranks first is safe to make the default."""
    from tgraph.bench.tune_attention import prefill_candidates

    d = 128
    case = make_case([1000, 1, 300], [1000, 2000, 300], 32, 8, d, 16, torch.bfloat16)
    ref = reference_prefill(case, d ** -0.5, None, torch.float32)
    variants = list(prefill_candidates())
    # The sweep re-times its best few without page prefetch / with three loops; one pipeline
    # depth of each tile shape covers those code paths (the depth changes no indexing).
    for config in variants[:]:
        if config.num_stages == 3 and config.block_n == 64:
            variants.append(dataclasses.replace(config, prefetch_pages=False))
            variants.append(dataclasses.replace(config, single_loop=False))
    for config in variants:
        assert_close(_launch_prefill(case, config, d ** -0.5, None), ref)


@pytest.mark.gpu
def test_gpu_cuda_graph_capture_and_replay():
    """Both kernels capture into one CUDA graph, and decode follows new seq_len on replay."""
    dtype, hq, hk, d, bs = torch.bfloat16, 32, 8, 128, 16
    lens = [300, 1000, 17]
    case = make_case(lens, lens, hq, hk, d, bs, dtype, extra_blocks=64)
    q_dec = decode_query(case, hq, d)
    out_pre = torch.empty_like(case.q)
    out_dec = torch.empty_like(q_dec)
    seq_len = case.seq_len.clone()  # decode's; changed between replays

    def step():
        paged_attention_prefill(case.q, case.k_cache, case.v_cache, case.block_table,
                                case.seq_len, case.query_start_loc, None, None, out_pre)
        paged_attention_decode(q_dec, case.k_cache, case.v_cache, case.block_table, seq_len,
                               None, None, out_dec)

    graph = capture_cuda_graph(step)
    out_pre.fill_(float("nan"))
    out_dec.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert_close(out_pre, reference_prefill(case, d**-0.5, None, torch.float32))
    assert_close(out_dec, reference_decode(case, q_dec, d**-0.5, None, torch.float32))

    # Decode with shorter contexts on replay: same graph, new device values (prefill unchanged).
    short = [n - 5 for n in lens]
    seq_len.copy_(torch.tensor(short, dtype=torch.int32))
    out_dec.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    truncated = PagedCase(case.q, [k[:n] for k, n in zip(case.k_dense, short)],
                          [v[:n] for v, n in zip(case.v_dense, short)], case.k_cache, case.v_cache,
                          case.block_table, seq_len, case.query_start_loc, case.q_lens)
    assert_close(out_dec, reference_decode(truncated, q_dec, d**-0.5, None, torch.float32))


def _cuda_time(fn, iters: int = 50) -> float:
    """Median seconds per call of ``fn`` over ``iters`` runs (after warm-up)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


@pytest.mark.parametrize("dtype, heads, head_dim, block_size", sweep(
    [GPU_DTYPES, GPU_HEADS, [64, 128], [16, 32]],
    fast=[(BF16, (32, 8), 128, 16), (FP16, (32, 4), 64, 32), (BF16, (32, 32), 64, 32)],
    ids=_IDS[:4]))
def test_gpu_decode_new_key(dtype, heads, head_dim, block_size):
    lens = [8192, 1, 4095, 0, 777, 2048, 16, 5000]
    for interleaved, window in ((False, None), (True, 1024)):
        case, q_raw, q_rot, k_rot, nk = new_key_case(lens, heads[0], heads[1], head_dim,
                                                     block_size, dtype, head_dim // 2,
                                                     interleaved)
        for splits in (None, 1, 8):
            check_new_key(case, q_raw, q_rot, k_rot, nk, window, splits, torch.float32)
