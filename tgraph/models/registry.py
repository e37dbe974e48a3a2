"""Which class serves which checkpoint: ``model_type`` / ``architectures`` -> model class.

The built-in families are a table (:data:`BUILTIN_FAMILIES`) of the ``model_type`` values and
``architectures`` each serves and the module that defines it; a family's module is imported only
when a config asks for one of its names, so resolving a Llama checkpoint imports the Llama family
alone. A model class registers itself with :func:`register_model` when its module is imported. A
user adds their own by naming a Python file (a custom module map, :func:`load_module_map`) that
calls :func:`register_model`; nothing else is imported implicitly.
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from tgraph.errors import ConfigError
from tgraph.io.model_config import ModelConfig

__all__ = ["BUILTIN_FAMILIES", "BuiltinFamily", "ModelEntry", "load_module_map",
           "register_model", "resolve_model_class", "supported_model_types"]


@dataclass(frozen=True)
class BuiltinFamily:
    """A family shipped with tgraph: the names it serves and the module that registers it."""

    module: str
    model_types: tuple[str, ...]
    architectures: tuple[str, ...]

    def serves(self, config: ModelConfig) -> bool:
        """Whether ``config`` names this family (by an architecture or its model type)."""
        return bool(set(config.architectures) & set(self.architectures)) or \
            config.model_type in self.model_types


BUILTIN_FAMILIES: tuple[BuiltinFamily, ...] = (
    BuiltinFamily("tgraph.models.llama", ("llama",), ("LlamaForCausalLM",)),
    BuiltinFamily("tgraph.models.mistral", ("mistral",), ("MistralForCausalLM",)),
    BuiltinFamily("tgraph.models.qwen2", ("qwen2",), ("Qwen2ForCausalLM",)),
    BuiltinFamily("tgraph.models.qwen3", ("qwen3",), ("Qwen3ForCausalLM",)),
    BuiltinFamily("tgraph.models.qwen3_moe", ("qwen3_moe",), ("Qwen3MoeForCausalLM",)),
    BuiltinFamily("tgraph.models.qwen2_moe", ("qwen2_moe",), ("Qwen2MoeForCausalLM",)),
    BuiltinFamily("tgraph.models.mixtral", ("mixtral",), ("MixtralForCausalLM",)),
    BuiltinFamily("tgraph.models.olmo2", ("olmo2", "olmo3"),
                  ("Olmo2ForCausalLM", "Olmo3ForCausalLM")),
    BuiltinFamily("tgraph.models.phi3", ("phi3",), ("Phi3ForCausalLM",)),
    BuiltinFamily("tgraph.models.olmoe", ("olmoe",), ("OlmoeForCausalLM",)),
    BuiltinFamily("tgraph.models.gemma3", ("gemma3_text", "gemma3"),
                  ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")),
)


@dataclass(frozen=True)
class ModelEntry:
    """One registration: a model class and the HF names it serves."""

    cls: type
    model_types: tuple[str, ...]
    architectures: tuple[str, ...]


# Registrations, highest priority first: users' (latest first), then the built-in families'.
_ENTRIES: list[ModelEntry] = []


def register_model(*, model_types: Sequence[str] = (), architectures: Sequence[str] = ()
                   ) -> Callable[[type], type]:
    """Class decorator registering a model class for HF ``model_type`` values / ``architectures``.

    Later registrations win, and a user's registration wins over a built-in family's whenever
    the family is imported, so a user's module map can override a built-in family.

    Args:
        model_types: HF ``model_type`` values the class serves.
        architectures: HF ``architectures`` class names the class serves.

    Returns:
        The decorator (it returns the class unchanged).

    Raises:
        TypeError: neither ``model_types`` nor ``architectures`` is given.
    """
    if not model_types and not architectures:
        raise TypeError("register_model needs model_types or architectures")

    def decorate(cls: type) -> type:
        entry = ModelEntry(cls, tuple(model_types), tuple(architectures))
        if _is_builtin(cls):
            _ENTRIES.append(entry)
        else:
            _ENTRIES.insert(0, entry)
        return cls

    return decorate


def supported_model_types() -> list[str]:
    """Return every model type that can be resolved, without importing any family.

    Returns:
        The sorted union of the built-in table's model types and those registered so far.
    """
    builtin = {t for family in BUILTIN_FAMILIES for t in family.model_types}
    return sorted(builtin | {t for e in _ENTRIES for t in e.model_types})


def resolve_model_class(config: ModelConfig) -> type:
    """Return the class for a config: by ``architectures`` first, then ``model_type``.

    Imports the built-in families that ``config`` names (usually one), and no other.

    Args:
        config: the parsed checkpoint config.

    Returns:
        The registered model class.

    Raises:
        ConfigError: no class serves the config; the message lists the supported model types.
    """
    for family in BUILTIN_FAMILIES:
        if family.serves(config):
            importlib.import_module(family.module)
    for entry in _ENTRIES:
        if set(config.architectures) & set(entry.architectures):
            return entry.cls
    for entry in _ENTRIES:
        if config.model_type in entry.model_types:
            return entry.cls
    raise ConfigError(f"unsupported model_type {config.model_type!r} (architectures "
                      f"{list(config.architectures)}); supported: "
                      f"{', '.join(supported_model_types())}. A custom model can be registered "
                      "from a Python file with --module-map FILE")


def load_module_map(path: str | Path) -> None:
    """Import a user's Python file that registers models (and config builders).

    Args:
        path: the Python file.

    Raises:
        ConfigError: the file does not exist or cannot be imported as a module.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"module map {str(path)!r} does not exist")
    name = f"tgraph_user_module_map_{abs(hash(str(path.resolve())))}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"cannot import module map {str(path)!r}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)


def _is_builtin(cls: type) -> bool:
    module = cls.__module__
    return any(module == f.module or module.startswith(f.module + ".") for f in BUILTIN_FAMILIES)
