"""Tests of HF ``config.json`` parsing into :class:`ModelConfig`.

Configs are produced by the installed transformers (``XConfig(...).save_pretrained``, the 5.x
layout with ``rope_parameters``) and written by hand in the 4.x layout (``rope_theta`` +
``rope_scaling``), so both layouts found on the Hub are covered.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tgraph.errors import ConfigError
from tgraph.io import model_config as config_mod
from tgraph.io.model_config import (
    ModelConfig,
    parse_common_fields,
    register_config_builder,
    registered_config_builders,
)

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=100)


def hf_saved(tmp_path: Path, cls_name: str, **kwargs) -> tuple[Path, dict]:
    import transformers

    cfg = getattr(transformers, cls_name)(**{**TINY, **kwargs})
    cfg.save_pretrained(tmp_path)
    return tmp_path, json.loads((tmp_path / "config.json").read_text())


def legacy(**overrides) -> dict:
    """A transformers-4.x style llama config.json."""
    d = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "rope_theta": 500000.0,
         "rope_scaling": None, "rms_norm_eps": 1e-5, "max_position_embeddings": 8192,
         "torch_dtype": "bfloat16", "bos_token_id": 128000, "eos_token_id": [128001, 128009],
         "tie_word_embeddings": True, **TINY}
    d.update(overrides)
    return d


@pytest.fixture
def restore_builders():
    saved = list(config_mod._BUILDERS)
    yield
    config_mod._BUILDERS[:] = saved


# ------------------------------------------------------------------------------------ families
def test_llama_from_transformers_save(tmp_path):
    path, raw = hf_saved(tmp_path, "LlamaConfig", rope_theta=500000.0, attention_bias=True,
                         tie_word_embeddings=True, max_position_embeddings=4096)
    assert "rope_parameters" in raw and "rope_theta" not in raw  # the 5.x layout really is used
    c = ModelConfig.from_dir(path)
    assert (c.model_type, c.vocab_size, c.hidden_size) == ("llama", 100, 64)
    assert c.intermediate_size == 128
    assert (c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads) == (2, 4, 2)
    assert c.head_dim == 16 and c.rotary_dim == 16
    assert c.rope_theta == 500000.0 and c.rope_scaling is None and c.rope_type == "default"
    assert c.max_position_embeddings == 4096 and c.rms_norm_eps == 1e-6
    assert c.attention_bias and not c.mlp_bias and not c.qk_norm
    assert c.tie_word_embeddings and c.sliding_window is None and c.hidden_act == "silu"
    assert c.bos_token_id == 1 and c.eos_token_ids == (2,) and c.eos_token_id == 2
    assert c.hf_config == raw


def test_qwen2_defaults(tmp_path):
    path, raw = hf_saved(tmp_path, "Qwen2Config")
    assert "attention_bias" not in raw  # Qwen2 hard-codes its q/k/v biases
    c = ModelConfig.from_dir(path)
    assert c.model_type == "qwen2" and c.attention_bias is True
    assert c.sliding_window is None
    assert c.max_position_embeddings == 32768 and not c.qk_norm and c.head_dim == 16
    # 4.x Qwen2 configs carry a window that only applies with use_sliding_window.
    off = {**raw, "use_sliding_window": False, "sliding_window": 4096}
    assert ModelConfig.from_dict(off).sliding_window is None
    c = ModelConfig.from_dict({**off, "use_sliding_window": True})
    assert c.sliding_window == 4096
    with pytest.raises(ConfigError, match="sliding_window is null"):
        ModelConfig.from_dict({**raw, "use_sliding_window": True, "sliding_window": None})
    # The window applies from layer max_window_layers on (a 4.x config has no layer_types);
    # layer_types, where the config states them, win.
    legacy = {k: v for k, v in off.items() if k != "layer_types"}
    c = ModelConfig.from_dict({**legacy, "use_sliding_window": True, "max_window_layers": 1})
    assert c.layer_types == ("full_attention", "sliding_attention")
    assert (c.layer_config(0).sliding_window, c.layer_config(1).sliding_window) == (None, 4096)
    c = ModelConfig.from_dict({**legacy, "use_sliding_window": True,
                               "layer_types": ["sliding_attention", "full_attention"]})
    assert c.layer_config(0).sliding_window == 4096 and c.layer_config(1).sliding_window is None


def test_qwen3_qk_norm_and_explicit_head_dim(tmp_path):
    path, _ = hf_saved(tmp_path, "Qwen3Config", head_dim=32)
    c = ModelConfig.from_dir(path)
    assert c.qk_norm is True and c.head_dim == 32  # not hidden_size // heads == 16
    assert c.attention_bias is False
    raw = {k: v for k, v in c.hf_config.items() if k != "head_dim"}
    assert ModelConfig.from_dict(raw).head_dim == 128  # transformers' Qwen3 default


def test_mistral_sliding_window(tmp_path):
    path, raw = hf_saved(tmp_path, "MistralConfig", sliding_window=4096)
    c = ModelConfig.from_dir(path)
    assert c.model_type == "mistral" and c.sliding_window == 4096 and not c.attention_bias
    assert ModelConfig.from_dict({**raw, "sliding_window": None}).sliding_window is None
    assert ModelConfig.from_dict({**raw, "head_dim": None}).head_dim == 16


def test_legacy_layout_and_token_ids():
    c = ModelConfig.from_dict(legacy())
    assert c.rope_theta == 500000.0 and c.rope_scaling is None
    assert c.architectures == ("LlamaForCausalLM",) and c.torch_dtype == "bfloat16"
    assert c.eos_token_ids == (128001, 128009) and c.eos_token_id == 128001
    assert c.bos_token_id == 128000 and c.rms_norm_eps == 1e-5
    assert ModelConfig.from_dict(legacy(torch_dtype=None, dtype="float16")).torch_dtype == "float16"
    assert ModelConfig.from_dict(legacy(eos_token_id=None)).eos_token_id is None
    no_kv = {k: v for k, v in legacy().items() if k != "num_key_value_heads"}
    assert ModelConfig.from_dict(no_kv).num_key_value_heads == 4  # MHA when unstated


LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}


def test_rope_scaling_in_both_layouts(tmp_path):
    old = ModelConfig.from_dict(legacy(rope_scaling={"rope_type": "llama3", **LLAMA3}))
    path, raw = hf_saved(tmp_path, "LlamaConfig", max_position_embeddings=131072,
                         rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, **LLAMA3})
    new = ModelConfig.from_dir(path)
    assert raw["rope_parameters"]["rope_type"] == "llama3"
    for c in (old, new):
        assert c.rope_theta == 500000.0
        assert c.rope_scaling == {"rope_type": "llama3", **LLAMA3}  # no rope_theta inside
        assert c.rope_type == "llama3"
    # 4.x "type" key and an explicit default type
    c = ModelConfig.from_dict(legacy(rope_scaling={"type": "linear", "factor": 2.0}))
    assert c.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert ModelConfig.from_dict(legacy(rope_scaling={"rope_type": "default"})).rope_scaling is None
    # partial rotary inside rope_parameters
    c = ModelConfig.from_dict(legacy(rope_scaling=None, rope_parameters={
        "rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}))
    assert c.partial_rotary_factor == 0.5 and c.rotary_dim == 8 and c.rope_theta == 1e4
    # Phi-3 style top-level original_max_position_embeddings takes priority
    c = ModelConfig.from_dict(legacy(original_max_position_embeddings=4096,
                                     rope_scaling={"rope_type": "yarn", "factor": 4.0}))
    assert c.rope_scaling["original_max_position_embeddings"] == 4096


# -------------------------------------------------------------------------------------- errors
def test_missing_file_and_invalid_json(tmp_path):
    with pytest.raises(ConfigError, match="config.json' does not exist"):
        ModelConfig.from_dir(tmp_path)
    (tmp_path / "config.json").write_text('{\n  "model_type": "llama",\n  "hidden_size": 64,,\n}')
    with pytest.raises(ConfigError, match="line 3 column 21"):
        ModelConfig.from_dir(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="expected a JSON object, got list"):
        ModelConfig.from_dir(tmp_path / "config.json")


def test_missing_required_keys_listed_with_source(tmp_path):
    d = {k: v for k, v in legacy().items() if k not in ("vocab_size", "num_hidden_layers")}
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(ConfigError) as info:
        ModelConfig.from_dir(tmp_path)
    msg = str(info.value)
    assert "vocab_size" in msg and "num_hidden_layers" in msg and str(tmp_path) in msg


@pytest.mark.parametrize("key, value, expected", [
    ("hidden_size", "64", "'hidden_size' must be an int, got str"),
    ("num_attention_heads", 4.0, "'num_attention_heads' must be an int, got float"),
    ("num_hidden_layers", True, "'num_hidden_layers' must be an int, got bool"),
    ("vocab_size", 0, "'vocab_size' must be >= 1"),
    ("rms_norm_eps", "1e-6", "'rms_norm_eps' must be a number"),
    ("tie_word_embeddings", "yes", "'tie_word_embeddings' must be true or false"),
    ("rope_theta", -1.0, "'rope_theta' must be a positive number"),
    ("rope_scaling", [1], "'rope_scaling' must be an object or null"),
    ("eos_token_id", "</s>", "'eos_token_id' must be an int, a list of ints or null"),
    ("architectures", "LlamaForCausalLM", "'architectures' must be a list of strings"),
    ("num_key_value_heads", 3, r"multiple of num_key_value_heads \(3\)"),
    ("hidden_size", 66, "hidden_size \\(66\\) is not divisible by num_attention_heads"),
])
def test_wrong_types_and_values(key, value, expected):
    d = legacy(**{key: value})
    if key == "hidden_size" and value == 66:
        d.pop("head_dim", None)
    with pytest.raises(ConfigError, match=expected):
        ModelConfig.from_dict(d)


def test_unknown_or_missing_model_type():
    with pytest.raises(ConfigError) as info:
        ModelConfig.from_dict(legacy(model_type="gpt2"))
    msg = str(info.value)
    assert "'gpt2'" in msg
    assert all(name in msg for name in ("llama", "qwen2", "qwen3", "mistral"))
    with pytest.raises(ConfigError, match="'model_type' must be a string.*supported: llama"):
        ModelConfig.from_dict({k: v for k, v in legacy().items() if k != "model_type"})


def test_per_layer_rope_parameters_refused():
    d = legacy(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    with pytest.raises(ConfigError, match="per-layer-type"):
        ModelConfig.from_dict(d)


# ------------------------------------------------------------------------------------- registry
def test_register_custom_and_specialized_builders(restore_builders):
    def build_tiny(d):
        fields = parse_common_fields(d, {"intermediate_size": 4 * d["hidden_size"]})
        return ModelConfig(**fields)

    d = legacy(model_type="tiny")
    del d["intermediate_size"]
    register_config_builder("tiny", lambda d: d.get("model_type") == "tiny", build_tiny)
    assert registered_config_builders()[-1] == "tiny"
    c = ModelConfig.from_dict(d)
    assert c.intermediate_size == 256 and c.hf_config["model_type"] == "tiny"

    # `first=True` lets a specialization win over the built-in llama builder.
    def build_biased(d):
        return ModelConfig(**{**parse_common_fields(d), "mlp_bias": True})

    def is_biased(d):
        return d.get("model_type") == "llama" and "BiasedLlama" in d.get("architectures", [])

    register_config_builder("llama-mlp-bias", is_biased, build_biased, first=True)
    assert registered_config_builders()[0] == "llama-mlp-bias"
    assert ModelConfig.from_dict(legacy(architectures=["BiasedLlama"])).mlp_bias is True
    assert ModelConfig.from_dict(legacy()).mlp_bias is False

    # Re-registering a name replaces it in place.
    n = len(registered_config_builders())
    register_config_builder("tiny", lambda d: False, build_tiny)
    assert len(registered_config_builders()) == n
    with pytest.raises(ConfigError, match="unsupported model_type 'tiny'"):
        ModelConfig.from_dict(d)


def test_builder_errors_name_the_builder(restore_builders):
    register_config_builder("broken", lambda d: d.get("model_type") == "broken",
                            lambda d: ModelConfig(**parse_common_fields({})))
    with pytest.raises(ConfigError, match=r"\(broken config\): missing required keys"):
        ModelConfig.from_dict(legacy(model_type="broken"))


YARN = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8192,
        "attention_factor": 1.2079441541679836, "beta_fast": 32, "beta_slow": 1}


def olmo3_hub(**overrides) -> dict:
    """OLMo-3-7B's config.json layout: rope_theta and a YaRN rope_scaling, typed layers."""
    return {"architectures": ["Olmo3ForCausalLM"], "model_type": "olmo3", "rope_theta": 500000.0,
            "rope_scaling": YARN, "sliding_window": 4096, "max_position_embeddings": 65536,
            "layer_types": ["sliding_attention", "full_attention"], **TINY, **overrides}


