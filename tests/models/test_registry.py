"""The model registry: built-in families, lookup order, and user module maps."""
from __future__ import annotations

import importlib
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.models.conftest import PROMPTS, copy_checkpoint, load_tiny, relative_error
from tgraph.errors import ConfigError
from tgraph.io.model_config import ModelConfig
from tgraph.models import (
    check_model,
    load_model,
    register_model,
    resolve_model_class,
    supported_model_types,
)
from tgraph.models.llama import FlashLlamaForCausalLM
from tgraph.models.mistral import FlashMistralForCausalLM
from tgraph.models.qwen2 import FlashQwen2ForCausalLM
from tgraph.models.qwen3 import FlashQwen3ForCausalLM
from tgraph.testing import PagedBatcher, hf_logits, tiny_hf_config

# fp32 on both sides; see test_families.py for the justification of 1e-4 x max|logit|.
REL_TOL = 1e-4

BUILTIN = {"llama": FlashLlamaForCausalLM, "qwen2": FlashQwen2ForCausalLM,
           "qwen3": FlashQwen3ForCausalLM, "mistral": FlashMistralForCausalLM}

# A user's module map: a Llama whose logits are scaled by the config's "logit_scale" (a Gemma-
# or Cohere-like twist), registered with a config builder for its made-up model_type.
TWIST_MAP = '''
from tgraph.io.model_config import ModelConfig, parse_common_fields, register_config_builder
from tgraph.models.base.graph import torch_to_graph
from tgraph.models.llama.modeling import LlamaLikeForCausalLM
from tgraph.models.registry import register_model


def _build(d):
    return ModelConfig(**parse_common_fields(d))


register_config_builder("tinytwist", lambda d: d.get("model_type") == "tinytwist", _build)


@register_model(model_types=("tinytwist",), architectures=("TinyTwistForCausalLM",))
@torch_to_graph()
class FlashTinyTwistForCausalLM(LlamaLikeForCausalLM):
    def forward(self, **kwargs):
        logits = super().forward(**kwargs)["model_out"]
        return {"model_out": logits * self.config.hf_config["logit_scale"]}
'''


@pytest.fixture
def isolated_registry(monkeypatch):
    """Registrations made by a test are undone afterwards (the registries are module lists)."""
    from tgraph.io import model_config
    from tgraph.models import registry

    # Import every family first: one first imported inside the test would register into the
    # copy only, and stay unregistered (its module already imported) after the test.
    for family in registry.BUILTIN_FAMILIES:
        importlib.import_module(family.module)
    monkeypatch.setattr(registry, "_ENTRIES", list(registry._ENTRIES))
    monkeypatch.setattr(model_config, "_BUILDERS", list(model_config._BUILDERS))


def config_dict(family: str, **changes) -> dict:
    d = tiny_hf_config(family).to_dict()
    d.update(changes)
    return d


def write_map(path: Path, text: str) -> Path:
    path.write_text(textwrap.dedent(text))
    return path


def test_supported_model_types_lists_the_builtins():
    assert set(BUILTIN) <= set(supported_model_types())


@pytest.mark.parametrize("family", list(BUILTIN))
def test_builtin_families_resolve(family):
    d = config_dict(family)
    assert resolve_model_class(ModelConfig.from_dict(d)) is BUILTIN[family]
    d["architectures"] = []  # model_type alone is enough
    assert resolve_model_class(ModelConfig.from_dict(d)) is BUILTIN[family]


def test_architectures_take_priority_over_model_type():
    d = config_dict("llama", architectures=["MistralForCausalLM"])
    assert resolve_model_class(ModelConfig.from_dict(d)) is FlashMistralForCausalLM


