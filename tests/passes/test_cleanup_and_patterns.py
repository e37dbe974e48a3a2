"""Pass tests: each checks structure (match counts, node counts) and numbers (fused == unfused)."""
from __future__ import annotations

import pytest
import torch

from tgraph.errors import PassError
from tgraph.nn import functional as F
from tgraph.nn.network_manager import recording
from tgraph.nn.tensor import Tensor
from tgraph.passes import PassManager, Pattern, PatternPass
from tgraph.passes.canonicalize import RmsNormFusion, SiluFusion
from tgraph.passes.cleanup import CommonSubexpressionElimination, DeadCodeElimination, NoOpRemoval


def _ops(net):
    return [n.op for n in net.nodes]


def _run_both(net, inputs, **build):
    fused = net.build_engine(**build).forward(inputs)
    plain = net.build_engine(passes=False).forward(inputs)
    return fused, plain


def test_noop_removal_drops_identity_ops_only():
    with recording("noop") as net:
        x = Tensor("x", torch.float32, ("n", 8))
        y = F.cast(x, torch.float32).reshape("n", 8)[:, 0:8]
        y = (y + 0) * 1
        z = F.cast(y, torch.float16)  # a real cast stays
        net.mark_output(z, "z")
    work, _ = net.clone()
    assert NoOpRemoval().run(work) == 5
    assert _ops(work) == ["cast"]
    x = torch.randn(3, 8)
    torch.testing.assert_close(net.build_engine().forward({"x": x})["z"], x.half())


def test_noop_removal_keeps_promoting_add():
    # int tensor + 0.0 is a float tensor: not a no-op.
    with recording("promote") as net:
        x = Tensor("x", torch.int64, (4,))
        net.mark_output(x + 0.0, "y")
    work, _ = net.clone()
    assert NoOpRemoval().run(work) == 0


def test_cse_merges_identical_nodes_and_respects_constants():
    with recording("cse") as net:
        x = Tensor("x", torch.float32, (4, 4))
        a, b = F.exp(x) * 2.0, F.exp(x) * 2.0
        c = F.exp(x) * 3.0
        net.mark_output(a + b + c, "y")
    work, _ = net.clone()
    assert CommonSubexpressionElimination().run(work) == 3  # two exp + one mul merged
    assert _ops(work).count("exp") == 1 and _ops(work).count("mul") == 2
    x = torch.randn(4, 4)
    fused, plain = _run_both(net, {"x": x})
    torch.testing.assert_close(fused["y"], plain["y"])


def test_cse_never_merges_side_effects():
    with recording("cache") as net:
        k = Tensor("k", torch.float32, ("t", 2, 4))
        kc = Tensor("kc", torch.float32, (4, 4, 2, 4))
        vc = Tensor("vc", torch.float32, (4, 4, 2, 4))
        slots = Tensor("slots", torch.int64, ("t",))
        F.reshape_and_cache(k, k, kc, vc, slots)
        F.reshape_and_cache(k, k, kc, vc, slots)
        net.mark_output(F.exp(k), "y")
    work, _ = net.clone()
    assert CommonSubexpressionElimination().run(work) == 0
    assert DeadCodeElimination().run(work) == 0
    assert _ops(work).count("reshape_and_cache") == 2


def test_dce_removes_unused_nodes():
    with recording("dce") as net:
        x = Tensor("x", torch.float32, (4,))
        F.exp(F.sin(x))
        net.mark_output(F.cos(x), "y")
    work, _ = net.clone()
    assert DeadCodeElimination().run(work) == 2
    assert _ops(work) == ["cos"]


def _silu_net():
    with recording("silu") as net:
        x = Tensor("x", torch.float32, ("n", 16))
        net.mark_output(x * F.sigmoid(x), "y")
    return net


def test_pattern_rewrite_silu_matches_and_is_equal():
    net = _silu_net()
    work, _ = net.clone()
    assert SiluFusion().run(work) == 1
    DeadCodeElimination().run(work)
    assert _ops(work) == ["silu"]
    x = torch.randn(5, 16)
    fused, plain = _run_both(net, {"x": x})
    torch.testing.assert_close(fused["y"], plain["y"], rtol=1e-6, atol=1e-6)


def test_pattern_matches_commuted_operands():
    with recording("silu2") as net:
        x = Tensor("x", torch.float32, (4,))
        net.mark_output(F.sigmoid(x) * x, "y")
    work, _ = net.clone()
    assert SiluFusion().run(work) == 1


def test_pattern_refuses_intermediate_read_elsewhere():
    with recording("shared") as net:
        x = Tensor("x", torch.float32, (4,))
        s = F.sigmoid(x)
        net.mark_output(x * s, "y")
        net.mark_output(s + 1.0, "z")  # the sigmoid is also read outside the pattern
    work, _ = net.clone()
    assert SiluFusion().run(work) == 0
    x = torch.randn(4)
    fused, plain = _run_both(net, {"x": x})
    torch.testing.assert_close(fused["z"], plain["z"])