def test_olmo3_scales_only_the_full_layers_rope(tmp_path):
    """As transformers converts the hub's layout: YaRN on the full-attention layers, the sliding
    ones plain RoPE of the same theta and a window; the saved 5.x layout reads the same."""
    c = ModelConfig.from_dict(olmo3_hub())
    assert c.layer_types == ("sliding_attention", "full_attention")
    sliding, full = c.layer_config(0), c.layer_config(1)
    assert (sliding.sliding_window, sliding.rope_theta, sliding.rope_scaling) == (4096, 5e5, None)
    assert full.sliding_window is None and full.rope_type == "yarn"
    assert full.rope_scaling["factor"] == 8.0 and full.rope_theta == 5e5
    _, saved = hf_saved(tmp_path, "Olmo3Config", rope_theta=500000.0, rope_scaling=YARN,
                        layer_types=["sliding_attention", "full_attention"])
    assert isinstance(saved["rope_parameters"]["full_attention"], dict)
    c5 = ModelConfig.from_dict(saved)
    assert c5.layer_config(1).rope_scaling == full.rope_scaling
    assert c5.layer_config(0).rope_scaling is None


def test_olmo3_default_layer_types_and_refusals():
    c = ModelConfig.from_dict({**olmo3_hub(num_hidden_layers=8), "layer_types": None})
    assert c.layer_types == ("sliding_attention",) * 3 + ("full_attention",) + \
        ("sliding_attention",) * 3 + ("full_attention",)
    with pytest.raises(ConfigError, match="layer_types must name one of .* each of the 2 layers"):
        ModelConfig.from_dict(olmo3_hub(layer_types=["sliding_attention"]))
    with pytest.raises(ConfigError, match="layer_types must name one of"):
        ModelConfig.from_dict(olmo3_hub(layer_types=["sliding_attention", "chunked"]))
    with pytest.raises(ConfigError, match="sliding_window is null"):
        ModelConfig.from_dict(olmo3_hub(sliding_window=None))
    with pytest.raises(ConfigError, match="unknown layer types .*'local'"):
        ModelConfig.from_dict(olmo3_hub(rope_parameters={"local": {"rope_theta": 1.0}}))


