"""The differential fuzzer (tgraph.testing.fuzz): a bounded run on both backends, the shrinker on
an injected fault, replay, and the regressions it found.

Tolerances are the fuzzer's own (see its module docstring): fp32 1e-4 relative to the output's
scale; bf16/fp16 a few units of roundoff per op of the longest chain.
"""
from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch

import tgraph.engine.plan as plan
from tgraph.nn import functional as F
from tgraph.nn.module import Parameter
from tgraph.nn.network_manager import recording
from tgraph.nn.tensor import Tensor
from tgraph.testing import fuzz
from tgraph.testing.fuzz_case import Case, InvalidCase, Step, draw_case, evaluate
from tgraph.testing.fuzz_ops import OPS


def _findings(report: fuzz.Report) -> list[str]:
    return [f"{case_id} -> {small}: [{f.config}] {f.kind}: {f.detail}"
            for case_id, small, f in report.failures]


def test_bounded_run_on_the_reference_backend():
    # 150 cases of up to 8 ops: passes on and off against the fp64 oracle (~15 s on 2 cores).
    report = fuzz.fuzz(150, seed=7, max_ops=8, out=lambda line: None)
    assert report.cases >= 140, f"only {report.cases} valid cases ({report.invalid} invalid)"
    assert not _findings(report), "\n".join(_findings(report))
    # The generator reaches every op of its catalogue in a run this size.
    assert set(report.ops) == set(OPS), set(OPS) - set(report.ops)


def test_bounded_run_on_the_triton_backend():
    # Fewer, smaller cases: the Triton interpreter runs each kernel on CPU in Python.
    report = fuzz.fuzz(40, seed=11, backend="triton", max_ops=6, out=lambda line: None)
    assert report.cases >= 36
    assert not _findings(report), "\n".join(_findings(report))


def _wrong_tanh(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the engine's tanh reference 25% off (what a broken kernel would do)."""
    real = plan.get_op

    def get_op(name: str):
        op = real(name)
        if name == "tanh":
            return dataclasses.replace(op, reference=lambda x: torch.tanh(x) * 1.25)
        return op

    monkeypatch.setattr(plan, "get_op", get_op)


def test_shrinker_reduces_an_injected_fault_to_one_op(monkeypatch):
    _wrong_tanh(monkeypatch)
    big = Case("inject", "bfloat16", [[4, 6], [6], [4, 1]], [
        Step("linear", [0], {"out": 6, "bias": True, "tb": True, "epi": "none", "act": "silu"}),
        Step("binary", [3, 1], {"fn": "add"}),
        Step("unary", [4], {"fn": "tanh"}),
        Step("softmax", [5], {"dim": -1}),
        Step("binary", [6, 2], {"fn": "mul"}),
    ], symbolic=True)
    found = fuzz.check_case(big, ("plain",))
    assert [f.signature for f in found] == [("plain", "mismatch")]
    small = fuzz.shrink(big, found[0])
    assert [s.op for s in small.steps] == ["unary"] and small.steps[0].params == {"fn": "tanh"}
    assert small.inputs == [[1, 1]] and small.dtype == "float32" and not small.symbolic
    # The printed id replays the shrunk case, which still fails the same way.
    assert Case.decode(small.encode()) == small
    assert [f.signature for f in fuzz.check_case(small, ("plain",))] == [("plain", "mismatch")]


def test_a_failing_run_prints_the_shrunk_case_and_its_replay_id(monkeypatch):
    _wrong_tanh(monkeypatch)
    lines: list[str] = []
    report = fuzz.fuzz(25, seed=3, max_ops=6, out=lines.append)
    tanh_failures = [f for f in report.failures if f[2].kind == "mismatch"]
    assert tanh_failures, "the injected fault went unnoticed"
    case_id, small_id, failure = tanh_failures[0]
    text = "\n".join(lines)
    assert f"FAIL {case_id}" in text and f"--replay {small_id}" in text
    small = fuzz.case_from_id(small_id)
    assert len(small.steps) == 1 and "tanh" in small.steps[0].params["fn"]  # or exp_tanh
    assert fuzz.case_from_id(case_id) == draw_case(case_id.rsplit(":", 1)[0], max_ops=6)


def test_cases_are_deterministic_per_seed():
    a = [draw_case(f"5:{i}", max_ops=8) for i in range(20)]
    b = [draw_case(f"5:{i}", max_ops=8) for i in range(20)]
    assert a == b
    assert a != [draw_case(f"6:{i}", max_ops=8) for i in range(20)]
    for case in a[:5]:  # the same data too, and through an encoded id
        ev1, ev2 = evaluate(case), evaluate(Case.decode(case.encode()))
        assert all(torch.equal(x, y) for x, y in zip(ev1.values, ev2.values))


def test_replay_from_the_command_line():
    case = draw_case("9:0", max_ops=4)
    run = subprocess.run([sys.executable, "-m", "tgraph.testing.fuzz", "--replay", case.encode()],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert case.describe() in run.stdout and run.stdout.rstrip().endswith("ok")


def test_a_shrunk_shape_that_no_longer_fits_is_invalid_not_a_failure():
    case = Case("x", "float32", [[4, 6]], [Step("split", [0], {"dim": 1, "sizes": [2, 4]})])
    evaluate(case)
    with pytest.raises(InvalidCase):
        evaluate(dataclasses.replace(case, inputs=[[4, 3]]))


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_linear_relu_epilogue(backend):
    """Found by the fuzzer: the fused linear + relu looked relu up in a table without it
    (KeyError on both backends)."""
    x, w = torch.randn(3, 4), torch.randn(5, 4)
    with recording("linear_relu") as net:
        y = F.activation(F.linear(Tensor("x", torch.float32, (3, 4)), Parameter(w, name="w")),
                         F.ActType.RELU)
        net.mark_output(y, "y")
    engine = net.build_engine(backend=backend)
    assert "linear_epilogue" in [n.op for n in engine.net.nodes]
    torch.testing.assert_close(engine.forward({"x": x})["y"], torch.relu(x @ w.t()))
