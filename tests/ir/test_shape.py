"""Symbolic shapes: the dim helpers, record-time shape/dtype inference through ops, and the views of
a recorded network (``str``, DOT, networkx) that show those shapes."""
from __future__ import annotations

import importlib.util
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tgraph.errors import RecordError
from tgraph.ir.ops import Meta, get_op
from tgraph.ir.shape import (
    ShapeRuleError,
    broadcast_shapes,
    dims_conflict,
    format_shape,
    merge_dims,
    normalize_dim,
    reshape_target,
    resolve_shape,
)
from tgraph.nn import functional as F
from tgraph.nn.module import Parameter
from tgraph.nn.network_manager import recording
from tgraph.nn.tensor import Tensor

f32, bf16 = torch.float32, torch.bfloat16


# ---- dim helpers ---------------------------------------------------------------------------------

def test_merge_dims_prefers_ints_then_symbols() -> None:
    assert merge_dims(4, "n") == 4 and merge_dims("n", 4) == 4
    assert merge_dims("n", None) == "n" and merge_dims(None, "n") == "n"
    assert merge_dims(None, None) is None
    assert merge_dims(3, 3) == 3
    with pytest.raises(ShapeRuleError, match="3 and 4"):
        merge_dims(3, 4)


def test_dims_conflict_only_for_two_different_ints() -> None:
    assert dims_conflict(3, 4)
    assert not dims_conflict(3, 3)
    assert not dims_conflict("n", 4) and not dims_conflict(None, 4) and not dims_conflict("a", "b")


def test_broadcast_shapes_with_symbols() -> None:
    assert broadcast_shapes(("n", 1, 8), (4, 8)) == ("n", 4, 8)
    assert broadcast_shapes(("n", 8), (8,), ()) == ("n", 8)
    assert broadcast_shapes(("n", 8), (5, 8)) == (5, 8)  # the int is more informative
    assert broadcast_shapes((1,), ("n",)) == ("n",)
    assert broadcast_shapes((3, None), (3, 1)) == (3, None)
    assert broadcast_shapes(None, (3,)) is None
    with pytest.raises(ShapeRuleError, match=r"\[2, 3\], \[4, 3\] do not broadcast"):
        broadcast_shapes((2, 3), (4, 3))


@settings(max_examples=50, deadline=None)
@given(st.lists(st.lists(st.sampled_from([1, 2, 3]), max_size=4), min_size=1, max_size=3))
def test_broadcast_shapes_agrees_with_torch(shapes: list[list[int]]) -> None:
    try:
        want = tuple(torch.broadcast_shapes(*[torch.Size(s) for s in shapes]))
    except RuntimeError:
        with pytest.raises(ShapeRuleError):
            broadcast_shapes(*[tuple(s) for s in shapes])
        return
    assert broadcast_shapes(*[tuple(s) for s in shapes]) == want


def test_normalize_dim() -> None:
    assert normalize_dim(-1, 3) == 2 and normalize_dim(0, 3) == 0 and normalize_dim(2, None) == 2
    with pytest.raises(ShapeRuleError, match="out of range for rank 3"):
        normalize_dim(3, 3)
    with pytest.raises(ShapeRuleError, match="out of range"):
        normalize_dim(-4, 3)
    with pytest.raises(ShapeRuleError, match="needs a known rank"):
        normalize_dim(-1, None)


def test_reshape_target_solves_minus_one_with_symbols() -> None:
    # [num_tokens, 4096] -> (-1, 32, 128): the symbolic parts cancel.
    assert reshape_target(("num_tokens", 4096), (-1, 32, 128)) == ("num_tokens", 32, 128)
    assert reshape_target(("num_tokens", 32, 128), ("num_tokens", -1)) == ("num_tokens", 4096)
    assert reshape_target((4, 6), (-1, 3)) == (8, 3)
    assert reshape_target(("n", 6), (-1,)) == (None,)  # n * 6 has no single-symbol name
    assert reshape_target(("a", "b", 4), (-1, 4)) == (None, 4)
    assert reshape_target(None, (-1, 4)) == (None, 4)


