"""A Llama-style decoder block written with plain ops: the fusion pipeline must turn it into a
stated small number of kernels, and every way of running it must give the same numbers."""
from __future__ import annotations

import pytest
import torch

from tgraph.errors import CaptureError, EngineInputError
from tgraph.nn import functional as F
from tgraph.nn.module import Parameter
from tgraph.nn.network_manager import recording
from tgraph.nn.tensor import Tensor

T, HIDDEN, HQ, HK, D, INTER = 9, 64, 4, 2, 16, 96
BLOCK, NUM_BLOCKS = 16, 8


def _plain_rms(x, w, eps=1e-6):
    h = F.cast(x, torch.float32)
    h = h * F.rsqrt(F.mean(h * h, -1, keepdim=True) + eps)
    return w * F.cast(h, x.dtype)


WEIGHTS = {"ln1": (HIDDEN,), "ln2": (HIDDEN,), "wq": (HQ * D, HIDDEN), "wk": (HK * D, HIDDEN),
           "wv": (HK * D, HIDDEN), "wo": (HIDDEN, HQ * D), "wg": (INTER, HIDDEN),
           "wu": (INTER, HIDDEN), "wd": (HIDDEN, INTER)}


def _record(dtype, params: dict | None = None, decode: bool = False):
    """The block; weights are graph inputs, or Parameters (engine weights) when given. With
    ``decode`` every sequence brings one token and attention has no ``query_start_loc``."""
    with recording("decoder_block") as net:
        sym = "batch" if decode else "num_tokens"
        h = Tensor("hidden", dtype, (sym, HIDDEN))
        residual = Tensor("residual", dtype, (sym, HIDDEN))
        cos = Tensor("cos", torch.float32, (sym, D // 2))
        sin = Tensor("sin", torch.float32, (sym, D // 2))
        k_cache = Tensor("k_cache", dtype, (NUM_BLOCKS, BLOCK, HK, D))
        v_cache = Tensor("v_cache", dtype, (NUM_BLOCKS, BLOCK, HK, D))
        slots = Tensor("slots", torch.int32, (sym,))
        block_table = Tensor("block_table", torch.int32, ("batch", 4))
        seq_len = Tensor("seq_len", torch.int32, ("batch",))
        qsl = None if decode else Tensor("query_start_loc", torch.int32, ("batch_plus_one",))
        if params is None:
            w = {name: Tensor(name, dtype, shape) for name, shape in WEIGHTS.items()}
        else:
            w = {name: Parameter(params[name], name=name) for name in WEIGHTS}

        r = h + residual
        x = _plain_rms(r, w["ln1"])
        q = F.linear(x, w["wq"]).reshape(-1, HQ, D)  # (tokens, q_heads, head_dim)
        k = F.linear(x, w["wk"]).reshape(-1, HK, D)  # (tokens, kv_heads, head_dim)
        v = F.linear(x, w["wv"]).reshape(-1, HK, D)
        q, k = F.rope(q, k, cos, sin)
        k_cache, v_cache = F.reshape_and_cache(k, v, k_cache, v_cache, slots)
        # As the Attention layer does: a prefill's attention may read the new keys directly.
        a = F.paged_attention(q, k_cache, v_cache, block_table, seq_len, qsl,
                              new_kv=None if decode else (k, v))
        r2 = F.linear(a.reshape(-1, HQ * D), w["wo"]) + r
        x2 = _plain_rms(r2, w["ln2"])
        g, u = F.linear(x2, w["wg"]), F.linear(x2, w["wu"])
        out = F.linear(g * F.sigmoid(g) * u, w["wd"]) + r2
        net.mark_output(out, "out")
    return net


def _inputs(dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    lens = [4, 5]  # two sequences, packed: 9 tokens

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    blocks = torch.randperm(NUM_BLOCKS, generator=gen)[:4].to(torch.int32).reshape(2, 2)
    slots = torch.cat([blocks[b, 0] * BLOCK + torch.arange(n) for b, n in enumerate(lens)])
    pos = torch.cat([torch.arange(n) for n in lens]).float()
    freqs = pos[:, None] / (10000 ** (torch.arange(0, D, 2).float() / D))[None, :]
    return {
        "hidden": rnd(T, HIDDEN), "residual": rnd(T, HIDDEN),
        "cos": freqs.cos(), "sin": freqs.sin(),
        "k_cache": torch.zeros(NUM_BLOCKS, BLOCK, HK, D, dtype=dtype),
        "v_cache": torch.zeros(NUM_BLOCKS, BLOCK, HK, D, dtype=dtype),
        "slots": slots.to(torch.int32), "block_table": torch.cat(
            [blocks, torch.zeros(2, 2, dtype=torch.int32)], 1),
        "seq_len": torch.tensor(lens, dtype=torch.int32),
        "query_start_loc": torch.tensor([0, 4, 9], dtype=torch.int32),
        "ln1": 1 + rnd(HIDDEN, scale=0.1), "ln2": 1 + rnd(HIDDEN, scale=0.1),
        "wq": rnd(HQ * D, HIDDEN, scale=0.1), "wk": rnd(HK * D, HIDDEN, scale=0.1),
        "wv": rnd(HK * D, HIDDEN, scale=0.1), "wo": rnd(HIDDEN, HQ * D, scale=0.1),
        "wg": rnd(INTER, HIDDEN, scale=0.1), "wu": rnd(INTER, HIDDEN, scale=0.1),
        "wd": rnd(HIDDEN, INTER, scale=0.1),
    }


def _decode_inputs(dtype, seed=0):
    """Two sequences decoding their 4th and 7th token: earlier keys already in the cache."""
    inputs = _inputs(dtype, seed)
    gen = torch.Generator().manual_seed(seed + 100)
    lens = [4, 7]
    blocks = inputs["block_table"]
    for name in ("k_cache", "v_cache"):
        inputs[name] = torch.randn(NUM_BLOCKS, BLOCK, HK, D, generator=gen).to(dtype)
    pos = torch.tensor(lens) - 1
    inputs["slots"] = (blocks[:, 0] * BLOCK + pos).to(torch.int32)
    freqs = pos[:, None].float() / (10000 ** (torch.arange(0, D, 2).float() / D))[None, :]
    inputs.update(hidden=inputs["hidden"][:2], residual=inputs["residual"][:2],
                  cos=freqs.cos(), sin=freqs.sin(),
                  seq_len=torch.tensor(lens, dtype=torch.int32))
    del inputs["query_start_loc"]
    return inputs


def _fresh(inputs):
    return {k: v.clone() for k, v in inputs.items()}


VIEWS = ("reshape", "split", "slice", "select", "permute", "transpose")


def test_kernel_counts_with_and_without_passes():
    net = _record(torch.float32)
    fused = net.build_engine()
    plain = net.build_engine(passes=False)
    matches = {r.name: r.matches for r in fused.pass_records}
    assert matches["RmsNormFusion"] == 2
    assert matches["SiluFusion"] == 1
    assert matches["AddRmsNorm"] == 2  # both norms follow a residual add
    assert matches["SwiGLU"] == 1
    assert matches["RopeCache"] == 1
    assert matches["LinearEpilogue"] == 1  # the down projection absorbs the last residual add
    assert matches["HorizontalLinear"] == 0  # weights are graph inputs here: nothing to concat
    assert matches["NormLinear"] == 0  # each norm feeds several linears
    assert matches["RopeAttention"] == 0  # prefill attention: the rope stays its own kernel
    ops = [n.op for n in fused.net.nodes if n.op not in VIEWS]
    assert ops == ["add_rms_norm", "linear", "linear", "linear", "rope_cache", "paged_attention",
                   "linear", "add_rms_norm", "linear", "linear", "silu_mul", "linear_epilogue"]
    assert fused.stats.kernel_count == 12
    assert plain.stats.kernel_count == 31
    # The attention reads the rotated keys: the fused rope keeps them as a fourth output.
    rope = next(n for n in fused.net.nodes if n.op == "rope_cache")
    attn = next(n for n in fused.net.nodes if n.op == "paged_attention")
    assert rope.attrs.get("keep_k") is True and attn.inputs[6] is rope.outputs[3]


def test_decode_block_folds_the_rope_into_attention():
    net = _record(torch.float32, decode=True)
    fused = net.build_engine()
    assert {r.name: r.matches for r in fused.pass_records}["RopeAttention"] == 1
    ops = [n.op for n in fused.net.nodes if n.op not in VIEWS]
    assert ops == ["add_rms_norm", "linear", "linear", "linear", "rope_cache_attention",
                   "linear", "add_rms_norm", "linear", "linear", "silu_mul", "linear_epilogue"]
    assert fused.stats.kernel_count == 11


def test_decode_triton_backend_matches_reference_on_cpu_interpreter():
    # The Triton decode attention rotates q and the new key itself and writes the cache; fp32
    # under the interpreter, 1e-4 as for the prefill block above.
    net = _record(torch.float32, decode=True)
    inputs = _decode_inputs(torch.float32)
    ref_in, tri_in = _fresh(inputs), _fresh(inputs)
    ref = net.build_engine(backend="reference").forward(ref_in)["out"]
    engine = net.build_engine(backend="triton")
    assert "triton.rope_cache_attention" in str(engine)
    torch.testing.assert_close(engine.forward(tri_in)["out"], ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(tri_in["k_cache"], ref_in["k_cache"])
    torch.testing.assert_close(tri_in["v_cache"], ref_in["v_cache"])


def test_weights_as_parameters_merge_qkv_and_gate_up():
    inputs = _inputs(torch.float32)
    params = {k: inputs.pop(k) for k in WEIGHTS}
    net = _record(torch.float32, params)
    fused = net.build_engine()
    assert {r.name: r.matches for r in fused.pass_records}["HorizontalLinear"] == 2
    # NormLinear: the o projection absorbs the residual add, the second norm and the gate move
    # into the gate|up linear.
    assert {r.name: r.matches for r in fused.pass_records}["NormLinear"] == 3
    ops = [n.op for n in fused.net.nodes if n.op not in VIEWS]
    assert ops == ["add_rms_norm", "linear", "rope_cache", "paged_attention", "linear_epilogue",
                   "norm_linear", "linear_epilogue"]
    assert fused.stats.kernel_count == 7
    norm_linear = next(n for n in fused.net.nodes if n.op == "norm_linear")
    assert norm_linear.attrs["act"] == "swiglu"
    assert "wq+wk+wv" in [v.name for v in fused.weights]
    got = fused.forward(_fresh(inputs))["out"]
    want = net.build_engine(passes=False).forward(_fresh(inputs))["out"]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("decode", [False, True], ids=["prefill", "decode"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_fused_equals_unfused(dtype, tol, decode):
    # The fused references compose the unfused ones; only rounding order may differ in bf16.
    net = _record(dtype, decode=decode)
    inputs = _decode_inputs(dtype) if decode else _inputs(dtype)
    a, b = _fresh(inputs), _fresh(inputs)
    fused = net.build_engine().forward(a)["out"]
    plain = net.build_engine(passes=False).forward(b)["out"]
    torch.testing.assert_close(fused.float(), plain.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(a["k_cache"], b["k_cache"])
    torch.testing.assert_close(a["v_cache"], b["v_cache"])


def test_triton_backend_matches_reference_on_cpu_interpreter():
    # fp32: Triton's fp32 dot may use TF32 on GPU, but under the interpreter it is exact fp32;
    # 1e-4 covers summation-order differences at K <= 96.
    net = _record(torch.float32)
    inputs = _inputs(torch.float32)
    ref_in, tri_in = _fresh(inputs), _fresh(inputs)
    ref = net.build_engine(backend="reference").forward(ref_in)["out"]
    engine = net.build_engine(backend="triton")
    out = engine.forward(tri_in)["out"]
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(tri_in["k_cache"], ref_in["k_cache"])
    assert "triton.rope_cache" in str(engine) and "triton.paged_attention" in str(engine)
    # A second call with fewer tokens reuses the plan and the compiled kernels.
    plan = engine.plan
    small = _inputs(torch.float32, seed=1)
    for k in ("hidden", "residual", "cos", "sin", "slots"):
        small[k] = small[k][:4]
    small.update(seq_len=torch.tensor([4], dtype=torch.int32),
                 query_start_loc=torch.tensor([0, 4], dtype=torch.int32),
                 block_table=small["block_table"][:1])
    ref_small = net.build_engine(backend="reference").forward(_fresh(small))["out"]
    torch.testing.assert_close(engine.forward(_fresh(small))["out"], ref_small, rtol=1e-4,
                               atol=1e-4)
    assert engine.plan is plan and engine.stats.bindings == 2


@pytest.mark.parametrize("tokens", [3, 9])
def test_norm_linear_on_triton_backend_matches_reference(tokens):
    # 3 tokens run the fused GEMV (norm in the prologue, SwiGLU in the epilogue); 9 run the
    # large-M path (norm kernel, GEMM, gate kernel). fp32 under the interpreter: 1e-4 covers the
    # fused kernel's other summation order and its unrounded normed activations at K <= 96.
    inputs = _inputs(torch.float32)
    params = {k: inputs.pop(k) for k in WEIGHTS}
    net = _record(torch.float32, params)
    if tokens == 3:
        for k in ("hidden", "residual", "cos", "sin", "slots"):
            inputs[k] = inputs[k][:3]
        inputs.update(seq_len=torch.tensor([3], dtype=torch.int32),
                      query_start_loc=torch.tensor([0, 3], dtype=torch.int32),
                      block_table=inputs["block_table"][:1])
    ref = net.build_engine(backend="reference").forward(_fresh(inputs))["out"]
    engine = net.build_engine(backend="triton")
    assert "triton.norm_linear" in str(engine)
    torch.testing.assert_close(engine.forward(_fresh(inputs))["out"], ref, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
def test_cuda_graph_replay_is_bit_identical():
    net = _record(torch.bfloat16)
    inputs = {k: v.cuda() for k, v in _inputs(torch.bfloat16).items()}
    caches = {k: inputs[k] for k in ("k_cache", "v_cache")}

    def run(engine, data):
        for c in caches.values():
            c.zero_()  # the captured graph writes into these very tensors
        return engine.forward({**data, **caches})["out"]

    engine = net.build_engine()
    eager = run(engine, inputs)
    engine.capture({**inputs, **caches})
    assert engine.captured_signatures == 1
    assert torch.equal(run(engine, inputs), eager)
    # New values of the same shapes replay the same graph and match an uncaptured engine.
    other = {k: v.cuda() for k, v in _inputs(torch.bfloat16, seed=3).items()}
    want = run(net.build_engine(), other)
    assert torch.equal(run(engine, other), want)
    # A different cache tensor is refused rather than silently ignored.
    with pytest.raises(EngineInputError, match="updated in place"):
        engine.forward({**other, "k_cache": caches["k_cache"].clone()})
    assert len(engine.captured_graphs) >= 1
    engine.release_captures()
    assert engine.captured_signatures == 0 and engine.captured_graphs == []
    assert torch.equal(run(engine, other), want)  # uncaptured again, same numbers


@pytest.mark.gpu
def test_cuda_graph_inputs_held_by_reference():
    """Inputs captured by reference are read in place: writing new values into them and
    passing the same tensor objects replays without copies (the decode fast path), and the
    result equals an uncaptured engine on those values."""
    net = _record(torch.bfloat16)
    held = {k: v.cuda() for k, v in _inputs(torch.bfloat16).items()}
    engine = net.build_engine()
    handle = engine.capture(held, by_reference=list(held))
    fresh = {k: v.cuda() for k, v in _inputs(torch.bfloat16, seed=5).items()}
    for k, v in fresh.items():
        if k not in ("k_cache", "v_cache"):
            held[k].copy_(v)  # new step data, same tensors
    for k in ("k_cache", "v_cache"):
        held[k].zero_()
    got = engine.forward(held)["out"].clone()
    ref_in = {k: v.clone() for k, v in held.items()}
    for k in ("k_cache", "v_cache"):
        ref_in[k].zero_()
    assert torch.equal(got, net.build_engine().forward(ref_in)["out"])
    # replay(handle): the same graph with no checks at all.
    for k in ("k_cache", "v_cache"):
        held[k].zero_()
    assert torch.equal(engine.replay(handle)["out"], got)
    # Another tensor for a held input is refused rather than copied into the caller's tensor.
    with pytest.raises(EngineInputError, match="by_reference"):
        engine.forward({**held, "hidden": held["hidden"].clone()})
    with pytest.raises(CaptureError, match="not inputs"):
        engine.capture(held, by_reference=["nope"])
    partial = net.build_engine()
    with pytest.raises(CaptureError, match="every input held"):
        partial.replay(partial.capture(held, by_reference=["hidden"]))
    assert engine.graphs_of(handle) and len(engine.graphs_of(handle)) <= len(engine.captured_graphs)
    engine.release_captures()
    with pytest.raises(CaptureError, match="released"):
        engine.replay(handle)
    with pytest.raises(CaptureError, match="released"):
        engine.graphs_of(handle)


@pytest.mark.gpu
def test_cuda_graph_with_a_host_segment_between_captured_ones():
    # A node reading a host value cannot be captured: it runs eagerly between two graphs and
    # must still find the values the first graph produced.
    with recording("host_between") as net:
        x = Tensor("x", torch.float32, ("t", 64))
        n = Tensor("n", torch.float32, (), host=True)  # a 0-d CPU scalar multiplies CUDA tensors
        y = F.exp(x) * 2.0
        y = y * n
        net.mark_output(F.sin(y) + 1.0, "out")
    engine = net.build_engine()
    assert [s.capturable for s in engine.segments] == [True, False, True]
    x = torch.randn(8, 64, device="cuda")
    engine.capture({"x": x}, runtime_params={"n": 3.0})
    for scale in (3.0, 0.5):
        got = engine.forward({"x": x}, runtime_params={"n": scale})["out"]
        torch.testing.assert_close(got, torch.sin(torch.exp(x) * 2.0 * scale) + 1.0)


@pytest.mark.gpu
@pytest.mark.parametrize("host_first", [False, True])
def test_cuda_graph_prologue_uploads_staged_inputs(host_first):
    """A capture prologue (here: pinned host -> held device input) is replayed ahead of the
    kernels, so a step that only rewrites the pinned array sees the new values. With a host
    segment first, the prologue gets a graph of its own and still runs before it."""
    with recording("prologue") as net:
        x = Tensor("x", torch.float32, ("t", 64))
        if host_first:
            n = Tensor("n", torch.float32, (), host=True)
            x = x * n
        net.mark_output(F.sin(F.exp(x) * 2.0) + 1.0, "out")
    engine = net.build_engine()
    assert engine.segments[0].capturable is (not host_first)
    host = torch.randn(8, 64).pin_memory()
    device_x = torch.empty(8, 64, device="cuda")

    def upload():
        device_x.copy_(host, non_blocking=True)

    params = {"n": 1.0} if host_first else None
    handle = engine.capture({"x": device_x}, params, by_reference=["x"], prologue=upload)
    for seed in (1, 2):
        host.copy_(torch.randn(8, 64, generator=torch.Generator().manual_seed(seed)))
        want = torch.sin(torch.exp(host.cuda()) * 2.0) + 1.0
        if host_first:
            got = engine.forward({"x": device_x}, runtime_params=params)["out"]
        else:
            got = engine.replay(handle)["out"]
        torch.cuda.synchronize()
        torch.testing.assert_close(got, want)
