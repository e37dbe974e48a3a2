"""The ``AllReduceAddRmsNorm`` pass and collective capturability, in process.

Recording a collective needs a process group; these tests only record and build engines (they
never run a collective), so a fake group is enough: ``torch.distributed`` is patched to say it
is initialized with 2 ranks on a chosen backend. The numbers (fused == unfused on gloo, both
backends, and in the models) are checked by the 2-process launch in ``test_tp_gloo.py``.
"""
from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist

from tgraph.bench.tp import decode_graph_report, describe
from tgraph.engine import Engine
from tgraph.ir.ops import Meta, get_op
from tgraph.ir.shape import ShapeRuleError
from tgraph.nn import distributed
from tgraph.nn import functional as F
from tgraph.nn.network_manager import new_network, recording
from tgraph.nn.tensor import Tensor
from tgraph.passes import pass_names

FUSED = "all_reduce_add_rms_norm"
PASS = "AllReduceAddRmsNorm"
F32 = torch.float32
H = 16


@pytest.fixture
def fake_group(monkeypatch: pytest.MonkeyPatch) -> Callable[..., None]:
    """Pretend to be rank 0 of 2 on ``backend`` (default gloo)."""

    def make(backend: str = "gloo", capture: bool = True) -> None:
        monkeypatch.setattr(dist, "is_available", lambda: True)
        monkeypatch.setattr(dist, "is_initialized", lambda: True)
        monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
        monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
        monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
        monkeypatch.setattr(distributed, "_capture_collectives", capture)

    make()
    return make


def _ops(engine: Engine) -> list[str]:
    return [n.op for n in engine.net.nodes]


def _matches(engine: Engine) -> int:
    return next(r.matches for r in engine.pass_records if r.name == PASS)


def _block(residual_first: bool = True, *, mark_reduced: bool = False, read_x: bool = False,
           x_is_input: bool = False, x_view: bool = False, residual_rows: int | str = "rows",
           disabled: tuple[str, ...] = ()) -> Engine:
    """``rms_norm(residual + all_reduce(x))`` and the new residual, ``x = linear(a, w)`` (or an
    input, or a view of the linear), with optional extra readers."""
    with recording(new_network("block")) as net:
        residual = Tensor("residual", F32, (residual_rows, H))
        g = Tensor("g", F32, (H,))
        if x_is_input:
            x = Tensor("x", F32, ("rows", H))
        else:
            x = F.linear(Tensor("a", F32, ("rows", 8)), Tensor("w", F32, (H, 8)))
            if x_view:  # the first half of a wider linear's output
                wide = F.linear(Tensor("a2", F32, ("rows", 8)), Tensor("w2", F32, (2 * H, 8)))
                x = F.split(wide, H, dim=-1)[0]
        reduced = distributed.all_reduce(x)
        summed = residual + reduced if residual_first else reduced + residual
        net.mark_output(F.rms_norm(summed, g, 1e-5), "normed")
        net.mark_output(summed, "summed")
        if mark_reduced:
            net.mark_output(reduced * 2.0, "reduced_twice")
        if read_x:
            net.mark_output(x * 3.0, "x_thrice")
    return net.build_engine(disabled_passes=disabled)


@pytest.mark.parametrize("residual_first", [True, False], ids=["residual+reduced",
                                                               "reduced+residual"])
@pytest.mark.parametrize("disabled", [(), ("AddRmsNorm",)], ids=["after_AddRmsNorm",
                                                                  "plain_add_and_norm"])
def test_fuses_both_spellings(fake_group, residual_first: bool, disabled: tuple[str, ...]) -> None:
    engine = _block(residual_first, disabled=disabled)
    ops = _ops(engine)
    assert _matches(engine) == 1
    assert ops.count(FUSED) == 1
    for gone in ("all_reduce", "add_rms_norm", "rms_norm", "add"):
        assert gone not in ops, f"{gone} left beside the fused op: {ops}"
    (node,) = [n for n in engine.net.nodes if n.op == FUSED]
    assert node.attrs["world_size"] == 2 and node.attrs["capturable"] is False
    assert node.attrs["reduce_in_place"] is True  # the linear's output is read by nothing else
    assert node.inputs[0].producer.op == "linear"
    assert node.inputs[1].name == "residual"
    # Both outputs are used: the normed tensor and the new residual.
    assert set(engine.net.outputs.values()) == set(node.outputs)


def test_pass_is_in_the_pipeline_after_add_rms_norm() -> None:
    names = pass_names()
    assert names.index("AddRmsNorm") < names.index(PASS) < names.index("PointwiseFusion")


