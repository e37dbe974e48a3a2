"""The symbolic ``Tensor`` API: identity, operators, indexing, reshapes, record-time shapes, and the
network manager (``recording``, ``get_default_net``)."""
from __future__ import annotations

import threading

import pytest
import torch

from tests.helpers import assert_close, run_graph
from tgraph.errors import RecordError
from tgraph.ir.value import ValueKind
from tgraph.nn import functional as F
from tgraph.nn.network_manager import get_default_net, recording, reset_default_net
from tgraph.nn.tensor import Tensor

f32 = torch.float32


# ---- identity ------------------------------------------------------------------------------------

def test_two_tensors_with_one_name_are_different() -> None:
    with recording("identity"):
        a, b = Tensor("x"), Tensor("x")
        assert a is not b and a.id != b.id
        assert hash(a) != hash(b)
        assert len({a, b}) == 2 and a in {a} and b not in {a}
        table = {a: "first", b: "second"}
        assert table[a] == "first" and table[b] == "second"
        # == is symbolic: it records an op, it never compares names.
        eq = a == b
        assert isinstance(eq, Tensor) and eq.producer is not None and eq.producer.op == "eq"
        assert eq.producer.inputs == [a, b]
        assert hash(a) == hash(a)  # stable although == is overloaded


def test_truth_value_of_a_symbolic_tensor_raises_a_helpful_type_error() -> None:
    with recording("bool"):
        x = Tensor("x", f32, (4,))
        with pytest.raises(TypeError, match=r"truth value of symbolic tensor x .*is_prefill"):
            bool(x)
        with pytest.raises(TypeError, match="truth value"):
            if x > 0:  # the classic mistake: a data-dependent branch while recording
                pass
        with pytest.raises(TypeError, match="not iterable; use F.split"):
            list(x)


def test_constructor_validates_dtype_and_dims() -> None:
    with pytest.raises(TypeError, match="dtype must be a torch.dtype, got 'float32'"):
        Tensor("x", "float32")
    with pytest.raises(TypeError, match=r"dims must be non-negative ints.*-3"):
        Tensor("x", f32, (4, -3))
    with pytest.raises(TypeError, match="dims must be"):
        Tensor("x", f32, (4, 2.0))
    t = Tensor("x", f32, ["n", None, 3])
    assert t.shape == ("n", None, 3) and t.kind is ValueKind.INPUT
    assert t.ndim == 3 and t.dim() == 3 and t.size() == ("n", None, 3) and t.size(-1) == 3
    assert Tensor("y").shape is None and Tensor("y").size(0) is None


def test_operands_must_be_symbolic_or_python_scalars() -> None:
    with recording("operands"):
        x = Tensor("x", f32, (4,))
        with pytest.raises(RecordError, match=r"add: got a real torch.Tensor of shape \(4,\).*"
                                              r"Parameter"):
            x + torch.ones(4)
        with pytest.raises(RecordError, match="mul: cannot use a str as an operand"):
            x * "2"


# ---- operators -----------------------------------------------------------------------------------

def _arith(x, y):
    return {
        "add": x + y, "radd": 1.5 + x, "sub": x - y, "rsub": 2 - x, "mul": x * y,
        "rmul": 3 * x, "div": x / y, "rdiv": 2.0 / y, "neg": -x, "pow": y ** 2, "scalar": x + 1,
        "lt": x < y, "le": x <= 0.5, "gt": x > y, "ge": 0.5 >= x, "eq": x == y, "ne": x != 0.0,
        "matmul": x @ y.transpose(0, 1),
    }


def test_operators_with_tensors_and_scalars_on_both_sides() -> None:
    x = torch.randint(-2, 3, (4, 6)).float()  # small integers: comparisons see ties
    y = torch.randint(1, 3, (4, 6)).float() * torch.where(torch.rand(4, 6) > 0.5, 1.0, -1.0)
    got = run_graph(_arith, {"x": x, "y": y}, like=_arith(x, y))
    for name, want in _arith(x.double(), y.double()).items():
        assert_close(got[name], want, msg=name)


