"""Which class serves which checkpoint: ``model_type`` / ``architectures`` -> model class.

Models register themselves with :func:`register_model`. A user adds their own by naming a Python
file (a custom module map) that calls :func:`register_model`; nothing is imported implicitly.
"""
from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from tgraph.errors import ConfigError
from tgraph.models.base.config import ModelConfig


@dataclass(frozen=True)
class ModelEntry:
    cls: type
    model_types: tuple[str, ...]
    architectures: tuple[str, ...]


_ENTRIES: list[ModelEntry] = []


def register_model(*, model_types: Sequence[str] = (), architectures: Sequence[str] = ()
                   ) -> Callable[[type], type]:
    """Class decorator registering a model class for HF ``model_type``s / ``architectures``.

    Later registrations win, so a user's module map can override a built-in family.
    """
    if not model_types and not architectures:
        raise TypeError("register_model needs model_types or architectures")

    def decorate(cls: type) -> type:
        _ENTRIES.insert(0, ModelEntry(cls, tuple(model_types), tuple(architectures)))
        return cls

    return decorate


def supported_model_types() -> list[str]:
    _ensure_builtins()
    return sorted({t for e in _ENTRIES for t in e.model_types})


def resolve_model_class(config: ModelConfig) -> type:
    """The class for a config: by ``architectures`` first, then ``model_type``.

    Raises:
        ConfigError: listing the supported model types.
    """
    _ensure_builtins()
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
    """Import a user's Python file that registers models (and config builders)."""
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


def _ensure_builtins() -> None:
    # NOTE: the built-in families register on import; importing them here (not at module load)
    # keeps the registry importable by the families themselves.
    import tgraph.models.llama  # noqa: F401
    import tgraph.models.mistral  # noqa: F401
    import tgraph.models.qwen2  # noqa: F401
    import tgraph.models.qwen3  # noqa: F401
