"""Quantized weights through a whole model: a tiny Llama whose linears (and embedding) are held
quantized gives the logits of the same model built from the dequantized weights, in the eager
mode, the static mode on the reference kernels, and the static mode on the Triton kernels (the
interpreter); the passes keep working on it (norm fused into the quantized linear, q|k|v merged
where the schemes agree) and rules choose how a quantized linear runs.

Tolerance: ``1e-4 * max|logit|`` as in tests/models: both sides compute in fp32 on the same fp32
weight values (the dequantized weights are exact), so they differ by summation order only.
"""
from __future__ import annotations

import pytest
import torch

from tests.helpers import build_with_triton_backend
from tgraph.io.model_config import ModelConfig
from tgraph.io.weights import DictWeightLoader
from tgraph.models.loading import build_model
from tgraph.quant import is_quantized, quantize
from tgraph.testing import PagedBatcher, random_hf_model

REL_TOL = 1e-4
PROMPTS = [[3, 17, 42, 5, 9], [101, 7]]
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _schemes(name: str, mixed: bool) -> tuple[str, int | None, bool]:
    if mixed and name.endswith("v_proj.weight"):
        return ("int8", 16, True)  # v quantized unlike q and k: the packed layer keeps parts
    if name.endswith(("gate_proj.weight", "up_proj.weight")):
        return ("fp8", None, False)
    if name.endswith("down_proj.weight"):
        return ("int8", 32, False)
    return ("int4", 16, True)


@pytest.fixture(scope="module")
def tiny_llama():
    hf = random_hf_model("llama", seed=3)
    return hf.config.to_dict(), {k: v.detach().clone() for k, v in hf.state_dict().items()}


def _loaders(tiny_llama, mixed=False):
    config, weights = tiny_llama
    quantized = {}
    for name, w in weights.items():
        if any(name.endswith(f"{lin}.weight") for lin in LINEARS) or name.endswith(
                "embed_tokens.weight"):
            kind, group, offsets = ("int8", 32, False) if "embed" in name else _schemes(name,
                                                                                       mixed)
            quantized[name] = quantize(w, kind, group, offsets, name=name)
    dense = {n: (quantized[n].dequantize() if n in quantized else w) for n, w in weights.items()}
    q_loader = DictWeightLoader(weights)
    for name, q in quantized.items():
        q_loader.register_quantized(name, q.shape, lambda q=q: q)
    return ModelConfig.from_dict(config), q_loader, DictWeightLoader(dense), quantized


def _logits(model) -> list[torch.Tensor]:
    model.allocate_kv_cache(16)
    b = PagedBatcher.for_model(model)
    ids = [b.add(p) for p in PROMPTS]
    out = [model.run(b.step(ids, all_logits=True)).clone()]
    for _ in range(2):
        for i, s in enumerate(ids):
            b.append(s, int(out[-1][-len(PROMPTS) + i].argmax()) if len(out) > 1 else 1)
        out.append(model.run(b.step(ids)).clone())
    return out


