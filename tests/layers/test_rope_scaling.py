"""RoPE frequencies and cos/sin tables against transformers' own implementation.

Tolerances: inverse frequencies follow the same fp32 formulas as transformers, so they must agree
to fp32 rounding (rtol 1e-6). cos/sin are taken at arguments ``position * inv_freq`` up to ~64 rad,
where one fp32 ulp is ~7.6e-6, so a different but valid evaluation order may move them by ~1e-5.
"""
from __future__ import annotations

import math

import pytest
import torch

from tgraph.errors import ConfigError
from tgraph.io.model_config import ModelConfig
from tgraph.layers.rope_scaling import SUPPORTED_ROPE_TYPES, cos_sin_table, rope_inv_freq

MAX_POS = 32
HEAD_DIM = 32

SCALINGS = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    "yarn_mscale": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                    "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 16, "beta_slow": 2},
    "longrope": {"rope_type": "longrope", "original_max_position_embeddings": 16,
                 "short_factor": [1.0 + 0.05 * i for i in range(HEAD_DIM // 2)],
                 "long_factor": [1.5 + 0.25 * i for i in range(HEAD_DIM // 2)]},
}


def hf_config(scaling, rope_theta=10000.0, partial=None):
    from transformers import LlamaConfig

    params = {"rope_type": "default", **(scaling or {}), "rope_theta": rope_theta}
    if partial is not None:
        params["partial_rotary_factor"] = partial
    return LlamaConfig(hidden_size=4 * HEAD_DIM, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=64, vocab_size=32, num_hidden_layers=1,
                       max_position_embeddings=MAX_POS, rope_parameters=params)


def hf_inv_freq(hf, rope_type, seq_len=None):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    if rope_type == "default":
        return LlamaRotaryEmbedding.compute_default_rope_parameters(hf)
    return ROPE_INIT_FUNCTIONS[rope_type](hf, None, seq_len)


@pytest.mark.parametrize("case", list(SCALINGS))
@pytest.mark.parametrize("seq_len", [None, 8, MAX_POS, 3 * MAX_POS])
def test_inv_freq_matches_transformers(case, seq_len):
    hf = hf_config(SCALINGS[case], rope_theta=50000.0)
    config = ModelConfig.from_dict(hf.to_dict())
    rope_type = config.rope_type
    ours, scale = rope_inv_freq(config, seq_len)
    ref, ref_scale = hf_inv_freq(hf, rope_type, seq_len)
    assert ours.dtype == torch.float32 and ours.shape == (HEAD_DIM // 2,)
    torch.testing.assert_close(ours, ref.float(), rtol=1e-6, atol=0)
    assert scale == pytest.approx(ref_scale, rel=1e-12)
    if case != "default":
        # Guards the comparison: every scaled variant must differ from plain RoPE somewhere.
        plain, _ = rope_inv_freq(ModelConfig.from_dict(hf_config(None, 50000.0).to_dict()))
        if not (case == "dynamic" and (seq_len or 0) <= MAX_POS):
            assert not torch.allclose(ours, plain, rtol=1e-3, atol=0)


def test_dynamic_depends_on_seq_len_only_past_max_positions():
    config = ModelConfig.from_dict(hf_config(SCALINGS["dynamic"]).to_dict())
    default, _ = rope_inv_freq(ModelConfig.from_dict(hf_config(None).to_dict()))
    torch.testing.assert_close(rope_inv_freq(config, MAX_POS)[0], default, rtol=1e-6, atol=0)
    longer, longest = rope_inv_freq(config, 2 * MAX_POS)[0], rope_inv_freq(config, 4 * MAX_POS)[0]
    assert (longer[1:] < default[1:]).all() and (longest[1:] < longer[1:]).all()
    assert longer[0] == default[0] == 1.0  # frequency 0 is base**0 whatever the base


@pytest.mark.parametrize("case", ["linear", "llama3", "yarn"])
def test_partial_rotary(case):
    hf = hf_config(SCALINGS[case], partial=0.5)
    config = ModelConfig.from_dict(hf.to_dict())
    assert config.rotary_dim == HEAD_DIM // 2
    ours, scale = rope_inv_freq(config)
    ref, ref_scale = hf_inv_freq(hf, case)
    assert ours.shape == (HEAD_DIM // 4,)
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=0)
    assert scale == pytest.approx(ref_scale)


def test_legacy_layout_gives_same_frequencies():
    new = ModelConfig.from_dict(hf_config(SCALINGS["llama3"], rope_theta=5e5).to_dict())
    raw = {k: v for k, v in new.hf_config.items() if k != "rope_parameters"}
    old = ModelConfig.from_dict({**raw, "rope_theta": 5e5, "rope_scaling": {
        "type": "llama3", **{k: v for k, v in SCALINGS["llama3"].items() if k != "rope_type"}}})
    assert torch.equal(rope_inv_freq(old)[0], rope_inv_freq(new)[0])


@pytest.mark.parametrize("case", ["default", "linear", "dynamic", "llama3", "yarn", "longrope"])
def test_cos_sin_table_matches_hf_rotary_embedding(case):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    hf = hf_config(SCALINGS[case])
    config = ModelConfig.from_dict(hf.to_dict())
    # Past max_position_embeddings HF recomputes dynamic/longrope frequencies for that length.
    num_pos = 2 * MAX_POS
    inv_freq, scale = rope_inv_freq(config, seq_len=num_pos)
    cos, sin = cos_sin_table(inv_freq, num_pos, scale)
    assert cos.shape == sin.shape == (num_pos, HEAD_DIM // 2) and cos.dtype == torch.float32

    x = torch.zeros(1, num_pos, HEAD_DIM)
    ref_cos, ref_sin = LlamaRotaryEmbedding(hf)(x, torch.arange(num_pos)[None])
    half = HEAD_DIM // 2
    for ours, ref in ((cos, ref_cos[0]), (sin, ref_sin[0])):
        torch.testing.assert_close(ours, ref[:, :half], rtol=0, atol=1e-5)
        torch.testing.assert_close(ours, ref[:, half:], rtol=0, atol=1e-5)  # rotate_half layout


def test_cos_sin_table_values_and_scaling():
    inv_freq = torch.tensor([1.0, 0.5, 0.25])
    cos, sin = cos_sin_table(inv_freq, 5, attention_scaling=2.0)
    pos = torch.arange(5, dtype=torch.float64)[:, None]
    ref = pos * inv_freq.double()
    torch.testing.assert_close(cos.double(), 2 * ref.cos(), rtol=0, atol=1e-6)
    torch.testing.assert_close(sin.double(), 2 * ref.sin(), rtol=0, atol=1e-6)
    assert cos[0].tolist() == [2.0, 2.0, 2.0] and sin[0].tolist() == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="1-D tensor"):
        cos_sin_table(inv_freq[None], 5)
    with pytest.raises(ValueError, match="max_positions"):
        cos_sin_table(inv_freq, 0)


def test_bad_rope_configs():
    base = hf_config(None).to_dict()
    config = ModelConfig.from_dict({**base, "rope_parameters": {"rope_type": "mrope",
                                                                 "rope_theta": 1e4}})
    with pytest.raises(ConfigError) as info:
        rope_inv_freq(config)
    assert "'mrope'" in str(info.value)
    assert all(t in str(info.value) for t in SUPPORTED_ROPE_TYPES)
    config = ModelConfig.from_dict({**base, "rope_parameters": {"rope_type": "linear",
                                                                 "rope_theta": 1e4}})
    with pytest.raises(ConfigError, match="'linear' needs 'factor'"):
        rope_inv_freq(config)
    config = ModelConfig.from_dict({**base, "rope_parameters": {
        "rope_type": "longrope", "rope_theta": 1e4, "original_max_position_embeddings": 16,
        "short_factor": [1.0, 2.0], "long_factor": [1.0, 2.0]}})
    with pytest.raises(ConfigError, match="must have 16 entries"):
        rope_inv_freq(config)
    with pytest.raises(ValueError, match="seq_len"):
        rope_inv_freq(ModelConfig.from_dict(base), seq_len=0)


def test_yarn_attention_scaling_formula():
    # Independent of transformers: YaRN's default attention factor is 0.1 * ln(factor) + 1.
    config = ModelConfig.from_dict(hf_config(SCALINGS["yarn"]).to_dict())
    assert rope_inv_freq(config)[1] == pytest.approx(0.1 * math.log(4.0) + 1.0)


@pytest.mark.gpu
def test_cos_sin_table_on_cuda_llama3_8b_shapes():
    # Llama-3.1-8B rope: head_dim 128, theta 5e5, llama3 scaling, an 8192-position table.
    from transformers import LlamaConfig

    hf = LlamaConfig(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                     intermediate_size=14336, vocab_size=128256, num_hidden_layers=1,
                     max_position_embeddings=131072, rope_parameters={
                         "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192})
    inv_freq, scale = rope_inv_freq(ModelConfig.from_dict(hf.to_dict()))
    cos, sin = cos_sin_table(inv_freq.cuda(), 8192, scale)
    ref_cos, ref_sin = cos_sin_table(inv_freq, 8192, scale)
    assert cos.device.type == "cuda" and cos.shape == (8192, 64)
    # Same fp32 arguments on both devices; cos/sin libraries differ by a few ulp of the result.
    torch.testing.assert_close(cos.cpu(), ref_cos, rtol=0, atol=1e-5)
    torch.testing.assert_close(sin.cpu(), ref_sin, rtol=0, atol=1e-5)
