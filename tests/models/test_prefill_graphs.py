"""Prefill from CUDA graphs captured at token buckets: the padding, and parity with uncaptured
prefill (the padded signature on CPU, the captured graphs on a GPU)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.models.conftest import NUM_BLOCKS, PROMPTS, load_tiny
from tgraph.errors import ConfigError
from tgraph.io.model_config import ModelConfig
from tgraph.models.base.batch import pad_prefill_arrays, prefill_token_bucket
from tgraph.models.base.llm_config import LlmConfig
from tgraph.testing import PagedBatcher, make_tiny_hf_model


def test_token_buckets():
    # Multiples of 128 up to 1024 tokens, then of 256; None above the limit or for nothing.
    assert [prefill_token_bucket(n, 4096) for n in (1, 128, 129, 1000, 1024, 1025, 4000)] == \
        [128, 128, 256, 1024, 1024, 1280, 4096]
    assert prefill_token_bucket(4097, 4096) is None
    assert prefill_token_bucket(0, 4096) is None
    assert prefill_token_bucket(5, 0) is None
    # A limit that is not a multiple of the step caps the last bucket at the limit.
    assert prefill_token_bucket(990, 1000) == 1000


def _arrays(q_lens, logits):
    tokens = sum(q_lens)
    qsl = np.concatenate(([0], np.cumsum(q_lens))).astype(np.int32)
    return {
        "input_ids": np.arange(7, 7 + tokens, dtype=np.int32),
        "position_ids": np.arange(tokens, dtype=np.int32),
        "slots_mapping": np.arange(100, 100 + tokens, dtype=np.int32),
        "seq_len": np.array(q_lens, dtype=np.int32),
        "lm_head_indices": np.array(logits, dtype=np.int32),
        "query_start_loc": qsl,
        "block_table": np.arange(1, 1 + 3 * len(q_lens), dtype=np.int32).reshape(-1, 3),
    }


def test_pad_prefill_arrays():
    got = pad_prefill_arrays(_arrays([3, 2], [2, 4]), tokens=8, seqs=4)
    assert got["input_ids"].tolist() == [7, 8, 9, 10, 11, 0, 0, 0]
    assert got["position_ids"].tolist() == [0, 1, 2, 3, 4, 0, 0, 0]
    assert got["slots_mapping"].tolist() == [100, 101, 102, 103, 104, -1, -1, -1]
    # Pad sequences are empty: no query rows, no context.
    assert got["query_start_loc"].tolist() == [0, 3, 5, 5, 5]
    assert got["seq_len"].tolist() == [3, 2, 0, 0]
    assert got["lm_head_indices"].tolist() == [2, 4, 0, 0]
    assert got["block_table"].tolist() == [[1, 2, 3], [4, 5, 6], [0, 0, 0], [0, 0, 0]]
    assert all(a.dtype == np.int32 for a in got.values())
    # Logits rows are padded to the sequence bucket too: one per token fits when few enough.
    assert pad_prefill_arrays(_arrays([3], [0, 1, 2]), 4, 4)["lm_head_indices"].tolist() == \
        [0, 1, 2, 0]


@pytest.mark.parametrize("tokens, seqs", [(4, 4), (8, 1)])
def test_pad_prefill_arrays_refuses_a_smaller_signature(tokens, seqs):
    with pytest.raises(ValueError, match="cannot pad a prefill of 5 tokens, 2 sequences"):
        pad_prefill_arrays(_arrays([3, 2], [2, 4]), tokens, seqs)


def test_prefill_graph_tokens_is_validated():
    model = ModelConfig.from_dict({"model_type": "llama", "hidden_size": 64,
                                   "num_attention_heads": 4, "num_hidden_layers": 1,
                                   "intermediate_size": 128, "vocab_size": 32})
    with pytest.raises(ConfigError, match="prefill_graph_tokens must be an int >= 0"):
        LlmConfig(model, prefill_graph_tokens=-1)
    with pytest.raises(ConfigError, match="prefill_graph_tokens must be an int >= 0"):
        LlmConfig(model, prefill_graph_tokens=True)


@pytest.mark.parametrize("variant", ["llama", "qwen2", "mistral"])
def test_padded_signature_equals_the_unpadded_prefill(tiny_model, variant):
    """The engine run on the padded arrays a captured prefill uses gives the real sequences'
    logits and writes the KV cache exactly as the unpadded batch does (pad tokens write no
    slot and are attended by no real row). CPU, fp32, the Triton kernels under the
    interpreter; the logits rows are the sequences' last tokens and two chosen rows."""
    model = load_tiny(tiny_model(variant).path)
    state = model._graph_state()
    prompts = PROMPTS[:3]
    batcher = PagedBatcher.for_model(model)
    ids = [batcher.add(p) for p in prompts]
    batch = batcher.step(ids)
    ref = model.run(batch).clone()
    ref_cache = [(k.clone(), v.clone()) for k, v in model.kv_caches]

    model.allocate_kv_cache(NUM_BLOCKS)  # zeroed: the padded run must write the same slots
    engine = state.engines[(True, ())]
    arrays = pad_prefill_arrays(state.step_inputs.arrays(batch), tokens=64, seqs=8)
    inputs = {name: torch.from_numpy(a) for name, a in arrays.items()}
    inputs.update(state.step_inputs.resident())
    got = engine.forward(inputs)["model_out"][:len(prompts)]
    # fp32 on both sides; the linears see 64 rows instead of 36 (another blocking of the sums).
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    for (k, v), (k0, v0) in zip(model.kv_caches, ref_cache):
        torch.testing.assert_close(k, k0, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v, v0, rtol=1e-5, atol=1e-5)


