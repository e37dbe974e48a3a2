"""PointwiseFusion: structure (group counts, what stays unfused, outputs) and numbers.

Numbers: the fused node's reference runs the registry references of the very ops it replaced, in
the same order, on the same tensors, so the fused engine must equal the unfused one bit for bit
(``rtol=0, atol=0``); any difference means the program computes something else.
"""
from __future__ import annotations

import math

import pytest
import torch

import tgraph.ir.ops.fused_pointwise  # noqa: F401  (registers the op until ir.ops imports it)
from tgraph.engine import build_engine
from tgraph.ir.ops.fused_pointwise import PointwiseProgram
from tgraph.nn import functional as F
from tgraph.nn.module import Parameter
from tgraph.nn.network_manager import recording
from tgraph.nn.tensor import Tensor
from tgraph.passes import PassManager, default_pipeline
from tgraph.passes.cleanup import DeadCodeElimination
from tgraph.passes.pointwise_fusion import PointwiseFusion


def _ops(net) -> list[str]:
    return [n.op for n in net.nodes]


def _fuse(net, disabled=()):
    """Clone ``net`` and run the default pipeline with PointwiseFusion after the hand-written
    fusions (where the lead's pipeline puts it). Returns the fused copy and the group count."""
    work, _ = net.clone()
    passes = default_pipeline()
    dce = next(i for i, p in enumerate(passes) if isinstance(p, DeadCodeElimination))
    passes.insert(dce, PointwiseFusion())
    records = PassManager(passes, disabled).run(work)
    count = next(r.matches for r in records if r.name == "PointwiseFusion")
    return work, count


def _assert_same_numbers(net, work, inputs):
    want = net.build_engine(passes=False).forward(inputs)
    got = build_engine(work, passes=False).forward(inputs)
    assert set(got) == set(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)


def _fused_nodes(net):
    return [n for n in net.nodes if n.op == "fused_pointwise"]


# ---- groups that fuse ---------------------------------------------------------------------------


def test_hand_written_softmax_is_one_row_kernel():
    with recording("softmax") as net:
        x = Tensor("x", torch.float32, ("n", 20))
        e = F.exp(x - F.amax(x, -1, keepdim=True))
        net.mark_output(e / F.sum(e, -1, keepdim=True), "y")
    work, count = _fuse(net)
    assert count == 1 and _ops(work) == ["fused_pointwise"]
    program: PointwiseProgram = work.nodes[0].attrs["program"]
    assert [i[1] for i in program.instrs if i[0] == "reduce"] == ["amax", "sum"]
    assert len(program.outputs) == 1 and work.nodes[0].inputs[0].name == "x"
    for rows in (1, 5, 9):  # one engine, several token counts
        _assert_same_numbers(net, work, {"x": torch.randn(rows, 20)})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_spelling_fuses_only_when_rms_norm_fusion_is_disabled(dtype):
    with recording("rms") as net:
        x = Tensor("x", dtype, ("n", 32))
        w = Parameter(torch.randn(32).to(dtype), name="w")
        h = F.cast(x, torch.float32)
        h = h * F.rsqrt(F.mean(h * h, -1, keepdim=True) + 1e-6)
        net.mark_output(w * F.cast(h, dtype), "y")
    inputs = {"x": torch.randn(6, 32).to(dtype)}

    work, count = _fuse(net)  # the hand-written fusion wins: nothing is left for this pass
    assert count == 0 and _ops(work) == ["rms_norm"]

    work, count = _fuse(net, disabled=["RmsNormFusion"])
    assert count == 1 and _ops(work) == ["fused_pointwise"]
    node = work.nodes[0]
    assert [v.name for v in node.inputs] == ["x", "w"]  # the [32] weight broadcasts over rows
    assert node.outputs[0].dtype == dtype
    _assert_same_numbers(net, work, inputs)


def test_gelu_tanh_spelled_in_ops_is_one_flat_kernel():
    with recording("gelu") as net:
        x = Tensor("x", torch.float16, ("n", 24))
        inner = math.sqrt(2 / math.pi) * (x + 0.044715 * F.pow(x, 3.0))
        net.mark_output(0.5 * x * (1.0 + F.tanh(inner)), "y")
    work, count = _fuse(net)
    assert count == 1 and _ops(work) == ["fused_pointwise"]
    program = work.nodes[0].attrs["program"]
    assert not program.has_reductions
    assert [i[1] for i in program.instrs if i[0] == "op"] == \
        ["pow", "mul", "add", "mul", "mul", "tanh", "add", "mul"]
    _assert_same_numbers(net, work, {"x": torch.randn(7, 24).half()})


