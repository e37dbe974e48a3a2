"""The demo behind ``tgraph demo``: record a small network, print it, build it, run it and check
the result against torch."""
from __future__ import annotations

import time

import torch

from tgraph.nn import functional as F
from tgraph.nn.network_manager import get_default_net
from tgraph.nn.tensor import Tensor


def run_demo() -> int:
    """Record ``x @ w`` with unknown shapes, build the engine, run it on 1000x2000 @ 2000x3000."""
    out = F.linear(Tensor("x"), Tensor("weight"), None, False, False)
    get_default_net().mark_output(out, "out")
    print(get_default_net())
    start = time.perf_counter()
    engine = get_default_net().build_engine()
    build_ms = (time.perf_counter() - start) * 1e3
    x, w = torch.rand(1000, 2000), torch.rand(2000, 3000)
    result = torch.empty(1000, 3000)
    start = time.perf_counter()
    engine.forward({"x": x, "weight": w}, {"out": result})
    run_ms = (time.perf_counter() - start) * 1e3
    print(engine)
    err = (result - x @ w).abs().max().item()
    ok = torch.allclose(x @ w, result, rtol=1e-2, atol=1e-2)
    print(f"built in {build_ms:.1f} ms, ran in {run_ms:.1f} ms; max |tgraph - torch| = {err:.2e}: "
          + ("OK" if ok else "MISMATCH"))
    return 0 if ok else 1