def test_cpu_prefill_runs_uncaptured(tiny_model):
    # No CUDA graphs off CUDA: nothing is captured or staged, whatever prefill_graph_tokens says.
    model = load_tiny(tiny_model("llama").path, prefill_graph_tokens=4096)
    batcher = PagedBatcher.for_model(model)
    model.run(batcher.step([batcher.add(PROMPTS[0])]))
    state = model._graph_state()
    assert not state.captured and not state.step_inputs.stagings


def _prefill_signatures(model) -> list[tuple]:
    return [sig for _, sig in model._graph_state().captured if isinstance(sig, tuple)]


@pytest.mark.gpu
def test_captured_prefill_matches_uncaptured(tmp_path):
    """Prefill batches of different sizes through captured graphs (token buckets 128 and 256,
    the shared arena growing in between, which releases the first capture: it is captured
    again), then greedy decode: the same tokens and, within fp32 tolerance, the same logits as
    the model with prefill_graph_tokens=0 (cuBLAS may sum the padded GEMMs in another order)."""
    from tgraph.models import load_model

    path = make_tiny_hf_model("llama", tmp_path / "llama", seed=5, hidden_size=256,
                              intermediate_size=512, num_attention_heads=8,
                              num_key_value_heads=2, num_hidden_layers=2, vocab_size=512)
    rounds = [[list(range(3, 40)), [5, 6, 7]],                    # 40 tokens: bucket 128
              [list(range(1, 200)), list(range(9, 20)), [4]],    # 211 tokens: bucket 256
              [list(range(50, 60))]]                             # bucket 128 again
    results = []
    for graph_tokens in (256, 0):
        model = load_model(path, device="cuda", dtype="float32", max_model_len=512,
                           prefill_graph_tokens=graph_tokens)
        model.allocate_kv_cache(128)
        batcher = PagedBatcher.for_model(model)
        logits, tokens = [], []
        for prompts in rounds:
            ids = [batcher.add(p) for p in prompts]
            last = model.run(batcher.step(ids)).clone()
            logits.append(last)
            for _ in range(4):
                nxt = [int(t) for t in last.argmax(-1)]
                tokens.append(nxt)
                for s, t in zip(ids, nxt):
                    batcher.append(s, t)
                last = model.run(batcher.step(ids)).clone()
                logits.append(last)
        results.append((logits, tokens))
        if graph_tokens:
            assert sorted(set(_prefill_signatures(model))) == [("prefill", 128, 1),
                                                               ("prefill", 128, 2),
                                                               ("prefill", 256, 4)]
        else:
            assert not _prefill_signatures(model)
    (got, got_tokens), (ref, ref_tokens) = results
    assert got_tokens == ref_tokens
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
def test_shared_arena_growth_releases_smaller_captures(tmp_path):
    from tgraph.models import load_model

    path = make_tiny_hf_model("llama", tmp_path / "llama", seed=6, hidden_size=128,
                              intermediate_size=256, num_attention_heads=4,
                              num_key_value_heads=2, num_hidden_layers=1, vocab_size=256)
    model = load_model(path, device="cuda", dtype="float32", max_model_len=512)
    model.allocate_kv_cache(64)
    state = model._graph_state()
    batcher = PagedBatcher.for_model(model)
    model.run(batcher.step([batcher.add([1, 2, 3])]))
    engine = state.engines[(True, ())]
    small = state.captured[((True, ()), ("prefill", 128, 1))]
    assert engine.is_captured(small)
    model.run(batcher.step([batcher.add(list(range(300)))]))  # bucket 384: a larger arena
    assert not engine.is_captured(small)
    assert engine.is_captured(state.captured[((True, ()), ("prefill", 384, 1))])
