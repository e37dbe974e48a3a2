"""The multi-LoRA shrink-concat kernel: ``[x | scaled shrink in the slot's block]`` in one launch,
its in-launch split-K reduction (arrival counters, fixed-order sum), the split heuristic and the
Triton wrapper of the graph op, against an fp64 torch reference.

CPU runs go through Triton's interpreter at small shapes; ``gpu`` tests use the Llama-3.2-1B decode
shapes of the LoRA benchmark (16 tokens, K 2048/8192, packed ranks 16..48, 5 slots) in bf16/fp16.

The reference is fp64 from the same rounded inputs, so only accumulation order and the final
rounding differ. Errors are ``max|got - ref| / max|ref|`` over the LoRA columns:
- fp32: 1e-5 (fp32 accumulation over K <= 600 terms drifts ~1e-6).
- fp16: 2e-3 (one rounding of the fp32 sum, unit roundoff 4.9e-4, plus the interpreter's fp16 dot).
- bf16: 1e-2 (one rounding, unit roundoff 3.9e-3).
The copied ``x`` columns and the zero columns must be exact.
"""
from __future__ import annotations

import pytest
import torch

from tests.helpers import capture_cuda_graph
from tgraph.kernels.triton import lora_rows, lora_tile
from tgraph.kernels.triton.lora import (
    LORA_COUNTERS,
    lora_concat_splits,
    lora_segments,
    lora_shrink_concat,
    new_lora_counters,
)
from tgraph.kernels.triton_backend.lora import lora_shrink_concat_into
from tgraph.tuning import Tuning

HAS_CUDA = torch.cuda.is_available()
DEV = "cuda" if HAS_CUDA else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
# The K block for T <= 128 tokens: splits cover whole blocks of this many columns.
DECODE_BLOCK_K = 128


def _nan(shape, dtype, device=DEV) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.double(), ref.double()
    assert not got.isnan().any(), "unwritten (NaN) elements"
    return float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def _case(T: int, K: int, R: int, L: int, dtype: torch.dtype, device: str = DEV, slots=None):
    """Inputs scaled so the shrink is O(1); slot ranks differ (zero-padded rows of A)."""
    x = torch.randn(T, K, device=device).to(dtype)
    a = torch.randn(L, R, K, device=device) / K ** 0.5
    for s in range(L):
        a[s, max(1, R - 2 * s):] = 0  # slot s has rank R - 2s: padding rows are zero
    scaling = torch.rand(L, device=device) + 0.5
    if slots is None:
        slots = torch.randint(0, L, (T,), dtype=torch.int32, device=device)
    return x, a.to(dtype), scaling, slots


def _reference(x, a, scaling, slots, lead: int, width: int) -> torch.Tensor:
    """fp64 ``[x | blocks]``: slot s's block at ``K + lead + (s - 1) * R``, zeros elsewhere."""
    T, K = x.shape
    L, R, _ = a.shape
    out = torch.zeros(T, K + width, dtype=torch.float64, device=x.device)
    out[:, :K] = x.double()
    s = slots.long()
    shrink = torch.einsum("tk,trk->tr", x.double(), a.double()[s.clamp(0, L - 1)])
    shrink *= scaling.double()[s.clamp(0, L - 1)][:, None]
    for t in range(T):
        if 0 < int(s[t]) < L:
            first = K + lead + (int(s[t]) - 1) * R
            out[t, first:first + R] = shrink[t]
    return out


def _check(out, x, a, scaling, slots, lead, width, dtype, rows=None) -> None:
    rows = torch.ones(x.shape[0], dtype=torch.bool, device=x.device) if rows is None else rows
    K = x.shape[1]
    want = _reference(x, a, scaling, slots, lead, width)
    assert torch.equal(out[rows, :K], x[rows]), "x must be copied exactly"
    lora, want_lora = out[rows, K:], want[rows, K:]
    # Outside the slot's block (and in the zero rows of padded ranks) the kernel writes exact zeros.
    assert (lora[want_lora == 0] == 0).all(), "columns outside the slot's block must be zero"
    if want_lora.abs().max() > 0:
        assert _rel(lora, want_lora) <= TOL[dtype]