def test_disabled_pass_leaves_the_collective(fake_group) -> None:
    engine = _block(disabled=(PASS,))
    assert FUSED not in _ops(engine) and "all_reduce" in _ops(engine)
    record = next(r for r in engine.pass_records if r.name == PASS)
    assert record.skipped and str(record) == f"{PASS}: disabled"


def test_refused_when_the_reduced_value_is_read_elsewhere(fake_group) -> None:
    engine = _block(mark_reduced=True)
    assert _matches(engine) == 0
    assert FUSED not in _ops(engine) and "all_reduce" in _ops(engine)


def test_refused_when_the_residual_broadcasts(fake_group) -> None:
    """The kernel takes no broadcasting: a one-row residual stays unfused."""
    engine = _block(residual_rows=1)
    assert _matches(engine) == 0


@pytest.mark.parametrize("kind", ["x_read_elsewhere", "x_is_input", "x_is_a_view"])
def test_reduces_in_place_only_a_dead_buffer(fake_group, kind: str) -> None:
    engine = _block(read_x=kind == "x_read_elsewhere", x_is_input=kind == "x_is_input",
                    x_view=kind == "x_is_a_view")
    (node,) = [n for n in engine.net.nodes if n.op == FUSED]
    # Still fused, but the kernel must copy x before reducing: x is read later, is the
    # caller's tensor, or shares its buffer with a value the reshape came from.
    assert node.attrs["reduce_in_place"] is False


@pytest.mark.parametrize("backend, capture, expected", [
    ("nccl", True, True), ("nccl", False, False), ("gloo", True, False)])
def test_collectives_capturable_on_nccl_only(fake_group, backend: str, capture: bool,
                                             expected: bool) -> None:
    fake_group(backend, capture)
    assert distributed.collectives_capturable() is expected
    with recording(new_network("tp")) as net:
        x = Tensor("x", F32, ("rows", H))
        h = distributed.all_reduce(F.linear(x, Tensor("w", F32, (H, H))))
        summed = x + h
        normed = F.rms_norm(summed, Tensor("g", F32, (H,)), 1e-5)
        net.mark_output(distributed.all_gather(normed * 2.0, dim=-1), "gathered")
        net.mark_output(summed, "summed")
    engine = net.build_engine()
    collectives = [n for n in engine.net.nodes if n.op in (FUSED, "all_gather")]
    assert [n.op for n in collectives] == [FUSED, "all_gather"]
    assert all(n.attrs["capturable"] is expected for n in collectives)
    report = decode_graph_report(engine)
    if expected:
        # One CUDA graph can hold the whole step.
        assert engine.stats.segment_count == 1 and engine.stats.capturable_segments == 1
        assert report == {"collectives": 2, "captured_collectives": 2, "graphs_per_step": 1,
                          "host_segments": 0}
        assert describe(report) == ("2 collectives (all captured), 1 CUDA graphs and 0 host "
                                    "segments per decode step")
    else:
        # linear | fused collective | mul | all_gather: two graphs around two host segments.
        assert report == {"collectives": 2, "captured_collectives": 0, "graphs_per_step": 2,
                          "host_segments": 2}
        assert "(none captured)" in describe(report)
    # An explicit choice wins over the group's default.
    with recording(new_network("explicit")) as net2:
        net2.mark_output(distributed.all_reduce(Tensor("x", F32, (2, H)), capturable=False), "o")
    assert net2.nodes[0].attrs["capturable"] is False


def test_fused_op_rules() -> None:
    op = get_op(FUSED)
    assert op.has_side_effects, "every rank must issue it: DCE/CSE may not drop or merge it"
    x = Meta(("rows", H), torch.bfloat16)
    w = Meta((H,), torch.bfloat16)
    assert op.infer_metas([x, x, w], {"eps": 1e-5, "world_size": 2}) == [x, x]
    with pytest.raises(ShapeRuleError, match="world_size must be a positive int"):
        op.infer_metas([x, x, w], {"eps": 1e-5, "world_size": 0})
    with pytest.raises(ShapeRuleError, match="does not match the last dim"):
        op.infer_metas([x, x, Meta((H + 1,), torch.bfloat16)], {"eps": 1e-5, "world_size": 2})
    with pytest.raises(RuntimeError, match="torch.distributed is not initialized"):
        op.reference(torch.ones(2, H), torch.ones(2, H), torch.ones(H), eps=1e-5, world_size=2)
