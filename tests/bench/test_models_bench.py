"""The model bench's table and the model's per-bucket decode graphs it times (CPU side; the
GPU side is in test_ab.py)."""
from __future__ import annotations

import pytest
import torch

from tgraph.bench.models import PresetResult, print_table, random_weights
from tgraph.io.model_config import ModelConfig
from tgraph.io.weights import DictWeightLoader
from tgraph.models.loading import build_model

HF = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=32,
          intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
          num_key_value_heads=2, vocab_size=64, max_position_embeddings=128, rms_norm_eps=1e-5,
          tie_word_embeddings=False)


def test_table_shows_the_replay_column_and_a_dash_where_there_is_none(capsys):
    r = PresetResult("tiny", 1000, 0.5, decode_ms={"tgraph static": {1: 0.75, 16: 1.5}},
                     host_overhead_ms={1: 0.05, 16: 0.07}, replay_ms={1: 0.7})
    print_table([r])
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split()[-1] == "ms" and "replay ms" in lines[1]
    row1 = next(line for line in lines if line.startswith("tiny") and line.split()[1] == "1")
    row16 = next(line for line in lines if line.startswith("tiny") and line.split()[1] == "16")
    assert row1.split()[-1] == "0.700" and row1.split()[-2] == "0.05"
    assert row16.split()[-1] == "-"


def test_decode_graphs_are_empty_where_nothing_is_captured():
    model = build_model(ModelConfig.from_dict(HF),
                        DictWeightLoader(random_weights(HF, torch.float32, "cpu"), device="cpu",
                                         dtype=torch.float32), max_model_len=64)
    model.allocate_kv_cache(8)
    assert model.capture_decode_graphs([1]) == []  # no CUDA graphs on the CPU
    assert model.decode_graphs(1) == []
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="positive int"):
            model.decode_graphs(bad)