def test_reshape_target_errors() -> None:
    with pytest.raises(ShapeRuleError, match="more than one -1"):
        reshape_target((4, 6), (-1, -1))
    with pytest.raises(ShapeRuleError, match="not divisible"):
        reshape_target((4, 6), (-1, 5))
    with pytest.raises(ShapeRuleError, match="24 elements besides symbols"):
        reshape_target((4, 6), (5, 5))
    with pytest.raises(ShapeRuleError, match="negative dim -2"):
        reshape_target((4, 6), (-2, 12))


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(1, 4), min_size=1, max_size=4), st.data())
def test_reshape_target_agrees_with_torch(shape: list[int], data: st.DataObject) -> None:
    numel = 1
    for d in shape:
        numel *= d
    divisors = [d for d in range(1, numel + 1) if numel % d == 0]
    target = data.draw(st.lists(st.sampled_from(divisors), min_size=1, max_size=3))
    if data.draw(st.booleans()):
        target[data.draw(st.integers(0, len(target) - 1))] = -1
    try:
        want = tuple(torch.empty(shape).reshape(target).shape)
    except RuntimeError:
        with pytest.raises(ShapeRuleError):
            reshape_target(tuple(shape), tuple(target))
        return
    assert reshape_target(tuple(shape), tuple(target)) == want


def test_format_and_resolve_shape() -> None:
    assert format_shape(("n", None, 4)) == "[n, ?, 4]"
    assert format_shape(None) == "[?...]"
    assert format_shape(()) == "[]"
    assert resolve_shape(("n", "m", 4), {"n": 7}) == (7, "m", 4)
    assert str(Meta(("n", 4), bf16)) == "bfloat16[n, 4]"


# ---- record-time inference through ops -----------------------------------------------------------

def test_symbolic_dims_propagate_through_linear_and_reshape() -> None:
    with recording("llama_attention_shapes"):
        x = Tensor("x", bf16, ("num_tokens", 64))
        wq = Parameter(torch.zeros(64, 64, dtype=bf16), name="wq")
        wk = Parameter(torch.zeros(16, 64, dtype=bf16), name="wk")
        q = F.linear(x, wq).reshape(-1, 4, 16)       # (tokens, heads, head_dim)
        k = F.linear(x, wk).reshape(-1, 1, 16)
        assert q.shape == ("num_tokens", 4, 16) and q.dtype == bf16
        assert k.shape == ("num_tokens", 1, 16)
        flat = q.reshape("num_tokens", -1)
        assert flat.shape == ("num_tokens", 64)
        scores = F.matmul(q.transpose(0, 1), k.permute(1, 2, 0))  # (heads, tokens, tokens)
        assert scores.shape == (4, "num_tokens", "num_tokens")
        assert F.softmax(scores.float(), -1).dtype == f32


def test_symbolic_dims_through_memory_ops() -> None:
    with recording("memory_shapes"):
        h = Tensor("h", f32, ("num_tokens", 32))
        rows = Tensor("rows", torch.int32, ("batch",))
        assert F.gather(h, 0, rows).shape == ("batch", 32)
        assert F.embedding(Tensor("ids", torch.int64, ("num_tokens",)),
                           Tensor("emb", bf16, (100, 32))).shape == ("num_tokens", 32)
        a, b = F.split(h, [8, 24], dim=-1)
        assert (a.shape, b.shape) == (("num_tokens", 8), ("num_tokens", 24))
        assert F.cat(a, b, a, dim=-1).shape == ("num_tokens", 40)
        assert F.cat(h, h, dim=0).shape == (None, 32)  # n + n has no name
        assert F.sum(h, -1, keepdim=True).shape == ("num_tokens", 1)
        assert F.mean(h, (0, 1)).shape == ()
        assert h[:, 3:9:2].shape == ("num_tokens", 3)
        assert h[1:].shape == (None, 32)  # a slice of a symbolic dim has an unknown length
        assert h[None, ..., 0].shape == (1, "num_tokens")


def test_unknown_shapes_and_dtypes_stay_unknown() -> None:
    with recording("unknown"):
        x, w = Tensor("x"), Tensor("w")
        y = F.linear(x, w)
        assert y.shape is None and y.dtype is None
        z = F.exp(Tensor("i", torch.int32))
        assert z.dtype == f32 and z.shape is None
        assert (Tensor("c", bf16, (4,)) + 1.0).dtype == bf16  # python scalars are weak
        assert (Tensor("c2", bf16, (4,)) + Tensor("d", f32, (4,))).dtype == f32
        assert (Tensor("e", torch.int32, (4,)) / 2).dtype == f32
        assert (Tensor("g", torch.int32, (4,)) < 2).dtype == torch.bool


