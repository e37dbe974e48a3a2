"""The A/B tool: two variants from settings overrides, parsed strictly, each with its own tuning."""
from __future__ import annotations

import pytest

from tgraph.bench.ab import parse_variants
from tgraph.config import tuning_of


def test_variants_carry_their_own_settings():
    a, b = parse_variants(["llm.engine.tuning.decode_attention.min_keys_per_split=100000"],
                          ["llm.engine.tuning.gemv.tma_weights=false"], ["L2Prefetch"])
    assert tuning_of(a.settings).decode_attention.min_keys_per_split == 100000
    assert tuning_of(a.settings).gemv.tma_weights is True
    assert tuning_of(b.settings).gemv.tma_weights is False
    assert tuning_of(b.settings).decode_attention.min_keys_per_split == 256
    assert a.llm_options["disabled_passes"] == ()
    assert b.llm_options["disabled_passes"] == ("L2Prefetch",)
    assert b.llm_options["tuning"] == tuning_of(b.settings)
    assert "tma_weights=false" in b.label and "without L2Prefetch" in b.label


@pytest.mark.parametrize("set_a, set_b, message", [
    ([], [], "differ by"),
    (["llm.engine.tuning.gemv.tma=false"], [], "unknown setting"),
    (["llm.engine.tuning.gemv.m1_stages=0"], [], "integer >= 1"),
    (["tma_weights"], [], "key.path=value"),
    (["llm.engine.tuning.gemv.tma_weights=true"], ["llm.engine.tuning.gemv.tma_weights=true"],
     "same settings"),
])
def test_bad_variants_are_refused(set_a, set_b, message):
    with pytest.raises(SystemExit, match=message):
        parse_variants(set_a, set_b)


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
    staging = list(model._graph_state().step_inputs.stagings.values())
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
