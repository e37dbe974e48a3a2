"""MoE families on a GPU in bf16 with their decode CUDA graphs, against transformers in fp32 on
the same bf16-rounded weights (the method and bounds of tests/models/test_gpu_parity.py): every
logit row of a packed prefill and 10 greedy decode steps. The experts run as the Triton expert
kernels (the grouped GEMM for the prefill, the decode kernels in the captured decode steps).
Then the routed experts of one layer placed on the CPU by a rule while the rest runs in CUDA
graphs: the same logits as the all-GPU model, up to the CPU's fp32 summation order."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

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


def test_experts_on_the_cpu_between_cuda_graphs(tmp_path: Path):
    from tgraph.models import load_model
    from tgraph.testing import make_tiny_hf_model, run_greedy

    path = make_tiny_hf_model("qwen3_moe", tmp_path, seed=3, num_experts=4, num_experts_per_tok=2,
                              moe_intermediate_size=48, norm_topk_prob=True, head_dim=32)
    rules = [{"match": {"name": r"^model\.layers\.0\.mlp\.experts$"},
              "replace": {"class": "default", "kwargs": {"device": "cpu"}}}]
    prompts = [[1, 5, 9, 22, 7], [3, 4, 100]]
    runs = []
    for r in (None, rules):
        model = load_model(path, rules=r, device="cuda", dtype="float32", max_model_len=64,
                           block_size=16)
        model.allocate_kv_cache(16)
        model.capture_decode_graphs([2])
        runs.append(run_greedy(model, prompts, 4))
    assert model.model.layers[0].mlp.experts.placement.startswith("cpu")
    engine = next(e for e in model.engines.values() if "decode" in str(e))
    assert "runs on cpu" in str(engine)
    for a, b in zip(runs[0].prefill_logits + runs[0].step_logits,
                    runs[1].prefill_logits + runs[1].step_logits):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)  # fp32, CPU vs GPU sum order
    assert runs[0].generated == runs[1].generated
