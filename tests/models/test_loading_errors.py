"""Bad checkpoints and bad calls fail with errors that say what was expected; ``check_model``
reports the same problems without raising."""
from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.models.conftest import copy_checkpoint, load_tiny
from tgraph.errors import ConfigError, WeightLoadError
from tgraph.models import check_model, load_model
from tgraph.models.base.batch import BatchMeta
from tgraph.testing import PagedBatcher

FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "olmo2", "olmoe", "phi3")
MISSING = "model.layers.1.post_attention_layernorm.weight"
RESHAPED = "model.layers.2.mlp.up_proj.weight"  # [intermediate 96, hidden 64]
EXTRA = "model.layers.0.self_attn.extra_scale"


def edit_weights(path: Path, drop: tuple[str, ...] = (),
                 add: dict[str, torch.Tensor] | None = None) -> Path:
    """Rewrite the single-file checkpoint of ``path`` without ``drop`` and with ``add``."""
    file = path / "model.safetensors"
    tensors = {k: v for k, v in load_file(str(file)).items() if k not in drop}
    tensors.update(add or {})
    save_file(tensors, str(file), metadata={"format": "pt"})
    return path


def edit_config(path: Path, **changes) -> Path:
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture
def llama_copy(tiny_model, tmp_path) -> Path:
    """A private copy of the tiny untied Llama checkpoint."""
    return copy_checkpoint(tiny_model("llama").path, tmp_path / "ckpt")


# ------------------------------------------------------------------------------- config.json
def test_unknown_model_type_lists_supported(llama_copy):
    edit_config(llama_copy, model_type="gpt_fake", architectures=["GptFakeForCausalLM"])
    with pytest.raises(ConfigError) as err:
        load_model(llama_copy, device="cpu")
    msg = str(err.value)
    assert "gpt_fake" in msg
    for family in FAMILIES:
        assert family in msg, f"supported family {family!r} not listed in: {msg}"