# --------------------------------------------------------------------------- the kernel

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 5, 16, 70])
@pytest.mark.parametrize("splits", [None, 1, 3, 7])
def test_shrink_concat_matches_reference(dtype, T, splits):
    # K 600: 5 blocks of 128, the last ragged (88 columns); 7 splits leave two chunks empty.
    # R 12 pads to a 16-wide block; slot 3 is never used; lead 5 and 3 trailing pad columns.
    K, R, L, lead = 600, 12, 5, 5
    width = lead + (L - 1) * R + 3
    slots = torch.tensor([[0, 1, 2, 4][i % 4] for i in range(T)], dtype=torch.int32, device=DEV)
    x, a, scaling, slots = _case(T, K, R, L, dtype, slots=slots[torch.randperm(T, device=DEV)])
    out = _nan((T, K + width), dtype)
    counters = new_lora_counters(DEV)
    lora_shrink_concat(x, a, scaling, slots, out, counters, lead=lead, splits=splits, rows=False)
    _check(out, x, a, scaling, slots, lead, width, dtype)
    assert not counters.any(), "the launch must leave its counters zeroed"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 5, 16])
@pytest.mark.parametrize("chunk_elems", [8192, 256], ids=["one-k-tile", "k-loop"])
@pytest.mark.parametrize("R", [12, 1])
def test_per_token_kernel_matches_reference(dtype, T, chunk_elems, R, monkeypatch):
    # The decode path: one program per (token, rank chunk). K 600 in one 1024-wide tile (ranks
    # in chunks of 8: two chunks for R 12), or in 256-wide tiles (chunks of one rank: the loop
    # and its A tiles loaded after the wait). Lead 5 and 3 trailing pad columns, slot 3 unused.
    monkeypatch.setattr(lora_rows, "_ROWS_CHUNK_ELEMS", chunk_elems)
    K, L, lead = 600, 5, 5
    width = lead + (L - 1) * R + 3
    slots = torch.tensor([[0, 1, 2, 4][i % 4] for i in range(T)], dtype=torch.int32, device=DEV)
    x, a, scaling, slots = _case(T, K, R, L, dtype, slots=slots[torch.randperm(T, device=DEV)])
    out = _nan((T, K + width), dtype)
    lora_shrink_concat(x, a, scaling, slots, out, new_lora_counters(DEV), lead=lead, rows=True)
    _check(out, x, a, scaling, slots, lead, width, dtype)


def test_decode_batches_take_the_per_token_kernel(monkeypatch):
    launched = []
    monkeypatch.setattr(lora_tile, "launch_rows",
                        lambda *args: launched.append(args[0].shape[0]))
    T, K, R, L = 16, 64, 8, 3
    x, a, scaling, slots = _case(T, K, R, L, torch.float32)
    counters = new_lora_counters(DEV)
    lora_shrink_concat(x, a, scaling, slots, _nan((T, K + 2 * R), torch.float32), counters)
    assert launched == [16]
    # Tile options (splits, config) and more than 64 tokens select the slot-tile kernel.
    lora_shrink_concat(x, a, scaling, slots, _nan((T, K + 2 * R), torch.float32), counters,
                       splits=2)
    x, a, scaling, slots = _case(65, K, R, L, torch.float32)
    lora_shrink_concat(x, a, scaling, slots, _nan((65, K + 2 * R), torch.float32), counters)
    assert launched == [16]


def test_two_launches_reuse_the_counters_and_are_bit_identical():
    # Two launches in a row on one counter buffer (as the linears of a step, or graph replays):
    # each finds the counters zeroed, and a rerun gives the same bits (no float atomics).
    T, K, R, L = 21, 1024, 16, 4
    x, a, scaling, slots = _case(T, K, R, L, torch.float32)
    counters = new_lora_counters(DEV)
    assert lora_concat_splits(T, K, R, L) > 1
    first = _nan((T, K + 3 * R), torch.float32)
    lora_shrink_concat(x, a, scaling, slots, first, counters, rows=False)
    assert not counters.any()
    second = _nan((T, K + 3 * R), torch.float32)
    lora_shrink_concat(x, a, scaling, slots, second, counters, rows=False)
    assert not counters.any()
    assert torch.equal(first, second)
    _check(first, x, a, scaling, slots, 0, 3 * R, torch.float32)


@pytest.mark.parametrize("slot_values", [[0, 0, 0, 0], [2, 2, 2, 2]],
                         ids=["all-base", "one-adapter"])
