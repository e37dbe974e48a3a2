"""Loading a model from a checkpoint: a Hugging Face-style directory (config.json + safetensors,
possibly quantized) or a GGUF file (see :mod:`tgraph.io.checkpoint`)."""
from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tgraph.errors import ConfigError, WeightLoadError
from tgraph.io.checkpoint import is_gguf, open_checkpoint, read_config
from tgraph.io.model_config import ModelConfig
from tgraph.io.weights import SafetensorFileLoader, WeightLoader
from tgraph.models.base.llm_config import LlmConfig
from tgraph.models.registry import load_module_map, resolve_model_class
from tgraph.quant import is_quantized

if TYPE_CHECKING:
    from tgraph.rules import Rule

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


class _PlacingLoader(SafetensorFileLoader):
    """A safetensors reader that puts each tensor straight on the device the rules place its
    module on (``device_of(name)``; ``None``: the loader's device), so a model split over GPUs
    never has to fit on the first one."""

    def __init__(self, *args: Any, device_of: Callable[[str], torch.device | None],
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._device_of = device_of

    def _device_for(self, real: str) -> torch.device:
        target = self._device_of(real)
        return self.device if target is None else target


def check_max_model_len(value: Any) -> None:
    """Refuse a ``max_model_len`` that is not ``None`` or an int >= 1.

    Raises:
        ConfigError: naming the value.
    """
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"max_model_len must be None (the model's, capped at 8192) or an int "
                          f">= 1, got {value!r}")


def check_floating(loader: WeightLoader) -> list[str]:
    """One message per dense checkpoint tensor stored in an integer or bool dtype (read from the
    headers: no weight is read). Such a tensor is not a weight a model can use: converted to
    the model's dtype it would compute garbage. Integer storage is read only through a
    quantization scheme (``quantization_config`` in config.json, or a GGUF file), whose parts
    :meth:`~tgraph.io.weights.WeightLoader.non_floating` leaves out."""
    return [f"tensor '{name}' is stored as {str(dtype).removeprefix('torch.')}; expected a "
            "floating dtype (float32, float16, bfloat16 or fp8), or a quantization scheme in "
            "config.json's quantization_config that stores it as integers"
            for name, dtype in loader.non_floating() if not name.endswith(_IGNORED_SUFFIXES)]


def _parse_rules(rules: str | Path | Sequence[Any], module_map: str | Path | None) -> list[Rule]:
    from tgraph.rules import Rule, load_rules

    if isinstance(rules, (str, Path)) or not all(isinstance(r, Rule) for r in rules):
        return load_rules(rules, module_map=module_map)
    return list(rules)


def load_model(model_dir: str | Path, *, dtype: str | torch.dtype | None = "auto",
               device: str | torch.device | None = "auto", max_model_len: int | None = None,
               module_map: str | Path | None = None, rank: int = 0, world_size: int = 1,
               progress: bool | None = None, strict: bool = True,
               rules: str | Path | Sequence[Rule | Mapping[str, Any]] | None = None,
               **llm_options: Any):
    """Build the model for a checkpoint directory, reading this rank's weights.

    Args:
        model_dir: directory with ``config.json`` and ``*.safetensors`` (quantized or not), or
            a ``.gguf`` file.
        dtype, device: ``"auto"`` or explicit.
        max_model_len: longest sequence served (default: the model's max positions, capped at
            8192 to keep rotary tables and block tables small).
        module_map: a Python file registering custom models.
        strict: refuse checkpoint tensors the model does not use.
        rules: injection rules (a YAML file, parsed rule mappings, or :func:`load_rules`'s
            result), checked before any weight is read and applied to the built model. Weights
            of modules the rules place on another device (``kwargs.device``) are read straight
            onto it (guessed from the rules' names, see :func:`tgraph.rules.predict_placement`;
            whatever the guess missed is moved when the rules are applied).
        llm_options: other :class:`LlmConfig` fields (graph, block_size, cuda_graph...).
    """
    model_dir = Path(model_dir)
    check_max_model_len(max_model_len)
    # bad rules fail before loading; their classes may come from the module map
    parsed = _parse_rules(rules, module_map) if rules is not None else None
    if module_map is not None:
        load_module_map(module_map)
    config = read_config(model_dir)
    cls = resolve_model_class(config)
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, config, dev)
    max_len = max_model_len or min(config.max_position_embeddings, 8192)
    llm = LlmConfig(config, dtype=dt, device=dev, max_model_len=max_len, rank=rank,
                    world_size=world_size, **llm_options)
    loader_options = dict(device=dev, dtype=dt, rank=rank, world_size=world_size,
                          progress=progress)
    make_loader = None
    if parsed is not None and any(r.device is not None for r in parsed):
        devices = _rule_devices(parsed)

        def make_loader(path, **options):
            return _PlacingLoader(path, device_of=devices, **options)
    _, loader = open_checkpoint(model_dir, config, make_loader, **loader_options)
    refused = check_floating(loader)
    if refused:  # before any weight is read
        more = f" (and {len(refused) - 1} more)" if len(refused) > 1 else ""
        raise WeightLoadError(refused[0] + more)
    for name in loader.names():
        if name.endswith(_IGNORED_SUFFIXES):
            loader.mark_used(name)
    model = cls(llm, loader)
    unused = loader.unused_names()
    if unused and strict:
        raise WeightLoadError(f"{len(unused)} checkpoint tensors are not used by "
                              f"{cls.__name__}: {unused[:8]}{' ...' if len(unused) > 8 else ''}")
    if parsed is not None:
        from tgraph.rules import apply_rules

        apply_rules(model, parsed)  # before any graph is recorded
    return model


