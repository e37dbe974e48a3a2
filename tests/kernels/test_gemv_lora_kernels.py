"""Small-M linear (GEMV / split-K) against torch references, and the multi-LoRA linear it runs at
decode: one GEMV on ``[x | shrink]`` and the ``[W | B blocks]`` storage, whose base view is
row-strided.

CPU runs go through Triton's interpreter at small shapes; ``gpu`` tests use real LLM shapes.

Tolerances (reference in fp64 from the same rounded inputs, so only accumulation order and the
final rounding differ):
- fp32: rtol 1e-5, atol 1e-5 on outputs of magnitude ~1 (fp32 accumulation over K <= 1100 terms
  of size ~1/sqrt(K) drifts ~1e-6).
- fp16: rtol/atol 2e-3 (one rounding of the output, unit roundoff 4.9e-4, plus fp16 residual).
- bf16: rtol/atol 2e-2 (unit roundoff 3.9e-3; the LoRA path rounds twice: shrink output, then y).
"""
from __future__ import annotations

import pytest
import torch

from tests.helpers import capture_cuda_graph
from tgraph.kernels.triton.gemv import choose_config, prefer_small_m, small_m_linear, workspace_size
from tgraph.kernels.triton.lora import lora_segments, lora_shrink_concat, new_lora_counters

HAS_CUDA = torch.cuda.is_available()
DEV = "cuda" if HAS_CUDA else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def _nan(shape, dtype, device=DEV) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def _close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    tol = TOL[dtype]
    torch.testing.assert_close(actual.double(), expected.double(), rtol=tol, atol=tol)


def _linear_inputs(M, N, K, dtype, device=DEV):
    x = torch.randn(M, K, device=device).to(dtype)
    # 1/sqrt(K) keeps outputs ~1 so the relative tolerances are meaningful.
    w = (torch.randn(N, K, device=device) / K**0.5).to(dtype)
    b = torch.randn(N, device=device).to(dtype)
    r = torch.randn(M, N, device=device).to(dtype)
    return x, w, b, r


def _linear_ref(x, w, b=None, r=None) -> torch.Tensor:
    y = x.double() @ w.double().T
    if b is not None:
        y = y + b.double()
    if r is not None:
        y = y + r.double()
    return y


