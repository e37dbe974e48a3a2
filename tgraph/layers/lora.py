"""LoRA adapters: loading a PEFT directory and packing it for the model's (packed) linears.

A PEFT LoRA adapter adds ``scaling * x @ A.T @ B.T`` to a linear's output, with ``A [r, in]``,
``B [out, r]`` and ``scaling = lora_alpha / r`` (``lora_alpha / sqrt(r)`` with ``use_rslora``).

The model runs q/k/v and gate/up as one packed GEMM each. An adapter is packed the same way, so
that one delta covers the packed output: the parts' A matrices are stacked along the rank
(``A_packed [E * R, in]``, the ``e``-th enabled part in rows ``e*R : e*R + r``) and B is
block-diagonal (``B_packed [out_total, E * R]``, a part's output rows times its rank block; a part
the feature does not target gets no block and no delta). ``R`` is the feature's
``max_rank``: every adapter is zero-padded to it, so all adapters have the same shapes and
switching adapters never rebuilds an engine. Zero padding adds exact zeros.

At run time ``A_packed`` is stacked per slot and ``B_packed`` sits beside the base weight (see
:mod:`tgraph.layers.lora_bank`): the linear and its adapters run as one GEMM on the operand that
:func:`lora_shrink_concat` records.
"""
from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tgraph.errors import ConfigError, WeightLoadError
from tgraph.nn import functional as F
from tgraph.nn.tensor import Tensor

__all__ = [
    "LORA_TARGET_MODULES", "LoraAdapter", "LoraTarget", "check_adapter", "find_lora_targets",
    "load_peft_adapter", "lora_shrink_concat", "pack_adapter",
]

# PEFT module names tgraph can adapt, by the packed tgraph module that holds them.
_PACKED: dict[str, tuple[str, tuple[str, ...]]] = {
    "qkv_proj": ("self_attn", ("q_proj", "k_proj", "v_proj")),
    "o_proj": ("self_attn", ("o_proj",)),
    "gate_up_proj": ("mlp", ("gate_proj", "up_proj")),
    "down_proj": ("mlp", ("down_proj",)),
}
LORA_TARGET_MODULES: tuple[str, ...] = tuple(p for _, parts in _PACKED.values() for p in parts)

# e.g. "base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight"
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


@dataclass
class LoraAdapter:
    """One LoRA adapter read from a PEFT directory (weights in fp32 on the CPU).

    Attributes:
        name: the name requests use.
        path: the directory it was read from.
        rank: ``r``.
        alpha: ``lora_alpha``.
        use_rslora: rank-stabilised scaling.
        target_modules: the PEFT module names it adapts (a subset of
            :data:`LORA_TARGET_MODULES`).
        weights: ``(layer, module) -> (A [r, in], B [out, r])``.
    """

    name: str
    path: Path
    rank: int
    alpha: float
    use_rslora: bool
    target_modules: frozenset[str]
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)

    @property
    def scaling(self) -> float:
        """The factor of ``x @ A.T @ B.T``: ``alpha / r`` (``alpha / sqrt(r)`` with rsLoRA)."""
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


def _read_config(path: Path) -> dict[str, Any]:
    config_file = path / "adapter_config.json"
    if not config_file.is_file():
        raise WeightLoadError(f"LoRA adapter {str(path)!r}: missing adapter_config.json (expected "
                              "a PEFT adapter directory saved by save_pretrained)")
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as err:
        raise WeightLoadError(f"LoRA adapter {str(config_file)!r} is not valid JSON: "
                              f"{err}") from None
    if not isinstance(config, dict):
        raise WeightLoadError(f"LoRA adapter {str(config_file)!r} must hold a JSON object")
    return config


def _check_config(config: dict[str, Any], where: str) -> tuple[int, float, bool, frozenset[str]]:
    """Validate the keys tgraph honours and refuse the ones it does not implement."""
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise ConfigError(f"{where}: peft_type {peft_type!r} is not supported; expected LORA")
    r = config.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise ConfigError(f"{where}: 'r' must be a positive int, got {r!r}")
    alpha = config.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise ConfigError(f"{where}: 'lora_alpha' must be a number, got {alpha!r}")
    refused = {"use_dora": bool(config.get("use_dora")),
               "rank_pattern": bool(config.get("rank_pattern")),
               "alpha_pattern": bool(config.get("alpha_pattern")),
               "modules_to_save": bool(config.get("modules_to_save")),
               "bias": config.get("bias", "none") not in (None, "none"),
               "fan_in_fan_out": bool(config.get("fan_in_fan_out"))}
    bad = [k for k, v in refused.items() if v]
    if bad:
        raise ConfigError(f"{where}: {', '.join(bad)} not supported (tgraph serves plain LoRA "
                          "on linear layers)")
    targets = config.get("target_modules")
    if isinstance(targets, str):
        raise ConfigError(f"{where}: target_modules {targets!r} is a regular expression; "
                          f"tgraph needs a list of module names among {list(LORA_TARGET_MODULES)}")
    if not isinstance(targets, list) or not targets:
        raise ConfigError(f"{where}: target_modules must be a non-empty list, got {targets!r}")
    unknown = sorted(set(targets) - set(LORA_TARGET_MODULES))
    if unknown:
        raise ConfigError(f"{where}: unknown target module(s) {unknown}; tgraph adapts "
                          f"{list(LORA_TARGET_MODULES)}")
    return r, float(alpha), bool(config.get("use_rslora", False)), frozenset(targets)


