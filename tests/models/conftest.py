"""Fixtures of the model tests: tiny random Hugging Face checkpoints, built once per session.

Each *variant* is a family plus the config keys that exercise what is special about it. The
``tiny_model`` fixture returns a factory: ``tiny_model("qwen2")`` saves the checkpoint (the first
time only) and returns its directory together with the in-memory Hugging Face model, the oracle.
"""
from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from tgraph.testing import GreedyTrace, hf_logits, random_hf_model, run_greedy

# Llama 3 rope scaling with a short original context: with head_dim 16 and theta 1e4 the
# wavelengths run from 6 to ~20000 positions, so the frequencies are split between the
# unchanged (< 8), smoothed (8..32) and divided-by-factor (> 32) bands.
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}

# name -> (family, config overrides). Every variant has 3 layers and GQA (4 heads, 2 KV heads).
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {"tie_word_embeddings": False}),
    "llama3_tied": ("llama", {"tie_word_embeddings": True, "rope_scaling": LLAMA3_ROPE}),
    # Qwen2 always has q/k/v biases (random, see random_hf_model).
    "qwen2": ("qwen2", {}),
    # Explicit head_dim: 4 heads x 32 = 128 != hidden 64, and per-head q/k RMSNorm.
    "qwen3": ("qwen3", {"head_dim": 32}),
    # A window of 5 tokens, shorter than most test prompts.
    "mistral": ("mistral", {"sliding_window": 5}),
    # Qwen's window applies from layer max_window_layers on: layer 0 full, 1 and 2 sliding.
    "qwen3_window": ("qwen3", {"head_dim": 32, "use_sliding_window": True, "sliding_window": 5,
                               "max_window_layers": 1}),
    # Mixture-of-experts: 4 experts, 2 per token. Qwen3-MoE renormalises the top-2 and keeps
    # layer 1 dense; Qwen2-MoE adds its gated shared expert and does not renormalise; Mixtral
    # always renormalises.
    "qwen3_moe": ("qwen3_moe", {"num_experts": 4, "num_experts_per_tok": 2,
                                "moe_intermediate_size": 48, "norm_topk_prob": True,
                                "head_dim": 32, "mlp_only_layers": [1]}),
    "qwen2_moe": ("qwen2_moe", {"num_experts": 4, "num_experts_per_tok": 2,
                                "moe_intermediate_size": 48, "norm_topk_prob": False,
                                "shared_expert_intermediate_size": 80}),
    "mixtral": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    # q and k each normalised over all heads; OLMo 2 normalises each block's output, OLMoE
    # routes without renormalising and clamps q/k/v (at 2.5: a few percent of them clip).
    "olmo2": ("olmo2", {}),
    # OLMo 3: layers 0 and 2 slide over 5 tokens, layer 1 attends to all with YaRN-scaled RoPE
    # (the hub's layout: rope_theta + a rope_scaling only the full layers use).
    "olmo3": ("olmo3", {"sliding_window": 5, "rope_theta": 10000.0,
                        "layer_types": ["sliding_attention", "full_attention",
                                        "sliding_attention"],
                        "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                         "original_max_position_embeddings": 16}}),
    # Gemma 3: (1 + w) norms, scaled embeddings, query_pre_attn_scalar, a window of 5 on layers
    # 0 and 2 with the local RoPE base, layer 1 full with a linearly scaled global one.
    "gemma3": ("gemma3_text", {"head_dim": 32, "query_pre_attn_scalar": 24, "sliding_window": 5,
                               "layer_types": ["sliding_attention", "full_attention",
                                               "sliding_attention"],
                               "rope_parameters": {
                                   "sliding_attention": {"rope_type": "default",
                                                         "rope_theta": 10000.0},
                                   "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                      "rope_theta": 1000000.0}}}),
    # Phi-3: fused qkv_proj / gate_up_proj read as their parts, half the head dims rotated
    # (Phi-4-mini's partial rotary), a window of 6, LongRoPE's short factors and attention
    # factor (sequences stay inside its original context of 64, as tgraph tabulates it).
    "phi3": ("phi3", {"partial_rotary_factor": 0.5, "sliding_window": 6, "pad_token_id": 0,
                      "original_max_position_embeddings": 64,
                      "rope_scaling": {"rope_type": "longrope",
                                       "short_factor": [1.0, 1.1, 1.3, 1.6],
                                       "long_factor": [1.2, 2.0, 3.5, 6.0]}}),
    "olmoe": ("olmoe", {"num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": False,
                        "clip_qkv": 2.5}),
}

# Prompts of different lengths (1 to 18 tokens), longer than the sliding window and spanning
# several 4-token cache blocks; with 10 decode steps the longest sequence reaches 28 tokens.
PROMPTS: list[list[int]] = [
    [1, 5, 9, 22, 7, 3, 100],
    [3, 4],
    [17, 150, 8, 8, 8, 8, 191, 0, 42, 42, 13, 77, 5, 60, 61, 62, 2, 9],
    [121],
    [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21],
]
DECODE_STEPS = 10
# Serving settings of the CPU tests: small cache blocks so sequences span several blocks.
MAX_MODEL_LEN = 64
BLOCK_SIZE = 4
NUM_BLOCKS = 96


@dataclass
class TinyModel:
    """A saved tiny checkpoint and the Hugging Face model it was saved from."""

    name: str
    family: str
    overrides: dict[str, Any]
    path: Path
    hf: Any


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., TinyModel]:
    """Factory ``tiny_model(variant, max_shard_size=None) -> TinyModel``, cached per session.

    Tests that modify a checkpoint must copy it first (:func:`copy_checkpoint`).
    """
    cache: dict[tuple[str, Any], TinyModel] = {}

    def get(variant: str, max_shard_size: str | None = None) -> TinyModel:
        key = (variant, max_shard_size)
        if key not in cache:
            family, overrides = VARIANTS[variant]
            hf = random_hf_model(family, seed=0, **overrides)
            path = tmp_path_factory.mktemp(f"{variant}-{max_shard_size or 'single'}")
            kwargs: dict[str, Any] = {"safe_serialization": True}
            if max_shard_size is not None:
                kwargs["max_shard_size"] = max_shard_size
            hf.save_pretrained(path, **kwargs)
            cache[key] = TinyModel(variant, family, overrides, path, hf)
        return cache[key]

    return get


def copy_checkpoint(src: Path, dst: Path) -> Path:
    """Copy a checkpoint directory (to modify it without touching the session's copy)."""
    shutil.copytree(src, dst)
    return dst


def load_tiny(path: Path, graph: str = "static", **kwargs: Any) -> Any:
    """``load_model`` with the CPU test settings and an allocated KV cache."""
    from tgraph.models import load_model

    kwargs = {"max_model_len": MAX_MODEL_LEN, "block_size": BLOCK_SIZE, **kwargs}
    model = load_model(path, graph=graph, device="cpu", dtype="float32", **kwargs)
    model.allocate_kv_cache(NUM_BLOCKS)
    return model


def relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """``max|got - ref| / max|ref|``: the error relative to the logit scale."""
    return float((got.double() - ref.double()).abs().max() / ref.double().abs().max())


def compare_trace(trace: GreedyTrace, hf: Any) -> list[tuple[int, int, float]]:
    """Compare every logit row of a trace with Hugging Face's full-sequence forward.

    Returns:
        ``(sequence, position, relative error)`` for every row, where the relative error is
        taken over that row with the scale ``max|ref|`` of the whole sequence.
    """
    rows = []
    for i, tokens in enumerate(trace.sequences):
        ref = hf_logits(hf, tokens)
        got = trace.logits_of(i)
        assert got.shape == ref.shape, f"sequence {i}: logits {tuple(got.shape)} vs HF " \
                                       f"{tuple(ref.shape)}"
        scale = float(ref.abs().max())
        err = (got.double() - ref.double()).abs().amax(dim=-1) / scale
        rows += [(i, p, float(e)) for p, e in enumerate(err)]
    return rows


@pytest.fixture
def greedy_parity() -> Callable[..., tuple[GreedyTrace, list[tuple[int, int, float]]]]:
    """``greedy_parity(model, hf, prompts, steps)``: prefill + greedy decode through
    :class:`~tgraph.testing.PagedBatcher` batches, compared row by row with Hugging Face."""

    def run(model: Any, hf: Any, prompts: list[list[int]] = PROMPTS,
            steps: int = DECODE_STEPS) -> tuple[GreedyTrace, list[tuple[int, int, float]]]:
        trace = run_greedy(model, prompts, steps)
        return trace, compare_trace(trace, hf)

    return run