def test_operators_record_the_expected_ops_and_constants() -> None:
    with recording("ops") as net:
        x = Tensor("x", f32, (4, 4))
        ops = {k: v.producer for k, v in _arith(x, Tensor("y", f32, (4, 4))).items()
               if k != "matmul"}
    assert {k: n.op for k, n in ops.items()} == {
        "add": "add", "radd": "add", "sub": "sub", "rsub": "sub", "mul": "mul", "rmul": "mul",
        "div": "div", "rdiv": "div", "neg": "neg", "pow": "pow", "scalar": "add", "lt": "lt",
        "le": "le", "gt": "gt", "ge": "le", "eq": "eq", "ne": "ne"}
    # Python scalars become constants on the side they were written on.
    assert ops["rsub"].inputs[0].kind is ValueKind.CONST and ops["rsub"].inputs[0].data == 2
    assert ops["rsub"].inputs[1] is x
    assert ops["rdiv"].inputs[0].data == 2.0
    assert ops["radd"].inputs[0].data == 1.5
    assert ops["ge"].inputs[0] is x and ops["ge"].inputs[1].data == 0.5  # 0.5 >= x is x <= 0.5
    assert len(net.nodes) == 19  # 17 above, the transpose and the matmul


def test_comparison_and_promotion_dtypes_follow_torch() -> None:
    with recording("dtypes"):
        i = Tensor("i", torch.int32, (3,))
        h = Tensor("h", torch.float16, (3,))
        cases = {
            "int + int scalar": (i + 2, torch.int32), "int * float scalar": (i * 0.5, f32),
            "int / int": (i / i, f32), "half + float scalar": (h + 2.5, torch.float16),
            "half + int": (h + i, torch.float16), "compare": (h < i, torch.bool),
            "neg int": (-i, torch.int32), "cast": (i.to(torch.bfloat16), torch.bfloat16),
            "float()": (h.float(), f32),
        }
    x_i, x_h = torch.tensor([1, 2, 3], dtype=torch.int32), torch.ones(3, dtype=torch.float16)
    torch_dtypes = {
        "int + int scalar": (x_i + 2).dtype, "int * float scalar": (x_i * 0.5).dtype,
        "int / int": (x_i / x_i).dtype, "half + float scalar": (x_h + 2.5).dtype,
        "half + int": (x_h + x_i).dtype, "compare": (x_h < x_i).dtype, "neg int": (-x_i).dtype,
        "cast": torch.bfloat16, "float()": f32,
    }
    for name, (t, want) in cases.items():
        assert t.dtype == want == torch_dtypes[name], name


# ---- indexing ------------------------------------------------------------------------------------

def _indexing(x, rows):
    return {
        "int": x[1], "neg_int": x[-1, 2], "slice": x[1:4], "step": x[:, 1:7:3],
        "ellipsis": x[..., 2], "none": x[None, 1:3, None], "ellipsis_none": x[..., None],
        "rows": x[rows], "rows_then_slice": x[rows, 2:5], "cols": x[:, rows],
        "mixed": x[..., rows][0], "open_end": x[2:, -3:],
    }


def test_getitem_matches_torch() -> None:
    x = torch.randn(5, 8)
    rows = torch.tensor([4, 0, 0, 2])
    want = _indexing(x, rows)
    got = run_graph(_indexing, {"x": x, "rows": rows}, like=want,
                    shapes={"x": ("num_tokens", 8), "rows": ("batch",)})
    for name in want:
        assert_close(got[name], want[name].double(), msg=name)


def test_getitem_record_time_shapes() -> None:
    with recording("getitem"):
        x = Tensor("x", f32, ("num_tokens", 8))
        rows = Tensor("rows", torch.int64, ("batch",))
        assert x[0].shape == (8,)
        assert x[:, 2].shape == ("num_tokens",)
        assert x[rows].shape == ("batch", 8)
        assert x[rows, 1:3].shape == ("batch", 2)
        assert x[..., None].shape == ("num_tokens", 8, 1)
        assert x[:] is x and x[:, :] is x  # a full slice records nothing


def test_getitem_errors() -> None:
    with recording("getitem_errors"):
        x = Tensor("x", f32, (4, 8))
        i = Tensor("i", torch.int64, (2,))
        with pytest.raises(RecordError, match="more than one index tensor"):
            x[i, i]  # torch would pair them elementwise; refused rather than silently different
        with pytest.raises(RecordError, match="cannot index a symbolic tensor with 1.5"):
            x[1.5]
        with pytest.raises(RecordError, match="cannot index a symbolic tensor with True"):
            x[True]
        with pytest.raises(RecordError, match="step must be positive"):
            x[::-1]
        with pytest.raises(RecordError, match=r"index 4 is out of range for dim 0 of size 4"):
            x[4]
        with pytest.raises(RecordError, match="needs a known rank"):
            Tensor("u")[..., 0]
        with pytest.raises(RecordError, match="gather index must be int32 or int64"):
            x[Tensor("mask", torch.bool, (4,))]


# ---- reshapes and friends ------------------------------------------------------------------------