def test_intermediate_that_is_a_network_output_becomes_a_fused_output():
    with recording("marked") as net:
        x = Tensor("x", torch.float32, ("n", 8))
        e = F.exp(x)
        net.mark_output(e, "e")
        net.mark_output(e * 2.0 + 1.0, "y")
    work, count = _fuse(net)
    assert count == 1 and _ops(work) == ["fused_pointwise"]
    node = work.nodes[0]
    assert len(node.outputs) == 2
    assert work.outputs["e"] is node.outputs[0] and work.outputs["y"] is node.outputs[1]
    _assert_same_numbers(net, work, {"x": torch.randn(3, 8)})


def test_value_read_outside_the_group_is_exposed_not_recomputed():
    with recording("shared") as net:
        x = Tensor("x", torch.float32, ("n", 16))
        wt = Parameter(torch.randn(16, 16), name="wt")
        a = x * 2.0
        net.mark_output(F.linear(a, wt), "lin")  # reads the group value a
        net.mark_output(F.exp(a) + 1.0, "y")
    work, count = _fuse(net)
    assert count == 1 and sorted(_ops(work)) == ["fused_pointwise", "linear"]
    (fused,) = _fused_nodes(work)
    assert len(fused.outputs) == 2
    linear = next(n for n in work.nodes if n.op == "linear")
    assert linear.inputs[0] is fused.outputs[0]  # a is computed once, by the fused kernel
    assert sum(1 for i in fused.attrs["program"].instrs if i[0] == "op") == 3
    _assert_same_numbers(net, work, {"x": torch.randn(4, 16)})


def test_fused_node_moves_before_outside_readers_recorded_between_members():
    # The linear reads a = exp(x) and sits between exp and mul in the list; the fused node is
    # placed after its last member, so the linear must move after it.
    with recording("order") as net:
        x = Tensor("x", torch.float32, ("n", 16))
        wt = Parameter(torch.randn(16, 16), name="wt")
        a = F.exp(x)
        net.mark_output(F.linear(a, wt), "lin")
        net.mark_output(a * 3.0, "y")
    work, count = _fuse(net)
    assert count == 1 and _ops(work) == ["fused_pointwise", "linear"]
    work.verify()
    _assert_same_numbers(net, work, {"x": torch.randn(5, 16)})


def test_bool_masks_fuse_with_float_math():
    with recording("mask") as net:
        x = Tensor("x", torch.bfloat16, ("n", 16))
        keep = Tensor("keep", torch.bool, ("n", 16))
        y = F.where(F.logical_not(keep), x * 2.0, -1e4)
        net.mark_output(F.where(x > 0.0, y, 0.0), "y")
    work, count = _fuse(net)
    assert count == 1 and _ops(work) == ["fused_pointwise"]
    inputs = {"x": torch.randn(4, 16).bfloat16(), "keep": torch.rand(4, 16) > 0.5}
    _assert_same_numbers(net, work, inputs)


def test_leading_dim_broadcasts_fuse():
    with recording("bias") as net:
        x = Tensor("x", torch.float32, (2, "s", 16))
        w = Tensor("w", torch.float32, (16,))
        b = Tensor("b", torch.float32, (1, 1, 16))
        pos = Tensor("pos", torch.float32, ("s", 16))
        scale = Tensor("scale", torch.float32, ())
        net.mark_output(F.sigmoid(x * w + b) * pos * scale, "y")
    work, count = _fuse(net)
    assert count == 1 and _ops(work) == ["fused_pointwise"]
    inputs = {"x": torch.randn(2, 3, 16), "w": torch.randn(16), "b": torch.randn(1, 1, 16),
              "pos": torch.randn(3, 16), "scale": torch.tensor(0.5)}
    _assert_same_numbers(net, work, inputs)


def test_dtype_promotion_is_kept():
    with recording("promote") as net:
        x = Tensor("x", torch.bfloat16, ("n", 8))
        y = Tensor("y", torch.float32, ("n", 8))
        net.mark_output(F.exp(x) * y + 1, "z")
    work, count = _fuse(net)
    assert count == 1 and work.outputs["z"].dtype == torch.float32
    _assert_same_numbers(net, work, {"x": torch.randn(3, 8).bfloat16(), "y": torch.randn(3, 8)})


# ---- what is left alone --------------------------------------------------------------------------