def load_peft_adapter(path: str | Path, name: str | None = None) -> LoraAdapter:
    """Read a PEFT LoRA adapter directory (``adapter_config.json`` +
    ``adapter_model.safetensors``; no pickle is ever read).

    Args:
        path: the adapter directory.
        name: the adapter's name (default: the directory name).

    Returns:
        The adapter, weights in fp32 on the CPU.

    Raises:
        WeightLoadError: a file is missing or unreadable, a tensor is unexpected or has a shape
            that contradicts ``r``, or an A/B pair is incomplete.
        ConfigError: the config uses a feature tgraph does not implement, or names an unknown
            target module.
    """
    from safetensors.torch import load_file

    path = Path(path)
    where = f"LoRA adapter {str(path)!r}"
    if not path.is_dir():
        raise WeightLoadError(f"{where}: no such directory")
    r, alpha, rslora, targets = _check_config(_read_config(path), where)
    weights_file = path / "adapter_model.safetensors"
    if not weights_file.is_file():
        hint = " (adapter_model.bin is pickle and is refused)" \
            if (path / "adapter_model.bin").exists() else ""
        raise WeightLoadError(f"{where}: missing adapter_model.safetensors{hint}")
    tensors = load_file(str(weights_file), device="cpu")
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.search(key)
        if m is None:
            raise WeightLoadError(f"{where}: unexpected tensor {key!r}; expected "
                                  "'...layers.<i>.<self_attn|mlp>.<module>.lora_<A|B>.weight'")
        layer, module, which = int(m.group(1)), m.group(2), m.group(3)
        if module not in targets:
            raise ConfigError(f"{where}: tensor {key!r} adapts {module!r}, which is not in its "
                              f"target_modules {sorted(targets)}")
        want = (r, None) if which == "A" else (None, r)
        if t.dim() != 2 or any(w is not None and w != d for w, d in zip(want, t.shape)):
            raise WeightLoadError(f"{where}: {key!r} has shape {list(t.shape)}; expected "
                                  f"{'[r, in]' if which == 'A' else '[out, r]'} with r={r}")
        parts.setdefault((layer, module), {})[which] = t.float()
    if not parts:
        raise WeightLoadError(f"{where}: adapter_model.safetensors holds no LoRA weights")
    weights = {}
    for (layer, module), ab in parts.items():
        if set(ab) != {"A", "B"}:
            raise WeightLoadError(f"{where}: layer {layer} {module} has lora_{''.join(ab)} but "
                                  "not its pair")
        weights[(layer, module)] = (ab["A"], ab["B"])
    return LoraAdapter(name or path.name, path, r, alpha, rslora, targets, weights)


@dataclass(frozen=True)
class LoraTarget:
    """One model linear that LoRA adapters may change.

    Attributes:
        layer: decoder layer index.
        module: the tgraph module name (``qkv_proj``, ``o_proj``, ``gate_up_proj``,
            ``down_proj``).
        linear: the tgraph linear layer.
        parts: the PEFT module names it packs, in column order.
        part_sizes: output features of each part.
        in_features: input features.
        enabled: the parts adapters may change (the feature's ``target_modules``); each gets a
            rank block in the packed matrices, the others none.
    """

    layer: int
    module: str
    linear: Any
    parts: tuple[str, ...]
    part_sizes: tuple[int, ...]
    in_features: int
    enabled: tuple[str, ...]

    @property
    def key(self) -> str:
        """``"<layer>_<module>"``: the suffix of this target's engine input names."""
        return f"{self.layer}_{self.module}"

    @property
    def out_features(self) -> int:
        return sum(self.part_sizes)

    def width(self, max_rank: int) -> int:
        """The packed rank: one ``max_rank`` block per enabled part."""
        return len(self.enabled) * max_rank


