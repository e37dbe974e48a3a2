from __future__ import annotations

import torch

from tgraph.nn import functional as F
from tgraph.nn.network_manager import recording
from tgraph.nn.tensor import Tensor
from tgraph.passes.memory import lifetimes, plan_memory
from tgraph.passes.partition import partition


def _chain(n: int):
    with recording("chain") as net:
        x = Tensor("x", torch.float32, ("t", 64))
        h = x
        for _ in range(n):
            h = F.exp(h)
        net.mark_output(h, "y")
    return net


def _concrete(net, tokens):
    engine = net.build_engine(passes=False)
    engine.forward({"x": torch.randn(tokens, 64)})
    return engine


def test_buffers_are_reused_along_a_chain():
    engine = _concrete(_chain(6), 10)
    stats = engine.stats
    one = 10 * 64 * 4
    # Only two intermediates are ever live at once (the one being read and the one written).
    assert stats.peak_intermediate_bytes <= 3 * ((one + 255) // 256 * 256)
    assert stats.naive_intermediate_bytes >= 6 * one
    assert stats.peak_intermediate_bytes < stats.naive_intermediate_bytes


def test_plan_has_no_overlap_between_live_buffers():
    with recording("diamond") as net:
        x = Tensor("x", torch.float32, (16, 16))
        a, b = F.exp(x), F.sin(x)
        c = a + b
        d = F.reshape(c, (256,))  # a view keeps c alive
        net.mark_output(F.cos(d) + F.sum(d, 0), "y")
    engine = net.build_engine(passes=False)
    engine.forward({"x": torch.randn(16, 16)})
    binding = engine._latest
    spans = lifetimes(engine.net)
    plan = binding.memory[None]
    values = list(plan.offsets)
    for i, u in enumerate(values):
        for v in values[i + 1:]:
            (a0, a1), (b0, b1) = spans[u], spans[v]
            if a1 < b0 or b1 < a0:
                continue
            ou, ov = plan.offsets[u], plan.offsets[v]
            assert ou + plan.sizes[u] <= ov or ov + plan.sizes[v] <= ou, (u, v)
    # The reshape is a view: no buffer of its own.
    assert all(v.producer.op != "reshape" for v in plan.offsets)


def test_memory_plan_per_binding():
    net = _chain(3)
    engine = net.build_engine(passes=False)
    engine.forward({"x": torch.randn(4, 64)})
    small = engine.stats.peak_intermediate_bytes
    engine.forward({"x": torch.randn(400, 64)})
    assert engine.stats.peak_intermediate_bytes > small
    assert engine.stats.bindings == 2


def test_host_inputs_split_segments():
    with recording("host") as net:
        x = Tensor("x", torch.float32, ("t", 4))
        n = Tensor("n", torch.float32, (1,), host=True)
        y = F.exp(x)
        y = y * n  # reads a host value: its own segment
        net.mark_output(F.sin(y), "y")
    segments = partition(net)
    assert [s.capturable for s in segments] == [True, False, True]
    assert "host value n" in segments[1].reason
    engine = net.build_engine()
    assert engine.stats.segment_count == 3
    x = torch.randn(3, 4)
    out = engine.forward({"x": x}, runtime_params={"n": [2.0]})["y"]
    torch.testing.assert_close(out, torch.sin(torch.exp(x) * 2.0))


def test_plan_memory_directly_with_exclusions():
    net = _chain(2)
    shapes = {v: ((8, 64), torch.float32) for n in net.nodes for v in n.outputs}
    out = net.outputs["y"]
    plan = plan_memory(net, shapes, exclude={out})
    assert out not in plan.offsets and len(plan.offsets) == 1