@pytest.mark.parametrize("rows", [False, True], ids=["tiles", "per-token"])
def test_degenerate_batches(slot_values, rows):
    T, K, R, L = 4, 300, 16, 3
    x, a, scaling, slots = _case(T, K, R, L, torch.float32,
                                 slots=torch.tensor(slot_values, dtype=torch.int32, device=DEV))
    out = _nan((T, K + 2 * R), torch.float32)
    lora_shrink_concat(x, a, scaling, slots, out, new_lora_counters(DEV),
                       splits=None if rows else 2, rows=rows)
    _check(out, x, a, scaling, slots, 0, 2 * R, torch.float32)
    if slot_values[0] == 0:
        assert (out[:, K:] == 0).all()


@pytest.mark.parametrize("rows", [False, True], ids=["tiles", "per-token"])
def test_out_of_range_slots_leave_their_rows_unwritten(rows):
    # Documented: a token outside [0, L) belongs to no tile (checking would need a host sync).
    T, K, R, L = 5, 64, 16, 3
    slot_ids = torch.tensor([1, 7, -1, 2, 0], dtype=torch.int32, device=DEV)
    x, a, scaling, slots = _case(T, K, R, L, torch.float32, slots=slot_ids)
    out = _nan((T, K + 2 * R), torch.float32)
    lora_shrink_concat(x, a, scaling, slots, out, new_lora_counters(DEV), rows=rows)
    assert out[1:3].isnan().all()
    valid = torch.tensor([True, False, False, True, True], device=DEV)
    _check(out, x, a, scaling, slots, 0, 2 * R, torch.float32, rows=valid)


def test_prefill_tiles_and_strided_rows():
    # T=150 takes the BLOCK_T=64 tiles; x is a row-strided view; rank 48 (3 packed parts of 16)
    # pads to a 64-wide block; 2 forced splits.
    T, K, R, L = 150, 96, 48, 4
    x, a, scaling, slots = _case(T, K, R, L, torch.float32)
    wide = torch.randn(T, K + 8, device=DEV)
    wide[:, :K] = x
    out = _nan((T, K + 3 * R), torch.float32)
    counters = new_lora_counters(DEV)
    lora_shrink_concat(wide[:, :K], a, scaling, slots, out, counters, splits=2)
    _check(out, x, a, scaling, slots, 0, 3 * R, torch.float32)
    assert not counters.any()


def test_per_token_kernel_strided_rows():
    # A row-strided x and a row-strided out (an operand with spare columns after the block).
    T, K, R, L = 6, 96, 48, 4
    x, a, scaling, slots = _case(T, K, R, L, torch.float32)
    wide = torch.randn(T, K + 8, device=DEV)
    wide[:, :K] = x
    out = _nan((T, K + 3 * R + 5), torch.float32)
    lora_shrink_concat(wide[:, :K], a, scaling, slots, out[:, :K + 3 * R], new_lora_counters(DEV),
                       rows=True)
    _check(out[:, :K + 3 * R], x, a, scaling, slots, 0, 3 * R, torch.float32)
    assert out[:, K + 3 * R:].isnan().all(), "columns past out's view must stay untouched"


def test_segments_may_be_passed_and_match_the_sort():
    slots = torch.tensor([3, 0, 1, 3, 1, 0], dtype=torch.int32, device=DEV)
    order, seg = lora_segments(slots, 5)
    assert order.tolist() == [1, 5, 2, 4, 0, 3]  # stable
    assert seg.tolist() == [0, 2, 4, 4, 6, 6] and seg.dtype == torch.int32
    x, a, scaling, _ = _case(6, 64, 16, 5, torch.float32)
    with_seg, without = _nan((6, 64 + 64), torch.float32), _nan((6, 64 + 64), torch.float32)
    lora_shrink_concat(x, a, scaling, slots, with_seg, new_lora_counters(DEV),
                       segments=(order.to(torch.int32), seg))
    lora_shrink_concat(x, a, scaling, slots, without, new_lora_counters(DEV))
    assert torch.equal(with_seg, without)


def test_graph_op_wrapper():
    # The Triton wrapper the engine runs: int64 slots, engine-style int32 segments, a K the
    # heuristic splits.
    T, K, R, L = 9, 1024, 16, 4
    assert lora_concat_splits(T, K, R, L) > 1
    x, a, scaling, _ = _case(T, K, R, L, torch.float32)
    slots = torch.tensor([3, 0, 1, 1, 3, 2, 0, 1, 3], device=DEV)
    order, seg = lora_segments(slots, L)
    out = _nan((T, K + 2 + 3 * R), torch.float32)
    counters = new_lora_counters(DEV)
    lora_shrink_concat_into([out], x, a, scaling, slots, order.to(torch.int32), seg, counters,
                            tuning=Tuning(), lead=2, width=2 + 3 * R)
    _check(out, x, a, scaling, slots, 2, 2 + 3 * R, torch.float32)
    with pytest.raises(ValueError, match="must have K \\+ width = 1075 columns"):
        lora_shrink_concat_into([out], x, a, scaling, slots, order, seg, counters,
                                tuning=Tuning(), lead=2, width=51)


