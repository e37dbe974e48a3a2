"""Tests of the attention backends: the ``sdpa_attention`` op (torch SDPA over the paged cache)
against a naive fp64 attention, on both engine backends and into poisoned outputs; the layer's
``configure(backend=...)``; and a rule switching a tiny Llama / Mistral to SDPA prefill."""
from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers import assert_close, poison_like
from tgraph.errors import ConfigError, RecordError
from tgraph.layers.attention import Attention
from tgraph.nn import functional as F
from tgraph.nn.network_manager import recording
from tgraph.nn.tensor import Tensor
from tgraph.rules import apply_rules, load_rules
from tgraph.testing import PagedBatcher, make_tiny_hf_model, run_greedy

SDPA_RULE = [{"match": {"class": "tgraph.layers.attention.Attention"},
              "replace": {"class": "default", "kwargs": {"backend": "sdpa"}}}]
RULES_DIR = Path(__file__).parents[2] / "configs" / "rules"


# ---------------------------------------------------------------------------- the op itself
def paged_case(q_lens: list[int], seq_len: list[int], *, q_heads: int, kv_heads: int,
               head_dim: int, block_size: int, dtype: torch.dtype = torch.float32,
               device: str = "cpu", seed: int = 0) -> tuple[dict[str, torch.Tensor],
                                                            list[torch.Tensor],
                                                            list[torch.Tensor]]:
    """Packed queries and per-sequence K/V paged into a cache through shuffled blocks.

    Slots that hold no key are NaN (block 0 is never owned), so reading past ``seq_len`` shows.

    Returns:
        The op's inputs, and the unpaged keys and values of each sequence.
    """
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape: int) -> torch.Tensor:
        return (torch.rand(shape, generator=gen) * 2 - 1).to(dtype)

    blocks_per_seq = [-(-n // block_size) for n in seq_len]
    num_blocks = 1 + sum(blocks_per_seq) + 2
    owned = list(range(1, num_blocks))
    random.Random(seed).shuffle(owned)
    k_cache = torch.full((num_blocks, block_size, kv_heads, head_dim), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    table = torch.zeros(len(seq_len), max(blocks_per_seq) + 1, dtype=torch.int32)
    keys, values = [], []
    for b, n in enumerate(seq_len):
        mine, owned = owned[:blocks_per_seq[b]], owned[blocks_per_seq[b]:]
        table[b, :len(mine)] = torch.tensor(mine, dtype=torch.int32)
        k, v = rnd(n, kv_heads, head_dim), rnd(n, kv_heads, head_dim)
        j = torch.arange(n)
        blk, off = table[b, j // block_size].long(), j % block_size
        k_cache[blk, off], v_cache[blk, off] = k, v
        keys.append(k)
        values.append(v)
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    inputs = {"q": rnd(starts[-1], q_heads, head_dim), "k_cache": k_cache, "v_cache": v_cache,
              "block_table": table, "seq_len": torch.tensor(seq_len, dtype=torch.int32),
              "query_start_loc": torch.tensor(starts, dtype=torch.int32)}
    return {k: t.to(device) for k, t in inputs.items()}, keys, values


def naive(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
          q_lens: list[int], scale: float, window: int | None) -> torch.Tensor:
    """Causal attention in fp64 on unpaged K/V, written out from the definition."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    start = 0
    for k, v, n in zip(keys, values, q_lens):
        seq_len, group = k.shape[0], q.shape[1] // k.shape[1]
        k64 = k.double().repeat_interleave(group, dim=1)
        v64 = v.double().repeat_interleave(group, dim=1)
        for i in range(n):
            p = seq_len - n + i
            keep = [j for j in range(seq_len) if j <= p and (window is None or p - j < window)]
            s = torch.einsum("hd,khd->hk", q[start + i].double().cpu(), k64[keep]) * scale
            out[start + i] = torch.einsum("hk,khd->hd", torch.softmax(s, -1), v64[keep])
        start += n
    return out


CASES = {
    # prefill, GQA (2 query heads per KV head), mixed lengths
    "prefill_gqa": dict(q_lens=[5, 1, 9], seq_len=[5, 1, 9], kv_heads=2),
    # chunked prefill: queries after a cached prefix; a sequence scheduling no query
    "chunked": dict(q_lens=[3, 4, 0], seq_len=[10, 4, 6], kv_heads=2),
    # sliding window (prefill and chunked) with an explicit scale, MQA
    "window": dict(q_lens=[7, 3], seq_len=[7, 11], kv_heads=1, window=3, scale=0.3),
}


def _sdpa_net(shapes: dict[str, tuple], dtype: torch.dtype, scale: float | None,
              window: int | None):
    with recording("sdpa") as net:
        args = {name: Tensor(name, dtype if name in ("q", "k_cache", "v_cache") else torch.int32,
                             shape) for name, shape in shapes.items()}
        net.mark_output(F.sdpa_attention(args["q"], args["k_cache"], args["v_cache"],
                                         args["block_table"], args["seq_len"],
                                         args["query_start_loc"], scale=scale,
                                         sliding_window=window), "out")
    return net


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_sdpa_op_matches_naive_attention(case: str, backend: str) -> None:
    spec = dict(CASES[case])
    window, scale = spec.pop("window", None), spec.pop("scale", None)
    inputs, keys, values = paged_case(q_heads=4, head_dim=16, block_size=4, **spec)
    shapes = {"q": ("num_tokens", 4, 16), "k_cache": tuple(inputs["k_cache"].shape),
              "v_cache": tuple(inputs["v_cache"].shape),
              "block_table": ("batch", inputs["block_table"].shape[1]), "seq_len": ("batch",),
              "query_start_loc": ("batch_plus_one",)}
    engine = _sdpa_net(shapes, torch.float32, scale, window).build_engine(backend=backend)
    assert any(st.node.op == "sdpa_attention" for st in engine.plan_for(None).steps)
    out = poison_like(inputs["q"])
    engine.forward(inputs, {"out": out})
    expected = naive(inputs["q"], keys, values, spec["q_lens"],
                     16 ** -0.5 if scale is None else scale, window)
    # fp32 against fp64: a softmax over <= 11 keys and a 16-term dot product, far below 1e-5.
    assert_close(out, expected, msg=f"sdpa {case} ({backend})")


def test_sdpa_op_is_a_host_segment_and_needs_query_starts() -> None:
    inputs, _, _ = paged_case([2, 3], [2, 3], q_heads=2, kv_heads=2, head_dim=16, block_size=4)
    shapes = {k: tuple(t.shape) for k, t in inputs.items()}
    engine = _sdpa_net(shapes, torch.float32, None, None).build_engine()
    sdpa_segments = [s for s in engine.segments if any(n.op == "sdpa_attention" for n in s.nodes)]
    assert len(sdpa_segments) == 1 and not sdpa_segments[0].capturable
    assert "reads lengths on the host" in sdpa_segments[0].reason
    with recording("decode"), pytest.raises(RecordError, match="needs query_start_loc"):
        F.record("sdpa_attention", [Tensor("q", torch.float32, (2, 2, 16)),
                                    Tensor("k", torch.float32, (3, 4, 2, 16)),
                                    Tensor("v", torch.float32, (3, 4, 2, 16)),
                                    Tensor("t", torch.int32, (2, 2)),
                                    Tensor("l", torch.int32, (2,)), None])


# ------------------------------------------------------------------------------ the layer
def _tiny_attention() -> Attention:
    from tgraph.io.model_config import ModelConfig
    from tgraph.io.weights import DictWeightLoader

    config = ModelConfig.from_dict({"model_type": "llama", "hidden_size": 32,
                                    "num_attention_heads": 2, "num_key_value_heads": 1,
                                    "num_hidden_layers": 1, "vocab_size": 8,
                                    "intermediate_size": 16})
    weights = {f"a.{n}.weight": torch.randn(o, 32) for n, o in
               (("q_proj", 32), ("k_proj", 16), ("v_proj", 16), ("o_proj", 32))}
    return Attention(config, DictWeightLoader(weights), "a", 0)


def _recorded_attention_ops(layer: Attention, prefill: bool) -> set[str]:
    from tgraph.layers.attention import AttentionMetadata

    with recording("attn") as net:
        meta = AttentionMetadata(
            Tensor("cos", torch.float32, ("n", 8)), Tensor("sin", torch.float32, ("n", 8)),
            Tensor("slots", torch.int32, ("n",)), Tensor("table", torch.int32, ("b", 4)),
            Tensor("lens", torch.int32, ("b",)),
            Tensor("qsl", torch.int32, ("b1",)) if prefill else None,
            [(Tensor("k", torch.float32, (8, 4, 1, 16)),
              Tensor("v", torch.float32, (8, 4, 1, 16)))])
        layer(Tensor("x", torch.float32, ("n", 32)), meta)
    return {n.op for n in net.nodes} & {"paged_attention", "sdpa_attention"}


def test_configure_picks_the_op_and_refuses_unknown_backends() -> None:
    layer = _tiny_attention()
    assert layer.backend == "triton"
    assert _recorded_attention_ops(layer, prefill=True) == {"paged_attention"}
    layer.configure(backend="sdpa")
    assert "backend=sdpa" in repr(layer)
    assert _recorded_attention_ops(layer, prefill=True) == {"sdpa_attention"}
    # Decode keeps the paged kernel (split-KV decode is what the Triton kernel is for).
    assert _recorded_attention_ops(layer, prefill=False) == {"paged_attention"}
    with pytest.raises(ValueError, match=r"attention backend must be one of \['sdpa', "
                                         r"'triton'\], got 'flash'"):
        layer.configure(backend="flash")
    assert layer.backend == "sdpa"  # a refused value changes nothing


@pytest.mark.parametrize("rule, field", [
    ({"match": {"class": "tgraph.layers.attention.Attention"},
      "replace": {"class": "default", "kwargs": {"backend": "flash"}}}, "rule 1.replace.kwargs"),
    ({"match": {"class": "tgraph.layers.attention.Attention"},
      "replace": {"class": "default", "kwargs": {"bakend": "sdpa"}}}, "rule 1.replace.kwargs"),
])
def test_bad_backend_is_refused_at_load_time(rule: dict, field: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_rules([{"match": {"name": "^lm_head$"}}, rule])
    assert str(info.value).startswith(f"{field}:")
    assert "flash" in str(info.value) or "bakend" in str(info.value)


# ------------------------------------------------------------------------------ a real model
@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_hf_model("llama", tmp_path_factory.mktemp("sdpa-llama"), seed=5,
                              tie_word_embeddings=False)


def _load(path: Path, rules: Any = None) -> Any:
    from tgraph.models import load_model

    model = load_model(path, device="cpu", dtype="float32", max_model_len=32, block_size=4,
                       rules=rules)
    model.allocate_kv_cache(24)
    return model


def _ops(model: Any) -> set[str]:
    return {n.op for e in model.engines.values() for n in e.net.nodes}


def _assert_logits_close(got: list[torch.Tensor], ref: list[torch.Tensor]) -> None:
    # fp32 on CPU: SDPA sums the same products in another order than the paged reference
    # (measured ~1e-6 on logits of magnitude ~3): 1e-5 of the logit scale.
    assert len(got) == len(ref)
    for a, b in zip(got, ref):
        scale = float(b.abs().max())
        assert float((a - b).abs().max()) <= 1e-5 * scale


def test_sdpa_rule_gives_the_same_logits(llama_dir: Path) -> None:
    prompts = [[1, 5, 9, 22, 7], [3, 4, 100]]
    base = _load(llama_dir)
    ref = run_greedy(base, prompts, 2)
    model = _load(llama_dir, RULES_DIR / "sdpa_prefill.yaml")
    assert all(layer.self_attn.backend == "sdpa" for layer in model.model.layers)
    got = run_greedy(model, prompts, 2)
    assert "sdpa_attention" in _ops(model) and "sdpa_attention" not in _ops(base)
    decode = model.engines[(False, ())]
    assert "sdpa_attention" not in {n.op for n in decode.net.nodes}
    _assert_logits_close(got.prefill_logits + got.step_logits,
                         ref.prefill_logits + ref.step_logits)
    assert got.generated == ref.generated


def test_sdpa_chunked_prefill_reads_the_cached_prefix(llama_dir: Path) -> None:
    tokens = [7, 1, 44, 9, 13, 2, 80, 5, 31]
    results = []
    for rules in (None, SDPA_RULE):
        model = _load(llama_dir, rules)
        batcher = PagedBatcher.for_model(model)
        seq = batcher.add(tokens)
        # Three chunks: the second and third attend to keys cached by earlier chunks.
        chunks = [model.run(batcher.step([seq], [n], all_logits=True)).clone() for n in (4, 3, 2)]
        results.append(torch.cat(chunks))
    _assert_logits_close([results[1]], [results[0]])


def test_sdpa_with_a_sliding_window(tmp_path: Path) -> None:
    path = make_tiny_hf_model("mistral", tmp_path / "mistral", seed=2, sliding_window=3)
    prompts = [[4, 8, 15, 16, 23, 42, 7], [9, 3]]
    ref = run_greedy(_load(path), prompts, 2)
    model = _load(path)
    apply_rules(model, load_rules(SDPA_RULE))
    assert model.model.layers[0].self_attn.sliding_window == 3
    got = run_greedy(model, prompts, 2)
    _assert_logits_close(got.prefill_logits + got.step_logits,
                         ref.prefill_logits + ref.step_logits)


# ------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sdpa_op_on_gpu_realistic_shapes(dtype: torch.dtype) -> None:
    # Llama-3-8B-like heads (32 query heads, 8 KV heads, head_dim 128), a prefill with a long
    # and a short prompt plus a chunk after a 1000-token cached prefix.
    from tgraph.ir.ops.attention import paged_attention_reference

    q_lens, seq_len = [700, 33, 300], [700, 33, 1300]
    inputs, _, _ = paged_case(q_lens, seq_len, q_heads=32, kv_heads=8, head_dim=128,
                              block_size=16, dtype=dtype, device="cuda")
    shapes = {k: tuple(t.shape) for k, t in inputs.items()}
    engine = _sdpa_net(shapes, dtype, None, None).build_engine()
    assert engine.kernel_kind(inputs["q"].device) == "triton"
    out = poison_like(inputs["q"])
    engine.forward(inputs, {"out": out})
    # The naive paged attention in fp32 on the same (already rounded) inputs.
    order = ("q", "k_cache", "v_cache", "block_table", "seq_len", "query_start_loc")
    expected = paged_attention_reference(*(inputs[k].float() if inputs[k].is_floating_point()
                                           else inputs[k] for k in order))
    # Half-precision inputs, fp32 accumulation inside SDPA's kernels and one rounding of the
    # output: the dtype's default tolerance (bf16 2e-2, fp16 2e-3 relative).
    assert_close(out, expected, msg=f"sdpa gpu {dtype}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_sdpa_rule_on_gpu(tmp_path: Path, dtype: str) -> None:
    from tgraph.models import load_model

    path = make_tiny_hf_model("llama", tmp_path / "llama", seed=1, hidden_size=256,
                              intermediate_size=512, num_attention_heads=8,
                              num_key_value_heads=2, num_hidden_layers=4, vocab_size=512)
    prompts = [list(range(3, 90)), [5, 6, 7]]
    traces = []
    for rules in (None, SDPA_RULE):
        model = load_model(path, device="cuda", dtype=dtype, max_model_len=256, rules=rules)
        model.allocate_kv_cache(64)
        model.capture_decode_graphs([1, 2])
        traces.append(run_greedy(model, prompts, 4))
    ref, got = traces
    # Both sides round to half precision at every layer with different kernels (flash vs ours):
    # bf16 has 8 mantissa bits, so allow 5% of the logit scale (fp16: 1%).
    tol = 5e-2 if dtype == "bfloat16" else 1e-2
    for a, b in zip(got.prefill_logits + got.step_logits, ref.prefill_logits + ref.step_logits):
        scale = float(b.float().abs().max())
        assert float((a.float() - b.float()).abs().max()) <= tol * scale
