"""The small-M linear reading its weight tiles by TMA (tensor descriptors, ``tma_weights``)
against the pointer loads: the same tiles in the same order, so the same bits, at ragged shapes
(rows past N of the gate half, K past the last tile, splits) and at real decode shapes on a GPU."""
from __future__ import annotations

import pytest
import torch

import tgraph.kernels.triton.gemv as gemv
from tests.helpers import linear_operands
from tgraph.kernels.triton.gemv import small_m_linear
from tgraph.tuning import GemvTuning

HAS_CUDA = torch.cuda.is_available()
DEV = "cuda" if HAS_CUDA else "cpu"


def _both(M, N, K, gated, norm, config, dtype=torch.float32, seed=0):
    x, w, b, r = linear_operands(M, N, K, dtype, gated, DEV, seed)
    g = torch.randn(K, generator=torch.Generator().manual_seed(seed + 1)).to(dtype).to(DEV)
    kw = dict(norm_eps=1e-6, norm_weight=g) if norm else {}
    outs, used = [], []
    for tma in (False, True):
        tuning = GemvTuning(tma_weights=tma)
        used.append(gemv.weight_descriptor(w, config[0], config[1], True, tuning) is not None)
        out = torch.full((M, N), float("nan"), dtype=dtype, device=DEV)
        small_m_linear(x, w, out, bias=b, residual=r, config=config, gated=gated, tuning=tuning,
                       **kw)
        outs.append(out)
    assert used == [False, True]
    return outs


@pytest.mark.parametrize("M, N, K, gated, norm, config", [
    (16, 200, 640, False, False, (64, 128, 1, 4, 2)),   # ragged last column block
    (16, 200, 640, True, True, (64, 128, 1, 4, 2)),     # gate rows past N read up rows
    (5, 130, 520, False, True, (64, 128, 2, 4, 2)),     # ragged K, 2 splits, the norm
    (16, 96, 1000, True, False, (64, 128, 3, 4, 2)),    # 3 splits, last one ragged
])
def test_tma_weight_tiles_give_the_bits_of_pointer_loads(M, N, K, gated, norm, config):
    pointers, tma = _both(M, N, K, gated, norm, config)
    assert not tma.isnan().any()
    assert torch.equal(pointers, tma)


def test_no_descriptor_where_tma_cannot_read_the_weight():
    w = torch.randn(64, 130)  # 520-byte rows: not 16-byte aligned
    assert gemv.weight_descriptor(w, 64, 128, True) is None
    w = torch.randn(64, 128)
    assert gemv.weight_descriptor(w, 64, 128, False) is None  # operands not swapped
    assert gemv.weight_descriptor(w, 64, 128, True) is not None
    assert gemv.weight_descriptor(w, 64, 128, True, GemvTuning(tma_weights=False)) is None


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("N, K, gated, norm, config", [
    (3072, 2048, False, True, (64, 256, 1, 4, 4)),    # Llama-3.2-1B q|k|v with the norm
    (8192, 2048, True, True, (64, 256, 1, 4, 3)),     # gate|up with the norm and SwiGLU
    (2048, 8192, False, False, (64, 128, 4, 4, 4)),   # down, 4 splits
])
def test_tma_weight_tiles_on_the_gpu(N, K, gated, norm, config):
    pointers, tma = _both(16, N, K, gated, norm, config, dtype=torch.bfloat16)
    torch.cuda.synchronize()
    assert torch.equal(pointers, tma)