def gemma3_hub(**overrides) -> dict:
    """Gemma-3-4B's text config layout: global rope_theta with linear scaling, the local base
    in rope_local_base_freq, a window pattern instead of layer_types."""
    return {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
            "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
            "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "sliding_window": 1024,
            "sliding_window_pattern": 6, "query_pre_attn_scalar": 256, "head_dim": 256,
            "hidden_activation": "gelu_pytorch_tanh", "final_logit_softcapping": None,
            "attn_logit_softcapping": None, **{**TINY, "num_hidden_layers": 12}, **overrides}


def test_gemma3_local_and_global_rope_and_refusals(tmp_path):
    c = ModelConfig.from_dict(gemma3_hub())
    assert c.layer_types == (("sliding_attention",) * 5 + ("full_attention",)) * 2
    assert c.hidden_act == "gelu_pytorch_tanh" and c.tie_word_embeddings and c.head_dim == 256
    local, full = c.layer_config(0), c.layer_config(5)
    assert (local.sliding_window, local.rope_theta, local.rope_scaling) == (1024, 1e4, None)
    assert (full.sliding_window, full.rope_theta) == (None, 1e6)
    assert full.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    _, saved = hf_saved(tmp_path, "Gemma3TextConfig", **{
        k: v for k, v in gemma3_hub().items() if k not in ("architectures", "model_type")})
    c5 = ModelConfig.from_dict(saved)
    assert c5.layer_types == c.layer_types and c5.sliding_rope == c.sliding_rope
    assert c5.layer_config(5).rope_scaling == full.rope_scaling
    with pytest.raises(ConfigError, match="final_logit_softcapping = 30.0 is not supported"):
        ModelConfig.from_dict(gemma3_hub(final_logit_softcapping=30.0))
    with pytest.raises(ConfigError, match="use_bidirectional_attention"):
        ModelConfig.from_dict(gemma3_hub(use_bidirectional_attention=True))
    # a vision-language config without its language model's
    with pytest.raises(ConfigError, match="text_config.*an object"):
        ModelConfig.from_dict({"model_type": "gemma3", "vision_config": {}})
