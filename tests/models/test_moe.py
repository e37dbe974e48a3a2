"""Mixture-of-experts beyond family parity (tests/models/test_families.py runs Qwen3-MoE,
Qwen2-MoE and Mixtral against transformers): the ``moe`` op against a per-token loop, experts
placed on a second device by rules (the CPU two-device simulation: results must be bit for bit
the single-device run's), the shipped CPU-experts rules, and bad MoE configs and checkpoints.
"""
from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch

from tgraph.errors import ConfigError, WeightLoadError
from tgraph.ir.ops.moe import moe_reference, route
from tgraph.rules import load_rules, predict_placement
from tgraph.testing import make_tiny_hf_model, run_greedy

RULES_DIR = Path(__file__).parents[2] / "configs" / "rules"
MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 48,
       "norm_topk_prob": True, "head_dim": 32, "mlp_only_layers": [1]}


@pytest.mark.parametrize("renormalize", [True, False])
def test_moe_op_is_the_per_token_sum_of_its_top_k_experts(renormalize):
    g = torch.Generator().manual_seed(0)
    t, h, i, e, k = 7, 16, 12, 5, 3
    x, logits = torch.randn(t, h, generator=g), torch.randn(t, e, generator=g)
    w13, w2 = torch.randn(e, 2 * i, h, generator=g), torch.randn(e, h, i, generator=g)
    got = moe_reference(x, logits, w13, w2, top_k=k, renormalize=renormalize)
    probs = torch.softmax(logits, -1)
    for tok in range(t):
        top = torch.topk(probs[tok], k)
        weights = top.values / top.values.sum() if renormalize else top.values
        want = torch.zeros(h)
        for w, ex in zip(weights, top.indices):
            gu = w13[ex] @ x[tok]
            want += w * (w2[ex] @ (torch.nn.functional.silu(gu[:i]) * gu[i:]))
        torch.testing.assert_close(got[tok], want, rtol=1e-5, atol=1e-5)
    weights, ids = route(logits, k, renormalize)
    assert ids.shape == (t, k) and weights.dtype == torch.float32


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_hf_model("qwen3_moe", tmp_path_factory.mktemp("moe"), seed=3, **MOE)


def _load(path: Path, rules=None, **options):
    from tgraph.models import load_model

    options = {"device": "cpu", "dtype": "float32", "max_model_len": 32, "block_size": 4,
               **options}
    model = load_model(path, rules=rules, **options)
    model.allocate_kv_cache(24)
    return model


def _experts_rule(layers: str) -> list[dict]:
    return [{"match": {"name": rf"^model\.layers\.({layers})\.mlp\.experts$"},
             "replace": {"class": "default", "kwargs": {"device": "cpu:1"}}}]


@pytest.mark.parametrize("graph", ["static", "eager"])
@pytest.mark.parametrize("layers", ["0|2", "2"], ids=["every sparse layer", "one layer"])
def test_experts_on_a_second_device_give_identical_logits(moe_dir, graph, layers):
    prompts = [[1, 5, 9, 22, 7], [3, 4, 100]]
    ref_model = _load(moe_dir, graph=graph)
    ref = run_greedy(ref_model, prompts, 3)
    model = _load(moe_dir, _experts_rule(layers), graph=graph)
    moved = [int(n) for n in layers.split("|")]
    for idx, layer in enumerate(model.model.layers):
        if idx == 1:  # mlp_only_layers: a dense MLP, no experts
            assert not hasattr(layer.mlp, "experts")
            continue
        want = "cpu:1" if idx in moved else "cpu:0"  # cpu:0: the model's device
        assert layer.mlp.experts.placement == want
        assert layer.mlp.gate.placement == "cpu:0" and layer.self_attn.placement == "cpu:0"
    got = run_greedy(model, prompts, 3)
    for a, b in zip(got.prefill_logits + got.step_logits, ref.prefill_logits + ref.step_logits):
        assert torch.equal(a, b)  # copies are exact and every kernel runs on the same numbers
    assert got.generated == ref.generated
    if graph == "static":
        assert any("to_device cpu:0 -> cpu:1" in str(e) for e in model.engines.values())
        for single, placed in zip(_ops(ref_model), _ops(model)):
            # MoeAddRmsNorm fuses the combine into the norm after it, never across a device
            # boundary: a moved layer keeps its moe op (its output crosses back first).
            assert single["moe_add_rms_norm"] == 2 and single["moe"] == 0
            assert placed["moe"] == len(moved) and placed["moe_add_rms_norm"] == 2 - len(moved)


def _ops(model) -> list[Counter]:
    return [Counter(n.op for n in e.net.nodes) for _, e in sorted(model.engines.items())]


def test_shipped_rules_put_every_layers_experts_on_the_cpu():
    rules = load_rules(RULES_DIR / "moe_experts_on_cpu.yaml")
    assert predict_placement(rules, "model.layers.17.mlp.experts.3.gate_proj.weight") == "cpu:0"
    assert predict_placement(rules, "model.layers.17.mlp.gate.weight") is None
    assert predict_placement(rules, "model.layers.17.self_attn.q_proj.weight") is None


