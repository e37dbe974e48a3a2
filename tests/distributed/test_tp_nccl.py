"""2-process NCCL tensor parallelism at Llama-3.2-1B widths, with CUDA graphs and the collectives
captured in them (needs 2 GPUs).

tp=2 (``tp_worker.py`` under torchrun, ``--capture``) is compared with tp=1 in this process
(CUDA graphs captured too), both in the low-precision dtype on the same bf16/fp16 checkpoint,
with teacher forcing (both feed tp=1's greedy tokens) so that a near-tie cannot make the
sequences diverge. Every logit row of the prefill and of each decode step is compared.

Bounds. tp=2 rounds each rank's row-parallel partial sum to the dtype before the all-reduce and
sums in another order; the logits then differ by a few units of the last place through the
layers, like a bf16 vs fp32 comparison (tests/models/test_gpu_parity.py measured KL ~1e-3 for
that at these widths):

* KL(p_tp1 || p_tp2) per row: bf16 mean < 1e-2, max < 5e-2 nats (as test_gpu_parity). KL grows
  like the variance of the logit error, i.e. the unit roundoff squared; fp16's is 8x smaller,
  so its bounds are 10x smaller (mean < 1e-3, max < 5e-3), still > 6x margin.
* Top-1: every row's argmax agrees, or tp=2's pick is within ``TIE_REL * max|row|`` of tp=1's
  best logit (a near-tie that rounding may flip).

A wrong shard, head split or reduction moves logits by O(1), far outside both bounds.

Structure: every collective of the decode step (the all-reduce + add + RMSNorm fusions, the
embedding's all-reduce, the logits all-gather) sits inside the CUDA graph, so one decode step
replays exactly one graph.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.distributed.launch import finish, start_torchrun
from tests.distributed.tp_worker import BLOCKS_PER_SEQ, MAX_MODEL_LEN, PROMPTS, generate

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]

WORKER = Path(__file__).resolve().with_name("tp_worker.py")
LAYERS = 2
LLAMA_1B_WIDTHS: dict[str, Any] = dict(
    vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=LAYERS,
    num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
    rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True, initializer_range=0.02,
    rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
STEPS = 5
BUCKETS = [1, 2, 4]
KL_BOUNDS = {torch.bfloat16: (1e-2, 5e-2), torch.float16: (1e-3, 5e-3)}  # (mean, max)
TIE_REL = 5e-2
LAUNCH_TIMEOUT_S = 600.0


def _row_stats(got: torch.Tensor, ref: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: KL(ref || got) and whether got's argmax is ref's best or a near-tie of it."""
    ref, got = ref.double(), got.double()
    logp_ref, logp_got = ref.log_softmax(-1), got.log_softmax(-1)
    kl = (logp_ref.exp() * (logp_ref - logp_got)).sum(-1)
    pick = got.argmax(-1)
    gap = ref.max(-1).values - ref.gather(-1, pick[:, None])[:, 0]
    return kl, gap <= TIE_REL * ref.abs().max(-1).values


def _tp1(ckpt: Path, dtype: torch.dtype) -> tuple[list[torch.Tensor], list[list[int]]]:
    from tgraph.models import load_model

    model = load_model(ckpt, device="cuda", dtype=dtype, graph="static",
                       max_model_len=MAX_MODEL_LEN, progress=False)
    model.allocate_kv_cache(len(PROMPTS) * BLOCKS_PER_SEQ)
    assert model.capture_decode_graphs(BUCKETS)
    try:
        return generate(model, STEPS)
    finally:
        del model
        torch.cuda.empty_cache()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_nccl_captured_tp2_matches_tp1_at_llama_1b_widths(tmp_path: Path,
                                                           dtype: torch.dtype) -> None:
    from safetensors.torch import load_file

    from tgraph.testing import random_hf_model

    hf = random_hf_model("llama", seed=0, device="cuda", dtype=dtype, **LLAMA_1B_WIDTHS)
    ckpt = tmp_path / "ckpt"
    hf.save_pretrained(ckpt, safe_serialization=True)
    del hf
    torch.cuda.empty_cache()
    ref_logits, ref_tokens = _tp1(ckpt, dtype)
    forced = tmp_path / "forced.json"
    forced.write_text(json.dumps({"llama": ref_tokens}))
    out = tmp_path / "out"
    dtype_name = str(dtype).replace("torch.", "")
    launch = finish(start_torchrun(
        [str(WORKER), "--out", str(out), "--timeout", "300", "--model", f"llama={ckpt}",
         "--modes", "static", "--steps", str(STEPS), "--device", "cuda", "--dtype", dtype_name,
         "--forced", str(forced), "--capture", "--fusion"]), LAUNCH_TIMEOUT_S)
    assert launch.rc == 0, f"NCCL launch failed:\n{launch.output[-8000:]}"

    kl_mean_max, kl_max_max = KL_BOUNDS[dtype]
    for r in range(2):
        report = json.loads((out / f"rank{r}.json").read_text())
        assert report["backend"] == "nccl"
        decode = report["engines"]["llama_static"]["decode"]
        # Each layer's two all-reduces fused with the residual add and the next norm.
        assert decode["fusion_matches"] == 2 * LAYERS
        assert decode["fused_in_place"] == [True] * (2 * LAYERS)
        assert decode["collectives"], "no collective recorded at world size 2"
        for op, capturable, in_graph in decode["collectives"]:
            assert capturable and in_graph, f"rank {r}: {op} runs outside the CUDA graph"
        assert decode["graphs_per_step"] == 1 and decode["segments"] == 1, decode
        assert decode["captured_signatures"] == len(BUCKETS)

        tensors = load_file(str(out / f"rank{r}.safetensors"))
        kls, agree = [], []
        for label in ("static", "static_unfused"):
            for i, expected in enumerate(ref_logits):
                got = tensors[f"llama_{label}_step{i}"]
                assert got.shape == expected.shape and torch.isfinite(got).all()
                kl, ok = _row_stats(got, expected)
                kls.append(kl)
                agree.append(ok)
        kl, ok = torch.cat(kls), torch.cat(agree)
        print(f"\nrank {r} {dtype_name}: {len(kl)} rows, KL mean {kl.mean():.2e} "
              f"max {kl.max():.2e}, top-1 (near-tie) {ok.float().mean():.1%}")
        assert kl.mean() < kl_mean_max and kl.max() < kl_max_max
        assert bool(ok.all()), f"rank {r}: top-1 differs beyond a near-tie"
        # The fusion networks (fp32): fused == unfused, bitwise on the reference backend. On
        # the Triton backend the fused op is one peer-memory kernel whose norm sums the squares
        # in another order than the unfused rms_norm kernel: fp32 rounding of a 16-term sum,
        # relative error < 16 * 2**-24 ~ 1e-6.
        for key in [k for k in tensors if k.startswith("fusion_") and "_fused_" in k]:
            got, want = tensors[key], tensors[key.replace("_fused_", "_unfused_")]
            if "_reference_" in key:
                assert torch.equal(got, want), key
            else:
                torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6, msg=key)
    # Both ranks hold the same all-gathered logits.
    ranks = [load_file(str(out / f"rank{r}.safetensors")) for r in range(2)]
    for key in ranks[0]:
        if key.startswith("llama_"):
            assert torch.equal(ranks[0][key], ranks[1][key]), key