# Run in a fresh interpreter: which family modules does resolving one config import?
RESOLVE_SCRIPT = '''
import json, sys
from tgraph.io.model_config import ModelConfig
from tgraph.models import resolve_model_class, supported_model_types
from tgraph.models.registry import register_model

def families():
    return sorted({m.split(".")[2] for m in sys.modules
                   if m.split(".")[:2] == ["tgraph", "models"] and len(m.split(".")) > 2
                   and m.split(".")[2] in ("llama", "mistral", "qwen2", "qwen3")})

listed = supported_model_types()
before = families()
if sys.argv[2] == "user":
    @register_model(model_types=(json.loads(sys.argv[1])["model_type"],))
    class UserModel:
        pass
cls = resolve_model_class(ModelConfig.from_dict(json.loads(sys.argv[1])))
print(json.dumps({"listed": listed, "before": before, "after": families(),
                  "class": cls.__name__}))
'''


def _resolve_in_subprocess(family: str, user: bool = False) -> dict:
    d = {"model_type": family, "architectures": [], "vocab_size": 32, "hidden_size": 16,
         "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2}
    run = subprocess.run([sys.executable, "-c", RESOLVE_SCRIPT, json.dumps(d),
                          "user" if user else "-"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("family, imported", [("llama", ["llama"]),
                                               ("qwen3", ["llama", "qwen3"])])
def test_resolving_a_family_imports_that_family_only(family, imported):
    # Qwen3 builds on the Llama family's classes, so it imports llama too; no other family.
    got = _resolve_in_subprocess(family)
    assert got["before"] == []  # listing the supported types imported nothing
    assert set(BUILTIN) <= set(got["listed"])
    assert got["after"] == imported
    assert got["class"] == BUILTIN[family].__name__


def test_a_user_registration_wins_over_a_family_imported_after_it():
    got = _resolve_in_subprocess("llama", user=True)
    assert got["after"] == ["llama"] and got["class"] == "UserModel"


def test_register_model_needs_a_key():
    with pytest.raises(TypeError, match="model_types or architectures"):
        register_model()


def test_custom_module_map_is_loaded_and_used(isolated_registry, tiny_model, tmp_path):
    tm = tiny_model("llama")
    ckpt = copy_checkpoint(tm.path, tmp_path / "twist")
    config = json.loads((ckpt / "config.json").read_text())
    config.update(model_type="tinytwist", architectures=["TinyTwistForCausalLM"], logit_scale=0.5)
    (ckpt / "config.json").write_text(json.dumps(config))

    with pytest.raises(ConfigError, match="tinytwist"):  # a module map is never guessed
        load_model(ckpt, device="cpu")

    module_map = write_map(tmp_path / "my_models.py", TWIST_MAP)
    model = load_tiny(ckpt, module_map=module_map)
    assert type(model).__name__ == "FlashTinyTwistForCausalLM"
    assert "tinytwist" in supported_model_types()
    b = PagedBatcher.for_model(model)
    logits = model.run(b.step([b.add(PROMPTS[0])], all_logits=True))
    # The twist is applied: half of the plain Llama logits.
    ref = 0.5 * hf_logits(tm.hf, PROMPTS[0])
    assert relative_error(logits, ref) <= REL_TOL
    assert relative_error(logits, 2 * ref) > 0.4  # a run without the twist would be caught
    assert check_model(ckpt, module_map=module_map).ok


def test_module_map_overrides_a_builtin_family(isolated_registry, tiny_model, tmp_path):
    """Later registrations win: a module map can replace the class serving ``llama``."""
    module_map = write_map(tmp_path / "override.py", '''
        from tgraph.models.base.graph import torch_to_graph
        from tgraph.models.llama.modeling import LlamaLikeForCausalLM
        from tgraph.models.registry import register_model

        @register_model(model_types=("llama",), architectures=("LlamaForCausalLM",))
        @torch_to_graph()
        class MyLlama(LlamaLikeForCausalLM):
            pass
        ''')
    model = load_tiny(tiny_model("llama").path, module_map=module_map)
    assert type(model).__name__ == "MyLlama"


def test_module_map_errors(isolated_registry, tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_model(tmp_path, module_map=tmp_path / "missing.py")
    broken = write_map(tmp_path / "broken.py", "raise RuntimeError('user map failed')\n")
    with pytest.raises(RuntimeError, match="user map failed"):
        load_model(tmp_path, module_map=broken)
