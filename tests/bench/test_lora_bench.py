"""The LoRA benchmark's pieces on CPU: the adapter writer and a tiny smoke run.

The written adapter must mean the same thing to tgraph and to PEFT: PEFT must find every tensor
under its own names (it only warns about missing keys, so the test compares them), and a tgraph
model serving the adapter must match the PEFT model. Both compute in fp32 and differ only in
summation order (~1e-6 measured): tolerance ``1e-4 * max|logits|``, as in
``tests/models/test_lora.py``; the adapter moves the logits by more than 5e-2 relative.
"""
from __future__ import annotations

import copy
import json

import pytest
import torch

from tgraph.bench.lora import lora_module_shapes, measure_lora_decode, write_random_adapter
from tgraph.io.model_config import ModelConfig
from tgraph.layers.lora import LORA_TARGET_MODULES, load_peft_adapter
from tgraph.testing import PagedBatcher, hf_logits, random_hf_model

REL_TOL = 1e-4
ADAPTER_EFFECT = 5e-2
TINY: dict = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=192,
                  hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
                  max_position_embeddings=256, tie_word_embeddings=True)


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.double() - ref.double()).abs().max() / ref.double().abs().max())


def test_written_adapter_loads_in_tgraph_and_peft_alike(tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file

    from tgraph.models import load_model

    hf = random_hf_model("llama", seed=0)  # tiny: 3 layers, hidden 64, 4 heads / 2 KV heads
    hf.save_pretrained(tmp_path / "base", safe_serialization=True)
    config = ModelConfig.from_dir(tmp_path / "base")
    path = write_random_adapter(tmp_path / "adapter", config, rank=4, alpha=8, seed=3)
    written = load_file(str(path / "adapter_model.safetensors"))
    assert len(written) == 2 * 7 * config.num_hidden_layers

    # tgraph's reader: config fields and every (layer, module) pair, values unchanged
    adapter = load_peft_adapter(path, "x")
    assert (adapter.rank, adapter.alpha, adapter.scaling) == (4, 8.0, 2.0)
    assert adapter.target_modules == frozenset(LORA_TARGET_MODULES)
    shapes = lora_module_shapes(config)
    assert len(adapter.weights) == 7 * config.num_hidden_layers
    for (layer, module), (a, b) in adapter.weights.items():
        key = f"base_model.model.model.layers.{layer}." \
              f"{'mlp' if module in ('gate_proj', 'up_proj', 'down_proj') else 'self_attn'}" \
              f".{module}.lora_"
        assert torch.equal(a, written[key + "A.weight"])
        assert torch.equal(b, written[key + "B.weight"])
        assert a.shape == (4, shapes[module][0]) and b.shape == (shapes[module][1], 4)
        assert b.abs().max() > 0

    # PEFT's reader: the same tensors under its parameter names, nothing missing or left over
    peft_model = PeftModel.from_pretrained(copy.deepcopy(hf), str(path)).eval()
    loaded = {n.replace(".default", ""): p for n, p in peft_model.named_parameters()
              if ".lora_" in n}
    assert set(loaded) == set(written)
    for name, p in loaded.items():
        assert torch.equal(p.detach(), written[name]), name
    assert peft_model.peft_config["default"].r == 4

    # tgraph serving the adapter == PEFT, and the adapter matters
    model = load_model(tmp_path / "base", device="cpu", dtype="float32", max_model_len=64,
                       block_size=4, features={"single_lora": {"max_rank": 8}})
    model.allocate_kv_cache(16)
    single = model.features["single_lora"]
    single.load("x", path)
    single.activate("x")
    tokens = [1, 5, 9, 22, 7, 3, 100, 42]
    batcher = PagedBatcher.for_model(model)
    batch = batcher.step([batcher.add(tokens)], all_logits=True)
    got = model.run(batch)
    with torch.no_grad():
        want = peft_model(torch.tensor([tokens]), use_cache=False).logits[0].float()
    assert rel_err(got, want) <= REL_TOL
    assert rel_err(hf_logits(hf, tokens), want) > ADAPTER_EFFECT


def test_write_random_adapter_bad_input(tmp_path):
    config = ModelConfig.from_dict(TINY)
    with pytest.raises(ValueError, match=r"target_modules must be a non-empty subset"):
        write_random_adapter(tmp_path / "a", config, target_modules=["q_proj", "lm_head"])
    with pytest.raises(ValueError, match="rank must be a positive int"):
        write_random_adapter(tmp_path / "a", config, rank=0)
    with pytest.raises(TypeError, match="config must be a tgraph ModelConfig"):
        write_random_adapter(tmp_path / "a", TINY)
    # the same arguments give the same files; another seed other weights
    first = write_random_adapter(tmp_path / "b", config, seed=1)
    again = write_random_adapter(tmp_path / "c", config, seed=1)
    other = write_random_adapter(tmp_path / "d", config, seed=2)
    read = [(p / "adapter_model.safetensors").read_bytes() for p in (first, again, other)]
    assert read[0] == read[1] != read[2]
    assert json.loads((first / "adapter_config.json").read_text())["r"] == 16


@pytest.mark.parametrize("merge", [True, False])
def test_measure_lora_decode_smoke_cpu(merge):
    """The whole measurement at a tiny shape (wall-clock timing on CPU, no CUDA graphs), with
    the single adapter merged into the weights and recorded in its engines."""
    r = measure_lora_decode(TINY, batch=8, context=16, max_loras=4, rank=4,
                            dtype=torch.float32, device="cpu", warmup=1, iters=2,
                            merge_single=merge)
    assert not r.skipped, r.skipped
    assert r.merge_single is merge
    assert set(r.decode_ms) == {"base", "multi_lora", "single_lora", "single+multi"}
    assert all(ms > 0 for ms in r.decode_ms.values())
    assert r.ratios["base"] == 1.0
    # no CUDA graphs on CPU, and the result says so
    assert r.cuda_graph_buckets == [] and not any(r.captured.values())
    # the adapters were applied ...
    assert min(r.logit_change.values()) > ADAPTER_EFFECT, r.logit_change
    # ... and single and multi agree on the shared adapter (fp32, summation order only)
    assert r.single_vs_multi is not None and r.single_vs_multi <= REL_TOL
    out = json.loads(json.dumps(r.to_json()))
    assert out["captured"] == {"base": False, "multi_lora": False, "single_lora": False,
                               "single+multi": False}
    with pytest.raises(ValueError, match="expected positive ints"):
        measure_lora_decode(TINY, batch=0, device="cpu")


def test_profiles_come_after_every_system_is_timed(capsys, monkeypatch):
    # The profiler leaves launches slower for the rest of the process: no system may be timed
    # after a profile ran.
    from tgraph.bench import lora as lora_bench

    events = []
    timed = lora_bench._median_ms
    monkeypatch.setattr(lora_bench, "_median_ms",
                        lambda *a, **k: events.append("time") or timed(*a, **k))
    monkeypatch.setattr(lora_bench, "_print_profile",
                        lambda system, step, device: events.append(f"profile {system}"))
    r = measure_lora_decode(TINY, batch=4, context=16, max_loras=2, rank=4,
                            dtype=torch.float32, device="cpu", warmup=1, iters=1, profile=True)
    assert not r.skipped, r.skipped
    assert events == ["time"] * 4 + [f"profile {s}" for s in ("base", "multi_lora", "single_lora",
                                                                     "single+multi")]


def test_bench_lora_subcommand_needs_cuda(capsys):
    from tgraph.bench.__main__ import main

    if torch.cuda.is_available():
        pytest.skip("checks the message shown without CUDA")
    assert main(["lora", "--out", "/nonexistent/lora.json"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err
