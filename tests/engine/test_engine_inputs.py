"""``Engine.forward``'s contract: what it refuses (each message says what was expected), what it
writes (only the given outputs and declared caches), how it binds dynamic dims and reuses its plan,
and what ``engine.stats`` reports. Also the errors of recording and of building."""
from __future__ import annotations

import inspect

import pytest
import torch

from tests.helpers import assert_close, poison_like
from tgraph.errors import EngineInputError, GraphError, PassError, RecordError, TGraphError
from tgraph.nn import functional as F
from tgraph.nn.module import Module, Parameter
from tgraph.nn.network_manager import recording
from tgraph.nn.tensor import Tensor
from tgraph.passes import pass_names

f32 = torch.float32


def _here() -> int:
    """The caller's line number."""
    return inspect.currentframe().f_back.f_lineno


# ---- recording errors ----------------------------------------------------------------------------

def test_record_error_names_op_tensors_shapes_and_source_line() -> None:
    with recording("record_error"):
        x = Tensor("hidden", f32, ("num_tokens", 64))
        w = Tensor("q_proj.weight", f32, (32, 48))
        with pytest.raises(RecordError) as info:
            line = _here() + 1
            F.linear(x, w)
    message = str(info.value)
    assert message.startswith("linear")
    assert "inner dims differ (64 vs 48)" in message
    assert "hidden: float32[num_tokens, 64]" in message
    assert "q_proj.weight: float32[32, 48]" in message
    assert f"{__file__}:{line}" in message
    assert isinstance(info.value, ValueError) and isinstance(info.value, TGraphError)