def find_lora_targets(model: Any, target_modules: Iterable[str]) -> list[LoraTarget]:
    """The linears of a Llama-like model (``model.model.layers[i].self_attn/mlp``) that hold a
    module of ``target_modules``; a packed linear is a target if any of its parts is.

    Args:
        model: a ``FlashCausalLM`` whose decoder is ``model.model``.
        target_modules: PEFT module names among :data:`LORA_TARGET_MODULES`.

    Returns:
        The targets, in layer order.

    Raises:
        ConfigError: an unknown module name, or a model without the expected layout.
    """
    wanted = set(target_modules)
    unknown = sorted(wanted - set(LORA_TARGET_MODULES))
    if unknown:
        raise ConfigError(f"LoRA target_modules: unknown {unknown}; expected names among "
                          f"{list(LORA_TARGET_MODULES)}")
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ConfigError(f"LoRA needs a Llama-like model (model.model.layers); "
                          f"{type(model).__name__} has none")
    targets = []
    for i, layer in enumerate(layers):
        for module, (parent, parts) in _PACKED.items():
            if not wanted.intersection(parts):
                continue
            linear = getattr(getattr(layer, parent), module)
            sizes = tuple(getattr(linear, "output_sizes", [linear.out_features]))
            if len(sizes) != len(parts):
                raise ConfigError(f"layer {i} {module}: packs {len(sizes)} parts, expected "
                                  f"{len(parts)} ({', '.join(parts)})")
            enabled = tuple(p for p in parts if p in wanted)
            targets.append(LoraTarget(i, module, linear, parts, sizes, linear.in_features,
                                      enabled))
    return targets


def check_adapter(adapter: LoraAdapter, targets: list[LoraTarget], max_rank: int,
                  num_layers: int) -> None:
    """Check that ``adapter`` fits the model and the feature's settings.

    Raises:
        ConfigError: rank above ``max_rank``, or a module the feature does not adapt.
        WeightLoadError: a layer index or a shape that contradicts the base model.
    """
    where = f"LoRA adapter {adapter.name!r} ({str(adapter.path)!r})"
    if adapter.rank > max_rank:
        raise ConfigError(f"{where}: rank {adapter.rank} exceeds max_rank {max_rank}; raise the "
                          "feature's 'max_rank' setting")
    by_part = {(t.layer, p): (t, t.parts.index(p)) for t in targets for p in t.enabled}
    enabled = {p for t in targets for p in t.enabled}
    for (layer, module), (a, b) in adapter.weights.items():
        if not 0 <= layer < num_layers:
            raise WeightLoadError(f"{where}: layer {layer} out of range; the model has "
                                  f"{num_layers} layers")
        if (layer, module) not in by_part:
            raise ConfigError(f"{where}: adapts {module!r}, which this model's LoRA feature does "
                              f"not target (enabled: {sorted(enabled)}); set the feature's "
                              "'target_modules'")
        target, j = by_part[(layer, module)]
        want_a, want_b = (adapter.rank, target.in_features), (target.part_sizes[j], adapter.rank)
        if tuple(a.shape) != want_a or tuple(b.shape) != want_b:
            raise WeightLoadError(f"{where}: layer {layer} {module} has A {list(a.shape)} and B "
                                  f"{list(b.shape)}; the base model needs A {list(want_a)} and "
                                  f"B {list(want_b)}")


def pack_adapter(adapter: LoraAdapter | None, target: LoraTarget, max_rank: int,
                 scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The packed ``(A [E * max_rank, in], B [out_total, E * max_rank])`` of one target (``E``
    enabled parts), fp32 on the CPU (see the module docstring). Parts the adapter does not adapt
    stay zero.

    Args:
        adapter: the adapter (``None``: all zeros).
        target: the model linear.
        max_rank: the padded rank ``R`` of each part.
        scale: multiplies B (the single-adapter path folds the scaling in).
    """
    width = target.width(max_rank)
    a_packed = torch.zeros(width, target.in_features)
    b_packed = torch.zeros(target.out_features, width)
    if adapter is None:
        return a_packed, b_packed
    row = 0
    for part, size in zip(target.parts, target.part_sizes):
        pair = adapter.weights.get((target.layer, part))
        if pair is not None and part in target.enabled:
            a, b = pair
            r0 = target.enabled.index(part) * max_rank
            a_packed[r0:r0 + adapter.rank] = a
            b_packed[row:row + size, r0:r0 + adapter.rank] = b * scale
        row += size
    return a_packed, b_packed


def lora_shrink_concat(x: Tensor, a_stack: Tensor, scaling: Tensor, token_slots: Tensor,
                       token_order: Tensor, seg_start: Tensor, counters: Tensor, *, lead: int,
                       width: int) -> Tensor:
    """Record the concatenated operand ``[x | scaled shrink]`` of a LoRA linear's single GEMM
    (see ``tgraph.ir.ops.lora``).

    Args:
        x: ``[tokens, in]``; a_stack ``[slots, rank, in]``; scaling fp32 ``[slots]``;
            token_slots int32 ``[tokens]`` (0: no adapter).
        token_order, seg_start: int32 ``[tokens]`` / ``[slots + 1]``: the tokens grouped by
            slot, computed once per step (see
            :meth:`tgraph.models.base.lora_features.MultiLoraDecorator.batch_arrays`).
        counters: the feature's zeroed int32 arrival counters.
        lead: zero columns before slot 1's block; width: columns after ``x``.

    Returns:
        ``[tokens, in + width]``.
    """
    out = F.record("lora_shrink_concat",
                   [x, a_stack, scaling, token_slots, token_order, seg_start, counters],
                   lead=lead, width=width)
    assert not isinstance(out, tuple)
    return out
