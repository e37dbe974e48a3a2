"""Programmatic dependent launch: off where it cannot apply, and results unchanged where it does."""
from __future__ import annotations

import pytest
import torch

from tgraph.kernels.triton.pdl import pdl_enabled, pdl_kwargs


def test_pdl_is_off_for_cpu_tensors_and_when_disabled(monkeypatch):
    assert pdl_kwargs(torch.zeros(1)) == {"PDL": False}
    monkeypatch.setenv("TGRAPH_PDL", "0")
    assert not pdl_enabled(torch.zeros(1))


@pytest.mark.gpu
def test_pdl_chain_in_a_cuda_graph_is_bit_identical(monkeypatch):
    """A decode-like chain (norm -> GEMV with prefetched weights -> swiglu -> GEMV -> norm),
    captured with PDL, gives exactly the results of the same chain without PDL."""
    from tgraph.kernels.triton.activations import swiglu
    from tgraph.kernels.triton.gemv import small_m_linear
    from tgraph.kernels.triton.norms import rms_norm

    if not pdl_enabled(torch.zeros(1, device="cuda")):
        pytest.skip("PDL needs Hopper and a Triton with launch_pdl")
    torch.manual_seed(0)
    hidden, inter = 2048, 8192
    dev, dt = "cuda", torch.bfloat16
    x = torch.randn(1, hidden, device=dev, dtype=dt)
    norm_w = torch.rand(hidden, device=dev, dtype=dt) + 0.5
    up = torch.randn(2 * inter, hidden, device=dev, dtype=dt) / hidden ** 0.5
    down = torch.randn(hidden, inter, device=dev, dtype=dt) / inter ** 0.5

    def chain():
        h = torch.empty_like(x)
        rms_norm(x, norm_w, 1e-5, h)
        gu = torch.empty(1, 2 * inter, device=dev, dtype=dt)
        small_m_linear(h, up, gu)
        act = torch.empty(1, inter, device=dev, dtype=dt)
        swiglu(gu, act)
        y = torch.empty_like(x)
        small_m_linear(act, down, y, residual=x)
        out = torch.empty_like(x)
        rms_norm(y, norm_w, 1e-5, out)
        return out

    results = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("TGRAPH_PDL", flag)
        chain()  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = chain()
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        results[flag] = out.clone()
    assert torch.equal(results["0"], results["1"])
