"""Known model shapes by name (data, used by the benchmark and tests): Hugging Face config
fields of real checkpoints, for random-weight models of the real size."""
from __future__ import annotations

from typing import Any

PRESETS: dict[str, dict[str, Any]] = {
    # The CPU bench's model when its GGUF cannot be fetched (tgraph.bench.cpu).
    "smollm2-135m": dict(
        model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=49152,
        hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, rms_norm_eps=1e-5, rope_theta=100000.0,
        max_position_embeddings=8192, tie_word_embeddings=True, torch_dtype="bfloat16"),
    "llama-3.2-1b": dict(
        model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=128256,
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        max_position_embeddings=131072, tie_word_embeddings=True, torch_dtype="bfloat16"),
    "qwen2.5-0.5b": dict(
        model_type="qwen2", architectures=["Qwen2ForCausalLM"], vocab_size=151936,
        hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=1000000.0,
        max_position_embeddings=32768, tie_word_embeddings=True, torch_dtype="bfloat16",
        use_sliding_window=False),
    "llama-3-8b": dict(
        model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=128256,
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, rms_norm_eps=1e-5, rope_theta=500000.0,
        max_position_embeddings=8192, tie_word_embeddings=False, torch_dtype="bfloat16"),
    "qwen3-0.6b": dict(
        model_type="qwen3", architectures=["Qwen3ForCausalLM"], vocab_size=151936,
        hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
        max_position_embeddings=40960, tie_word_embeddings=True, torch_dtype="bfloat16"),
    "mistral-7b": dict(
        model_type="mistral", architectures=["MistralForCausalLM"], vocab_size=32000,
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, rms_norm_eps=1e-5, rope_theta=10000.0, sliding_window=4096,
        max_position_embeddings=32768, tie_word_embeddings=False, torch_dtype="bfloat16"),
    # q and k normalised over all heads, post-norm layers.
    "olmo-2-7b": dict(
        model_type="olmo2", architectures=["Olmo2ForCausalLM"], vocab_size=100352,
        hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=32, rms_norm_eps=1e-6, rope_theta=500000.0,
        max_position_embeddings=4096, tie_word_embeddings=False, torch_dtype="bfloat16"),
    # Five sliding layers (512) to one global; head_dim 256 with one KV head.
    "gemma-3-1b": dict(
        model_type="gemma3_text", architectures=["Gemma3ForCausalLM"], vocab_size=262144,
        hidden_size=1152, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256, sliding_window=512,
        sliding_window_pattern=6, rope_theta=1000000.0, rope_local_base_freq=10000.0,
        hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6, max_position_embeddings=32768,
        tie_word_embeddings=True, torch_dtype="bfloat16"),
    # Tensor-parallel shapes (tgraph.bench.tp): 141 GB and 145 GB in bf16, more than one GPU.
    "llama-3-70b": dict(
        model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=128256,
        hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
        num_key_value_heads=8, rms_norm_eps=1e-5, rope_theta=500000.0,
        max_position_embeddings=8192, tie_word_embeddings=False, torch_dtype="bfloat16"),
    "qwen2.5-72b": dict(
        model_type="qwen2", architectures=["Qwen2ForCausalLM"], vocab_size=152064,
        hidden_size=8192, intermediate_size=29568, num_hidden_layers=80, num_attention_heads=64,
        num_key_value_heads=8, rms_norm_eps=1e-6, rope_theta=1000000.0,
        max_position_embeddings=32768, tie_word_embeddings=False, torch_dtype="bfloat16"),
    # Mixture of experts: 128 experts of 768, 8 per token (3.3B of 30.5B parameters active).
    "qwen3-30b-a3b": dict(
        model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], vocab_size=151936,
        hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
        num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=40960,
        tie_word_embeddings=False, torch_dtype="bfloat16"),
    # 64 experts of 1024, 8 per token, not renormalised (1.3B of 6.9B parameters active).
    "olmoe-1b-7b": dict(
        model_type="olmoe", architectures=["OlmoeForCausalLM"], vocab_size=50304,
        hidden_size=2048, intermediate_size=1024, num_experts=64, num_experts_per_tok=8,
        norm_topk_prob=False, num_hidden_layers=16, num_attention_heads=16,
        num_key_value_heads=16, rms_norm_eps=1e-5, rope_theta=10000.0, clip_qkv=None,
        max_position_embeddings=4096, tie_word_embeddings=False, torch_dtype="bfloat16"),
    # 8 experts of 14336, 2 per token (12.9B of 46.7B parameters active): 93 GB in bf16, so its
    # bench runs in FP8 (tgraph.bench.moe.PRESET_SCHEMES).
    "mixtral-8x7b": dict(
        model_type="mixtral", architectures=["MixtralForCausalLM"], vocab_size=32000,
        hidden_size=4096, intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        rms_norm_eps=1e-5, rope_theta=1000000.0, max_position_embeddings=32768,
        sliding_window=None, tie_word_embeddings=False, torch_dtype="bfloat16"),
}


def preset(name: str) -> dict[str, Any]:
    try:
        return dict(PRESETS[name])
    except KeyError:
        raise KeyError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}") from None
