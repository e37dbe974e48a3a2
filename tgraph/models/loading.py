"""Loading a model from a Hugging Face-style directory (config.json + safetensors)."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tgraph.errors import ConfigError, WeightLoadError
from tgraph.models.base.config import ModelConfig
from tgraph.models.base.llm_config import LlmConfig
from tgraph.models.base.weight_loader import SafetensorFileLoader
from tgraph.models.registry import load_module_map, resolve_model_class

logger = logging.getLogger("tgraph.models")

# Checkpoint tensors that carry no weights of ours (recomputed buffers of older exports).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
           "fp16": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def resolve_dtype(name: str | torch.dtype | None, config: ModelConfig,
                  device: torch.device) -> torch.dtype:
    """``"auto"``: the checkpoint's dtype on CUDA, float32 on CPU (CPU half math is slow)."""
    if isinstance(name, torch.dtype):
        return name
    if name in (None, "auto"):
        if device.type == "cpu":
            return torch.float32
        return _DTYPES.get(config.torch_dtype or "bfloat16", torch.bfloat16)
    if name not in _DTYPES:
        raise ConfigError(f"unknown dtype {name!r}; expected auto or one of {sorted(_DTYPES)}")
    return _DTYPES[name]


def resolve_device(name: str | torch.device | None) -> torch.device:
    if name in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {name!r} requested but CUDA is not available")
    return device


def load_model(model_dir: str | Path, *, dtype: str | torch.dtype | None = "auto",
               device: str | torch.device | None = "auto", max_model_len: int | None = None,
               module_map: str | Path | None = None, rank: int = 0, world_size: int = 1,
               progress: bool | None = None, strict: bool = True, **llm_options: Any):
    """Build the model for a checkpoint directory, reading this rank's weights.

    Args:
        model_dir: directory with ``config.json`` and ``*.safetensors``.
        dtype, device: ``"auto"`` or explicit.
        max_model_len: longest sequence served (default: the model's max positions, capped at
            8192 to keep rotary tables and block tables small).
        module_map: a Python file registering custom models.
        strict: refuse checkpoint tensors the model does not use.
        llm_options: other :class:`LlmConfig` fields (graph, block_size, cuda_graph...).
    """
    model_dir = Path(model_dir)
    if module_map is not None:
        load_module_map(module_map)
    config = ModelConfig.from_dir(model_dir)
    cls = resolve_model_class(config)
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, config, dev)
    max_len = max_model_len or min(config.max_position_embeddings, 8192)
    llm = LlmConfig(config, dtype=dt, device=dev, max_model_len=max_len, rank=rank,
                    world_size=world_size, **llm_options)
    loader = SafetensorFileLoader(model_dir, device=dev, dtype=dt, rank=rank,
                                  world_size=world_size, progress=progress)
    for name in loader.names():
        if name.endswith(_IGNORED_SUFFIXES):
            loader.mark_used(name)
    model = cls(llm, loader)
    unused = loader.unused_names()
    if unused and strict:
        raise WeightLoadError(f"{len(unused)} checkpoint tensors are not used by "
                              f"{cls.__name__}: {unused[:8]}{' ...' if len(unused) > 8 else ''}")
    return model


def build_model(config: ModelConfig, loader, **llm_options: Any):
    """Build the model of ``config`` from any weight loader (e.g. random weights in memory)."""
    cls = resolve_model_class(config)
    llm = LlmConfig(config, dtype=loader.dtype or torch.float32, device=loader.device,
                    rank=loader.rank, world_size=loader.world_size, **llm_options)
    return cls(llm, loader)


@dataclass
class CheckReport:
    """What ``tgraph check-model`` found."""

    model_dir: str
    model_type: str = ""
    model_class: str = ""
    num_parameters: int = 0
    problems: list[str] = field(default_factory=list)
    unused: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems and not self.unused

    def __str__(self) -> str:
        lines = [f"model dir: {self.model_dir}", f"model_type: {self.model_type or '?'}",
                 f"class: {self.model_class or '?'}"]
        if self.num_parameters:
            lines.append(f"parameters: {self.num_parameters:,}")
        lines += [f"ERROR: {p}" for p in self.problems]
        lines += [f"UNUSED tensor: {u}" for u in self.unused]
        lines.append("OK" if self.ok else "FAILED")
        return "\n".join(lines)


def check_model(model_dir: str | Path, module_map: str | Path | None = None) -> CheckReport:
    """Parse the config and check every expected weight is present with the right shape, and
    that no checkpoint tensor is left unused. Weights are read onto the ``meta`` device."""
    report = CheckReport(str(model_dir))
    try:
        if module_map is not None:
            load_module_map(module_map)
        config = ModelConfig.from_dir(model_dir)
        report.model_type = config.model_type
        cls = resolve_model_class(config)
        report.model_class = cls.__name__
        llm = LlmConfig(config, dtype=torch.float32, device="meta",
                        max_model_len=min(config.max_position_embeddings, 64))
        loader = SafetensorFileLoader(model_dir, device="meta", dtype=torch.float32,
                                      progress=False)
        for name in loader.names():
            if name.endswith(_IGNORED_SUFFIXES):
                loader.mark_used(name)
        model = cls(llm, loader)
        report.num_parameters = sum(p.data.numel() for name, p in model.named_parameters()
                                    if p.data is not None and ".rotary." not in f".{name}")
        report.unused = loader.unused_names()
    except (ConfigError, WeightLoadError) as err:
        report.problems.append(str(err))
    return report