RECORD_ERRORS = [
    (lambda: F.linear(Tensor("x", f32, ("n", 64)), Tensor("w", f32, (32, 63))),
     ["linear", "inner dims differ (64 vs 63)", "x: float32[n, 64]", "w: float32[32, 63]"]),
    (lambda: F.linear(Tensor("x", f32, (4, 8)), Tensor("w", bf16, (8, 8))),
     ["linear", "same dtype", "float32[4, 8]", "bfloat16[8, 8]"]),
    (lambda: F.add(Tensor("a", f32, (2, 3)), Tensor("b", f32, (4, 3))),
     ["add", "do not broadcast", "a: float32[2, 3]", "b: float32[4, 3]"]),
    (lambda: F.matmul(Tensor("a", f32, (2, 4, 8)), Tensor("b", f32, (3, 7, 5))),
     ["matmul", "inner dims differ (8 vs 7)"]),
    (lambda: F.cat(Tensor("a", f32, (2, 4)), Tensor("b", f32, (2, 5)), dim=0),
     ["cat", "differ in dim 1"]),
    (lambda: F.split(Tensor("a", f32, (2, 10)), [4, 4], dim=1),
     ["split", "sum to 8", "size 10"]),
    (lambda: F.reshape(Tensor("a", f32, (4, 6)), (5, 5)),
     ["reshape", "cannot reshape [4, 6]", "a: float32[4, 6]"]),
    (lambda: F.rms_norm(Tensor("x", f32, ("n", 64)), Tensor("w", f32, (32,))),
     ["rms_norm", "does not match the last dim", "w: float32[32]"]),
    (lambda: F.gather(Tensor("x", f32, (4, 8)), 0, Tensor("i", f32, (2,))),
     ["gather", "int32 or int64", "i: float32[2]"]),
    (lambda: F.where(Tensor("c", f32, (4,)), Tensor("a", f32, (4,)), 0.0),
     ["where", "condition must be bool"]),
    (lambda: F.rope(Tensor("q", f32, ("n", 4, 16)), Tensor("k", f32, ("n", 2, 16)),
                    Tensor("cos", f32, ("n", 12)), Tensor("sin", f32, ("n", 12))),
     ["rope", "rotates 24 dims, head_dim is 16"]),
    (lambda: F.paged_attention(Tensor("q", f32, ("n", 6, 16)),
                               Tensor("kc", f32, (8, 4, 4, 16)), Tensor("vc", f32, (8, 4, 4, 16)),
                               Tensor("bt", torch.int32, ("b", 3)),
                               Tensor("lens", torch.int32, ("b",)),
                               Tensor("qsl", torch.int32, (None,))),
     ["paged_attention", "q heads (6) must be a multiple of kv heads (4)"]),
    (lambda: F.paged_attention(Tensor("q", f32, ("n", 8, 16)),
                               Tensor("kc", f32, (8, 4, 4, 16)), Tensor("vc", f32, (8, 4, 4, 16)),
                               Tensor("bt", torch.int32, ("b", 3)),
                               Tensor("lens", torch.int32, ("b",)),
                               Tensor("qsl", torch.int32, (None,)),
                               new_kv=(Tensor("kn", f32, ("n", 2, 16)),
                                       Tensor("vn", f32, ("n", 4, 16)))),
     ["paged_attention", "k_new", "must be [tokens of q", "kv_heads, head_dim]"]),
    (lambda: F.paged_attention(Tensor("q", f32, ("n", 8, 16)),
                               Tensor("kc", f32, (8, 4, 4, 16)), Tensor("vc", f32, (8, 4, 4, 16)),
                               Tensor("bt", torch.int32, ("b", 3)),
                               Tensor("lens", torch.int32, ("b",)),
                               Tensor("qsl", torch.int32, (None,)),
                               new_kv=(Tensor("kn", f32, ("n", 4, 16)),
                                       Tensor("vn", bf16, ("n", 4, 16)))),
     ["paged_attention", "v_new", "must have the cache's dtype"]),
    (lambda: F.reshape_and_cache(Tensor("k", f32, ("n", 2, 16)), Tensor("v", f32, ("n", 2, 16)),
                                 Tensor("kc", f32, (8, 4, 2, 8)), Tensor("vc", f32, (8, 4, 2, 8)),
                                 Tensor("slots", torch.int32, ("n",))),
     ["reshape_and_cache", "does not fit cache"]),
    (lambda: F.select(Tensor("x", f32, (3, 4)), 0, 3), ["select", "out of range"]),
    (lambda: F.squeeze(Tensor("x", f32, (3, 4)), 1), ["squeeze", "has size 4, not 1"]),
    (lambda: F.permute(Tensor("x", f32, (3, 4)), (0, 0)), ["permute", "not a permutation"]),
    (lambda: F.mean(Tensor("x", torch.int32, (3, 4)), -1), ["mean", "floating point"]),
]