def test_pattern_refuses_marked_intermediate():
    with recording("marked") as net:
        x = Tensor("x", torch.float32, (4,))
        s = F.sigmoid(x)
        net.mark_output(x * s, "y")
        net.mark_output(s, "s")
    work, _ = net.clone()
    assert SiluFusion().run(work) == 0


def test_pattern_placeholder_binds_by_identity_not_name():
    with recording("two_x") as net:
        a = Tensor("x", torch.float32, (4,))
        b = Tensor("x2", torch.float32, (4,))
        net.mark_output(a * F.sigmoid(b), "y")  # not silu: different tensors
    work, _ = net.clone()
    assert SiluFusion().run(work) == 0


def test_pattern_is_not_fooled_by_adjacent_unrelated_nodes():
    # sigmoid(x) and a mul that does not read it sit next to each other in the list.
    with recording("adjacent") as net:
        x = Tensor("x", torch.float32, (4,))
        s = F.sigmoid(x)
        y = x * x
        net.mark_output(y + s, "y")
    work, _ = net.clone()
    assert SiluFusion().run(work) == 0


def _hf_rms(x, w, eps, cast=True, use_pow=True):
    h = F.cast(x, torch.float32) if cast else x
    sq = h ** 2 if use_pow else h * h
    h = h * F.rsqrt(F.mean(sq, -1, keepdim=True) + eps)
    return w * (F.cast(h, x.dtype) if cast else h)


@pytest.mark.parametrize("dtype,cast,use_pow", [
    (torch.bfloat16, True, True), (torch.float32, True, False), (torch.float32, False, True)])
def test_rms_norm_fusion_on_hf_spelling(dtype, cast, use_pow):
    with recording("rms") as net:
        x = Tensor("x", dtype, ("n", 32))
        w = Tensor("w", dtype, (32,))
        net.mark_output(_hf_rms(x, w, 1e-5, cast, use_pow), "y")
    work, _ = net.clone()
    assert RmsNormFusion().run(work) == 1
    DeadCodeElimination().run(work)
    assert _ops(work) == ["rms_norm"]
    assert work.nodes[0].attrs["eps"] == 1e-5
    x, w = torch.randn(6, 32, dtype=dtype), torch.randn(32, dtype=dtype)
    fused, plain = _run_both(net, {"x": x, "w": w})
    # Same rounding steps in both (fp32 math, one rounding to dtype): equal to fp32 rounding.
    torch.testing.assert_close(fused["y"], plain["y"], rtol=1e-5, atol=1e-5)


def test_rms_norm_fusion_refuses_wrong_axis():
    with recording("rms_axis") as net:
        x = Tensor("x", torch.float32, (8, 32))
        w = Tensor("w", torch.float32, (32,))
        h = x * F.rsqrt(F.mean(x * x, 0, keepdim=True) + 1e-6)
        net.mark_output(w * h, "y")
    work, _ = net.clone()
    assert RmsNormFusion().run(work) == 0


def test_pattern_with_multiple_outputs_and_custom_replacement():
    # A two-output pattern: (a + b, (a + b) * 2) -> computed once by the replacement.
    def pattern_fn(a, b):
        s = a + b
        return s, s * 2.0

    def replacement(a, b):
        s = F.add(a, b)
        return s, F.add(s, s)

    pattern = Pattern("add_and_double", pattern_fn, replacement)
    with recording("multi") as net:
        a, b = Tensor("a", torch.float32, (4,)), Tensor("b", torch.float32, (4,))
        s = a + b
        net.mark_output(s, "s")
        net.mark_output(s * 2.0, "d")
    work, _ = net.clone()
    assert PatternPass("AddDouble", [pattern]).run(work) == 1
    assert [n.op for n in work.nodes] == ["add", "add"]
    a, b = torch.randn(4), torch.randn(4)
    engine = net.build_engine(passes=False)
    want = engine.forward({"a": a, "b": b})
    from tgraph.engine import Engine
    got = Engine(work).forward({"a": a, "b": b})
    torch.testing.assert_close(got["d"], want["d"])
    torch.testing.assert_close(got["s"], want["s"])


def test_pass_manager_disable_and_provenance():
    net = _silu_net()
    engine = net.build_engine(disabled_passes=["SiluFusion"])
    names = {r.name: r for r in engine.pass_records}
    assert names["SiluFusion"].skipped
    assert "silu" not in [n.op for n in engine.net.nodes]
    engine = net.build_engine()
    assert {r.name: r.matches for r in engine.pass_records}["SiluFusion"] == 1
    assert "SiluFusion: 1 matches" in str(engine)


def test_pass_manager_rejects_unknown_pass_name():
    with pytest.raises(PassError, match="NotAPass.*pipeline has: NoOpRemoval"):
        PassManager([NoOpRemoval()], disabled=["NotAPass"])


def test_build_does_not_change_the_recorded_network():
    net = _silu_net()
    before = str(net)
    net.build_engine()
    assert str(net) == before
