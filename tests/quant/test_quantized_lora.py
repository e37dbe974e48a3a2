"""LoRA on a quantized base: the base weights stay packed, the adapters' B columns live in a
dense bank of their own, and each adapted linear runs ``x @ W.T + xa @ B.T``; the result equals
the same adapters on the dequantized base (single and multi-LoRA, eager and static, the Triton
backend under the interpreter). Tolerance as in tests/models/test_lora.py (fp32, summation order
only)."""
from __future__ import annotations

import pytest

from tests.helpers import build_with_triton_backend
from tests.models.test_lora import make_adapter, run_steps
from tgraph.io.model_config import ModelConfig
from tgraph.io.weights import DictWeightLoader
from tgraph.models.loading import build_model
from tgraph.quant import is_quantized, quantize
from tgraph.testing import random_hf_model

REL_TOL = 1e-4
PROMPTS = [[3, 17, 42, 5, 9], [101, 7], [8, 8, 2]]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    hf = random_hf_model("llama", seed=7)
    path = tmp_path_factory.mktemp("qlora") / "all"
    make_adapter(hf, path, seed=11, r=4, lora_alpha=8,
                 target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                 "up_proj", "down_proj"])
    weights = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    quantized = {n: quantize(w, "int4", 16, True, name=n) for n, w in weights.items()
                 if n.endswith("proj.weight")}
    return hf.config.to_dict(), weights, quantized, path


def _model(setup, quantized_base: bool, graph: str, feature: str):
    config, weights, quantized, _ = setup
    if quantized_base:
        loader = DictWeightLoader(weights)
        for name, q in quantized.items():
            loader.register_quantized(name, q.shape, lambda q=q: q)
    else:
        loader = DictWeightLoader({n: quantized[n].dequantize() if n in quantized else w
                                   for n, w in weights.items()})
    model = build_model(ModelConfig.from_dict(config), loader, max_model_len=64, graph=graph,
                        block_size=4, features={feature: {"max_rank": 4}})
    model.allocate_kv_cache(32)
    return model


@pytest.mark.parametrize("graph", ["eager", "static", "static-triton"])
@pytest.mark.parametrize("feature", ["single_lora", "multi_lora"])
def test_adapters_on_a_quantized_base(setup, monkeypatch, graph, feature):
    if graph == "static-triton":
        build_with_triton_backend(monkeypatch)
    mode = graph.split("-")[0]
    got, want = (_model(setup, q, mode, feature) for q in (True, False))
    for model in (got, want):
        if feature == "single_lora":
            model.features[feature].load("all", setup[3])
            model.features[feature].activate("all")
        else:
            model.features[feature].load("all", setup[3])
    loras = None if feature == "single_lora" else ["all", None, "all"]
    for (_, g), (_, w) in zip(run_steps(got, PROMPTS, loras, 2), run_steps(want, PROMPTS, loras,
                                                                           2)):
        err = float((g - w).abs().max() / w.abs().max())
        assert err <= REL_TOL, err
    # The adapter matters: without it the first sequence's prefill logits move by far more.
    plain = _model(setup, True, mode, feature)
    (_, base), = run_steps(plain, PROMPTS[:1], None, 0)
    (_, adapted), = run_steps(got, PROMPTS[:1], loras[:1] if loras else None, 0)
    assert float((adapted - base).abs().max() / base.abs().max()) > 1e-2
    if feature == "single_lora":  # a delta cannot be merged into codes: recorded instead
        assert not got.features[feature].merged and want.features[feature].merged
    qkv = got.model.layers[0].self_attn.qkv_proj
    assert is_quantized(qkv.weight.data), "the base weight was dequantized"
    assert qkv.lora_bank.quantized and qkv.lora_bank.storage.shape[1] > 0
