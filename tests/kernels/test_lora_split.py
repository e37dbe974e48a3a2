"""Split-K multi-LoRA: the shrink's ``[splits, T, R]`` partials, the expand's fixed-order sum, the pair
launcher :func:`lora_shrink_expand` and the split heuristic, against torch references.

CPU runs go through Triton's interpreter at small shapes; ``gpu`` tests use the Llama-3.2-1B decode
shapes of the LoRA benchmark (16 tokens, K/N 2048/8192, rank 16, 5 slots) in bf16/fp16.

References are fp64 from the same rounded inputs, so only accumulation order and roundings differ.
Errors are ``max|got - ref| / max|ref|`` over the checked rows:
- fp32: 1e-5 (fp32 accumulation over K <= 600 terms drifts ~1e-6).
- fp16: 3e-3 (the shrink's fp32 sum is rounded to fp16 for the tensor-core dot, then y is rounded:
  two unit roundoffs of 4.9e-4, plus fp32 accumulation).
- bf16: 2e-2 (the same two roundings at unit roundoff 3.9e-3).
The shrink partials themselves are fp32 sums of exact products: 1e-5 for every input dtype, except
fp16 under the interpreter's dot (2e-3, as in ``test_gemv_lora_kernels.py``).
"""
from __future__ import annotations

import pytest
import torch

from tgraph.kernels.fast_lora import lora_delta_into
from tgraph.kernels.triton.lora import (
    lora_expand,
    lora_segments,
    lora_shrink,
    lora_shrink_expand,
    lora_shrink_splits,
)

HAS_CUDA = torch.cuda.is_available()
DEV = "cuda" if HAS_CUDA else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}
PARTIAL_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-5}
# The shrink's K block for T <= 128 tokens: splits cover whole blocks of this many columns.
DECODE_BLOCK_K = 128

# 21 tokens over 5 slots: slot 0 (no adapter), slot 3 empty (a gap between segments), slot 1 with
# 17 tokens (two tiles of 16), one token out of range (7) and one negative.
SLOTS = [1, 0, 4, 1, 2, 1, 1, 7, 1, 1, 0, 1, 1, 1, 2, 1, 1, 1, -1, 1, 1]
L_SLOTS = 5


def _nan(shape, dtype, device=DEV) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.double(), ref.double()
    assert not got.isnan().any(), "unwritten (NaN) elements"
    return float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def _adapters(L: int, R: int, K: int, N: int, dtype: torch.dtype, device: str = DEV):
    """Stacks scaled so that the shrink and the delta are O(1)."""
    a = (torch.randn(L, R, K, device=device) / K ** 0.5).to(dtype)
    b = (torch.randn(L, N, R, device=device) / R ** 0.5).to(dtype)
    scaling = torch.rand(L, device=device) + 0.5
    return a, b, scaling


def _valid(slots: torch.Tensor, L: int) -> torch.Tensor:
    return (slots > 0) & (slots < L)


def _shrink_ref(x, a, slots, k0: int = 0, k1: int | None = None) -> torch.Tensor:
    """``x[t, k0:k1] @ a[s, :, k0:k1].T`` in fp64; zero where the slot is 0 or out of range."""
    L = a.shape[0]
    s = slots.long().clamp(0, L - 1)
    out = torch.einsum("tk,trk->tr", x[:, k0:k1].double(), a.double()[s][:, :, k0:k1])
    out[~_valid(slots, L)] = 0
    return out


def _delta_ref(x, a, b, slots, scaling) -> torch.Tensor:
    L = a.shape[0]
    s = slots.long().clamp(0, L - 1)
    delta = torch.einsum("tr,tnr->tn", _shrink_ref(x, a, slots), b.double()[s])
    return delta * scaling.double()[s][:, None]


