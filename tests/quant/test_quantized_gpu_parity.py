"""Quantized models at real widths on a GPU (issue 26's quality bar): a Llama-3.2-1B-wide model
(4 layers, random bf16 weights) with its decoder linears held as int4 g128, int8 per channel, fp8
per channel or fp8 128x128 blocks, against the same model built from the dequantized weights.

Six prompts of 1-517 tokens are prefilled in one step (990 tokens: the prefill GEMMs, fp8 with
its activations quantized per token), then 8 decode steps of six rows (the tensor-core GEMV);
the decode feeds the twin's greedy tokens to both, so every row compares the same sequence. A
single 300-token prompt then decodes 4 steps alone (the one-row GEMV).

``fp8-a8`` is fp8 with e4m3 activations in prefill (opt-in, ``QuantGemmTuning.fp8_activations``).

Bounds, as tests/models/test_gpu_parity.py: per-row KL(twin || quantized) mean < 1e-2 and max
< 5e-2 nats; top-1 agreement (or a near-tie within 5% of the row's largest logit) >= 99%. The
GEMVs differ from the twin by the twin's bf16 weight rounding (2**-9 per weight); fp8-a8's prefill
adds e4m3's rounding of the activations (about 2% relative per linear output: KL mean 6.5e-3 and
top-1 95.4% measured). A wrong scale, offset or code order moves logits by O(1).
"""
from __future__ import annotations

import gc

import pytest
import torch

from tgraph.bench.quant import SCHEME_TUNING, linear_names, quantize_linears, quantized_model
from tgraph.quant import quantize
from tgraph.testing import PagedBatcher

pytestmark = pytest.mark.gpu

CONFIG = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=128256,
              hidden_size=2048, intermediate_size=8192, num_hidden_layers=4,
              num_attention_heads=32, num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5,
              rope_theta=500000.0, max_position_embeddings=4096, tie_word_embeddings=True,
              torch_dtype="bfloat16")
PROMPT_LENGTHS = (1, 9, 33, 130, 300, 517)
KL_MEAN_MAX, KL_MAX, TIE_REL, TOP1_MIN = 1e-2, 5e-2, 5e-2, 0.99
# fp8-a8 (opt-in: e4m3 activations in prefill) meets the KL bounds but not the top-1 one: ~2%
# noise per linear flips near-flat random-weight logits (95.4% measured on an H100); its bound
# is the measured level less a margin, so a regression still fails.
TOP1_MIN_A8 = 0.93


def _weights() -> dict[str, torch.Tensor]:
    from tgraph.bench.models import random_weights

    return random_weights(CONFIG, torch.bfloat16, "cuda")


def _quantized(weights: dict[str, torch.Tensor], scheme: str) -> dict:
    if scheme == "fp8-a8":
        return quantize_linears(weights, "fp8")
    if scheme == "fp8 block":
        return {n: quantize(weights[n], "fp8", block=(128, 128), name=n)
                for n in linear_names(weights)}
    return quantize_linears(weights, scheme)


def _run(model, prompts, steps, feed=None):
    """Logits of every prompt token (one packed prefill) and of ``steps`` decode steps; decode
    feeds ``feed`` (the twin's tokens) when given, else the model's own argmax."""
    model.allocate_kv_cache(256)
    b = PagedBatcher.for_model(model)
    ids = [b.add(p) for p in prompts]
    # Clone: an engine (and a replayed CUDA graph) may reuse its output buffer.
    logits = [model.run(b.step(ids, all_logits=True)).float().clone()]
    last = torch.stack([rows[-1] for rows in torch.split(logits[0], [len(p) for p in prompts])])
    tokens = [last.argmax(-1)]
    for step in range(steps):
        for i, s in enumerate(ids):
            b.append(s, int((feed[step] if feed is not None else tokens[-1])[i]))
        logits.append(model.run(b.step(ids)).float().clone())
        tokens.append(logits[-1].argmax(-1))
    return torch.cat(logits), tokens


def _stats(got: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    ref, got = ref.double(), got.double()
    logp_ref, logp_got = ref.log_softmax(-1), got.log_softmax(-1)
    kl = (logp_ref.exp() * (logp_ref - logp_got)).sum(-1)
    pick = got.argmax(-1)
    gap = ref.max(-1).values - ref.gather(-1, pick[:, None])[:, 0]
    near = (pick == ref.argmax(-1)) | (gap <= TIE_REL * ref.abs().max(-1).values)
    return {"kl_mean": float(kl.mean()), "kl_max": float(kl.max()),
            "top1": float(near.float().mean()), "rows": len(kl)}


@pytest.mark.parametrize("scheme", ["int4", "int8", "fp8", "fp8 block", "fp8-a8"])
def test_quantized_model_matches_its_dequantized_twin(scheme):
    weights = _weights()
    quantized = _quantized(weights, scheme)
    dense = dict(weights)
    for name, q in quantized.items():
        dense[name] = q.dequantize(torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, CONFIG["vocab_size"], (n,), generator=g).tolist()
               for n in PROMPT_LENGTHS]
    lone = [torch.randint(0, CONFIG["vocab_size"], (300,), generator=g).tolist()]
    results = []
    try:
        twin = quantized_model(CONFIG, dense, {}, max_model_len=1024)
        ref, ref_tokens = _run(twin, prompts, 8)
        ref_lone, lone_tokens = _run(twin, lone, 4)
        del twin
        extra = {"tuning": SCHEME_TUNING[scheme]} if scheme in SCHEME_TUNING else {}
        model = quantized_model(CONFIG, weights, quantized, max_model_len=1024, **extra)
        got, _ = _run(model, prompts, 8, feed=ref_tokens)
        got_lone, _ = _run(model, lone, 4, feed=lone_tokens)
        del model
        for what, a, b in (("6 prompts", got, ref), ("one prompt", got_lone, ref_lone)):
            s = _stats(a, b)
            results.append(s)
            print(f"\n{scheme} {what}: {s['rows']} rows, KL mean {s['kl_mean']:.2e} max "
                  f"{s['kl_max']:.2e}, top-1 (near-ties) {s['top1']:.3%}")
    finally:
        del weights, quantized, dense
        gc.collect()
        torch.cuda.empty_cache()
    for s in results:
        assert s["kl_mean"] < KL_MEAN_MAX and s["kl_max"] < KL_MAX, s
        assert s["top1"] >= (TOP1_MIN_A8 if scheme == "fp8-a8" else TOP1_MIN), s
