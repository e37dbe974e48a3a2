"""The language model of a Gemma 3 vision-language checkpoint (``Gemma3ForConditionalGeneration``,
the 4B / 12B / 27B releases) read for text: its tensors under either saved layout, the vision
tower left unread, greedy tokens equal to transformers' text-only forward (fp32, CPU)."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.models.conftest import PROMPTS, load_tiny
from tgraph.errors import WeightLoadError
from tgraph.testing import TINY_SHAPES, hf_greedy

TEXT = {**TINY_SHAPES, "head_dim": 32, "query_pre_attn_scalar": 24, "sliding_window": 5,
        "sliding_window_pattern": 2, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 4.0}}
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
              image_size=28, patch_size=14)
# transformers 4.x's names of the same tensors
LEGACY = (("model.language_model.", "language_model.model."), ("model.vision_tower.",
          "vision_tower."), ("model.multi_modal_projector.", "multi_modal_projector."))


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    config = Gemma3Config(text_config=TEXT, vision_config=VISION, mm_tokens_per_image=4)
    torch.manual_seed(0)
    hf = Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():  # norm scales off zero, so the (1 + w) offsets matter
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(0.2 * torch.randn_like(p))
    path = tmp_path_factory.mktemp("gemma3-vlm")
    hf.save_pretrained(path, safe_serialization=True)
    return hf, path


def _relayout(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            dst.joinpath(f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(src / "model.safetensors"))
    renamed = {}
    for name, t in tensors.items():
        for new, old in LEGACY:
            if name.startswith(new):
                name = old + name[len(new):]
        renamed[name] = t
    save_file(renamed, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst, renamed


@pytest.mark.parametrize("layout", ["transformers-5", "transformers-4"])
def test_text_of_a_vision_language_checkpoint_decodes_as_transformers(vlm, layout, tmp_path):
    hf, path = vlm
    if layout == "transformers-4":
        path, names = _relayout(path, tmp_path / "legacy")
        assert any(n.startswith("language_model.model.layers.") for n in names)
        assert any(n.startswith("vision_tower.") for n in names)
    model = load_tiny(path)
    assert type(model).__name__ == "FlashGemma3ForConditionalGeneration"
    prompts = [PROMPTS[0], PROMPTS[2]]
    from tgraph.testing import generate_greedy

    assert generate_greedy(model, prompts, 6) == hf_greedy(hf, prompts, 6)


def test_a_missing_text_tensor_is_named(vlm, tmp_path):
    _, path = vlm
    dst, tensors = _relayout(path, tmp_path / "broken")
    del tensors["language_model.model.layers.1.pre_feedforward_layernorm.weight"]
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(WeightLoadError, match=r"model\.layers\.1\.pre_feedforward_layernorm"):
        load_tiny(dst)
