"""The engine holds its tuning and hands it to the kernels: two engines of one network with
different settings run different launches in one process, with the same results."""
from __future__ import annotations

import pytest
import torch

from tests.helpers import build_with_triton_backend
from tgraph.errors import GraphError
from tgraph.kernels.triton import gemv
from tgraph.nn import functional as F
from tgraph.nn.network_manager import recording
from tgraph.nn.tensor import Tensor
from tgraph.tuning import GemvTuning, Tuning


def _linear_net():
    with recording("linear") as net:
        x = Tensor("x", torch.float32, ("m", 64))
        w = Tensor("w", torch.float32, (48, 64))
        net.mark_output(F.linear(x, w, None, False, True), "y")
    return net


def test_each_engine_launches_with_its_own_tuning(monkeypatch):
    build_with_triton_backend(monkeypatch)
    calls: list[GemvTuning] = []
    real = gemv.small_m_linear

    def spy(*args, tuning, **kwargs):
        calls.append(tuning)
        return real(*args, tuning=tuning, **kwargs)

    monkeypatch.setattr(gemv, "small_m_linear", spy)
    net = _linear_net()
    default = net.build_engine()
    rows_1 = _linear_net().build_engine(tuning=Tuning(gemv=GemvTuning(small_m_max=1)))
    assert default.tuning == Tuning() and rows_1.tuning.gemv.small_m_max == 1
    x, w = torch.randn(2, 64), torch.randn(48, 64)
    want = x @ w.T
    y_default = default.forward({"x": x, "w": w})["y"]
    assert calls == [default.tuning.gemv]  # two rows: the small-M kernel, with this tuning
    y_rows_1 = rows_1.forward({"x": x, "w": w})["y"]
    assert len(calls) == 1  # small_m_max=1: two rows go to the GEMM instead
    # fp32 with K = 64: both paths accumulate in fp32, agreeing to well under 1e-5.
    torch.testing.assert_close(y_default, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y_rows_1, want, rtol=1e-5, atol=1e-5)


def test_build_engine_refuses_a_wrong_tuning_type():
    with pytest.raises(GraphError, match="tuning must be a tgraph.tuning.Tuning, got dict"):
        _linear_net().build_engine(tuning={"gemv": {}})
