"""``--dump-tensors``: the named intermediates of each engine's first step are written to a
directory, and the run that follows is unchanged by the dump."""
from __future__ import annotations

import json

import torch
from safetensors.torch import load_file

from tgraph.models import load_model
from tgraph.testing import generate_greedy, make_tiny_hf_model


def test_dump_writes_every_intermediate_and_changes_nothing(tmp_path):
    model_dir = make_tiny_hf_model("llama", tmp_path / "model")
    prompts = [[1, 5, 9, 22, 7], [3, 4]]
    plain = load_model(model_dir, max_model_len=64)
    plain.allocate_kv_cache(16)
    want = generate_greedy(plain, prompts, 3)

    model = load_model(model_dir, max_model_len=64)
    model.allocate_kv_cache(16)
    model.dump_dir = str(tmp_path / "dump")
    assert generate_greedy(model, prompts, 3) == want
    files = sorted(p.name for p in (tmp_path / "dump").iterdir())
    assert files == ["FlashLlamaForCausalLM_decode.json",
                     "FlashLlamaForCausalLM_decode.safetensors",
                     "FlashLlamaForCausalLM_prefill.json",
                     "FlashLlamaForCausalLM_prefill.safetensors"]
    tensors = load_file(str(tmp_path / "dump" / "FlashLlamaForCausalLM_prefill.safetensors"))
    index = json.loads((tmp_path / "dump" / "FlashLlamaForCausalLM_prefill.json").read_text())
    assert set(tensors) == set(index)
    engine = model.engines[(True, ())]
    assert len(tensors) == sum(len(n.outputs) for n in engine.net.nodes)
    logits = [t for name, t in tensors.items() if name.endswith(tuple(
        f".{v.name}" for v in engine.net.outputs.values() if v.name))] or [
        tensors[max(tensors)]]
    assert logits[-1].shape[-1] == 192  # the tiny vocabulary: the last node is the LM head
    assert all(torch.isfinite(t.float()).all() for t in tensors.values()
               if t.dtype.is_floating_point and t.dim() < 4)
