"""The MoE runs of ``tgraph bench models``: which layers' experts the CPU run places, and a
tiny Mixtral built quantized tensor by tensor."""
from __future__ import annotations

import pytest
import torch

from tgraph.bench.moe import PRESET_SCHEMES, cpu_experts_rules, quantized_moe_model
from tgraph.models.presets import PRESETS
from tgraph.rules import predict_placement


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "mixtral-8x7b"])
def test_cpu_run_places_the_first_half_of_the_layers_experts(name):
    rules = cpu_experts_rules(PRESETS[name])
    half = PRESETS[name]["num_hidden_layers"] // 2
    for layer, want in ((0, "cpu"), (half - 1, "cpu"), (half, None)):
        got = predict_placement(rules, f"model.layers.{layer}.mlp.experts.3.w1.weight")
        if want:
            assert got is not None and got.startswith(want)
        else:
            assert got is None
    assert predict_placement(rules, "model.layers.0.mlp.gate.weight") is None


def test_presets_too_large_for_bf16_name_a_scheme():
    assert set(PRESET_SCHEMES) <= set(PRESETS)


def test_quantized_mixtral_is_built_tensor_by_tensor_with_packed_experts():
    from tgraph.quant import is_quantized
    from tgraph.testing import run_greedy

    config = dict(PRESETS["mixtral-8x7b"], hidden_size=256, intermediate_size=512,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                  vocab_size=512)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, sizes = quantized_moe_model(config, "fp8", device, max_model_len=64, block_size=16)
    experts = model.model.layers[0].mlp.experts
    assert is_quantized(experts.w13.data) and experts.w13.data.qdata.dtype == torch.float8_e4m3fn
    assert sum(".experts." in n for n in sizes) == 2 * 8 * 3
    model.allocate_kv_cache(16)
    out = run_greedy(model, [[1, 2, 3, 4]], 3)
    assert len(out.generated[0]) >= 3 and all(0 <= t < 512 for t in out.generated[0])