@pytest.mark.parametrize("build, fragments", RECORD_ERRORS,
                         ids=[f"{frag[0]}-{i}" for i, (_, frag) in enumerate(RECORD_ERRORS)])
def test_shape_rule_errors_at_record_time(build, fragments: list[str]) -> None:
    with recording("errors"):
        with pytest.raises(RecordError) as info:
            build()
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in:\n{message}"
    assert f"{__file__}:" in message  # points at the test's own source line


# Inputs and attributes of the ops whose rule is not "one tensor, no attributes".
RULE_ARGS: dict[str, tuple[int, dict]] = {
    "to_device": (1, {"device": "cpu:1"}), "sdpa_attention": (6, {}),
    "l2_prefetch": (3, {"halves": (1, 2)}),
    "all_reduce_add_rms_norm": (3, {"eps": 1e-6, "world_size": 2}),
    "lora_shrink_concat": (7, {"lead": 0, "width": 0}),
    "rms_norm_lora_concat": (8, {"eps": 1e-6, "lead": 0, "width": 0}),
    "add_rms_norm_lora_concat": (9, {"eps": 1e-6, "lead": 0, "width": 0}),
    **{name: (2, {}) for name in ("add", "sub", "mul", "div", "pow", "maximum", "minimum", "eq",
                                  "ne", "lt", "le", "gt", "ge", "matmul", "embedding",
                                  "silu_mul")},
    "where": (3, {}), "cast": (1, {"dtype": f32}), "sum": (1, {"dim": -1}),
    "mean": (1, {"dim": -1}), "amax": (1, {"dim": -1}), "softmax": (1, {"dim": -1}),
    "linear": (3, {}), "moe": (4, {"top_k": 2, "renormalize": True}),
    "moe_add_rms_norm": (6, {"top_k": 2, "renormalize": True, "eps": 1e-6}),
    "rms_norm": (2, {"eps": 1e-6}), "layer_norm": (3, {"eps": 1e-5}),
    "reshape": (1, {"shape": (-1, 4)}), "permute": (1, {"dims": (1, 0)}),
    "transpose": (1, {"dim0": 0, "dim1": -1}), "slice": (1, {"dim": -1, "start": 1, "end": None}),
    "select": (1, {"dim": -1, "index": 0}), "unsqueeze": (1, {"dim": 0}),
    "squeeze": (1, {"dim": 0}), "split": (1, {"sizes": (1, 1), "dim": -1}),
    "cat": (2, {"dim": -1}), "gather": (2, {"dim": -1}), "rope": (4, {}),
    "reshape_and_cache": (5, {}), "paged_attention": (6, {}), "add_rms_norm": (3, {"eps": 1e-6}),
    "rope_cache": (8, {}), "rope_cache_attention": (10, {}),
    "qk_norm_rope_cache_attention": (12, {"eps": 1e-6}), "linear_epilogue": (4, {}),
    "norm_linear": (4, {"eps": 1e-6}),
    "all_reduce": (1, {"world_size": 2}), "all_gather": (1, {"dim": -1, "world_size": 2}),
}
# Rules that interpret a program attribute rather than their operands.
NOT_APPLICABLE = {"fused_pointwise"}


def test_every_op_rule_accepts_unknown_inputs() -> None:
    """Unknown shapes and dtypes are legal at record time (they are bound at the first forward),
    so every shape rule must accept operands it knows nothing about, even with negative dims."""
    from tgraph.ir.ops import all_ops
    unknown = Meta(None, None)
    for op in all_ops():
        if op.name in NOT_APPLICABLE:
            continue
        n_inputs, attrs = RULE_ARGS.get(op.name, (1, {}))
        try:
            metas = op.infer_metas([unknown] * n_inputs, dict(attrs))
        except TypeError as err:
            pytest.fail(f"{op.name}: add its inputs/attributes to RULE_ARGS ({err})")
        except ShapeRuleError as err:
            pytest.fail(f"{op.name} refuses operands of unknown shape and dtype: {err}")
        assert metas and all(isinstance(m, Meta) for m in metas), op.name


