"""Every family against Hugging Face transformers on tiny random checkpoints (fp32, CPU).

Tolerance: ``max|tgraph - hf| <= 1e-4 * max|hf|`` per sequence. Both sides compute in fp32
(unit roundoff 6e-8); they differ only in summation order (packed vs padded attention, fused
add+RMSNorm, split GEMMs), which over 3 layers of dot products of length <= 128 gives relative
errors around 1e-6 (measured: at most 1.0e-6). The bound leaves 100x headroom, while every bug the
variants target moves logits by more than 5e-2 relative (see ``test_variant_feature_matters``).
"""
from __future__ import annotations

import copy
import json

import pytest
import torch

from tests.models.conftest import (
    DECODE_STEPS,
    PROMPTS,
    VARIANTS,
    load_tiny,
    relative_error,
)
from tgraph.testing import (
    PagedBatcher,
    generate_greedy,
    hf_greedy,
    hf_logits,
    make_tiny_hf_model,
    random_hf_model,
)

REL_TOL = 1e-4
# A variant's distinguishing feature must move HF's logits by this much (500x REL_TOL; measured
# 0.2 to 1.5; even a sliding window off by one moves them by 0.47), or the parity test could not
# tell a model that ignores it.
FEATURE_EFFECT = 5e-2


def assert_rows_close(rows: list[tuple[int, int, float]], what: str) -> None:
    bad = [r for r in rows if not r[2] <= REL_TOL]  # `not <=` also catches NaN
    assert not bad, (f"{what}: {len(bad)} of {len(rows)} logit rows differ from HF by more than "
                     f"{REL_TOL} x max|logit|; worst (seq, pos, rel err): "
                     f"{max(bad, key=lambda r: r[2] if r[2] == r[2] else float('inf'))}")