def test_group_that_would_make_a_cycle_is_split():
    # exp -> softmax -> add reads exp again: {exp, add} as one node would need its own output.
    with recording("cycle") as net:
        x = Tensor("x", torch.float32, ("n", 16))
        a = F.exp(x)
        c = a + F.softmax(a, -1)
        net.mark_output(c * 2.0, "y")
    work, count = _fuse(net)
    assert count == 1 and _ops(work) == ["exp", "softmax", "fused_pointwise"]
    program = _fused_nodes(work)[0].attrs["program"]
    assert [i[1] for i in program.instrs if i[0] == "op"] == ["add", "mul"]
    _assert_same_numbers(net, work, {"x": torch.randn(3, 16)})


def test_two_groups_that_would_form_a_cycle_once_both_fused():
    # G1 = {a, b, j} and G2 = {d, c, k} are each fine alone, but once both are single nodes,
    # G1 -> softmax -> G2 -> softmax -> G1. Only the first is fused.
    with recording("cross") as net:
        x = Tensor("x", torch.float32, ("n", 16))
        y = Tensor("y", torch.float32, ("n", 16))
        a = F.exp(x)
        d = F.cos(y)
        b = F.sin(F.softmax(d, -1))
        net.mark_output(a + b, "j")
        c = F.sin(F.softmax(a, -1))
        net.mark_output(c * d, "k")
    work, count = _fuse(net)
    # Which group wins depends on the growth order; what matters is that the two groups are
    # never both fused whole (that would be a cycle) and that the result is a valid network.
    assert count in (1, 2)
    work.verify()
    programs = [[i[1] for i in n.attrs["program"].instrs if i[0] == "op"]
                for n in _fused_nodes(work)]
    assert not (["exp", "sin", "add"] in programs and ["cos", "sin", "mul"] in programs)
    _assert_same_numbers(net, work, {"x": torch.randn(3, 16), "y": torch.randn(3, 16)})


@pytest.mark.parametrize("case", ["int_tensor", "int_operand", "last_dim_broadcast",
                                  "middle_broadcast", "unknown_rank", "host_input", "fp64"])
def test_refusals(case):
    with recording(case) as net:
        if case == "int_tensor":
            x = Tensor("x", torch.int32, ("n", 8))
            y = (x + 1) * 2
        elif case == "int_operand":
            x = Tensor("x", torch.float32, ("n", 8))
            i = Tensor("i", torch.int64, ("n", 8))
            y = F.exp(x * i)
        elif case == "last_dim_broadcast":
            x = Tensor("x", torch.float32, ("n", 8))
            s = Tensor("s", torch.float32, ("n", 1))
            y = F.exp(x * s)
        elif case == "middle_broadcast":
            x = Tensor("x", torch.float32, (2, "s", 8))
            s = Tensor("s", torch.float32, (2, 1, 8))
            y = F.exp(x * s)
        elif case == "unknown_rank":
            y = F.exp(Tensor("x", torch.float32) * 2.0)
        elif case == "host_input":
            y = F.exp(Tensor("x", torch.float32, (8,), host=True) * 2.0)
        else:
            y = F.exp(Tensor("x", torch.float64, ("n", 8)) * 2.0)
        net.mark_output(y, "y")
    work, count = _fuse(net)
    assert count == 0 and "fused_pointwise" not in _ops(work)


def test_reductions_join_only_when_the_group_reads_them():
    with recording("reductions") as net:
        x = Tensor("x", torch.float32, ("n", 16))
        e = F.exp(x) * 2.0
        net.mark_output(F.sum(e, -1, keepdim=True), "rowsum")  # trailing: stays a reduction
        net.mark_output(x - F.mean(x, 0, keepdim=True), "centered")  # not over the last dim
        net.mark_output(F.amax(x, -1) + 1.0, "nokeep")  # without keepdim
    work, count = _fuse(net)
    assert count == 1
    assert sorted(_ops(work)) == ["add", "amax", "fused_pointwise", "mean", "sub", "sum"]
    program = _fused_nodes(work)[0].attrs["program"]
    assert [i[1] for i in program.instrs if i[0] == "op"] == ["exp", "mul"]
    _assert_same_numbers(net, work, {"x": torch.randn(4, 16)})


def test_fused_network_prints_its_program():
    with recording("print") as net:
        x = Tensor("x", torch.float32, ("n", 8))
        net.mark_output(F.sigmoid(x) * 3.0, "y")
    work, _ = _fuse(net)
    text = str(work)
    assert "fused_pointwise(x, program={t1=sigmoid(in0); t3=mul(t1,3.0) -> t3})" in text