def _reshapes(x, w):
    return {
        "reshape": x.reshape(-1, 4), "reshape_tuple": x.reshape((2, -1)),
        "view_symbol": x.view("num_tokens", 2, -1), "permute": x.reshape(-1, 2, 4).permute(2, 0, 1),
        "permute_tuple": x.reshape(-1, 2, 4).permute((1, 2, 0)), "transpose": x.transpose(0, 1),
        "unsqueeze_squeeze": x.unsqueeze(1).squeeze(1), "to": x.to(torch.float16),
        "matmul": x @ w, "linear_reshape": F.linear(x, w, None, False, False).reshape(-1, 2, 3),
        "contiguous": x.transpose(0, 1).contiguous(),
    }


def test_reshape_view_permute_transpose_to_and_matmul() -> None:
    x = torch.randn(3, 8)
    w = torch.randn(8, 6)
    want = {
        "reshape": x.reshape(-1, 4), "reshape_tuple": x.reshape(2, -1),
        "view_symbol": x.view(3, 2, -1), "permute": x.reshape(-1, 2, 4).permute(2, 0, 1),
        "permute_tuple": x.reshape(-1, 2, 4).permute(1, 2, 0), "transpose": x.t(),
        "unsqueeze_squeeze": x, "to": x.half(), "matmul": x @ w,
        "linear_reshape": (x @ w).reshape(-1, 2, 3), "contiguous": x.t(),
    }
    got = run_graph(_reshapes, {"x": x, "w": w}, like=want, shapes={"x": ("num_tokens", 8)})
    for name in want:
        assert_close(got[name], want[name].double(), msg=name)


def test_symbolic_dims_propagate_at_record_time() -> None:
    with recording("symbols"):
        x = Tensor("x", torch.bfloat16, ("num_tokens", 64))
        w = Tensor("w", torch.bfloat16, (96, 64))
        qkv = F.linear(x, w)
        assert qkv.shape == ("num_tokens", 96)
        q, k, v = F.split(qkv, [64, 16, 16], dim=-1)
        q = q.view(-1, 4, 16)                  # (tokens, heads, head_dim)
        assert q.shape == ("num_tokens", 4, 16) and q.dtype == torch.bfloat16
        assert q.reshape("num_tokens", -1).shape == ("num_tokens", 64)
        assert k.view(-1, 1, 16).transpose(0, 1).shape == (1, "num_tokens", 16)
        assert (q.permute(1, 0, 2) @ q.permute(1, 2, 0)).shape == (4, "num_tokens", "num_tokens")
        assert x.to(torch.float32).sum(-1, keepdim=True).shape == ("num_tokens", 1)
        with pytest.raises(RecordError, match="not divisible"):
            qkv.reshape("num_tokens", 5, -1)  # 96 / 5: certain although num_tokens is unknown
        assert qkv.reshape(-1, 5).shape == (None, 5)  # num_tokens * 96 may be a multiple of 5


# ---- the network manager -------------------------------------------------------------------------

def test_recording_context_records_into_its_own_network() -> None:
    default = get_default_net()
    before = len(default.nodes)
    with recording("outer") as outer:
        assert get_default_net() is outer and outer.name == "outer"
        a = F.exp(Tensor("a", f32, (2,)))
        with recording("inner") as inner:
            F.sin(Tensor("b", f32, (2,)))
            assert get_default_net() is inner
        F.cos(a)
        assert get_default_net() is outer
    assert get_default_net() is default and len(default.nodes) == before
    assert [n.op for n in outer.nodes] == ["exp", "cos"]
    assert [n.op for n in inner.nodes] == ["sin"]
    # A value of one network can't be used in another.
    with recording("other"):
        with pytest.raises(RecordError, match=r"produced in another network, not in 'other'"):
            F.exp(a)


def test_default_net_is_fresh_after_build_engine() -> None:
    reset_default_net()
    out = F.exp(Tensor("x", f32, (3,)))
    net = get_default_net()
    net.mark_output(out, "y")
    engine = net.build_engine()
    fresh = get_default_net()
    assert fresh is not net and fresh.nodes == [] and fresh.outputs == {}
    x = torch.randn(3)
    assert_close(engine.forward({"x": x})["y"], x.double().exp())
    # Building a network that is not the default leaves the default alone.
    F.sin(Tensor("z", f32, (3,)))
    with recording("private") as private:
        private.mark_output(F.exp(Tensor("x", f32, (3,))), "y")
    private.build_engine()
    assert get_default_net() is fresh and [n.op for n in fresh.nodes] == ["sin"]
    reset_default_net()


def test_default_net_is_per_thread() -> None:
    mine = get_default_net()
    seen = []
    thread = threading.Thread(target=lambda: seen.append(get_default_net()))
    thread.start()
    thread.join()
    assert seen and seen[0] is not mine