def test_malformed_config_json(llama_copy):
    text = (llama_copy / "config.json").read_text()
    (llama_copy / "config.json").write_text(text[: len(text) // 2])  # truncated mid-object
    with pytest.raises(ConfigError, match=r"config\.json.*invalid JSON at line \d+ column \d+"):
        load_model(llama_copy, device="cpu")


def test_missing_config_json(llama_copy):
    (llama_copy / "config.json").unlink()
    with pytest.raises(ConfigError, match="config.json"):
        load_model(llama_copy, device="cpu")


def test_mistyped_config_key_is_named(llama_copy):
    edit_config(llama_copy, num_hidden_layers="three")
    with pytest.raises(ConfigError, match="num_hidden_layers"):
        load_model(llama_copy, device="cpu")


# --------------------------------------------------------------------------------- weights
def test_missing_tensor_is_named(llama_copy):
    edit_weights(llama_copy, drop=(MISSING,))
    with pytest.raises(WeightLoadError, match=f"tensor '{MISSING}' not found"):
        load_model(llama_copy, device="cpu")


def test_missing_untied_lm_head_is_named(llama_copy):
    edit_weights(llama_copy, drop=("lm_head.weight",))
    with pytest.raises(WeightLoadError, match="lm_head.weight") as err:
        load_model(llama_copy, device="cpu")
    assert "tie_word_embeddings" in str(err.value)


def test_wrongly_shaped_tensor_names_it_and_the_expected_shape(llama_copy):
    edit_weights(llama_copy, add={RESHAPED: torch.zeros(97, 64)})
    with pytest.raises(WeightLoadError) as err:
        load_model(llama_copy, device="cpu")
    msg = str(err.value)
    assert RESHAPED in msg and "[97, 64]" in msg and "expected [96, 64]" in msg, msg


def test_unused_extra_tensor_refused_when_strict(llama_copy):
    edit_weights(llama_copy, add={EXTRA: torch.ones(4)})
    with pytest.raises(WeightLoadError, match=EXTRA):
        load_model(llama_copy, device="cpu")
    # strict=False loads and runs the model, ignoring the extra tensor.
    model = load_tiny(llama_copy, strict=False)
    b = PagedBatcher.for_model(model)
    assert torch.isfinite(model.run(b.step([b.add([1, 2, 3])]))).all()


def test_rotary_inv_freq_buffers_are_accepted(llama_copy, tiny_model):
    """Older exports store ``rotary_emb.inv_freq`` buffers: recomputed, so not "unused"."""
    edit_weights(llama_copy, add={"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)})
    model = load_tiny(llama_copy)
    reference = load_tiny(tiny_model("llama").path)
    batches = [PagedBatcher.for_model(m) for m in (model, reference)]
    out = [m.run(b.step([b.add([4, 5, 6])])) for m, b in zip((model, reference), batches)]
    # Not bit-equal: the rewritten file places the weights at other offsets, and the CPU BLAS picks
    # its kernel (so its fp32 summation order) by alignment; a few ulp of fp32 at most. Honouring
    # the stored all-ones inv_freq would change the logits by O(1).
    torch.testing.assert_close(out[0], out[1], rtol=1e-5, atol=1e-5)


def test_pickle_checkpoint_is_refused_and_never_opened(llama_copy):
    (llama_copy / "model.safetensors").unlink()
    marker = llama_copy / "UNPICKLED"

    class Payload:  # unpickling this creates `marker`
        def __reduce__(self):
            return (open, (str(marker), "w"))

    (llama_copy / "pytorch_model.bin").write_bytes(pickle.dumps(Payload()))
    with pytest.raises(WeightLoadError) as err:
        load_model(llama_copy, device="cpu")
    msg = str(err.value)
    assert "pytorch_model.bin" in msg and "pickle" in msg and "safetensors" in msg, msg
    report = check_model(llama_copy)
    assert not report.ok and "pytorch_model.bin" in " ".join(report.problems)
    assert not marker.exists(), "the pickle checkpoint was unpickled"


def test_heads_not_divisible_by_world_size(tiny_model):
    # 4 attention heads over 3 ranks (the vocabulary, 192, does split in 3).
    with pytest.raises(ConfigError) as err:
        load_model(tiny_model("llama").path, device="cpu", rank=0, world_size=3)
    msg = str(err.value)
    assert "num_attention_heads (4)" in msg and "world size (3)" in msg, msg


# ------------------------------------------------------------------------- settings & calls
def test_run_before_allocate_kv_cache(tiny_model):
    model = load_model(tiny_model("llama").path, device="cpu", max_model_len=64)
    meta = BatchMeta([1, 2], [0, 1], [0, 1], [2], [2], [[0]])
    with pytest.raises(ConfigError, match=r"allocate_kv_cache"):
        model.run(meta)


def test_inconsistent_batch_is_refused(tiny_model):
    model = load_tiny(tiny_model("llama").path)
    meta = BatchMeta([1, 2, 3], [0, 1, 2], [0, 1, 2], [2], [3], [[0]])  # query_lens sum to 2
    with pytest.raises(ValueError, match="query_lens"):
        model.run(meta)


def test_position_beyond_max_model_len(tiny_model):
    model = load_tiny(tiny_model("llama").path, max_model_len=8)
    meta = BatchMeta([1], [8], [0], [1], [9], [[0, 1, 2]])
    with pytest.raises(ConfigError, match="max_model_len 8"):
        model.run(meta)


@pytest.mark.parametrize("kwargs, expected", [
    ({"graph": "lazy"}, "static"),
    ({"dtype": "float8"}, "bfloat16"),
    ({"module_map": "/nonexistent/map.py"}, "does not exist"),
])
def test_bad_load_settings(tiny_model, kwargs, expected):
    with pytest.raises(ConfigError, match=expected):
        load_model(tiny_model("llama").path, device="cpu", **kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_cuda_requested_without_cuda(tiny_model):
    with pytest.raises(ConfigError, match="CUDA is not available"):
        load_model(tiny_model("llama").path, device="cuda")


def test_missing_checkpoint_directory(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_model(tmp_path / "nope", device="cpu")


# ------------------------------------------------------------------------------ check_model
@pytest.mark.parametrize("variant", ["llama", "llama3_tied", "qwen2", "qwen3", "mistral"])
def test_check_model_ok(tiny_model, variant):
    tm = tiny_model(variant)
    report = check_model(tm.path)
    assert report.ok, str(report)
    assert report.model_type == tm.family
    assert report.model_class.startswith("Flash") and report.model_class.endswith("ForCausalLM")
    assert report.num_parameters >= sum(p.numel() for p in tm.hf.parameters())
    assert str(report).splitlines()[-1] == "OK"


@pytest.mark.parametrize("variant", ["llama", "qwen3"])
def test_check_model_counts_parameters_like_hf(tiny_model, variant):
    tm = tiny_model(variant)
    assert check_model(tm.path).num_parameters == sum(p.numel() for p in tm.hf.parameters())


def test_check_model_counts_tied_embedding_once(tiny_model, tmp_path):
    # The same shapes untied and tied differ by exactly one vocab x hidden matrix; the rotary
    # tables (counted or not) are the same in both.
    untied = tiny_model("llama").path
    tied = edit_weights(edit_config(copy_checkpoint(untied, tmp_path / "tied"),
                                    tie_word_embeddings=True), drop=("lm_head.weight",))
    difference = check_model(untied).num_parameters - check_model(tied).num_parameters
    assert difference == 192 * 64


def test_check_model_reports_missing_tensor(llama_copy):
    report = check_model(edit_weights(llama_copy, drop=(MISSING,)))
    assert not report.ok
    assert any(MISSING in p for p in report.problems), report.problems
    assert f"ERROR: tensor '{MISSING}'" in str(report) and "FAILED" in str(report)


def test_check_model_reports_wrong_shape(llama_copy):
    report = check_model(edit_weights(llama_copy, add={RESHAPED: torch.zeros(97, 64)}))
    assert not report.ok
    assert any(RESHAPED in p and "expected [96, 64]" in p for p in report.problems), \
        report.problems


def test_check_model_reports_unused_tensor(llama_copy):
    report = check_model(edit_weights(llama_copy, add={EXTRA: torch.ones(4)}))
    assert not report.ok and not report.problems
    assert report.unused == [EXTRA]
    assert f"UNUSED tensor: {EXTRA}" in str(report) and "FAILED" in str(report)


def test_check_model_reports_bad_config(llama_copy):
    report = check_model(edit_config(llama_copy, model_type="gpt_fake", architectures=[]))
    assert not report.ok and "gpt_fake" in report.problems[0]
