"""MoE families on a GPU in bf16 with their decode CUDA graphs, against transformers in fp32 on
the same bf16-rounded weights (the method and bounds of tests/models/test_gpu_parity.py): every
logit row of a packed prefill and 10 greedy decode steps. The experts run as the ``moe`` op's
reference (every expert on every token, weighted by its routing share): no data-dependent shapes,
so the decode step is captured like any other."""
from __future__ import annotations

from typing import Any

import pytest

from tests.models.test_gpu_parity import KL_MAX, KL_MEAN_MAX, TOP1_MIN, parity, report

pytestmark = pytest.mark.gpu

WIDTHS: dict[str, Any] = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2048,
                              num_hidden_layers=2, num_attention_heads=16, num_key_value_heads=4,
                              max_position_embeddings=4096, rms_norm_eps=1e-5,
                              initializer_range=0.02)
CASES = {
    "qwen3_moe": ("qwen3_moe", {"num_experts": 16, "num_experts_per_tok": 4, "head_dim": 64,
                                "moe_intermediate_size": 256, "norm_topk_prob": True}),
    "qwen2_moe": ("qwen2_moe", {"num_experts": 8, "num_experts_per_tok": 2,
                                "moe_intermediate_size": 512,
                                "shared_expert_intermediate_size": 1024}),
    "mixtral": ("mixtral", {"num_local_experts": 8, "num_experts_per_tok": 2}),
}


# Routing flips: bf16 rounding of a hidden state can swap a token's k-th and (k+1)-th experts
# when their router probabilities are within bf16 noise, and the token then gets a whole other
# expert's output, not a small perturbation. With 2 of 8 experts of 2048 columns (Mixtral's
# shape here) that happens on a few rows: measured on an H100, KL mean 2.9e-3 (within the
# bound), max 0.25 and near-tie top-1 97.0%. Its bounds keep the mean and loosen the per-row
# ones to what flips allow; the fp32 CPU tests (tests/models/test_families.py) are exact.
FLIP_KL_MAX, FLIP_TOP1_MIN = 0.5, 0.95
ROUTING_FLIPS = {"mixtral"}


@pytest.mark.parametrize("name", list(CASES))
def test_moe_bf16_parity(name, tmp_path):
    family, overrides = CASES[name]
    s = parity(family, overrides, tmp_path, widths=WIDTHS)
    print("\n" + report(name, s))
    assert s["buckets"], "no decode CUDA graphs were captured"
    kl_max, top1 = (FLIP_KL_MAX, FLIP_TOP1_MIN) if name in ROUTING_FLIPS else (KL_MAX, TOP1_MIN)
    assert float(s["kl"].mean()) < KL_MEAN_MAX and float(s["kl"].max()) < kl_max, report(name, s)
    assert float(s["near"].float().mean()) >= top1, report(name, s)
