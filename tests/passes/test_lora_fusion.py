"""LoraPrologue: the RMSNorm (with or without the residual add) that produces a LoRA linear's
input folds into its shrink. Numbers (fused == unfused, on the reference backend exactly:
the fused references are the compositions of the unfused ones; on the Triton backend within fp32
accumulation-order tolerance) and structure (matches, kernels, ops)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers import build_with_triton_backend
from tgraph.bench.lora import write_random_adapter
from tgraph.bench.models import random_weights
from tgraph.io.model_config import ModelConfig
from tgraph.io.weights import DictWeightLoader
from tgraph.models.loading import build_model
from tgraph.testing import PagedBatcher

HF = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=64,
          intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
          num_key_value_heads=2, vocab_size=128, max_position_embeddings=256, rms_norm_eps=1e-5,
          tie_word_embeddings=False)
LORAS = ["l0", None, "l1", "l0"]
FUSED_OPS = ("rms_norm_lora_concat", "add_rms_norm_lora_concat")


def _run(tmp_path: Path, disabled: tuple[str, ...]) -> tuple[object, list[torch.Tensor]]:
    """A prefill and a decode step of a mixed batch (two adapters and the base model)."""
    config = ModelConfig.from_dict(HF)
    torch.manual_seed(0)
    weights = random_weights(HF, torch.float32, "cpu")
    model = build_model(config, DictWeightLoader(weights, device="cpu", dtype=torch.float32),
                        max_model_len=64, disabled_passes=disabled,
                        features={"multi_lora": {"max_rank": 4, "max_loras": 2}})
    model.allocate_kv_cache(32)
    for i, name in enumerate(("l0", "l1")):
        adapter = tmp_path / name
        if not adapter.exists():
            write_random_adapter(adapter, config, rank=4, seed=i + 1, b_std=0.2)
        model.features["multi_lora"].load(name, adapter)
    b = PagedBatcher.for_model(model)
    seqs = [b.add([3 + i, 7, 11 + 2 * i]) for i in range(len(LORAS))]
    logits = []
    for _ in range(2):
        batch = b.step(seqs)
        batch.loras = LORAS
        logits.append(model.run(batch).clone())
        for i, s in enumerate(seqs):
            b.append(s, int(logits[-1][i].argmax()))
    return model, logits


def _ops(engine) -> list[str]:
    return [n.op for n in engine.net.nodes]


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_fused_prologues_equal_the_unfused_graph(tmp_path, backend, monkeypatch):
    if backend == "triton":
        build_with_triton_backend(monkeypatch)
    fused_model, fused = _run(tmp_path, ())
    plain_model, plain = _run(tmp_path, ("LoraPrologue",))
    for got, want in zip(fused, plain):
        if backend == "reference":
            assert torch.equal(got, want)
        else:  # the one-launch kernel accumulates the shrink in another order: fp32 rounding
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    layers = HF["num_hidden_layers"]
    for is_prefill in (True, False):
        engine = fused_model.engines[(is_prefill, ("multi_lora",))]
        plain_engine = plain_model.engines[(is_prefill, ("multi_lora",))]
        matches = {p.name: p.matches for p in engine.stats.passes}
        # Per layer: the norm before q/k/v and the add + norm before gate/up (o_proj's input comes
        # from attention, down_proj's from the SwiGLU: both keep their shrinks).
        assert matches["LoraPrologue"] == 2 * layers
        assert plain_engine.stats.kernel_count - engine.stats.kernel_count == 2 * layers
        ops = _ops(engine)
        assert ops.count("lora_shrink_concat") == 2 * layers
        assert ops.count("rms_norm_lora_concat") == 1  # layer 0: no residual add yet
        assert ops.count("add_rms_norm_lora_concat") == 2 * layers - 1
        # One norm is left, whatever form NormLinear gave it: the final one, before the LM head.
        assert sum(ops.count(op) for op in ("rms_norm", "add_rms_norm", "norm_linear")) == 1
        if backend == "triton":
            assert all(f"triton.{op}" in str(engine) for op in FUSED_OPS)


def test_base_engine_is_untouched(tmp_path):
    # No LoRA feature in the batch: no shrink, nothing for the pass to do.
    model, _ = _run(tmp_path, ())
    b = PagedBatcher.for_model(model)
    model.run(b.step([b.add([1, 2, 3])]))
    engine = model.engines[(True, ())]
    assert {p.name: p.matches for p in engine.stats.passes}["LoraPrologue"] == 0
    assert not set(FUSED_OPS) & set(_ops(engine))