# --------------------------------------------------------------------------- the heuristic

def test_split_heuristic_fills_the_gpu_at_decode():
    sms = 132  # the count assumed off CUDA
    for K in (2048, 8192):
        for R in (16, 32, 48):
            splits = lora_concat_splits(16, K, R, 5, "cpu")
            tiles = 16 // 16 + 5
            # Two K blocks per split at least (measured faster than one on an H100).
            assert 8 <= splits <= min(32, K // (2 * DECODE_BLOCK_K)), (K, R, splits)
            assert 48 <= tiles * splits <= 2 * sms, (K, R, splits)
            # The partials the last program of a tile sums stay bounded (rank 48 pads to 64).
            assert splits * 16 * max(16, 1 << (R - 1).bit_length()) <= 16384
            # Every split gets the same whole number of K blocks but the last, never none.
            per = -(-(K // DECODE_BLOCK_K) // splits)
            assert (splits - 1) * per < K // DECODE_BLOCK_K


def test_split_heuristic_edges():
    assert lora_concat_splits(16, 100, 16, 5) == 1  # one K block: nothing to split
    assert lora_concat_splits(16, 256, 16, 5) == 1  # two blocks: one split of two
    assert lora_concat_splits(0, 2048, 16, 5) == 1
    # Prefill already has many tiles: fewer splits than decode at the same K ...
    assert lora_concat_splits(4096, 2048, 16, 5) < lora_concat_splits(16, 2048, 16, 5)
    # ... and more tiles than counters run unsplit.
    assert lora_concat_splits(64 * LORA_COUNTERS, 2048, 16, 5) == 1
    assert lora_concat_splits(4096, 2048, 16, 5, max_tiles=10) == 1
    assert lora_concat_splits(1, 8192, 16, 2) == 32
    with pytest.raises(ValueError, match="in_features must be a non-negative int"):
        lora_concat_splits(16, -1, 16, 5)
    with pytest.raises(ValueError, match="num_tokens must be a non-negative int"):
        lora_concat_splits(16.0, 2048, 16, 5)


# --------------------------------------------------------------------------- bad input

def test_rejects_bad_input():
    T, K, R, L = 4, 64, 16, 3
    x, a, scaling, slots = _case(T, K, R, L, torch.float32)
    out = torch.empty(T, K + 2 * R, device=DEV)
    counters = new_lora_counters(DEV)
    with pytest.raises(ValueError, match=r"out must be \[4, >= 96\]"):
        lora_shrink_concat(x, a, scaling, slots, out[:, :90], counters)
    with pytest.raises(ValueError, match=r"out must be \[4, >= 99\]"):
        lora_shrink_concat(x, a, scaling, slots, out, counters, lead=3)
    with pytest.raises(TypeError, match="out must be torch.float32"):
        lora_shrink_concat(x, a, scaling, slots, out.half(), counters)
    with pytest.raises(ValueError, match=r"lora_a must be \[L, R, 64\]"):
        lora_shrink_concat(x, a[:, :, :32], scaling, slots, out, counters)
    with pytest.raises(TypeError, match="lora_a dtype"):
        lora_shrink_concat(x, a.half(), scaling, slots, out, counters)
    with pytest.raises(TypeError, match="token_slots must be an int32"):
        lora_shrink_concat(x, a, scaling, slots.float(), out, counters)
    with pytest.raises(ValueError, match=r"token_slots must have shape \[4\]"):
        lora_shrink_concat(x, a, scaling, slots[:3], out, counters)
    with pytest.raises(TypeError, match="scaling must be a float32"):
        lora_shrink_concat(x, a, scaling.double(), slots, out, counters)
    with pytest.raises(TypeError, match="counters must be a 1-D int32 tensor"):
        lora_shrink_concat(x, a, scaling, slots, out, counters.long())
    with pytest.raises(ValueError, match="segments must be"):
        lora_shrink_concat(x, a, scaling, slots, out, counters, segments=lora_segments(slots, 4))
    with pytest.raises(ValueError, match="need one counter per tile"):
        lora_shrink_concat(x, a, scaling, slots, out, counters[:2], splits=2)
    with pytest.raises(ValueError, match="splits must be a positive int"):
        lora_shrink_concat(x, a, scaling, slots, out, counters, splits=0)
    with pytest.raises(ValueError, match=r"per-token kernel \(rows=True\) takes neither"):
        lora_shrink_concat(x, a, scaling, slots, out, counters, splits=2, rows=True)


# --------------------------------------------------------------------------- sm_90 compile

_COMPILE_SCRIPT = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from tgraph.kernels.triton import lora_common, lora_rows, lora_tile

fn = lora_tile._shrink_concat_kernel
PTRS = {"scale_ptr": "*fp32", "order_ptr": "*i32", "seg_ptr": "*i32", "part_ptr": "*fp32",
        "count_ptr": "*i32", "scale2_ptr": "*fp32", "seg2_ptr": "*i32", "count2_ptr": "*i32"}
# What the wrapper launches: decode (split, 16-token tiles) and prefill (no split, 64-token
# tiles) tiles, bf16 tensor-core dots and fp32 IEEE dots, PDL on; one adapter set, or two
# (stacked features; the second set's token order int32 as engines pass it, or int64 as
# lora_segments returns it).
for dtype, split, block_t, block_r in (("bf16", True, 16, 64), ("bf16", False, 64, 64),
                                       ("fp16", True, 16, 16), ("fp32", True, 16, 32),
                                       ("bf16", False, 64, 256)):
    for second, order2 in ((False, "*i32"), (True, "*i32"), (True, "*i64")):
        block_k = lora_tile._block_k(16 if block_t == 16 else 4096, 4096)
        consts = dict(SECOND=second, SPLIT=split, F32_DOT=dtype == "fp32", BLOCK_T=block_t,
                      BLOCK_R=block_r, BLOCK_K=block_k,
                      BLOCK_L=8, BLOCK_C=lora_common.ZERO_CHUNK,
                      SPLIT_BLOCK=lora_tile._split_block(16 if split else 1, block_t, block_r),
                      PDL=True)
        sig, attrs = {}, {}
        for i, name in enumerate(fn.arg_names):
            if name in consts:
                sig[name] = "constexpr"
            elif name.endswith("_ptr"):
                sig[name] = {**PTRS, "order2_ptr": order2}.get(name, "*" + dtype)
                attrs[(i,)] = [["tt.divisibility", 16]]
            else:
                sig[name] = "i32"
        warps = 8 if block_t * block_r >= 64 * 128 else 4
        triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": warps})
# The per-token decode kernel: K 2048 (chunks of 4 ranks) and 8192 (one rank), bf16 and fp32,
# plain and with the norm folded in (RMSNorm, add + RMSNorm); one adapter set or two.
fn = lora_rows._shrink_rows_kernel
for dtype, block_r, block_k, prologue in (("bf16", 4, 2048, 0), ("bf16", 1, 8192, 0),
                                          ("fp32", 8, 1024, 0), ("bf16", 4, 2048, 1),
                                          ("bf16", 2, 4096, 2), ("fp16", 4, 2048, 2)):
    for second, slots2 in ((False, "*i32"), (True, "*i32"), (True, "*i64")):
        consts = dict(PROLOGUE=prologue, SECOND=second, BLOCK_R=block_r, BLOCK_K=block_k,
                      BLOCK_L=4, BLOCK_C=lora_common.ZERO_CHUNK, PDL=True)
        sig, attrs = {}, {}
        for i, name in enumerate(fn.arg_names):
            if name in consts:
                sig[name] = "constexpr"
            elif name.endswith("_ptr"):
                ptrs = {"scale_ptr": "*fp32", "slots_ptr": "*i32", "scale2_ptr": "*fp32",
                        "slots2_ptr": slots2}
                sig[name] = ptrs.get(name, "*" + dtype)
                attrs[(i,)] = [["tt.divisibility", 16]]
            else:
                sig[name] = "fp32" if name == "eps" else "i32"
        triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": 8})
print("compiled")
"""


@pytest.mark.slow
def test_kernel_compiles_for_sm90_without_a_gpu():
    # The interpreter accepts code the compiler rejects; compiling for an H100 target with the
    # bundled ptxas catches that on a CPU-only machine, in a process without TRITON_INTERPRET.
    from tests.helpers import run_without_interpreter

    done = run_without_interpreter(_COMPILE_SCRIPT)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-4000:]


# --------------------------------------------------------------------------- GPU, real shapes

GPU_TOL = {torch.float16: 2e-3, torch.bfloat16: 1e-2}
# Llama-3.2-1B decode at batch 16: q/k/v packed (3 rank blocks), o, gate/up packed, down.
GPU_SHAPES = [(2048, 3072, 48), (2048, 2048, 16), (2048, 16384, 32), (8192, 2048, 16)]


def _bench_slots(T: int, adapters: int = 4) -> torch.Tensor:
    """Request ``i`` uses adapter ``1 + i % adapters``, as the LoRA benchmark's mixed batch."""
    return torch.tensor([1 + i % adapters for i in range(T)], dtype=torch.int32, device="cuda")


def _lora_linear_ref(x, w, a, b, scaling, slots) -> torch.Tensor:
    s = slots.long()
    delta = torch.einsum("tr,tnr->tn", torch.einsum("tk,trk->tr", x.double(), a.double()[s]),
                         b.double()[s]) * scaling.double()[s][:, None]
    delta[s == 0] = 0
    return x.double() @ w.double().t() + delta


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "K{}-N{}-R{}".format(*s))
@pytest.mark.parametrize("pattern", ["mixed", "one-adapter", "with-base"])
@pytest.mark.parametrize("rows", [True, False], ids=["per-token", "tiles"])
def test_gpu_decode_shapes(shape, dtype, pattern, rows):
    K, N, R = shape
    T, L = 16, 5
    slots = {"mixed": _bench_slots(T), "one-adapter": _bench_slots(T, 1),
             "with-base": torch.randint(0, L, (T,), dtype=torch.int32, device="cuda")}[pattern]
    x, a, scaling, slots = _case(T, K, R, L, dtype, "cuda", slots)
    assert lora_concat_splits(T, K, R, L, "cuda") > 1
    counters = new_lora_counters("cuda")
    out = _nan((T, K + 4 * R), dtype, "cuda")
    lora_shrink_concat(x, a, scaling, slots, out, counters, rows=rows)
    _check(out, x, a, scaling, slots, 0, 4 * R, dtype)
    # The GEMM on [W | B blocks] is the LoRA linear.
    w = (torch.randn(N, K, device="cuda") / K ** 0.5).to(dtype)
    b = (torch.randn(L, N, R, device="cuda") / R ** 0.5).to(dtype)
    w_cat = torch.cat([w, *[b[s] for s in range(1, L)]], dim=1)
    y = out @ w_cat.t()
    want = _lora_linear_ref(x, w, a, b, scaling, slots)
    assert _rel(y, want) <= 2 * GPU_TOL[dtype]  # the shrink's rounding, then the GEMM's
    # Deterministic: no float atomics, so reruns are bit-identical; counters stay zeroed.
    for _ in range(3):
        again = _nan((T, K + 4 * R), dtype, "cuda")
        lora_shrink_concat(x, a, scaling, slots, again, counters, rows=rows)
        assert torch.equal(again, out)
    assert not counters.any()


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 7, 300, 2048, 8192])
def test_gpu_other_token_counts(T):
    K, R, L, dtype = 4096, 16, 5, torch.bfloat16
    x, a, scaling, slots = _case(T, K, R, L, dtype, "cuda")
    counters = new_lora_counters("cuda")
    out = _nan((T, K + 8 + (L - 1) * R), dtype, "cuda")
    lora_shrink_concat(x, a, scaling, slots, out, counters, lead=8)
    _check(out, x, a, scaling, slots, 8, 8 + (L - 1) * R, dtype)
    assert not counters.any()


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [True, False], ids=["per-token", "tiles"])
def test_gpu_cuda_graph_replays_new_slots(rows):
    # The grid depends on shapes only and the counters clean themselves: one capture serves any
    # slot mix, replay after replay.
    T, K, R, L, dtype = 16, 8192, 16, 5, torch.bfloat16
    x, a, scaling, slots = _case(T, K, R, L, dtype, "cuda", _bench_slots(T))
    order, seg = lora_segments(slots, L)
    counters = new_lora_counters("cuda")
    out = torch.empty(T, K + (L - 1) * R, dtype=dtype, device="cuda")

    def step():
        lora_shrink_concat(x, a, scaling, slots, out, counters, segments=(order, seg), rows=rows)

    graph = capture_cuda_graph(step)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        slots.copy_(torch.randint(0, L, (T,), dtype=torch.int32, device="cuda"))
        new_order, new_seg = lora_segments(slots, L)
        order.copy_(new_order)
        seg.copy_(new_seg)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _check(out, x, a, scaling, slots, 0, (L - 1) * R, dtype)
        assert not counters.any()
