"""Split-K in one launch (the last split of each output tile reduces it) against the two-launch
path with its reduce kernel: same summation order, so the same bits, and arrival counters that
every launch leaves at zero."""
from __future__ import annotations

import pytest
import torch

import tgraph.kernels.triton.gemv as gemv
from tests.helpers import linear_operands
from tgraph.kernels.triton.gemv import arrival_counters, small_m_linear
from tgraph.tuning import GemvTuning

HAS_CUDA = torch.cuda.is_available()
DEV = "cuda" if HAS_CUDA else "cpu"


class _Launches:
    """Stands in for the reduce kernel: records its launches and runs the real one."""

    def __init__(self, kernel):
        self.kernel, self.count = kernel, 0

    def __getitem__(self, grid):
        self.count += 1
        return self.kernel[grid]


def _operands(M, N, K, dtype, gated, seed=0):
    return linear_operands(M, N, K, dtype, gated, DEV, seed)


def _linear(monkeypatch, fixup, x, w, N, split_k, **kw):
    reduce = _Launches(gemv.split_k_reduce_kernel)
    monkeypatch.setattr(gemv, "split_k_reduce_kernel", reduce)
    out = torch.full((x.shape[0], N), float("nan"), dtype=x.dtype, device=DEV)
    small_m_linear(x, w, out, split_k=split_k, tuning=GemvTuning(split_k_fixup=fixup), **kw)
    monkeypatch.setattr(gemv, "split_k_reduce_kernel", reduce.kernel)
    return out, reduce.count


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M", [1, 3, 16])
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("epilogue", ["none", "bias+residual"])
def test_one_launch_gives_the_bits_of_the_reduce_launch(monkeypatch, dtype, M, gated, epilogue):
    # 3 splits of 512- / 256-wide K tiles (the last split ragged), operands not swapped.
    N, K, split = 40, 4096, 3
    x, w, b, r = _operands(M, N, K, dtype, gated)
    kw = dict(gated=gated, config=(4, 512, split, 4, 2) if M == 1 else (16, 256, split, 4, 2))
    if epilogue != "none":
        kw.update(bias=b, residual=r)
    one, reduces_one = _linear(monkeypatch, True, x, w, N, split, **kw)
    two, reduces_two = _linear(monkeypatch, False, x, w, N, split, **kw)
    assert (reduces_one, reduces_two) == (0, 1)
    assert not one.isnan().any()
    assert torch.equal(one, two)


def test_counters_are_left_zero_and_reused_by_the_next_launch(monkeypatch):
    x, w, b, r = _operands(2, 48, 4096, torch.float32, gated=False)
    out = torch.empty(2, 48, device=DEV)
    small_m_linear(x, w, out, bias=b, split_k=4)
    counters = arrival_counters(out, 1)
    assert counters.dtype == torch.int32 and not counters.any()
    first = out.clone()
    small_m_linear(x, w, out, bias=b, split_k=4)
    assert arrival_counters(out, 1) is counters and not counters.any()
    assert torch.equal(out, first)


def test_out_may_alias_the_residual(monkeypatch):
    x, w, b, r = _operands(3, 24, 4096, torch.float32, gated=False)
    expected, _ = _linear(monkeypatch, False, x, w, 24, 2, bias=b, residual=r)
    small_m_linear(x, w, r, bias=b, residual=r, split_k=2, tuning=GemvTuning(split_k_fixup=True))
    assert torch.equal(r, expected)


def test_swapped_operands_keep_the_reduce_launch(monkeypatch):
    # 64-row blocks at 16 rows swap the MMA operands; there the reduce launch measured faster.
    x, w, b, _ = _operands(16, 64, 4096, torch.float32, gated=False)
    one, reduces = _linear(monkeypatch, True, x, w, 64, 2, bias=b, config=(64, 256, 2, 4, 2))
    assert reduces == 1 and not one.isnan().any()


def test_counters_grow_and_keep_the_outgrown_buffer_alive():
    out = torch.empty(5, 7, device=DEV)
    small = arrival_counters(out, 10)
    assert small.numel() >= 10 and arrival_counters(out, 10) is small
    big = arrival_counters(out, 1000)
    assert big.numel() >= 1000 and big is not small and not big.any()
    assert any(t is small for t in gemv._RETIRED_COUNTERS)
    other = torch.empty(5, 7, device=DEV)
    assert arrival_counters(other, 10) is not big  # another output, other counters


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("case", ["plain", "norm swapped"])
def test_one_launch_split_k_is_bit_identical_on_the_gpu(case):
    # The real ticket race: many splits and tiles, arrival order left to the hardware.
    if case == "plain":  # 128 column blocks x 8 splits, operands not swapped
        M, N, K, config, kw = 16, 2048, 8192, (16, 256, 8, 4, 4), {}
    else:  # Llama-3.2-1B's q|k|v at batch 16: 48 swapped 64-row blocks x 3 splits, the norm
        M, N, K, config = 16, 3072, 2048, (64, 256, 3, 4, 4)
        g = torch.rand(K, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16).to(DEV)
        kw = dict(norm_eps=1e-5, norm_weight=g)
    x, w, b, r = _operands(M, N, K, torch.bfloat16, gated=False, seed=3)
    outs = []
    for fixup in (False, True, True):
        out = torch.empty(M, N, dtype=torch.bfloat16, device=DEV)
        for _ in range(3):
            small_m_linear(x, w, out, bias=b, residual=r, config=config,
                           tuning=GemvTuning(split_k_fixup=fixup), **kw)
        outs.append(out)
    torch.cuda.synchronize()
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[1], outs[2])
    assert not arrival_counters(outs[2], 1).any()


@pytest.mark.parametrize("M", [1, 16])
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("split", [2, 3])
def test_one_launch_with_the_norm_gives_the_bits_of_the_reduce_launch(monkeypatch, M, gated, split):
    # The fused RMSNorm: the last split of each tile applies 1 / rms from every split's sums of
    # squares. 3 column blocks, so tiles other than block 0 need the sums too; at M=16 the
    # 64-column blocks swap the MMA operands (the q|k|v of a batch-16 decode).
    N, K = 40 if M == 1 else 192, 1536
    x, w, b, r = _operands(M, N, K, torch.float32, gated)
    g = torch.randn(K, generator=torch.Generator().manual_seed(1)).to(DEV)
    config = (16, 256, split, 4, 2) if M == 1 else (64, 128, split, 4, 2)
    kw = dict(gated=gated, config=config, norm_eps=1e-6, norm_weight=g, bias=b, residual=r)
    one, reduces_one = _linear(monkeypatch, True, x, w, N, split, **kw)
    two, reduces_two = _linear(monkeypatch, False, x, w, N, split, **kw)
    assert (reduces_one, reduces_two) == (0, 1)
    assert not one.isnan().any()
    assert torch.equal(one, two)
    xn = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * g
    y = xn @ w.T + b
    if gated:
        y = torch.nn.functional.silu(y[:, :N]) * y[:, N:]
    # fp32 throughout: only summation order differs from torch's (K = 1536 terms).
    torch.testing.assert_close(one, y + r, rtol=1e-4, atol=1e-4)
