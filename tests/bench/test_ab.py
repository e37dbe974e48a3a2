"""The A/B tool's ``--set`` overrides: parsed strictly, applied only while variant B is built."""
from __future__ import annotations

import pytest

from tgraph.bench.ab import overridden, parse_override
from tgraph.kernels.triton import attention_decode


def test_override_is_applied_and_restored():
    before = attention_decode.MIN_KEYS_PER_SPLIT
    spec = parse_override("tgraph.kernels.triton.attention_decode.MIN_KEYS_PER_SPLIT=100000")
    assert spec == (attention_decode, "MIN_KEYS_PER_SPLIT", 100000)
    with overridden([spec]):
        assert attention_decode.MIN_KEYS_PER_SPLIT == 100000
        assert attention_decode.choose_num_splits(1, 8, 4096) == 1
    assert attention_decode.MIN_KEYS_PER_SPLIT == before


@pytest.mark.parametrize("text, message", [
    ("MIN_KEYS_PER_SPLIT", "MODULE.NAME=VALUE"),
    ("tgraph.kernels.triton.attention_decode.NOPE=1", "no attribute 'NOPE'"),
    ("tgraph.kernels.triton.attention_decode.MAX_SPLITS=many", "not a Python literal"),
])
def test_bad_overrides_are_refused(text, message):
    with pytest.raises(SystemExit, match=message):
        parse_override(text)


@pytest.mark.gpu
def test_captured_decode_stages_the_measured_batch_and_exposes_its_graphs():
    """Replays timed right after captured_decode must read context CONTEXT, not the capture's
    placeholder batch (seq_len 0)."""
    import torch

    from tgraph.bench.models import CONTEXT, captured_decode, random_model, random_weights

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    hf = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=64,
              intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=128, max_position_embeddings=1024,
              rms_norm_eps=1e-5, tie_word_embeddings=False)
    model = random_model(hf, random_weights(hf, torch.bfloat16, "cuda"), max_model_len=1024)
    meta = captured_decode(model, 2)
    staging = list(model._graph_state()._staging.values())
    assert len(staging) == 1 and staging[0].views["seq_len"].tolist() == [CONTEXT, CONTEXT]
    assert meta.seq_len == [CONTEXT, CONTEXT]
    # The bench times the captured bucket's graphs alone; other buckets have none.
    graphs = model.decode_graphs(2)
    assert graphs and all(isinstance(g, torch.cuda.CUDAGraph) for g in graphs)
    assert model.decode_graphs(1) == []
    model.engines[(False, ())].release_captures()  # the model's handle goes stale
    assert model.decode_graphs(2) == []
    model.release_graphs()
    assert model.decode_graphs(2) == []