def _rule_devices(rules: Sequence[Rule]) -> Callable[[str], torch.device | None]:
    from tgraph.ir.ops.transfer import placement_device
    from tgraph.rules import predict_placement

    def device_of(name: str) -> torch.device | None:
        label = predict_placement(rules, name)
        return None if label is None else placement_device(label)
    return device_of


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
    resident_bytes: int = 0
    checkpoint_bytes: int = 0
    schemes: dict[str, str] = field(default_factory=dict)  # weight name -> quantization
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
            lines.append(f"resident weight bytes: {self.resident_bytes} (fp32 where not "
                         f"quantized; checkpoint files: {self.checkpoint_bytes} bytes)")
        for name, scheme in self.schemes.items():
            lines.append(f"quantized: {name}: {scheme}")
        lines += [f"ERROR: {p}" for p in self.problems]
        lines += [f"UNUSED tensor: {u}" for u in self.unused]
        lines.append("OK" if self.ok else "FAILED")
        return "\n".join(lines)


def check_model(model_dir: str | Path, module_map: str | Path | None = None,
                chunk_bytes: int = 16 << 20) -> CheckReport:
    """Parse the config and check every expected weight is present with the right shape, and
    that no checkpoint tensor is left unused; report each quantized weight's scheme and the
    bytes the weights take resident. Weights are read onto the ``meta`` device. Then every
    floating-point tensor of the checkpoint is scanned for NaN and Inf, ``chunk_bytes`` at a
    time (memory stays bounded whatever the checkpoint's size); each problem found is
    reported, not only the first."""
    report = CheckReport(str(model_dir))
    config = None
    try:
        if module_map is not None:
            load_module_map(module_map)
        config = read_config(model_dir)
        report.model_type = config.model_type
        cls = resolve_model_class(config)
        report.model_class = cls.__name__
        llm = LlmConfig(config, dtype=torch.float32, device="meta",
                        max_model_len=min(config.max_position_embeddings, 64))
        _, loader = open_checkpoint(model_dir, config, device="meta", dtype=torch.float32,
                                    progress=False)
        report.problems += check_floating(loader)
        for name in loader.names():
            if name.endswith(_IGNORED_SUFFIXES):
                loader.mark_used(name)
        model = cls(llm, loader)
        weights = [(name, p.data) for name, p in model.named_parameters()
                   if p.data is not None and ".rotary." not in f".{name}"]
        report.num_parameters = sum(w.numel() for _, w in weights)
        report.resident_bytes = sum(w.nbytes if is_quantized(w) else w.numel() * w.element_size()
                                    for _, w in _distinct(weights))
        report.checkpoint_bytes = loader.checkpoint_bytes
        report.schemes = {name: w.scheme.describe(w.shape) for name, w in weights
                          if is_quantized(w)}
        report.unused = loader.unused_names()
    except (ConfigError, WeightLoadError) as err:
        report.problems.append(str(err))
    if config is not None:
        try:
            report.problems += scan_nonfinite(model_dir, config, chunk_bytes)
        except WeightLoadError as err:
            report.problems.append(str(err))
    return report


def scan_nonfinite(model_dir: str | Path, config: ModelConfig,
                   chunk_bytes: int = 16 << 20) -> list[str]:
    """One message per floating-point checkpoint tensor holding NaN or Inf values.

    Every tensor of the files is read raw (quantized formats' float parts too), a few rows at a
    time, so memory stays near ``chunk_bytes`` whatever the checkpoint's size.
    """
    path = Path(model_dir)
    if is_gguf(path):
        _, raw = open_checkpoint(path, config, progress=False)
    else:
        raw = SafetensorFileLoader(path, progress=False)  # no quantized view: every part
    problems = []
    try:
        for name in raw.names():
            dtype = raw.stored_dtype(name)
            if dtype is None or not dtype.is_floating_point:
                continue
            nan = inf = 0
            for chunk in raw.iter_chunks(name, chunk_bytes):
                values = chunk.float()
                nan += int(torch.isnan(values).sum())
                inf += int(torch.isinf(values).sum())
            if nan or inf:
                problems.append(f"tensor '{name}' holds {nan} NaN and {inf} Inf values; "
                                "expected finite weights")
    finally:
        raw.close()
    return problems


def _distinct(weights: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """Each weight once (tied weights share their data)."""
    seen: set[int] = set()
    out = []
    for name, w in weights:
        if id(w) not in seen:
            seen.add(id(w))
            out.append((name, w))
    return out