def _edit(src: Path, dst: Path, **config) -> Path:
    shutil.copytree(src, dst)
    path = dst / "config.json"
    data = json.loads(path.read_text())
    data.update(config)
    path.write_text(json.dumps(data))
    return dst


def test_bad_moe_configs_are_refused(moe_dir, tmp_path):
    with pytest.raises(ConfigError, match=r"num_experts_per_tok \(9\) must be between 1 and "
                                          r"the 4 experts"):
        _load(_edit(moe_dir, tmp_path / "k", num_experts_per_tok=9))
    with pytest.raises(ConfigError, match=r"'mlp_only_layers' must be a list of layer indices"):
        _load(_edit(moe_dir, tmp_path / "dense", mlp_only_layers="all"))


@pytest.mark.parametrize("clip", [-1.0, "8", True])
def test_a_bad_olmoe_clip_qkv_is_refused(tiny_model, tmp_path, clip):
    with pytest.raises(ConfigError, match=r"olmoe: 'clip_qkv' must be a positive number or null, "
                                          rf"got {clip!r}"):
        _load(_edit(tiny_model("olmoe").path, tmp_path / "clip", clip_qkv=clip))


def test_a_missing_expert_is_named(moe_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    dst = shutil.copytree(moe_dir, tmp_path / "missing")
    weights = load_file(str(dst / "model.safetensors"))
    del weights["model.layers.2.mlp.experts.3.up_proj.weight"]
    save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(WeightLoadError, match=r"model\.layers\.2\.mlp\.experts\.3\.up_proj"):
        _load(dst)


@pytest.mark.parametrize("family, overrides", [
    ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    ("qwen2_moe", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 48,
                   "shared_expert_intermediate_size": 80}),
    ("olmoe", {"num_experts": 4, "num_experts_per_tok": 2}),
])
def test_transformers_in_memory_state_dicts_load_too(family, overrides):
    """transformers 5 holds experts stacked (``experts.gate_up_proj``) and Mixtral's block as
    ``mlp`` in memory; a model built from ``state_dict()`` decodes as the saved checkpoint."""
    from tgraph.io.model_config import ModelConfig
    from tgraph.io.weights import DictWeightLoader
    from tgraph.models.loading import build_model
    from tgraph.testing import hf_greedy, random_hf_model

    hf = random_hf_model(family, seed=1, **overrides)
    state = hf.state_dict()
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
    model = build_model(ModelConfig.from_dict(hf.config.to_dict()),
                        DictWeightLoader(state, device="cpu", dtype=torch.float32),
                        max_model_len=64, block_size=4)
    model.allocate_kv_cache(64)
    prompts = [[1, 5, 9, 22, 7], [3, 4, 100]]
    got = run_greedy(model, prompts, 4).generated
    assert [g[:4] for g in got] == hf_greedy(hf, prompts, 4)


@pytest.mark.parametrize("packed", [True, False])
def test_quantized_experts_stay_packed_and_decode_as_their_values(moe_dir, packed):
    """Experts held as int8 codes stay packed (flat ``[E * 2I, H]`` quantized weights) and the
    model decodes exactly as one built from the dequantized tensors; with one expert dense the
    block cannot stay packed and is dequantized at load, with the same logits."""
    from safetensors.torch import load_file

    from tgraph.io.model_config import ModelConfig
    from tgraph.io.weights import DictWeightLoader
    from tgraph.models.loading import build_model
    from tgraph.quant import is_quantized, quantize

    weights = load_file(str(moe_dir / "model.safetensors"))
    config = ModelConfig.from_dir(moe_dir)
    quantized = {n: quantize(w, "int8", 16, name=n) for n, w in weights.items()
                 if ".mlp.experts." in n}
    if not packed:
        quantized.pop(next(n for n in quantized if ".experts.0.up_proj" in n))
    dense = {n: quantized[n].dequantize() if n in quantized else w for n, w in weights.items()}
    q_loader = DictWeightLoader({n: w for n, w in weights.items() if n not in quantized})
    for name, q in quantized.items():
        q_loader.register_quantized(name, q.shape, lambda q=q: q)
    prompts = [[1, 5, 9, 22, 7], [3, 4, 100]]
    runs = []
    for loader in (q_loader, DictWeightLoader(dense)):
        model = build_model(config, loader, max_model_len=32, block_size=4)
        model.allocate_kv_cache(24)
        runs.append(run_greedy(model, prompts, 3))
        if loader is q_loader:
            experts = model.model.layers[0].mlp.experts
            assert is_quantized(experts.w13.data) == packed
            assert ("int8" in repr(experts)) == packed
    for a, b in zip(runs[0].prefill_logits + runs[0].step_logits,
                    runs[1].prefill_logits + runs[1].step_logits):
        assert torch.equal(a, b)