def test_get_op_lists_known_ops_on_typo() -> None:
    with pytest.raises(KeyError, match="unknown op 'rmsnorm'.*rms_norm"):
        get_op("rmsnorm")


# ---- views of a network --------------------------------------------------------------------------

def _small_net():
    with recording("mlp") as net:
        x = Tensor("x", bf16, ("num_tokens", 16))
        w = Parameter(torch.zeros(32, 16, dtype=bf16), name="up.weight")
        h = F.linear(x, w)
        y = F.activation(h, F.ActType.SWIGLU)
        net.mark_output(y, "y")
        net.mark_output(h, "h")
    return net


def test_str_network_is_one_op_per_line_with_shapes_and_dtypes() -> None:
    net = _small_net()
    text = str(net)
    lines = text.splitlines()
    assert lines[0] == 'network "mlp" (1 inputs, 1 weights, 4 nodes)'
    assert "  input  x: bfloat16[num_tokens, 16]" in lines
    assert "  weight up.weight: bfloat16[32, 16]" in lines
    op_lines = [ln for ln in lines if " = " in ln and not ln.lstrip().startswith("output")]
    assert [re.search(r"= (\w+)\(", ln).group(1) for ln in op_lines] == \
        ["linear", "split", "silu", "mul"]
    assert "%0: bfloat16[num_tokens, 32] = linear(x, up.weight, None" in op_lines[0]
    assert "%1: bfloat16[num_tokens, 16], %2: bfloat16[num_tokens, 16] = split(%0, " \
           "sizes=(16, 16), dim=-1)" in op_lines[1]
    assert lines[-2:] == ["  output y = %4", "  output h = %0"]


def test_to_dot_is_valid_dot() -> None:
    net = _small_net()
    dot = net.to_dot()
    if importlib.util.find_spec("pydot") is not None:
        import pydot
        from networkx.drawing import nx_pydot
        graphs = pydot.graph_from_dot_data(dot)
        assert graphs and len(graphs) == 1
        g = nx_pydot.from_pydot(graphs[0])
        assert g.number_of_nodes() == 2 + 4 + 2  # leaves, ops, outputs
        return
    # Without pydot: check the grammar we rely on line by line.
    lines = dot.splitlines()
    assert re.fullmatch(r'digraph "mlp" \{', lines[0]) and lines[-1] == "}"
    quoted = r'"(?:[^"\\]|\\.)*"'
    node_re = re.compile(rf'  (\w+) \[label={quoted}, shape=\w+\];')
    edge_re = re.compile(rf'  (\w+) -> (\w+) \[label={quoted}\];')
    nodes, edges = set(), []
    for line in lines[1:-1]:
        if line.strip() in ("rankdir=TB;", "node [fontname=monospace];"):
            continue
        if m := node_re.fullmatch(line):
            nodes.add(m.group(1))
        elif m := edge_re.fullmatch(line):
            edges.append((m.group(1), m.group(2)))
        else:
            pytest.fail(f"not a node or edge statement: {line!r}")
    assert len(nodes) == 2 + 4 + 2
    assert all(a in nodes and b in nodes for a, b in edges), "an edge names an undeclared node"
    # linear reads x and the weight; split, silu, mul; two output edges
    assert len(edges) == 2 + 1 + 1 + 2 + 2
    assert dot.count("{") == dot.count("}") == 1


def test_to_networkx_counts() -> None:
    net = _small_net()
    g = net.to_networkx()
    ops = [k for k in g.nodes if k[0] == "node"]
    leaves = [k for k in g.nodes if k[0] == "leaf"]
    assert len(ops) == 4 and len(leaves) == 2
    # linear: x, weight (bias None is no edge); split: 1; silu: 1; mul: 2
    assert g.number_of_edges() == 6
    assert sorted(g.nodes[k]["op"] for k in ops) == ["linear", "mul", "silu", "split"]
    import networkx as nx
    assert nx.is_directed_acyclic_graph(g)
