"""LoraPrologue: the RMSNorm (with or without the residual add) that produces a LoRA linear's
input folds into its shrink, also the stacked shrink of single + multi LoRA (one per adapted
linear, both features' columns). Numbers (fused == unfused, on the reference backend exactly:
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
SHRINK_OPS = ("lora_shrink_concat", *FUSED_OPS)
MULTI = ("multi_lora",)
STACKED = ("multi_lora", "single_lora")


def _run(tmp_path: Path, disabled: tuple[str, ...],
         stacked: bool = False) -> tuple[object, list[torch.Tensor]]:
    """A prefill and a decode step of a mixed batch (two adapters and the base model; with
    ``stacked``, a single adapter active for every request too)."""
    config = ModelConfig.from_dict(HF)
    torch.manual_seed(0)
    weights = random_weights(HF, torch.float32, "cpu")
    features = {"multi_lora": {"max_rank": 4, "max_loras": 2}}
    if stacked:
        features["single_lora"] = {"max_rank": 8, "merge": False}  # its own shrink set
    model = build_model(config, DictWeightLoader(weights, device="cpu", dtype=torch.float32),
                        max_model_len=64, disabled_passes=disabled, features=features)
    model.allocate_kv_cache(32)
    for i, name in enumerate(("l0", "l1", "single")):
        adapter = tmp_path / name
        if not adapter.exists():
            write_random_adapter(adapter, config, rank=4 + 4 * (i == 2), seed=i + 1, b_std=0.2)
        if i < 2:
            model.features["multi_lora"].load(name, adapter)
        elif stacked:
            model.features["single_lora"].load(name, adapter)
            model.features["single_lora"].activate(name)
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


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_stacked_engine_has_one_shrink_per_adapted_linear(tmp_path, backend, monkeypatch):
    # Single + multi LoRA: each adapted linear's operand comes from one shrink with both
    # features' adapter sets, the norms before q/k/v and gate/up folded in as for multi alone, so
    # the stacked engine launches as many kernels as the multi-only one.
    if backend == "triton":
        build_with_triton_backend(monkeypatch)
    fused_model, fused = _run(tmp_path, (), stacked=True)
    plain_model, plain = _run(tmp_path, ("LoraPrologue",), stacked=True)
    multi_model, multi = _run(tmp_path, ())
    for got, want, without_single in zip(fused, plain, multi):
        if backend == "reference":
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert (got - without_single).abs().max() > 1e-2, "the single adapter must matter"
    layers = HF["num_hidden_layers"]
    targets = len(fused_model.features["single_lora"].targets)
    assert targets == 4 * layers  # q|k|v, o, gate|up, down
    for is_prefill in (True, False):
        engine = fused_model.engines[(is_prefill, STACKED)]
        shrinks = [n for n in engine.net.nodes if n.op in SHRINK_OPS]
        assert len(shrinks) == targets
        for node in shrinks:
            names = {v.name for v in node.inputs if v is not None}
            assert {"lora_token_slots", "single_lora_token_slots"} <= names
            assert node.attrs["second_width"] > 0
        matches = {p.name: p.matches for p in engine.stats.passes}
        assert matches["LoraPrologue"] == 2 * layers
        assert sum(n.op in FUSED_OPS for n in shrinks) == 2 * layers
        plain_engine = plain_model.engines[(is_prefill, STACKED)]
        assert plain_engine.stats.kernel_count - engine.stats.kernel_count == 2 * layers
        multi_engine = multi_model.engines[(is_prefill, MULTI)]
        assert engine.stats.kernel_count == multi_engine.stats.kernel_count
        if backend == "triton":
            assert all(f"triton.{op}" in str(engine) for op in SHRINK_OPS)