class _BadBlock(Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = Parameter(torch.zeros(8, 5))

    def forward(self, x: Tensor) -> Tensor:
        self.line = _here() + 1
        return F.linear(x, self.weight)


def test_record_error_inside_a_module_points_at_the_module_line() -> None:
    block = _BadBlock()
    with recording("module_error"):
        with pytest.raises(RecordError) as info:
            block(Tensor("x", f32, (3, 4)))
    message = str(info.value)
    assert "weight: float32[8, 5]" in message and "x: float32[3, 4]" in message
    assert f"{__file__}:{block.line}" in message


# ---- build errors --------------------------------------------------------------------------------

def test_build_refuses_a_network_without_outputs() -> None:
    with recording("no_outputs") as net:
        F.exp(Tensor("x", f32, (2,)))
    with pytest.raises(GraphError, match="no outputs; call mark_output"):
        net.build_engine()


def test_build_refuses_a_weight_without_data() -> None:
    with recording("no_data") as net:
        w = Parameter(shape=(4,), dtype=f32, name="norm.weight")
        net.mark_output(Tensor("x", f32, (2, 4)) * w, "y")
    with pytest.raises(GraphError, match=r"weight 'norm.weight' \(norm.weight: float32\[4\]\) "
                                         r"has no data"):
        net.build_engine()


def test_build_refuses_two_inputs_with_one_name() -> None:
    with recording("twins") as net:
        net.mark_output(Tensor("x", f32, (2,)) + Tensor("x", f32, (2,)), "y")
    with pytest.raises(GraphError, match="two different leaves of 'twins' are named 'x'"):
        net.build_engine()


def test_build_refuses_unknown_pass_and_backend_names() -> None:
    with recording("names") as net:
        net.mark_output(F.exp(Tensor("x", f32, (2,))), "y")
    with pytest.raises(PassError, match=r"unknown pass name\(s\) \['CSEE'\].*CSE"):
        net.build_engine(disabled_passes=["CSEE"])
    with pytest.raises(GraphError, match="unknown backend 'cuda'"):
        net.build_engine(backend="cuda")


def test_mark_output_errors() -> None:
    with recording("outputs") as net:
        y = F.exp(Tensor("x", f32, (2,)))
        net.mark_output(y, "y")
        with pytest.raises(GraphError, match="output name 'y' is already marked"):
            net.mark_output(y, "y")
        with pytest.raises(GraphError, match="expected a symbolic tensor, got Tensor"):
            net.mark_output(torch.zeros(2), "z")


# ---- forward: what it refuses --------------------------------------------------------------------

@pytest.fixture
def engine():
    """``y = exp(x @ w.T)`` with x ``[num_tokens, 8]`` and w ``[4, 8]`` (both inputs)."""
    with recording("checked") as net:
        x = Tensor("x", f32, ("num_tokens", 8))
        w = Tensor("w", f32, (4, 8))
        net.mark_output(F.exp(F.linear(x, w)), "y")
    return net.build_engine()


X, W = torch.randn(3, 8), torch.randn(4, 8)
EXPECTS = "The network expects: x: float32[num_tokens, 8]; w: float32[4, 8]"


@pytest.mark.parametrize("inputs, fragments", [
    ({"x": X}, ["missing w: float32[4, 8]", EXPECTS]),
    ({"x": X, "w": W, "xx": X}, ["unknown input 'xx' (did you mean 'x'?)", EXPECTS]),
    ({"x": X, "ww": W}, ["unknown input 'ww' (did you mean 'w'?)", "missing w"]),
    ({"x": X, "w": W.double()}, ["input 'w' has dtype float64, expected w: float32[4, 8]"]),
    ({"x": X, "w": W[None]}, ["input 'w' has shape [1, 4, 8] (rank 3), expected w: "
                              "float32[4, 8]"]),
    ({"x": X, "w": torch.randn(4, 9)}, ["input 'w' has shape [4, 9]: dim 1 is 9, expected w: "
                                        "float32[4, 8]"]),
    ({"x": X, "w": W.to("meta")}, ["input 'w' is on meta but other inputs are on cpu"]),
    ({"x": X, "w": W.tolist()}, ["input 'w' must be a torch.Tensor, got list; expected w: "
                                 "float32[4, 8]"]),
], ids=["missing", "unknown", "typo", "dtype", "rank", "int_dim", "device", "not_tensor"])
def test_forward_refuses_bad_inputs(engine, inputs, fragments: list[str]) -> None:
    with pytest.raises(EngineInputError) as info:
        engine.forward(inputs)
    for fragment in fragments:
        assert fragment in str(info.value), f"{fragment!r} not in {info.value}"


def test_forward_refuses_a_symbol_bound_to_two_values() -> None:
    with recording("symbols") as net:
        a = Tensor("a", f32, ("n", 8))
        b = Tensor("b", f32, ("n", 8))
        net.mark_output(a + b, "y")
    engine = net.build_engine()
    with pytest.raises(EngineInputError, match=r"dim 'n' is 3 in input 'a' but 4 in input 'b' "
                                               r"\(shape \[4, 8\], expected b: float32\[n, 8\]\)"):
        engine.forward({"a": torch.randn(3, 8), "b": torch.randn(4, 8)})


@pytest.mark.parametrize("outputs, fragment", [
    ({"z": torch.empty(3, 4)}, "outputs: missing ['y'], unknown ['z']; the network's outputs are "
                               "['y']"),
    ({"y": torch.empty(3, 5)}, "output 'y' is float32[3, 5], expected float32[3, 4]"),
    ({"y": torch.empty(3, 4, dtype=torch.float64)}, "output 'y' is float64[3, 4], expected "
                                                    "float32[3, 4]"),
    ({"y": torch.empty(3, 4, device="meta")}, "output 'y' is on meta, expected cpu"),
    ({"y": [0.0] * 12}, "output 'y' must be a torch.Tensor, expected float32[3, 4]"),
], ids=["name", "shape", "dtype", "device", "not_tensor"])
def test_forward_refuses_bad_outputs(engine, outputs, fragment: str) -> None:
    with pytest.raises(EngineInputError) as info:
        engine.forward({"x": X, "w": W}, outputs)
    assert fragment in str(info.value)


def test_forward_refuses_weights_on_another_device() -> None:
    with recording("weights_device") as net:
        w = Parameter(torch.randn(4, 8), name="proj.weight")
        net.mark_output(F.linear(Tensor("x", f32, (2, 8)), w), "y")
    engine = net.build_engine()
    with pytest.raises(EngineInputError, match=r"weight 'proj.weight' is on cpu but the inputs "
                                               r"are on meta; .*engine.to\('meta'\)"):
        engine.forward({"x": torch.empty(2, 8, device="meta")})


@pytest.fixture
def host_engine():
    """``y = sin(exp(x) * seq_len[:, None])`` with ``seq_len`` a host input."""
    with recording("host") as net:
        x = Tensor("x", f32, ("batch", 4))
        seq_len = Tensor("seq_len", torch.int32, ("batch",), host=True)
        y = F.exp(x) * F.cast(seq_len, f32)[:, None]
        net.mark_output(F.sin(y), "y")
    return net.build_engine()


def test_host_values_must_come_in_runtime_params(host_engine) -> None:
    x = torch.randn(2, 4)
    with pytest.raises(EngineInputError, match=r"'seq_len' is a host value: pass it in "
                                               r"runtime_params; missing seq_len: int32\[batch\] "
                                               r"\(host, in runtime_params\)"):
        host_engine.forward({"x": x, "seq_len": torch.tensor([1, 2], dtype=torch.int32)})
    with pytest.raises(EngineInputError, match="'x' is a device input: pass it in inputs, not "
                                               "runtime_params"):
        host_engine.forward({}, runtime_params={"x": x, "seq_len": [1, 2]})
    with pytest.raises(EngineInputError, match=r"unknown runtime param 'seqlen' \(did you mean "
                                               r"'seq_len'\?\)"):
        host_engine.forward({"x": x}, runtime_params={"seq_len": [1, 2], "seqlen": [1, 2]})
    with pytest.raises(EngineInputError, match="runtime param 'seq_len' must be on the CPU"):
        host_engine.forward({"x": x}, runtime_params={
            "seq_len": torch.tensor([1, 2], dtype=torch.int32, device="meta")})
    with pytest.raises(EngineInputError, match="dim 'batch' is 2 in input 'x' but 3 in input "
                                               "'seq_len'"):
        host_engine.forward({"x": x}, runtime_params={"seq_len": [1, 2, 3]})
    with pytest.raises(EngineInputError, match="expected a CPU tensor or a list of numbers"):
        host_engine.forward({"x": x}, runtime_params={"seq_len": object()})


def test_runtime_params_reach_the_host_input(host_engine) -> None:
    x = torch.randn(2, 4)
    for lens in ([3, 5], torch.tensor([7, 1], dtype=torch.int32)):
        out = host_engine.forward({"x": x}, runtime_params={"seq_len": lens})["y"]
        scale = torch.as_tensor(lens, dtype=torch.float64)[:, None]
        assert_close(out, torch.sin(x.double().exp() * scale))
    stats = host_engine.stats
    # exp | cast (reads the host value) | unsqueeze, mul, sin
    assert stats.segment_count == 3 and stats.capturable_segments == 2
    assert "host: cast reads host value seq_len" in str(host_engine)


def test_shapes_that_contradict_an_op_fail_with_the_recording_line() -> None:
    with recording("late") as net:
        line = _here() + 1
        y = F.linear(Tensor("x"), Tensor("w"))
        net.mark_output(y, "y")
    engine = net.build_engine()
    with pytest.raises(EngineInputError) as info:
        engine.forward({"x": torch.randn(3, 8), "w": torch.randn(4, 9)})
    message = str(info.value)
    assert "do not fit op linear" in message and f"{__file__}:{line}" in message
    assert "inner dims differ (8 vs 9)" in message


# ---- forward: what it writes ---------------------------------------------------------------------

def test_forward_writes_into_given_outputs_and_only_declared_caches() -> None:
    with recording("writes") as net:
        k = Tensor("k", f32, ("num_tokens", 2, 4))
        v = Tensor("v", f32, ("num_tokens", 2, 4))
        kc = Tensor("k_cache", f32, (3, 4, 2, 4))
        vc = Tensor("v_cache", f32, (3, 4, 2, 4))
        slots = Tensor("slots", torch.int32, ("num_tokens",))
        scale = Tensor("scale", f32, (4,))
        kc2, vc2 = F.reshape_and_cache(k * scale, v, kc, vc, slots)
        net.mark_output(F.sum(kc2, -1), "k_sum")
        net.mark_output(k.reshape(-1, 8), "k_flat")  # a view of an input
        net.mark_output(scale, "scale_out")          # an input itself
    engine = net.build_engine()
    inputs = {"k": torch.randn(3, 2, 4), "v": torch.randn(3, 2, 4),
              "k_cache": torch.zeros(3, 4, 2, 4), "v_cache": torch.zeros(3, 4, 2, 4),
              "slots": torch.tensor([5, -1, 0], dtype=torch.int32), "scale": torch.rand(4)}
    before = {name: t.clone() for name, t in inputs.items()}
    outputs = {"k_sum": poison_like(torch.empty(3, 4, 2)), "k_flat": poison_like(torch.empty(3, 8)),
               "scale_out": poison_like(torch.empty(4))}
    result = engine.forward(inputs, outputs)
    assert all(result[name] is outputs[name] for name in outputs)

    k_scaled = before["k"] * before["scale"]
    want_kc = before["k_cache"].clone()
    want_kc[1, 1], want_kc[0, 0] = k_scaled[0], k_scaled[2]
    want_vc = before["v_cache"].clone()
    want_vc[1, 1], want_vc[0, 0] = before["v"][0], before["v"][2]
    # The declared caches are written in place (slot -1 is skipped) ...
    assert_close(inputs["k_cache"], want_kc)
    assert_close(inputs["v_cache"], want_vc)
    # ... and no other input is touched.
    for name in ("k", "v", "slots", "scale"):
        assert torch.equal(inputs[name], before[name]), name
    assert_close(outputs["k_sum"], want_kc.sum(-1))
    assert_close(outputs["k_flat"], before["k"].reshape(-1, 8))
    assert_close(outputs["scale_out"], before["scale"])


def test_returned_outputs_never_alias_inputs_or_later_results() -> None:
    with recording("fresh") as net:
        x = Tensor("x", f32, ("n", 4))
        net.mark_output(x.reshape(-1), "flat")
        net.mark_output(F.exp(x), "e")
    engine = net.build_engine()
    x1, x2 = torch.randn(2, 4), torch.randn(5, 4)
    first = engine.forward({"x": x1})
    first["flat"].fill_(0.0)  # the caller owns what it got back
    assert torch.count_nonzero(x1) == x1.numel()
    second = engine.forward({"x": x2})
    assert_close(first["e"], x1.double().exp())  # untouched by the second call
    assert_close(second["e"], x2.double().exp())
    assert_close(second["flat"], x2.reshape(-1).double())


def test_an_input_marked_as_output_accepts_a_preallocated_buffer() -> None:
    with recording("leaf_output") as net:
        x = Tensor("x", f32, ("n", 4))
        net.mark_output(x, "y")  # also what passes leave of x[0:] or x.reshape(n, 4)
    engine = net.build_engine()
    x = torch.randn(2, 4)
    out = poison_like(x)
    engine.forward({"x": x}, {"y": out})
    assert_close(out, x)


def test_the_inputs_an_engine_takes_do_not_depend_on_the_passes() -> None:
    with recording("dead_input") as net:
        x, y = Tensor("x", f32, (2,)), Tensor("y", f32, (2,))
        F.exp(y)  # recorded, never used
        net.mark_output(F.exp(x), "out")
    inputs = {"x": torch.randn(2), "y": torch.randn(2)}
    assert set(net.build_engine(passes=False).specs) == {"x", "y"}
    out = net.build_engine().forward(inputs)["out"]
    assert_close(out, inputs["x"].double().exp())


# ---- binding and plan reuse ----------------------------------------------------------------------

def test_plan_is_reused_across_token_counts() -> None:
    with recording("reuse") as net:
        x = Tensor("x", f32, ("num_tokens", 8))
        w = Parameter(torch.randn(16, 8), name="w")
        h = F.linear(x, w).reshape("num_tokens", 2, 8)
        net.mark_output(F.softmax(h, -1), "p")
    engine = net.build_engine()
    plan = None
    for i, tokens in enumerate([3, 17, 64, 3]):
        x = torch.randn(tokens, 8)
        out = poison_like(torch.empty(tokens, 2, 8))
        engine.forward({"x": x}, {"p": out})
        want = torch.softmax((x.double() @ w.data.double().t()).reshape(tokens, 2, 8), -1)
        assert_close(out, want)
        plan = plan or engine.plan
        assert engine.plan is plan, "the launch plan was rebuilt"
        assert engine.stats.bindings == min(i + 1, 3)  # the 4th call repeats the 1st signature


def test_unknown_shapes_are_bound_at_the_first_call() -> None:
    with recording("unknown") as net:
        net.mark_output(F.exp(Tensor("a")) * 2.0, "y")
    engine = net.build_engine()
    assert engine.specs["a"].shape is None and engine.specs["a"].dtype is None
    first = torch.randn(3, 8)
    assert_close(engine.forward({"a": first})["y"], first.double().exp() * 2)
    spec = engine.specs["a"]
    assert spec.dtype == f32 and spec.shape == ("a.0", "a.1")
    other = torch.randn(5, 2)  # same rank, other dims: fine
    assert_close(engine.forward({"a": other})["y"], other.double().exp() * 2)
    with pytest.raises(EngineInputError, match=r"input 'a' has shape \[5\] \(rank 1\), expected "
                                               r"a: float32\[a.0, a.1\]"):
        engine.forward({"a": torch.randn(5)})
    with pytest.raises(EngineInputError, match="input 'a' has dtype float64, expected a: float32"):
        engine.forward({"a": torch.randn(5, 2, dtype=torch.float64)})


# ---- stats and printing --------------------------------------------------------------------------

def test_stats_count_nodes_segments_and_memory_reuse() -> None:
    with recording("chain") as net:
        x = Tensor("x", f32, ("n", 64))
        y = F.sigmoid(F.tanh(F.cos(F.sin(F.exp(x)))))
        net.mark_output(y, "y")
    engine = net.build_engine(passes=False)
    assert engine.stats.peak_intermediate_bytes is None  # no binding yet
    engine.forward({"x": torch.randn(64, 64)})
    stats = engine.stats
    assert stats.node_count == 5 and stats.kernel_count == 5
    assert stats.segment_count == 1 and stats.capturable_segments == 1
    buffer = 64 * 64 * 4
    assert stats.naive_intermediate_bytes == 5 * buffer
    # Only a producer and its consumer are live at once: two buffers serve the chain.
    assert stats.peak_intermediate_bytes == 2 * buffer < stats.naive_intermediate_bytes
    assert stats.passes == []


def test_stats_record_every_pass_in_order() -> None:
    with recording("passes") as net:
        x = Tensor("x", f32, (4, 8))
        net.mark_output(x * F.sigmoid(x) + F.exp(x) + F.exp(x), "y")
    engine = net.build_engine(disabled_passes=["CSE"])
    records = engine.stats.passes
    assert [r.name for r in records] == pass_names()
    by_name = {r.name: r for r in records}
    assert by_name["CSE"].skipped and str(by_name["CSE"]) == "CSE: disabled"
    assert by_name["SiluFusion"].matches == 1
    assert "SiluFusion: 1 matches" in str(engine)
    assert engine.stats.node_count == len(engine.net.nodes)
    x = torch.randn(4, 8)
    assert_close(engine.forward({"x": x})["y"], (x * torch.sigmoid(x) + 2 * x.exp()).double(),
                 rtol=1e-5, atol=1e-5)


# ---- a realistic block on a GPU ------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_engine_contract_on_gpu(dtype: torch.dtype) -> None:
    """Llama-7B-sized MLP: outputs written in place, the plan reused from 7 to 4096 tokens,
    results that stay valid across calls."""
    hidden, inter = 4096, 11008
    dev = "cuda"
    gate_up = Parameter((torch.randn(2 * inter, hidden, device=dev) / hidden ** 0.5).to(dtype),
                        name="mlp.gate_up_proj.weight")
    down = Parameter((torch.randn(hidden, inter, device=dev) / inter ** 0.5).to(dtype),
                     name="mlp.down_proj.weight")
    norm = Parameter(torch.rand(hidden, device=dev).to(dtype) + 0.5, name="norm.weight")
    with recording("mlp_gpu") as net:
        x = Tensor("x", dtype, ("num_tokens", hidden))
        h = F.linear(F.activation(F.linear(F.rms_norm(x, norm, 1e-6), gate_up), F.ActType.SWIGLU),
                     down)
        net.mark_output(x + h, "y")
    engine = net.build_engine()

    def reference(x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        n = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.data.float()
        gu = n @ gate_up.data.float().t()
        g, u = gu[:, :inter], gu[:, inter:]
        return xf + (torch.nn.functional.silu(g) * u) @ down.data.float().t()

    plan, kept = None, []
    for tokens in (7, 4096, 1, 7):
        x = torch.randn(tokens, hidden, device=dev).to(dtype)
        out = poison_like(torch.empty(tokens, hidden, device=dev, dtype=dtype))
        assert engine.forward({"x": x}, {"y": out})["y"] is out
        # bf16/fp16 GEMMs over K=11008 accumulate in fp32; outputs are O(1): 3e-2 abs, 2e-2 rel
        assert_close(out, reference(x), rtol=2e-2, atol=3e-2, msg=f"tokens={tokens}")
        kept.append((x, engine.forward({"x": x})["y"]))
        plan = plan or engine.plan
        assert engine.plan is plan
    assert engine.stats.bindings == 3
    for x, y in kept:  # earlier results were not overwritten by later calls
        assert_close(y, reference(x), rtol=2e-2, atol=3e-2)