# --------------------------------------------------------------------------- small_m_linear


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", [1, 2, 3, 5])
@pytest.mark.parametrize("epilogue", ["none", "bias+residual"])
@pytest.mark.parametrize("split_k", [1, 3])
def test_small_m_linear_matches_reference(dtype, M, epilogue, split_k):
    # N=37 is odd and not a multiple of BLOCK_N; K=1100 gives >= 3 K blocks for every M bucket so
    # split_k=3 really splits (the last split is ragged).
    N, K = 37, 1100
    x, w, b, r = _linear_inputs(M, N, K, dtype)
    bias = b if epilogue != "none" else None
    res = r if epilogue == "bias+residual" else None
    out = _nan((M, N), dtype)
    small_m_linear(x, w, out, bias=bias, residual=res, split_k=split_k)
    _close(out, _linear_ref(x, w, bias, res), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_k_writes_partials_and_agrees_with_no_split(dtype):
    M, N, K = 2, 50, 4096  # four 1024-wide K tiles at M=2, so split_k=4 holds
    x, w, b, r = _linear_inputs(M, N, K, dtype)
    full = _nan((M, N), dtype)
    small_m_linear(x, w, full, bias=b, residual=r, split_k=1)
    split = 4
    ws = _nan((workspace_size(M, N, split) + 7,), torch.float32)  # larger than needed is fine
    out = _nan((M, N), dtype)
    small_m_linear(x, w, out, bias=b, residual=r, workspace=ws, split_k=split)
    # Phase 1 wrote every partial, and the partials sum to the product without epilogue.
    parts = ws[: split * M * N].view(split, M, N)
    assert torch.isfinite(parts).all()
    torch.testing.assert_close(parts.double().sum(0), _linear_ref(x, w), rtol=1e-5, atol=1e-5)
    _close(out, full.double(), dtype)
    _close(out, _linear_ref(x, w, b, r), dtype)


def test_split_k_is_deterministic():
    M, N, K = 3, 40, 4096
    x, w, b, _ = _linear_inputs(M, N, K, torch.float32)
    a, c = _nan((M, N), torch.float32), _nan((M, N), torch.float32)
    small_m_linear(x, w, a, bias=b, split_k=4)
    small_m_linear(x, w, c, bias=b, split_k=4)
    assert torch.equal(a, c)


@pytest.mark.parametrize("split_k", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_out_may_alias_residual(split_k, dtype):
    M, N, K = 2, 33, 600
    x, w, b, r = _linear_inputs(M, N, K, dtype)
    expected = _linear_ref(x, w, b, r)
    small_m_linear(x, w, r, bias=b, residual=r, split_k=split_k)
    _close(r, expected, dtype)


@pytest.mark.parametrize("M", [1, 4, 17, 40])
def test_strided_rows_and_large_m(M):
    # x and out are column slices of wider buffers; M=17 uses the 32-row bucket with padding,
    # M=40 adds a second block along the M grid axis.
    N, K = 24, 96
    xb = torch.randn(M, K + 5, device=DEV)
    x = xb[:, 3:3 + K]
    w = torch.randn(N, K, device=DEV) / K**0.5
    ob = _nan((M, N + 9), torch.float32)
    out = ob[:, 4:4 + N]
    small_m_linear(x, w, out)
    _close(out, _linear_ref(x, w), torch.float32)
    assert torch.isnan(ob[:, :4]).all() and torch.isnan(ob[:, 4 + N:]).all()


def test_output_dtype_may_differ_from_input():
    M, N, K = 2, 20, 64
    x, w, b, r = _linear_inputs(M, N, K, torch.bfloat16)
    out = _nan((M, N), torch.float32)
    small_m_linear(x, w, out, bias=b, residual=r)
    _close(out, _linear_ref(x, w, b, r), torch.float32)


def test_small_m_linear_rejects_bad_input():
    x, w, b, r = _linear_inputs(2, 16, 32, torch.float32)
    out = torch.empty(2, 16, device=DEV)
    with pytest.raises(ValueError, match="weight must have shape"):
        small_m_linear(x, w[:, :16], out)
    with pytest.raises(TypeError, match="must match x dtype"):
        small_m_linear(x, w.half(), out)
    with pytest.raises(TypeError, match="float16, bfloat16 or float32"):
        small_m_linear(x.double(), w.double(), out.double())
    with pytest.raises(ValueError, match="out must have shape"):
        small_m_linear(x, w, out[:, :15])
    with pytest.raises(ValueError, match="bias must have shape"):
        small_m_linear(x, w, out, bias=b[:8])
    with pytest.raises(ValueError, match="contiguous last dim"):
        small_m_linear(x, w.t().contiguous().t(), out)
    # K=2048 has enough K blocks for split_k=2 to be honoured (and the workspace needed).
    xl, wl, _, _ = _linear_inputs(2, 16, 2048, torch.float32)
    with pytest.raises(ValueError, match="workspace must be contiguous with >= 64"):
        small_m_linear(xl, wl, out, workspace=torch.empty(10, device=DEV), split_k=2)
    with pytest.raises(TypeError, match="workspace must be float32"):
        small_m_linear(xl, wl, out, workspace=torch.empty(64, device=DEV, dtype=torch.half),
                       split_k=2)
    with pytest.raises(ValueError, match="split_k must be a positive int"):
        small_m_linear(x, w, out, split_k=0)
    with pytest.raises(ValueError, match="config must be a tuple of 5 positive ints"):
        small_m_linear(x, w, out, config=(16, 256, 1, 4))  # the stages are missing
    with pytest.raises(ValueError, match="config must be a tuple of 5 positive ints"):
        small_m_linear(x, w, out, config=(16, 0, 1, 4, 2))
    sq = torch.randn(16, 16, device=DEV)
    with pytest.raises(ValueError, match="must not alias x"):
        small_m_linear(sq, torch.randn(16, 16, device=DEV), sq)


def test_choose_config_splits_evenly_and_fills_the_gpu_above_m1():
    for M in (1, 2, 4, 8, 16, 32):
        for N, K in [(2048, 2048), (8192, 2048), (2048, 8192), (6144, 4096), (4096, 14336),
                     (128256, 2048)]:
            block_n, block_k, split_k, num_warps, _ = choose_config(M, N, K, "cpu")
            k_blocks = -(-K // block_k)
            per_split = -(-k_blocks // split_k)
            # Every split has the same number of K blocks, none empty.
            assert (split_k - 1) * per_split < k_blocks <= split_k * per_split
            assert block_k % 16 == 0 and block_n & (block_n - 1) == 0 and num_warps in (1, 2, 4, 8)
            if M == 1:
                # No split-K at M=1; K tiles of 2048 from K >= 2048 (see _m1_config).
                assert split_k == 1 and block_k == min(2048, K)
                continue
            if M <= 16:  # 2-16 rows share the 16-row tensor-core tiles (see gemv._block_m)
                assert choose_config(M, N, K, "cpu") == choose_config(16, N, K, "cpu")
            n_programs = -(-N // block_n) * split_k
            # Either the column blocks alone fill half of the 132 SMs (16-row tensor-core tiles,
            # one resident program each) or split-K brings it there.
            assert n_programs >= 66 or split_k == k_blocks, (M, N, K, n_programs)
    assert choose_config(16, 2048, 8192, "cpu")[2] > 1
    assert choose_config(1, 128256, 2048, "cpu")[2] == 1


def test_m1_config_rule():
    # Unfused: 2048-wide K tiles from K = 2048, 8 warps from K = 4096 (32 weight elements per
    # thread either way), output rows per program halved when fewer than 2 programs per SM.
    assert choose_config(1, 2048, 2048, "cpu") == (4, 2048, 1, 4, 3)
    assert choose_config(1, 2048, 8192, "cpu") == (4, 2048, 1, 8, 3)
    assert choose_config(1, 896, 4864, "cpu") == (2, 2048, 1, 8, 3)
    assert choose_config(1, 896, 896, "cpu") == (2, 1024, 1, 4, 3)
    assert choose_config(1, 100, 40, "cpu") == (2, 64, 1, 4, 3)
    # The norm and gate fusions keep 1024-wide tiles and 4 warps (gated: 2 outputs per program).
    assert choose_config(1, 3072, 2048, "cpu", norm=True) == (4, 1024, 1, 4, 3)
    assert choose_config(1, 8192, 2048, "cpu", gated=True, norm=True) == (2, 1024, 1, 4, 3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_m1_wide_k_tile_matches_reference(dtype):
    # The heuristic's wide-K configuration (2048-wide tiles, 2 outputs per program, 8 warps): one
    # full tile and a ragged one, N not a multiple of BLOCK_N.
    N, K = 37, 2048 + 300
    x, w, b, r = _linear_inputs(1, N, K, dtype)
    assert choose_config(1, N, K, "cpu")[:2] == (2, 2048)
    out = _nan((1, N), dtype)
    small_m_linear(x, w, out, residual=r)
    _close(out, _linear_ref(x, w, None, r), dtype)


def test_prefer_small_m():
    assert prefer_small_m(1, 4096, 4096)
    assert prefer_small_m(4, 4096, 4096)
    assert prefer_small_m(16, 4096, 4096)
    assert not prefer_small_m(17, 4096, 4096)  # cuBLAS's tensor-core tiles win from here
    # Above 4 rows a plain linear (nothing fused) goes to cuBLAS unless K is long.
    assert prefer_small_m(4, 4096, 4096, fused=False)
    assert not prefer_small_m(16, 4096, 4096, fused=False)
    assert prefer_small_m(16, 2048, 8192, fused=False)
    assert not prefer_small_m(0, 4096, 4096)


# --------------------------------------------------------------------------- LoRA


def lora_linear_reference(x, w, a, b, slots, scaling) -> torch.Tensor:
    """``x @ w.T + scaling[s] * (x @ a[s].T) @ b[s].T`` per token in fp64; no delta for slot 0."""
    y = x.double() @ w.double().T
    for s in range(1, a.shape[0]):
        rows = slots == s
        y[rows] += scaling[s].double() * ((x[rows].double() @ a[s].double().T) @ b[s].double().T)
    return y


def _adapters(L, R, K, N, ranks, dtype, device=DEV):
    """Stacked adapters, slot l having rank ``ranks[l]`` zero-padded to R; slot 0 is unused."""
    a = torch.randn(L, R, K, device=device) / K**0.5
    b = torch.randn(L, N, R, device=device) / R**0.5
    for slot, rank in enumerate(ranks):
        a[slot, rank:] = 0
        b[slot, :, rank:] = 0
    scaling = torch.rand(L, device=device) + 0.5
    return a.to(dtype), b.to(dtype), scaling


def _storage(w, b, pad: int = 0) -> torch.Tensor:
    """``[W | B_1 | ... | B_{L-1} | pad zero columns]``: the shared weight storage's layout."""
    N = w.shape[0]
    return torch.cat([w, *[b[s] for s in range(1, b.shape[0])],
                      torch.zeros(N, pad, dtype=w.dtype, device=w.device)], dim=1)


def _slots(values, device=DEV) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", [1, 3])
def test_small_m_linear_on_the_row_strided_base_view(dtype, M):
    # The base model runs on storage[:, :K] after the LoRA feature re-laid its weight out.
    N, K, L, R = 40, 96, 4, 16
    x, w, b, r = _linear_inputs(M, N, K, dtype)
    _, lb, _ = _adapters(L, R, K, N, [16, 4, 8, 16], dtype)
    storage = _storage(w, lb, pad=5)
    view = storage[:, :K]
    assert view.stride(0) == K + 3 * R + 5
    out = _nan((M, N), dtype)
    small_m_linear(x, view, out, bias=b, residual=r)
    _close(out, _linear_ref(x, w, b, r), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("slots", [[2], [0, 3, 1, 3]], ids=["one", "mixed"])
def test_lora_linear_as_one_small_m_gemm(dtype, slots):
    # Decode at M <= 4: the shrink writes [x | blocks], one GEMV on the storage is the LoRA linear.
    N, K, L, R = 40, 64, 4, 16
    slots = _slots(slots)
    M = slots.numel()
    x, w, bias, _ = _linear_inputs(M, N, K, dtype)
    a, lb, scaling = _adapters(L, R, K, N, [16, 4, 8, 16], dtype)
    xcat = _nan((M, K + (L - 1) * R), dtype)
    lora_shrink_concat(x, a, scaling, slots, xcat, new_lora_counters(DEV))
    out = _nan((M, N), dtype)
    small_m_linear(xcat, _storage(w, lb), out, bias=bias)
    _close(out, lora_linear_reference(x, w, a, lb, slots, scaling) + bias.double(), dtype)


# --------------------------------------------------------------------------- GPU, real shapes

LINEAR_SHAPES = [(2048, 2048), (8192, 2048), (2048, 8192), (6144, 4096), (4096, 14336),
                 (128256, 2048)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M", [1, 4, 16])
@pytest.mark.parametrize("shape", LINEAR_SHAPES)
def test_gpu_small_m_linear_real_shapes(shape, M, dtype):
    N, K = shape
    x, w, b, r = _linear_inputs(M, N, K, dtype, "cuda")
    out = _nan((M, N), dtype, "cuda")
    small_m_linear(x, w, out, bias=b, residual=r)
    _close(out, _linear_ref(x, w, b, r), dtype)


@pytest.mark.gpu
def test_gpu_cuda_graph_capture():
    # A LoRA decode step at M=4: base GEMV on the row-strided view, then the LoRA linear as shrink +
    # one split-K GEMV on the storage, all captured; the graph serves any slot mix.
    M, N, K, L, R = 4, 2048, 8192, 4, 16
    dtype = torch.bfloat16
    x, w, b, _ = _linear_inputs(M, N, K, dtype, "cuda")
    a, lb, scaling = _adapters(L, R, K, N, [16, 8, 16, 4], dtype, "cuda")
    storage = _storage(w, lb)
    split = choose_config(M, N, K, "cuda")[2]
    assert split > 1  # the capture covers the two-phase path
    ws = torch.empty(workspace_size(M, N, split), device="cuda")
    ws_cat = torch.empty(workspace_size(M, N, choose_config(M, N, storage.shape[1], "cuda")[2]),
                         device="cuda")
    base = torch.empty(M, N, dtype=dtype, device="cuda")
    out = torch.empty(M, N, dtype=dtype, device="cuda")
    slots = _slots([1, 0, 3, 1], "cuda")
    counters = new_lora_counters("cuda")
    xcat = torch.empty(M, K + (L - 1) * R, dtype=dtype, device="cuda")

    def step():
        small_m_linear(x, storage[:, :K], base, bias=b, workspace=ws)
        lora_shrink_concat(x, a, scaling, slots, xcat, counters, segments=lora_segments(slots, L))
        small_m_linear(xcat, storage, out, bias=b, workspace=ws_cat)

    graph = capture_cuda_graph(step)
    for _ in range(2):
        x.copy_(torch.randn_like(x))
        slots.copy_(torch.randint(0, L, (M,), dtype=torch.int32, device="cuda"))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _close(base, _linear_ref(x, w, b), dtype)
        _close(out, lora_linear_reference(x, w, a, lb, slots, scaling) + b.double(), dtype)
        assert not counters.any()


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 4])
@pytest.mark.parametrize("shape", [(3072, 2048, 48), (2048, 8192, 16)], ids=["qkv", "down"])
def test_gpu_lora_linear_small_m_real_shapes(shape, M):
    N, K, R = shape
    L, dtype = 5, torch.bfloat16
    slots = torch.randint(0, L, (M,), dtype=torch.int32, device="cuda")
    x, w, _, _ = _linear_inputs(M, N, K, dtype, "cuda")
    a, lb, scaling = _adapters(L, R, K, N, [R, R, R // 2, R, 4], dtype, "cuda")
    xcat = _nan((M, K + (L - 1) * R), dtype, "cuda")
    lora_shrink_concat(x, a, scaling, slots, xcat, new_lora_counters("cuda"))
    out = _nan((M, N), dtype, "cuda")
    small_m_linear(xcat, _storage(w, lb), out)
    _close(out, lora_linear_reference(x, w, a, lb, slots, scaling), dtype)