def _assert_close(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for g, w in zip(got, want):
        err = float((g - w).abs().max() / w.abs().max())
        assert err <= REL_TOL, f"relative error {err:.2e} > {REL_TOL}"


@pytest.mark.parametrize("mode", ["eager", "static-reference", "static-triton"])
@pytest.mark.parametrize("mixed", [False, True], ids=["q|k|v alike", "v unlike"])
def test_quantized_model_matches_its_dequantized_twin(tiny_llama, monkeypatch, mode, mixed):
    if mode == "static-triton":
        build_with_triton_backend(monkeypatch)
    config, q_loader, d_loader, quantized = _loaders(tiny_llama, mixed)
    graph = "eager" if mode == "eager" else "static"
    qmodel = build_model(config, q_loader, max_model_len=64, graph=graph, block_size=4)
    dmodel = build_model(config, d_loader, max_model_len=64, graph=graph, block_size=4)
    _assert_close(_logits(qmodel), _logits(dmodel))
    held = {n: p.data for n, p in qmodel.named_parameters() if p.data is not None}
    linears = [n for n in held if "proj.weight" in n or "embed_tokens" in n]
    assert linears and all(is_quantized(held[n]) for n in linears)  # none dequantized at load
    qkv = qmodel.model.layers[0].self_attn.qkv_proj
    assert qkv.num_parts == (3 if mixed else 1)


def test_passes_fuse_around_quantized_linears(tiny_llama):
    config, q_loader, _, _ = _loaders(tiny_llama, mixed=True)
    model = build_model(config, q_loader, max_model_len=64, block_size=4)
    _logits(model)
    decode = model.engines[(False, ())]
    matches = {r.name: r.matches for r in decode.stats.passes}
    # The norm moves into the quantized q (and k, v) and gate|up linears; q, k and v are not
    # merged into one linear because v's scheme differs (q and k are: they agree).
    assert matches["NormLinear"] > 0
    ops = [n.op for n in decode.net.nodes]
    assert "norm_linear" in ops
    linear_weights = [n.inputs[1].name for n in decode.net.nodes if n.op in ("linear",
                      "norm_linear", "linear_epilogue")]
    assert not any("v_proj" in w and "q_proj" in w for w in linear_weights)


@pytest.mark.parametrize("quant", ["reference", "dense"])
def test_rules_choose_how_a_quantized_linear_runs(tiny_llama, monkeypatch, quant):
    from tgraph.rules import apply_rules, load_rules

    build_with_triton_backend(monkeypatch)
    config, q_loader, d_loader, _ = _loaders(tiny_llama)
    model = build_model(config, q_loader, max_model_len=64, block_size=4)
    apply_rules(model, load_rules([{"match": {"name": r"mlp\.down_proj$"},
                                    "replace": {"class": "default", "kwargs": {"quant": quant}}}]))
    down = model.model.layers[0].mlp.down_proj
    assert is_quantized(down.weight.data) == (quant == "reference")
    dmodel = build_model(config, d_loader, max_model_len=64, block_size=4)
    _assert_close(_logits(model), _logits(dmodel))
    text = str(model.engines[(False, ())])
    if quant == "reference":  # the kernel registry's entry for impl="reference"
        assert "torch.linear" in text
    linears = [n for n in model.engines[(False, ())].net.nodes
               if n.op == "linear" and n.attrs.get("impl") == "reference"]
    assert len(linears) == (config.num_hidden_layers if quant == "reference" else 0)


def test_a_bad_quant_mode_is_refused_before_loading():
    from tgraph.errors import ConfigError
    from tgraph.rules import load_rules

    with pytest.raises(ConfigError, match="quant must be one of"):
        load_rules([{"match": {"name": "down_proj$", "class": "tgraph.layers.linear.LinearBase"},
                     "replace": {"class": "default", "kwargs": {"quant": "fast"}}}])


def test_the_engine_names_each_quantized_kernel_with_its_scheme(tiny_llama):
    config, q_loader, _, _ = _loaders(tiny_llama, mixed=True)
    model = build_model(config, q_loader, max_model_len=64, block_size=4)
    _logits(model)
    text = str(model.engines[(False, ())])
    assert "[int4 g16 offsets]" in text and "[int8 g16 offsets]" in text
    assert "[fp8 channel]" in text and "[int8 g32 sym]" in text


def test_the_example_rules_file(tiny_llama):
    from pathlib import Path

    from tgraph.rules import apply_rules, load_rules

    rules = load_rules(Path(__file__).resolve().parents[2] / "configs/rules/quantized.yaml")
    config, q_loader, d_loader, _ = _loaders(tiny_llama)
    model = build_model(config, q_loader, max_model_len=64, block_size=4)
    apply_rules(model, rules)
    assert not is_quantized(model.lm_head.weight.data)  # exact logits
    assert is_quantized(model.model.layers[0].mlp.down_proj.weight.data)
    dmodel = build_model(config, d_loader, max_model_len=64, block_size=4)
    _assert_close(_logits(model), _logits(dmodel))
