"""Which reader opens a checkpoint: a Hugging Face directory (safetensors, possibly quantized:
compressed-tensors, GPTQ, AWQ, FP8) or a GGUF file, each giving the model config, a
:class:`~tgraph.io.weights.WeightLoader` and the tokenizer.

Quantized formats are repacked at load into :mod:`tgraph.quant`'s layouts; a scheme or layout
tgraph does not support is refused before any weight is read.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from tgraph.errors import ConfigError
from tgraph.io.model_config import ModelConfig
from tgraph.io.weights import SafetensorFileLoader, WeightLoader

__all__ = ["check_model_path", "is_gguf", "load_tokenizer", "open_checkpoint",
           "quantization_of"]


def is_gguf(path: str | Path) -> bool:
    """Whether ``path`` names a GGUF file."""
    p = Path(path)
    if p.suffix.lower() == ".gguf":
        return True
    if not p.is_file():
        return False
    with p.open("rb") as f:
        return f.read(4) == b"GGUF"


def quantization_of(config: ModelConfig) -> dict[str, Any] | None:
    """The ``quantization_config`` of a Hugging Face checkpoint's ``config.json``, if any."""
    raw = config.hf_config.get("quantization_config") if config.hf_config else None
    return dict(raw) if raw else None


def check_model_path(path: str | Path) -> Path:
    """Refuse a model path that is neither a directory nor a GGUF file (before anything is read).

    Raises:
        ConfigError: the path does not exist, or is another kind of file.
    """
    p = Path(path)
    if p.is_dir() or is_gguf(p):
        return p
    if not p.exists():
        raise ConfigError(f"model path '{p}' not found; expected a model directory "
                          "(config.json + safetensors) or a .gguf file")
    raise ConfigError(f"model path '{p}' is a file, not a model directory; expected a model "
                      "directory (config.json + safetensors) or a .gguf file")


def read_config(path: str | Path) -> ModelConfig:
    """The model config of a checkpoint directory or GGUF file.

    Raises:
        ConfigError: the path is neither, or its config is invalid.
    """
    check_model_path(path)
    if is_gguf(path):
        from tgraph.io.gguf import gguf_model_config

        return gguf_model_config(Path(path))
    return ModelConfig.from_dir(path)


def open_checkpoint(path: str | Path, config: ModelConfig | None = None,
                    make_loader: Callable[..., WeightLoader] | None = None,
                    **loader_options: Any) -> tuple[ModelConfig, WeightLoader]:
    """The config and a weight loader of the checkpoint at ``path``.

    Args:
        path: a Hugging Face model directory or a ``.gguf`` file.
        config: the config, when the caller read it already.
        make_loader: builds the safetensors loader of a directory (default
            :class:`SafetensorFileLoader`); e.g. one that places weights per device.
        loader_options: device, dtype, rank, world_size, progress.

    Raises:
        WeightLoadError: an unsupported quantization scheme or layout (before any weight is read).
    """
    path = Path(path)
    config = config or read_config(path)
    if is_gguf(path):
        from tgraph.io.gguf import GGUFLoader

        return config, GGUFLoader(path, config, **loader_options)
    loader = (make_loader or SafetensorFileLoader)(path, **loader_options)
    quant = quantization_of(config)
    if quant is not None:
        from tgraph.io.hf_quant import register_hf_quantized

        register_hf_quantized(loader, config, quant)
    return config, loader


def load_tokenizer(path: str | Path) -> Any:
    """The checkpoint's tokenizer (transformers), or ``None`` when it ships none.

    Raises:
        ConfigError: the path is not a model directory or GGUF file, or the tokenizer cannot be
            built (e.g. it needs the checkpoint's own code: tgraph never runs it).
    """
    p = check_model_path(path)
    from transformers import AutoTokenizer

    if is_gguf(p):
        from tgraph.io.gguf import gguf_parts
        from tgraph.io.gguf_tokenizer import load_gguf_tokenizer

        return load_gguf_tokenizer(gguf_parts(p)[0])  # a split model's vocabulary: first part
    if not any((p / f).exists() for f in ("tokenizer.json", "tokenizer_config.json",
                                          "tokenizer.model")):
        return None
    # NOTE: trust_remote_code=False makes transformers refuse a tokenizer whose code ships with
    # the checkpoint (auto_map) instead of asking on stdin; tgraph never runs such code.
    try:
        return AutoTokenizer.from_pretrained(str(p), trust_remote_code=False)
    except Exception as err:  # transformers raises ValueError, OSError... for unusable files
        cause = " ".join(str(err).split())
        raise ConfigError(f"cannot load the tokenizer of '{p}' (expected one transformers "
                          f"builds without the checkpoint's own code): {type(err).__name__}: "
                          f"{cause}; pass a tokenizer object instead (LLM(..., tokenizer=...))"
                          ) from err
