"""The random weight loader of the tensor-parallel bench: each rank draws only its shard, a
model builds and runs from it, and the per-rank bound counts that shard's bytes."""
from __future__ import annotations

import pytest
import torch

from tgraph.bench.random_loader import RandomWeightLoader, checkpoint_shapes
from tgraph.bench.tp import rank_weight_bytes
from tgraph.io.model_config import ModelConfig
from tgraph.models.loading import build_model
from tgraph.models.presets import PRESETS
from tgraph.testing import run_greedy

TINY = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=192,
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False)


def test_each_rank_draws_only_its_shard():
    full = RandomWeightLoader(TINY, "cpu", torch.float32)
    half = RandomWeightLoader(TINY, "cpu", torch.float32, rank=1, world_size=2)
    name = "model.layers.0.mlp.gate_proj.weight"
    assert tuple(full.get_tensor(name).shape) == (128, 64)
    assert tuple(half.get_sharded(name, 0).shape) == (64, 64)
    norm = half.get_tensor("model.layers.0.input_layernorm.weight")
    assert torch.equal(norm, torch.ones(64))
    w = full.get_tensor(name)
    assert 0.01 < float(w.std()) < 0.03 and torch.isfinite(w).all()


def test_a_model_builds_and_runs_from_it_and_its_bytes_are_counted():
    model = build_model(ModelConfig.from_dict(TINY),
                        RandomWeightLoader(TINY, "cpu", torch.float32), max_model_len=32,
                        block_size=4)
    model.allocate_kv_cache(16)
    out = run_greedy(model, [[1, 2, 3]], 2)
    assert all(0 <= t < 192 for t in out.generated[0])
    engine = next(iter(model.engines.values()))
    params = sum(torch.Size(s).numel() for s in checkpoint_shapes(TINY).values())
    # fp32, each weight once (the qkv / gate-up packing concatenates, never duplicates)
    assert rank_weight_bytes(engine) == pytest.approx(params * 4, rel=0.01)


@pytest.mark.parametrize("name", ["llama-3-70b", "qwen2.5-72b"])
def test_the_70b_presets_have_their_shapes(name):
    shapes = checkpoint_shapes(PRESETS[name])
    params = sum(torch.Size(s).numel() for s in shapes.values())
    assert 69e9 < params < 73.5e9


@pytest.mark.parametrize("name, low, high", [("olmoe-1b-7b", 6.8e9, 7.0e9),
                                             ("olmo-2-7b", 7.2e9, 7.4e9),
                                             ("gemma-3-1b", 0.99e9, 1.01e9)])
def test_the_added_presets_have_their_shapes(name, low, high):
    """OLMoE-1B-7B-0924: 6.92B parameters; OLMo-2-1124-7B: 7.30B; Gemma-3-1B: 1.00B (the model
    cards' counts)."""
    shapes = checkpoint_shapes(PRESETS[name])
    params = sum(torch.Size(s).numel() for s in shapes.values())
    assert low < params < high, params