def _chunks(K: int, splits: int) -> list[tuple[int, int]]:
    """The documented chunking: ``ceil(ceil(K / BLOCK_K) / splits)`` whole blocks per split."""
    per = -(-(-(-K // DECODE_BLOCK_K)) // splits) * DECODE_BLOCK_K
    return [(min(s * per, K), min((s + 1) * per, K)) for s in range(splits)]


# --------------------------------------------------------------------------- shrink partials

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("splits", [1, 2, 3, 7])
def test_shrink_writes_one_partial_per_k_chunk(dtype, splits):
    # K = 600: 5 blocks of 128, the last ragged (88 columns); 7 splits leave two chunks empty.
    K, R = 600, 16
    slots = torch.tensor(SLOTS, dtype=torch.int32, device=DEV)
    T = slots.numel()
    a, _, _ = _adapters(L_SLOTS, R, K, 8, dtype)
    x = torch.randn(T, K, device=DEV).to(dtype)
    out = _nan((splits, T, R), torch.float32)
    lora_shrink(x, a, slots, out)

    valid = _valid(slots, L_SLOTS)
    in_range = (slots >= 0) & (slots < L_SLOTS)
    assert out[:, ~in_range].isnan().all(), "rows of out-of-range slots must stay unwritten"
    assert (out[:, slots == 0] == 0).all()
    for s, (k0, k1) in enumerate(_chunks(K, splits)):
        want = _shrink_ref(x, a, slots, k0, k1)[valid]
        if k0 == k1:
            assert (out[s, valid] == 0).all(), f"split {s} has no K columns but is not zero"
        else:
            assert _rel(out[s, valid], want) <= PARTIAL_TOL[dtype], f"split {s} (K {k0}:{k1})"
    assert _rel(out[:, valid].sum(0), _shrink_ref(x, a, slots)[valid]) <= PARTIAL_TOL[dtype]


def test_shrink_partials_apply_scaling():
    K, R = 300, 16
    slots = torch.tensor([2, 0, 1, 2], dtype=torch.int32, device=DEV)
    a, _, scaling = _adapters(3, R, K, 8, torch.float32)
    x = torch.randn(4, K, device=DEV)
    out = _nan((3, 4, R), torch.float32)
    lora_shrink(x, a, slots, out, scaling=scaling)
    want = _shrink_ref(x, a, slots) * scaling.double()[slots.long()][:, None]
    assert _rel(out.sum(0), want) <= 1e-5


def test_two_d_output_is_one_split():
    # The [T, R] output keeps its meaning: the whole product, in x's dtype if asked.
    K, R = 600, 16
    slots = torch.tensor([1, 0, 2, 2, 1], dtype=torch.int32, device=DEV)
    a, _, _ = _adapters(3, R, K, 8, torch.float16)
    x = torch.randn(5, K, device=DEV).half()
    out = _nan((5, R), torch.float16)
    lora_shrink(x, a, slots, out)
    assert _rel(out, _shrink_ref(x, a, slots)) <= TOL[torch.float16]


# --------------------------------------------------------------------------- expand of partials

@pytest.mark.parametrize("R,splits", [(16, 40), (48, 20), (32, 1)])
@pytest.mark.parametrize("overwrite", [True, False])
def test_expand_sums_the_partials(R, splits, overwrite):
    # 40 splits at rank 16 take two loads of 32 partials (the second masked); rank 48 pads to 64
    # and loads 8 at a time (3 loads, the last masked).
    N, L = 40, L_SLOTS
    slots = torch.tensor(SLOTS, dtype=torch.int32, device=DEV)
    T = slots.numel()
    _, b, scaling = _adapters(L, R, 8, N, torch.float32)
    partials = torch.randn(splits, T, R, device=DEV)
    y = torch.randn(T, N + 5, device=DEV)
    y_before = y.clone()
    lora_expand(partials, b, slots, y[:, 3:3 + N], scaling, overwrite=overwrite)

    s = slots.long().clamp(0, L - 1)
    delta = torch.einsum("tr,tnr->tn", partials.double().sum(0), b.double()[s]) * scaling.double()[s][:, None]
    valid = _valid(slots, L)
    want = delta + (0 if overwrite else y_before[:, 3:3 + N].double())
    assert _rel(y[valid, 3:3 + N], want[valid]) <= 1e-5
    untouched = (slots < 0) | (slots >= L) | ((slots == 0) & (not overwrite))
    assert torch.equal(y[untouched], y_before[untouched])
    if overwrite:
        assert (y[slots == 0, 3:3 + N] == 0).all()
    assert torch.equal(y[:, :3], y_before[:, :3]) and torch.equal(y[:, 3 + N:], y_before[:, 3 + N:])


# --------------------------------------------------------------------------- the pair

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("splits", [None, 1, 4])
def test_shrink_expand_matches_reference(dtype, splits):
    K, N, R, L = 600, 72, 16, L_SLOTS
    slots = torch.tensor(SLOTS, dtype=torch.int32, device=DEV)
    T = slots.numel()
    a, b, scaling = _adapters(L, R, K, N, dtype)
    x = torch.randn(T, K, device=DEV).to(dtype)
    y = _nan((T, N), dtype)
    workspace = None if splits is None else _nan((splits, T, R), torch.float32)
    lora_shrink_expand(x, a, b, scaling, slots, y, overwrite=True, workspace=workspace)
    valid = _valid(slots, L)
    assert _rel(y[valid], _delta_ref(x, a, b, slots, scaling)[valid]) <= TOL[dtype]
    assert (y[slots == 0] == 0).all()
    assert y[(slots < 0) | (slots >= L)].isnan().all()


def test_shrink_expand_accumulates_into_packed_columns():
    # Two parts of one packed output, each with its own stacks, added to y (no overwrite); the
    # segments are computed once and shared, as the model does for a step.
    K, R, L = 200, 16, 3
    slots = torch.tensor([1, 0, 2, 2, 1, 0, 1], dtype=torch.int32, device=DEV)
    T = slots.numel()
    segments = lora_segments(slots, L)
    x = torch.randn(T, K, device=DEV)
    y = torch.randn(T, 56, device=DEV)
    want = y.double().clone()
    for off, n in ((0, 32), (32, 24)):
        a, b, scaling = _adapters(L, R, K, n, torch.float32)
        lora_shrink_expand(x, a, b, scaling, slots, y, segments=segments, column_offset=off)
        want[:, off:off + n] += _delta_ref(x, a, b, slots, scaling)
    assert _rel(y, want) <= 1e-5


@pytest.mark.parametrize("slot_values", [[0, 0, 0, 0], [2, 2, 2, 2], [5, -3, 9, 5]],
                         ids=["all-base", "one-adapter", "all-out-of-range"])
def test_shrink_expand_degenerate_batches(slot_values):
    K, N, R, L = 300, 24, 16, 3
    slots = torch.tensor(slot_values, dtype=torch.int32, device=DEV)
    a, b, scaling = _adapters(L, R, K, N, torch.float32)
    x = torch.randn(4, K, device=DEV)
    y = torch.randn(4, N, device=DEV)
    y_before = y.clone()
    lora_shrink_expand(x, a, b, scaling, slots, y)
    assert _rel(y, y_before.double() + _delta_ref(x, a, b, slots, scaling)) <= 1e-5
    if slot_values[0] != 2:
        assert torch.equal(y, y_before)


def test_lora_delta_wrapper_uses_the_split_pair():
    # The graph op's Triton wrapper (what the engine runs) with int64 slots and engine-style
    # int32 segments, at a K that the heuristic splits.
    K, N, R, L, T = 1024, 40, 16, 4, 9
    assert lora_shrink_splits(T, K, R, L) > 1
    slots = torch.tensor([3, 0, 1, 1, 3, 2, 0, 1, 3], device=DEV)
    a, b, scaling = _adapters(L, R, K, N, torch.float32)
    x = torch.randn(T, K, device=DEV)
    order, seg = lora_segments(slots, L)
    out = _nan((T, N), torch.float32)
    lora_delta_into([out], x, a, b, scaling, slots, order.to(torch.int32), seg)
    assert _rel(out, _delta_ref(x, a, b, slots, scaling)) <= 1e-5
    out2 = _nan((T, N), torch.float32)
    lora_delta_into([out2], x, a, b, scaling, slots)
    assert torch.equal(out, out2)


# --------------------------------------------------------------------------- the heuristic

def test_split_heuristic_fills_the_gpu_at_decode():
    sms = 132  # the count assumed off CUDA
    for K in (2048, 8192):
        for R in (16, 32, 48):
            splits = lora_shrink_splits(16, K, R, 5, "cpu")
            tiles = 16 // 16 + 5
            assert 16 <= splits <= min(32, K // DECODE_BLOCK_K), (K, R, splits)
            assert 64 <= tiles * splits <= 2 * sms, (K, R, splits)
            # Partials an expand program sums stay bounded (rank 48 pads to 64).
            assert splits * 16 * max(16, 1 << (R - 1).bit_length()) <= 16384
            # Every split gets the same whole number of K blocks but the last, never none.
            per = -(-(K // DECODE_BLOCK_K) // splits)
            assert (splits - 1) * per < K // DECODE_BLOCK_K


def test_split_heuristic_edges():
    assert lora_shrink_splits(16, 100, 16, 5) == 1  # one K block: nothing to split
    assert lora_shrink_splits(0, 2048, 16, 5) == 1
    # Prefill already has many tiles: fewer splits than decode at the same K.
    assert lora_shrink_splits(4096, 2048, 16, 5) < lora_shrink_splits(16, 2048, 16, 5)
    assert lora_shrink_splits(1, 8192, 16, 2) == 32
    with pytest.raises(ValueError, match="in_features must be a non-negative int"):
        lora_shrink_splits(16, -1, 16, 5)
    with pytest.raises(ValueError, match="num_tokens must be a non-negative int"):
        lora_shrink_splits(16.0, 2048, 16, 5)


# --------------------------------------------------------------------------- bad input

def test_split_paths_reject_bad_input():
    T, K, N, R, L = 4, 64, 24, 16, 3
    x = torch.randn(T, K, device=DEV)
    a, b, scaling = _adapters(L, R, K, N, torch.float32)
    slots = torch.tensor([0, 1, 2, 1], dtype=torch.int32, device=DEV)
    y = torch.empty(T, N, device=DEV)
    with pytest.raises(TypeError, match="3-D out holds split-K partial sums and must be float32"):
        lora_shrink(x.half(), a.half(), slots, torch.empty(2, T, R, dtype=torch.float16, device=DEV))
    with pytest.raises(ValueError, match=r"out must have shape \[4, 16\] or \[splits, 4, 16\]"):
        lora_shrink(x, a, slots, torch.empty(2, T, 8, device=DEV))
    with pytest.raises(ValueError, match="needs splits >= 1"):
        lora_shrink(x, a, slots, torch.empty(0, T, R, device=DEV))
    with pytest.raises(ValueError, match="out must be 2-D or 3-D"):
        lora_shrink(x, a, slots, torch.empty(1, 2, T, R, device=DEV))
    with pytest.raises(TypeError, match="3-D t holds split-K partial sums and must be float32"):
        lora_expand(torch.empty(2, T, R, dtype=torch.float16, device=DEV), b.half(), slots, y.half(),
                    scaling)
    with pytest.raises(ValueError, match="workspace must be a float32 tensor"):
        lora_shrink_expand(x, a, b, scaling, slots, y, workspace=torch.empty(2, T + 1, R, device=DEV))
    with pytest.raises(ValueError, match=r"lora_b must be \[3, N, 16\]"):
        lora_shrink_expand(x, a, b[:, :, :8], scaling, slots, y)
    with pytest.raises(TypeError, match="lora_b dtype"):
        lora_shrink_expand(x, a, b.half(), scaling, slots, y)
    with pytest.raises(ValueError, match="lora_a must be"):
        lora_shrink_expand(x, a[:, :, :32], b, scaling, slots, y)
    with pytest.raises(TypeError, match="token_slots must be an int32"):
        lora_shrink_expand(x, a, b, scaling, slots.float(), y)


# --------------------------------------------------------------------------- GPU, real shapes

GPU_TOL = {torch.float16: 3e-3, torch.bfloat16: 2e-2}
# Llama-3.2-1B decode at batch 16: q/k/v packed (3 rank blocks), o, gate/up packed, down.
GPU_SHAPES = [(2048, 2048, 16), (2048, 8192, 16), (8192, 2048, 16), (2048, 3072, 48), (2048, 16384, 32)]


def _bench_slots(T: int, adapters: int = 4) -> torch.Tensor:
    """Request ``i`` uses adapter ``1 + i % adapters``, as the LoRA benchmark's mixed batch."""
    return torch.tensor([1 + i % adapters for i in range(T)], dtype=torch.int32, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "K{}-N{}-R{}".format(*s))
@pytest.mark.parametrize("pattern", ["mixed", "one-adapter", "with-base"])
def test_gpu_decode_shapes(shape, dtype, pattern):
    K, N, R = shape
    T, L = 16, 5
    slots = {"mixed": _bench_slots(T), "one-adapter": _bench_slots(T, 1),
             "with-base": torch.randint(0, L, (T,), dtype=torch.int32, device="cuda")}[pattern]
    a, b, scaling = _adapters(L, R, K, N, dtype, "cuda")
    x = torch.randn(T, K, device="cuda").to(dtype)
    assert lora_shrink_splits(T, K, R, L, "cuda") > 1
    y = _nan((T, N), dtype, "cuda")
    lora_shrink_expand(x, a, b, scaling, slots, y, overwrite=True)
    want = _delta_ref(x, a, b, slots, scaling)
    assert _rel(y, want) <= GPU_TOL[dtype]
    # Deterministic: no atomics, so a rerun is bit-identical.
    for _ in range(2):
        again = _nan((T, N), dtype, "cuda")
        lora_shrink_expand(x, a, b, scaling, slots, again, overwrite=True)
        assert torch.equal(again, y)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 7, 300, 2048])
def test_gpu_other_token_counts(T):
    K, N, R, L, dtype = 4096, 4096, 16, 5, torch.bfloat16
    slots = torch.randint(0, L, (T,), dtype=torch.int32, device="cuda")
    a, b, scaling = _adapters(L, R, K, N, dtype, "cuda")
    x = torch.randn(T, K, device="cuda").to(dtype)
    y = torch.randn(T, N, device="cuda").to(dtype)
    want = y.double() + _delta_ref(x, a, b, slots, scaling)
    lora_shrink_expand(x, a, b, scaling, slots, y)
    assert _rel(y, want) <= GPU_TOL[dtype]


@pytest.mark.gpu
def test_gpu_cuda_graph_replays_new_slots():
    # The grids and the workspace depend on shapes only: one capture serves any slot mix.
    T, K, N, R, L, dtype = 16, 8192, 2048, 16, 5, torch.bfloat16
    a, b, scaling = _adapters(L, R, K, N, dtype, "cuda")
    x = torch.randn(T, K, device="cuda").to(dtype)
    slots = _bench_slots(T)
    order, seg = lora_segments(slots, L)
    workspace = torch.empty(lora_shrink_splits(T, K, R, L, "cuda"), T, R, device="cuda")
    y = torch.empty(T, N, dtype=dtype, device="cuda")

    def step():
        lora_shrink_expand(x, a, b, scaling, slots, y, segments=(order, seg), overwrite=True,
                           workspace=workspace)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compiles outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        slots.copy_(torch.randint(0, L, (T,), dtype=torch.int32, device="cuda"))
        new_order, new_seg = lora_segments(slots, L)
        order.copy_(new_order)
        seg.copy_(new_seg)
        y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert _rel(y, _delta_ref(x, a, b, slots, scaling)) <= GPU_TOL[dtype]
