"""LoRA adapters: loading a PEFT directory and packing it for the model's (packed) linears.

A PEFT LoRA adapter adds ``scaling * x @ A.T @ B.T`` to a linear's output, with ``A [r, in]``,
``B [out, r]`` and ``scaling = lora_alpha / r`` (``lora_alpha / sqrt(r)`` with ``use_rslora``).
``r`` and ``lora_alpha`` may differ per module: ``rank_pattern`` / ``alpha_pattern`` map
regular expressions over the module's name in the base model
(``model.layers.3.self_attn.q_proj``) to that module's rank / alpha, matched by PEFT's rule
(:func:`_pattern_value`).

The model runs q/k/v and gate/up as one packed GEMM each. An adapter is packed the same way, so
that one delta covers the packed output: the parts' A matrices are stacked along the rank
(``A_packed [E * R, in]``, the ``e``-th enabled part in rows ``e*R : e*R + r``) and B is
block-diagonal (``B_packed [out_total, E * R]``, a part's output rows times its rank block; a part
the feature does not target gets no block and no delta). ``R`` is the feature's
``max_rank``: every module is zero-padded to it, whatever its own rank, so all adapters have the
same shapes and switching adapters never rebuilds an engine. Zero padding adds exact zeros.

The features scale each adapter's shrink by one number, :attr:`LoraAdapter.scaling`; a module
whose own scaling differs (patterns) carries the remaining factor in its packed B.

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
# What PEFT puts before the base model's module names in the tensor names it saves.
_PEFT_PREFIX = "base_model.model."


@dataclass
class LoraAdapter:
    """One LoRA adapter read from a PEFT directory (weights in fp32 on the CPU).

    Attributes:
        name: the name requests use.
        path: the directory it was read from.
        alpha: the config's ``lora_alpha`` (a module's own may come from ``alpha_pattern``).
        use_rslora: rank-stabilised scaling (``alpha / sqrt(r)``).
        target_modules: the PEFT module names it adapts (a subset of
            :data:`LORA_TARGET_MODULES`).
        weights: ``(layer, module) -> (A [r, in], B [out, r])``, ``r`` that module's rank.
        ranks: ``(layer, module) -> r`` (the config's ``r``, or its ``rank_pattern`` entry).
        scalings: ``(layer, module) ->`` the factor of that module's ``x @ A.T @ B.T``.
    """

    name: str
    path: Path
    alpha: float
    use_rslora: bool
    target_modules: frozenset[str]
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)
    ranks: dict[tuple[int, str], int] = field(repr=False)
    scalings: dict[tuple[int, str], float] = field(repr=False)

    @property
    def rank(self) -> int:
        """The largest rank of its modules (what the feature's ``max_rank`` must hold)."""
        return max(self.ranks.values())

    @property
    def scaling(self) -> float:
        """The adapter's common factor: its largest module scaling in magnitude (without
        patterns, every module's ``alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA). The LoRA
        features scale the adapter's shrink by it; :meth:`relative_scaling` is the rest."""
        return max(self.scalings.values(), key=abs, default=0.0)

    def relative_scaling(self, key: tuple[int, str]) -> float:
        """``scalings[key] / scaling``: what :func:`pack_adapter` folds into a module's B
        (1.0 for every module of an adapter without patterns)."""
        common = self.scaling
        return self.scalings[key] / common if common else 0.0


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


def _is_rank(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _is_alpha(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _pattern_value(patterns: dict[str, Any], name: str, default: Any) -> Any:
    r"""PEFT's rule (``peft.utils.other.get_pattern_key``) for a module's rank or alpha.

    The first key, in the config's order, that matches the end of ``name`` as a regular
    expression starting at a dot boundary (``re.match(rf"(.*\.)?({key})$", name)``) wins; if none
    matches, an entry keyed by ``name`` itself, else ``default``.
    """
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", name):
            return value
    return patterns.get(name, default)


def _check_pattern(config: dict[str, Any], key: str, noun: str, what: str, ok: Any,
                   where: str) -> dict[str, Any]:
    """``config[key]`` (``rank_pattern`` / ``alpha_pattern``) checked: an object of valid
    regular expressions to ``noun`` values that pass ``ok`` (``what`` says what it expects);
    missing or null: no entries."""
    patterns = config.get(key)
    if patterns is None:
        return {}
    if not isinstance(patterns, dict):
        raise ConfigError(f"{where}: {key!r} must be an object mapping module-name patterns "
                          f"(regular expressions such as 'q_proj' or 'layers\\.0\\..*_proj') to "
                          f"{noun} ({what}s), got {type(patterns).__name__} {patterns!r}")
    for pattern, value in patterns.items():
        try:
            re.compile(rf"(.*\.)?({pattern})$")
        except re.error as err:
            raise ConfigError(f"{where}: {key!r} key {pattern!r} is not a valid regular "
                              f"expression ({err})") from None
        if not ok(value):
            raise ConfigError(f"{where}: {key}[{pattern!r}] must be a {what}, got {value!r}")
    return dict(patterns)


@dataclass(frozen=True)
class _AdapterConfig:
    """The keys of ``adapter_config.json`` that tgraph honours."""

    r: int
    alpha: float
    use_rslora: bool
    targets: frozenset[str]
    rank_pattern: dict[str, int]
    alpha_pattern: dict[str, float]

    def module(self, name: str) -> tuple[int, float]:
        """``(rank, scaling)`` of the module ``name`` (``model.layers.3.self_attn.q_proj``)."""
        r = _pattern_value(self.rank_pattern, name, self.r)
        alpha = float(_pattern_value(self.alpha_pattern, name, self.alpha))
        return r, alpha / (math.sqrt(r) if self.use_rslora else r)


def _check_config(config: dict[str, Any], where: str) -> _AdapterConfig:
    """Validate the keys tgraph honours and refuse the ones it does not implement."""
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise ConfigError(f"{where}: peft_type {peft_type!r} is not supported; expected LORA")
    r = config.get("r")
    if not _is_rank(r):
        raise ConfigError(f"{where}: 'r' must be a positive int, got {r!r}")
    alpha = config.get("lora_alpha", 8)
    if not _is_alpha(alpha):
        raise ConfigError(f"{where}: 'lora_alpha' must be a finite number, got {alpha!r}")
    rslora = config.get("use_rslora", False)
    if not isinstance(rslora, bool) and rslora is not None:
        raise ConfigError(f"{where}: 'use_rslora' must be true or false, got {rslora!r}")
    rank_pattern = _check_pattern(config, "rank_pattern", "ranks", "positive int", _is_rank,
                                  where)
    alpha_pattern = _check_pattern(config, "alpha_pattern", "alphas", "finite number",
                                   _is_alpha, where)
    refused = {"use_dora": bool(config.get("use_dora")),
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
    return _AdapterConfig(r, float(alpha), bool(rslora), frozenset(targets), rank_pattern,
                          alpha_pattern)


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
            that contradicts its module's rank, or an A/B pair is incomplete.
        ConfigError: the config uses a feature tgraph does not implement, names an unknown
            target module, or has a malformed ``r``, ``lora_alpha``, ``use_rslora``,
            ``rank_pattern`` or ``alpha_pattern`` (a pattern that matches no module is fine, as
            in PEFT).
    """
    from safetensors.torch import load_file

    path = Path(path)
    where = f"LoRA adapter {str(path)!r}"
    if not path.is_dir():
        raise WeightLoadError(f"{where}: no such directory")
    config = _check_config(_read_config(path), where)
    weights_file = path / "adapter_model.safetensors"
    if not weights_file.is_file():
        hint = " (adapter_model.bin is pickle and is refused)" \
            if (path / "adapter_model.bin").exists() else ""
        raise WeightLoadError(f"{where}: missing adapter_model.safetensors{hint}")
    tensors = load_file(str(weights_file), device="cpu")
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    ranks: dict[tuple[int, str], int] = {}
    scalings: dict[tuple[int, str], float] = {}
    for key, t in tensors.items():
        m = _KEY.search(key)
        if m is None:
            raise WeightLoadError(f"{where}: unexpected tensor {key!r}; expected "
                                  "'...layers.<i>.<self_attn|mlp>.<module>.lora_<A|B>.weight'")
        layer, module, which = int(m.group(1)), m.group(2), m.group(3)
        if module not in config.targets:
            raise ConfigError(f"{where}: tensor {key!r} adapts {module!r}, which is not in its "
                              f"target_modules {sorted(config.targets)}")
        # the module's name in the base model, which the patterns are matched against
        module_name = key.rsplit(".lora_", 1)[0].removeprefix(_PEFT_PREFIX)
        r, scaling = config.module(module_name)
        want = (r, None) if which == "A" else (None, r)
        if t.dim() != 2 or any(w is not None and w != d for w, d in zip(want, t.shape)):
            raise WeightLoadError(f"{where}: {key!r} has shape {list(t.shape)}; expected "
                                  f"{'[r, in]' if which == 'A' else '[out, r]'} with r={r} "
                                  f"(the rank of {module_name!r})")
        parts.setdefault((layer, module), {})[which] = t.float()
        ranks[(layer, module)], scalings[(layer, module)] = r, scaling
    if not parts:
        raise WeightLoadError(f"{where}: adapter_model.safetensors holds no LoRA weights")
    weights = {}
    for (layer, module), ab in parts.items():
        if set(ab) != {"A", "B"}:
            raise WeightLoadError(f"{where}: layer {layer} {module} has lora_{''.join(ab)} but "
                                  "not its pair")
        weights[(layer, module)] = (ab["A"], ab["B"])
    return LoraAdapter(name or path.name, path, config.alpha, config.use_rslora, config.targets,
                       weights, ranks, scalings)


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
        ConfigError: a module's rank above ``max_rank``, or a module the feature does not adapt.
        WeightLoadError: a layer index or a shape that contradicts the base model.
    """
    where = f"LoRA adapter {adapter.name!r} ({str(adapter.path)!r})"
    if adapter.rank > max_rank:
        layer, module = min(k for k, r in adapter.ranks.items() if r == adapter.rank)
        raise ConfigError(f"{where}: rank {adapter.rank} exceeds max_rank {max_rank} (the "
                          f"largest module rank: layer {layer} {module}); raise the feature's "
                          "'max_rank' setting")
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
        r = adapter.ranks[(layer, module)]
        want_a, want_b = (r, target.in_features), (target.part_sizes[j], r)
        if tuple(a.shape) != want_a or tuple(b.shape) != want_b:
            raise WeightLoadError(f"{where}: layer {layer} {module} has A {list(a.shape)} and B "
                                  f"{list(b.shape)}; the base model needs A {list(want_a)} and "
                                  f"B {list(want_b)}")


def pack_adapter(adapter: LoraAdapter | None, target: LoraTarget, max_rank: int,
                 scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The packed ``(A [E * max_rank, in], B [out_total, E * max_rank])`` of one target (``E``
    enabled parts), fp32 on the CPU (see the module docstring). Parts the adapter does not adapt
    stay zero; a part of rank ``r < max_rank`` fills the first ``r`` rows / columns of its block.

    A part's B is multiplied by ``scale * adapter.relative_scaling(part)``: with the adapter's
    shrink scaled by ``adapter.scaling`` (or ``scale = adapter.scaling``), each part's delta gets
    its own scaling.

    Args:
        adapter: the adapter (``None``: all zeros), checked by :func:`check_adapter`.
        target: the model linear.
        max_rank: the padded rank ``R`` of each part.
        scale: multiplies B (the single-adapter path folds the scaling in).

    Raises:
        ValueError: a part's rank exceeds ``max_rank``.
    """
    width = target.width(max_rank)
    a_packed = torch.zeros(width, target.in_features)
    b_packed = torch.zeros(target.out_features, width)
    if adapter is None:
        return a_packed, b_packed
    row = 0
    for part, size in zip(target.parts, target.part_sizes):
        key = (target.layer, part)
        pair = adapter.weights.get(key)
        if pair is not None and part in target.enabled:
            a, b = pair
            r = adapter.ranks[key]
            if r > max_rank:
                raise ValueError(f"pack_adapter: layer {target.layer} {part} has rank {r} > "
                                 f"max_rank {max_rank} (check_adapter refuses such adapters)")
            r0 = target.enabled.index(part) * max_rank
            a_packed[r0:r0 + r] = a
            b_packed[row:row + size, r0:r0 + r] = b * (scale * adapter.relative_scaling(key))
        row += size
    return a_packed, b_packed


def lora_shrink_concat(x: Tensor, a_stack: Tensor, scaling: Tensor, token_slots: Tensor,
                       token_order: Tensor, seg_start: Tensor, counters: Tensor, *, lead: int,
                       width: int, second: tuple[Tensor, ...] | None = None,
                       second_lead: int = 0, second_width: int = 0) -> Tensor:
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
        second: a second adapter set's ``(a_stack, scaling, token_slots, token_order, seg_start,
            counters)``, whose columns follow: ``second_lead`` zero columns, then its slot
            blocks, up to ``second_width`` columns.

    Returns:
        ``[tokens, in + width + second_width]``.
    """
    inputs = [x, a_stack, scaling, token_slots, token_order, seg_start, counters]
    attrs = {"lead": lead, "width": width}
    if second is not None:
        inputs += list(second)
        attrs.update(second_lead=second_lead, second_width=second_width)
    out = F.record("lora_shrink_concat", inputs, **attrs)
    assert not isinstance(out, tuple)
    return out