@pytest.mark.parametrize("graph", ["static", "eager"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prefill_and_decode_match_hf(tiny_model, greedy_parity, variant, graph):
    tm = tiny_model(variant)
    model = load_tiny(tm.path, graph)
    trace, rows = greedy_parity(model, tm.hf)
    # every prompt token plus one row per decode step, per sequence
    assert len(rows) == sum(len(p) for p in PROMPTS) + DECODE_STEPS * len(PROMPTS)
    assert_rows_close(rows, f"{variant} ({graph})")
    assert set(model.engines) == {(True, ()), (False, ())}, (
        f"expected exactly the prefill and decode engines, got {list(model.engines)}")
    # The decode steps fed tgraph's own greedy tokens; they are HF's greedy tokens too.
    assert [g[:3] for g in trace.generated] == hf_greedy(tm.hf, PROMPTS, 3)


@pytest.mark.parametrize("graph", ["static", "eager"])
@pytest.mark.parametrize("variant", ["llama3_tied", "qwen3", "mistral"])
def test_chunked_prefill_matches_hf(tiny_model, variant, graph):
    """A prompt prefilled in two chunks (the second reading the first from the cache), packed
    with a new prompt in the second batch, then decoded."""
    tm = tiny_model(variant)
    model = load_tiny(tm.path, graph)
    long_prompt, other = PROMPTS[2], PROMPTS[0]
    b = PagedBatcher.for_model(model, shuffle_seed=3)
    a = b.add(long_prompt)
    first = model.run(b.step([a], [7], all_logits=True)).clone()  # tokens 0..6
    c = b.add(other)
    second = model.run(b.step([a, c], all_logits=True)).clone()  # a: 7..17 (context 7), c: all
    ref_a, ref_c = hf_logits(tm.hf, long_prompt), hf_logits(tm.hf, other)
    got_a = torch.cat([first, second[:len(long_prompt) - 7]])
    got_c = second[len(long_prompt) - 7:]
    assert relative_error(got_a, ref_a) <= REL_TOL
    assert relative_error(got_c, ref_c) <= REL_TOL
    # decode after a chunked prefill
    nxt = [int(ref_a[-1].argmax()), int(ref_c[-1].argmax())]
    b.append(a, nxt[0])
    b.append(c, nxt[1])
    step = model.run(b.step([a, c]))
    assert relative_error(step[0], hf_logits(tm.hf, long_prompt + nxt[:1])[-1]) <= REL_TOL
    assert relative_error(step[1], hf_logits(tm.hf, other + nxt[1:])[-1]) <= REL_TOL
    assert set(model.engines) == {(True, ()), (False, ())}


def test_engines_are_reused_across_batch_shapes(tiny_model):
    """No recompile storm: prefills and decodes of other sizes reuse the two engines."""
    tm = tiny_model("llama")
    model = load_tiny(tm.path)
    run_shapes = [PROMPTS[:1], PROMPTS[1:4], PROMPTS]
    for prompts in run_shapes:
        model.allocate_kv_cache(64)
        assert generate_greedy(model, prompts, 3) == hf_greedy(tm.hf, prompts, 3)
    engines = dict(model.engines)
    assert set(engines) == {(True, ()), (False, ())}
    b = PagedBatcher.for_model(model)
    model.run(b.step([b.add([5, 6, 7, 8, 9])]))
    assert all(model.engines[k] is engines[k] for k in engines)


def test_sharded_checkpoint_gives_identical_logits(tiny_model, tmp_path):
    """The same weights saved in several safetensors shards with an index load to the same
    model: the logits are bitwise equal (same bytes, same engine)."""
    single = tiny_model("llama")
    family, overrides = VARIANTS["llama"]
    # make_tiny_hf_model with the session's seed and overrides rebuilds the same weights.
    sharded = make_tiny_hf_model(family, tmp_path / "sharded", seed=0, max_shard_size="40KB",
                                 **overrides)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    files = set(index["weight_map"].values())
    assert len(files) >= 3, f"expected several shards, got {sorted(files)}"
    assert not (sharded / "model.safetensors").exists()
    traces = []
    for path in (single.path, sharded):
        model = load_tiny(path)
        b = PagedBatcher.for_model(model)
        ids = [b.add(p) for p in PROMPTS]
        prefill = model.run(b.step(ids, all_logits=True)).clone()
        for i, s in enumerate(ids):
            b.append(s, i + 1)
        traces.append((prefill, model.run(b.step(ids)).clone()))
    assert torch.equal(traces[0][0], traces[1][0])
    assert torch.equal(traces[0][1], traces[1][1])


def test_generate_greedy_matches_hf_greedy(tiny_model):
    tm = tiny_model("qwen2")
    model = load_tiny(tm.path)
    prompts = [PROMPTS[0], PROMPTS[3]]
    assert generate_greedy(model, prompts, 6) == hf_greedy(tm.hf, prompts, 6)


# ---------------------------------------------------------------------- the tests can fail
def _ablated_logits(tm, tokens: list[int]) -> torch.Tensor:
    """HF logits of the variant with its distinguishing feature removed."""
    family, overrides = VARIANTS[tm.name]
    if tm.name == "llama3_tied":
        other = random_hf_model(family, seed=0, **{**overrides, "rope_scaling": None})
    elif tm.name == "mistral":
        other = random_hf_model(family, seed=0, **{**overrides, "sliding_window": None})
    elif tm.name in ("qwen3_moe", "qwen2_moe", "mixtral"):
        # the same weights routed to one expert per token instead of two
        other = random_hf_model(family, seed=0, **{**overrides, "num_experts_per_tok": 1})
    elif tm.name == "qwen3_window":
        # the window on every layer, as tgraph applied it before reading max_window_layers
        other = random_hf_model(family, seed=0, **{**overrides, "max_window_layers": 0})
    elif tm.name == "olmo3":
        # the full-attention layer (no window, YaRN) made a sliding one like the others
        other = random_hf_model(family, seed=0, **{**overrides,
                                                   "layer_types": ["sliding_attention"] * 3})
    elif tm.name == "gemma3":
        # scores scaled by head_dim ** -0.5, as a model ignoring query_pre_attn_scalar would
        other = random_hf_model(family, seed=0, **{**overrides, "query_pre_attn_scalar": 32})
    elif tm.name == "phi3":
        # plain RoPE where LongRoPE scales the rotated dims
        other = random_hf_model(family, seed=0, **{**overrides, "rope_scaling": None})
    elif tm.name == "olmoe":
        other = random_hf_model(family, seed=0, **{**overrides, "clip_qkv": None})
    elif tm.name == "llama":
        # an untied head replaced by the embedding (what a wrong tie would compute)
        other = copy.deepcopy(tm.hf)
        with torch.no_grad():
            other.lm_head.weight.copy_(other.model.embed_tokens.weight)
    else:
        other = copy.deepcopy(tm.hf)
        with torch.no_grad():
            for name, p in other.named_parameters():
                if tm.name == "qwen2" and name.endswith("proj.bias"):
                    p.zero_()
                if tm.name in ("qwen3", "olmo2") and name.endswith(("q_norm.weight",
                                                                    "k_norm.weight")):
                    p.fill_(1.0)
    return hf_logits(other, tokens)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variant_feature_matters(tiny_model, variant):
    """Guard against a vacuous parity test: removing what is special about a variant (rope
    scaling, the untied head, q/k/v biases, q/k norms, the sliding window, the second routed
    expert of every token, Qwen's full first layers, OLMo 3's full layer, Gemma 3's
    query_pre_attn_scalar, Phi-3's LongRoPE, OLMoE's clamp of q/k/v) changes HF's logits by
    far more than the parity tolerance, so a tgraph model that ignored it would fail."""
    tm = tiny_model(variant)
    tokens = PROMPTS[2]
    ref = hf_logits(tm.hf, tokens)
    assert relative_error(_ablated_logits(tm, tokens), ref) > FEATURE_EFFECT
