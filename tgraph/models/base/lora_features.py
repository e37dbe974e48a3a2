"""LoRA feature decorators: one adapter for every request, or one adapter per request, or both.

Both features run every adapted linear as one GEMM (see ``tgraph.ir.ops.lora``)::

    y = [x | xa] @ [W | B blocks].T

``lora_shrink_concat`` writes the operand ``[x | xa]`` (``xa``: each token's scaled shrink
``scaling * x @ A.T`` in its adapter's column block, zeros elsewhere), and the B matrices live
beside the base weight in one storage per target linear (:mod:`tgraph.layers.lora_bank`)::

    storage = [W | multi_lora: slot 1 | ... | slot max_loras | single_lora: its slot]

one region per feature that targets the linear, each padded to 8 columns. The base model's
weight becomes the view ``storage[:, :K]``: the weight is held once, and the base engine runs on
the view. The multi-LoRA GEMM runs on ``storage[:, :K + multi region]``, paying no column for the
other feature: multi's mixed batches are the throughput case. The single-LoRA GEMM runs on the
whole storage, its shrink writing zeros into multi's columns.

A single adapter is merged into the target weights by default (``merge``; see
:class:`SingleLoraDecorator`): the base and multi-LoRA engines then serve it, and it owns no
columns. What follows is the single adapter recorded in engines (``merge: false``, or a quantized
base).

Stacking. The features declare each other compatible: while a single adapter is active and
requests also name multi-LoRA adapters (``BatchMeta.loras``), the batch runs one engine built for
both, whose adapted linears apply ``W x + B1 A1 x + B_r A_r x``. Recording gives each adapted
linear one shrink with two adapter sets, in storage order (:class:`_LoraLinear`; see
``tgraph.ir.ops.lora``): multi's stack and single's A both shrink the same ``x``, in one
kernel launch (with the RMSNorm before it folded in by ``LoraPrologue``, as for one set)::

    xcat = lora_shrink_concat(x, <multi set>, <single set>) = [x | multi region | single region]
    y = xcat @ storage.T

still one GEMM on the same storage. Requests that name no multi adapter sit in multi's slot 0 and
get the single delta alone, so a batch may mix them freely.

The layout is decided once, lazily, when any LoRA feature of the model first loads an adapter or
records a graph, for all its LoRA features together, so it never changes afterwards. Engines built
before (the base model's) are rebound to the views with ``Engine.set_weights`` and their captured
graphs released (captured again on the next step); a model that never uses LoRA keeps its
weights as they were.

Multi-LoRA's A matrices (stacked per slot, every adapter padded to ``max_rank``), each feature's
per-slot scaling and the shrink kernel's arrival counters are engine *inputs* of fixed shapes in
resident buffers; single-LoRA's A, like every B, is a weight its engines hold by reference (one
tensor per target, shared by the single-LoRA and the stacked engines).
Loading, activating or unloading an adapter rewrites them and the storage's B columns in place:
no engine is rebuilt, and captured graphs read the new weights at their next replay. Both
features pad their per-token arrays for prefill CUDA graphs (pad tokens in multi's slot 0), so
LoRA prefills replay captured graphs at token buckets as base prefills do.

Tensor parallelism: an adapter is split as its base linear is, when it is read. Column-parallel
linears (q/k/v, gate/up) keep A whole and take their rows of B (by heads for q/k/v, replicated
KV heads included); row-parallel ones (o, down) take their columns of A and keep B whole, so each
rank's GEMM yields its partial sum ``x_r W_r + B (A_r x_r)``, and the base linear's one
all-reduce sums both.

Settings (``LlmConfig.features["single_lora"]`` / ``["multi_lora"]``; ``LLM`` fills them from
``llm.lora``):
    ``max_rank`` (16): the largest adapter rank accepted.
    ``target_modules`` (all of q/k/v/o/gate/up/down_proj): which linears get a delta.
    ``max_loras`` (4, multi only): adapters loaded at once.
    ``merge`` (true, single only): merge the active adapter into dense target weights.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tgraph.errors import ConfigError
from tgraph.ir.ops.lora import LORA_COUNTER_SLOTS
from tgraph.layers.linear import RowParallelLinear
from tgraph.layers.lora import (
    LORA_TARGET_MODULES,
    LoraAdapter,
    LoraTarget,
    check_adapter,
    find_lora_targets,
    load_peft_adapter,
    lora_shrink_concat,
    pack_adapter,
)
from tgraph.layers.lora_bank import LoraWeightBank, aligned_width, attach_bank
from tgraph.layers.lora_merge import MergedAdapter
from tgraph.models.base.batch import BatchMeta
from tgraph.models.base.features import FeatureDecorator
from tgraph.nn import distributed
from tgraph.nn import functional as F
from tgraph.nn.module import Parameter
from tgraph.nn.tensor import Tensor
from tgraph.quant import is_quantized

__all__ = ["MultiLoraDecorator", "SingleLoraDecorator", "shard_adapter"]


class _LoraFeature(FeatureDecorator):
    """What both LoRA features share: settings, targets, the shared weight storage and their
    stage of the target linears' recorded GEMM."""

    # Where the feature's region sits in a shared storage: lower first (see the module docstring).
    bank_order: int = 0
    # Prefix of the feature's engine input names (two stacked features' must differ).
    input_prefix: str = "lora_"
    pads_prefill = True
    # The settings this feature takes (LlmConfig.features[name]).
    setting_names: frozenset[str] = frozenset({"max_rank", "target_modules"})

    def __init__(self, model: Any, settings: dict | None = None) -> None:
        super().__init__(model, settings)
        unknown = sorted(set(self.settings) - self.setting_names)
        if unknown:
            raise ConfigError(f"feature {self.name!r}: unknown settings {unknown}; expected "
                              f"{sorted(self.setting_names)}")
        self.max_rank = int(self.settings.get("max_rank", 16))
        if self.max_rank < 1:
            raise ConfigError(f"feature {self.name!r}: max_rank must be >= 1, got {self.max_rank}")
        self.target_modules = tuple(self.settings.get("target_modules", LORA_TARGET_MODULES))
        self._targets: list[LoraTarget] | None = None
        self._banks: dict[str, LoraWeightBank] | None = None
        self._gemm_weights: dict[str, Parameter] = {}
        self._wrapped: list[Any] = []

    # ---- model facts -----------------------------------------------------------------------------
    @property
    def targets(self) -> list[LoraTarget]:
        """The linears this feature adapts (found on first use; this rank's shards under tensor
        parallelism)."""
        if self._targets is None:
            self._targets = find_lora_targets(self.model, self.target_modules)
        return self._targets

    @property
    def banks(self) -> dict[str, LoraWeightBank]:
        """Each target's weight storage by target key (laid out on first use, for every LoRA
        feature of the model at once; see the module docstring)."""
        if self._banks is None:
            _lay_out_banks(self.model, self)
        assert self._banks is not None
        return self._banks

    def region_width(self, target: LoraTarget) -> int:
        """Columns this feature owns in ``target``'s storage."""
        raise NotImplementedError

    @property
    def takes_columns(self) -> bool:
        """Whether the feature owns columns in its targets' storage (records its own GEMM)."""
        return True

    @property
    def _dtype(self) -> torch.dtype:
        return self.model.llm_config.dtype

    @property
    def _device(self) -> torch.device:
        return self.model.llm_config.device

    def _read(self, name: str, path: str | Path) -> LoraAdapter:
        if not isinstance(name, str) or not name:
            raise ValueError(f"feature {self.name!r}: an adapter name must be a non-empty str, "
                             f"got {name!r}")
        adapter = shard_adapter(load_peft_adapter(path, name), self.targets)
        check_adapter(adapter, self.targets, self.max_rank,
                      self.model.llm_config.model.num_hidden_layers)
        return adapter

    def _shared_inputs(self, is_prefill: bool, num_slots: int) -> dict[str, Tensor]:
        """The symbolic inputs every adapted linear of the graph reads."""
        tokens = "num_tokens" if is_prefill else "batch"
        specs = {"scaling": (torch.float32, (num_slots,)),
                 "token_slots": (torch.int32, (tokens,)),
                 "token_order": (torch.int32, (tokens,)),
                 "seg_start": (torch.int32, (num_slots + 1,)),
                 "counters": (torch.int32, (LORA_COUNTER_SLOTS,))}
        p = self.input_prefix
        return {p + name: Tensor(p + name, dtype, shape) for name, (dtype, shape) in specs.items()}

    # ---- recording -------------------------------------------------------------------------------
    def _gemm_weight(self, target: LoraTarget) -> Parameter:
        """``[W | B regions up to this feature's]``: the weight of the target's single GEMM when
        this feature's region is the last one the graph uses."""
        weight = self._gemm_weights.get(target.key)
        if weight is None:
            weight = Parameter(self.banks[target.key].prefix(self.name),
                               name=f"{self.name}.{target.key}.weight_cat")
            self._gemm_weights[target.key] = weight
        return weight

    def _a_operand(self, target: LoraTarget, inputs: dict[str, Tensor]) -> Tensor:
        """The stacked A ``[slots, rank, in_features]`` the shrink of ``target`` reads."""
        raise NotImplementedError

    def adapter_set(self, target: LoraTarget, inputs: dict[str, Tensor]) -> tuple[Tensor, ...]:
        """This feature's inputs to ``target``'s shrink: ``(a_stack, scaling, token_slots,
        token_order, seg_start, counters)``."""
        p = self.input_prefix
        return (self._a_operand(target, inputs), inputs[p + "scaling"], inputs[p + "token_slots"],
                inputs[p + "token_order"], inputs[p + "seg_start"], inputs[p + "counters"])

    def _wrap(self, inputs: dict[str, Tensor]) -> None:
        """Add this feature's stage to every target linear while recording (a linear that
        another LoRA feature of the graph wrapped already gets a second stage)."""
        for target in self.targets:
            linear = target.linear
            wrapper = linear.__dict__.get("forward")
            if not isinstance(wrapper, _LoraLinear):
                wrapper = _LoraLinear(target, self.banks[target.key])
                # NOTE: an instance attribute shadows the class's forward; exit_graph deletes it.
                object.__setattr__(linear, "forward", wrapper)
            wrapper.stages.append((self, inputs))
            self._wrapped.append(linear)

    def enter_graph(self, inputs: dict[str, Tensor]) -> None:
        self._wrap(inputs)

    def exit_graph(self) -> None:
        for linear in self._wrapped:
            linear.__dict__.pop("forward", None)
        self._wrapped.clear()


class _LoraLinear:
    """A target linear while a graph with LoRA features is recorded: one shrink writes the
    operand, the features' adapter sets in storage order (two at most: the op's first and
    second set), then one GEMM on the storage up to the last region (two GEMMs on a quantized
    base), then the linear's all-reduce if it is row-parallel.
    """

    def __init__(self, target: LoraTarget, bank: LoraWeightBank) -> None:
        self.target, self.bank = target, bank
        self.stages: list[tuple[_LoraFeature, dict[str, Tensor]]] = []

    def __call__(self, x: Tensor) -> Tensor:
        linear, bank = self.target.linear, self.bank
        stages = sorted(self.stages, key=lambda stage: bank.lead(stage[0].name))
        if len(stages) > 2:
            raise ConfigError(f"LoRA: {self.target.key} is adapted by {len(stages)} features; "
                              "one shrink takes two adapter sets at most")
        (head, head_inputs), *rest = stages
        end = bank.width(head.name)  # LoRA columns of the first set
        second = {}
        if rest:
            # The second set's columns follow the first's region, laid out as in the storage.
            feature, inputs = rest[0]
            second = dict(second=feature.adapter_set(self.target, inputs),
                          second_lead=bank.lead(feature.name) - end,
                          second_width=bank.width(feature.name) - end)
        xcat = lora_shrink_concat(x, *head.adapter_set(self.target, head_inputs),
                                  lead=bank.lead(head.name), width=end,
                                  **second)  # (tokens, in + LoRA columns up to the last region)
        before = bank.width(stages[-1][0].name)  # LoRA columns of xcat
        weight = stages[-1][0]._gemm_weight(self.target)
        if bank.quantized:  # the packed base weight and the dense B columns: two GEMMs
            k = linear.in_features
            xa = F.slice(xcat, -1, k, k + before)  # (tokens, LoRA columns)
            out = linear._linear(x, linear.weight, linear.bias) + F.linear(xa, weight)
        else:
            out = F.linear(xcat, weight, linear.bias)
        if isinstance(linear, RowParallelLinear) and linear.world_size > 1 \
                and linear.reduce_output:
            # each rank's x_r W_r + B (A_r x_r): one all-reduce sums base and delta alike
            out = distributed.all_reduce(out)
        return out


def shard_adapter(adapter: LoraAdapter, targets: list[LoraTarget]) -> LoraAdapter:
    """This rank's part of ``adapter`` under tensor parallelism, split as each module's base
    linear is: column-parallel (q/k/v, gate/up) keep A whole and take their rows of B (by heads
    for q/k/v: a replicated KV head's whole B); row-parallel (o, down) take their columns of A
    and keep B whole. Without tensor parallelism the adapter is returned as it is.

    A module whose full shapes do not split so is left whole, for
    :func:`~tgraph.layers.lora.check_adapter` to refuse with the shapes the model needs.
    """
    if all(getattr(t.linear, "world_size", 1) == 1 for t in targets):
        return adapter
    parts = {(t.layer, p): (t, j) for t in targets for j, p in enumerate(t.parts)}
    weights = {}
    for key, (a, b) in adapter.weights.items():
        if key in parts:
            a, b = _shard_pair(*parts[key], a, b)
        weights[key] = (a, b)
    return dataclasses.replace(adapter, weights=weights)


def _shard_pair(target: LoraTarget, part: int, a: torch.Tensor, b: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    linear = target.linear
    world_size, rank = getattr(linear, "world_size", 1), getattr(linear, "rank", 0)
    if world_size == 1:
        return a, b
    if isinstance(linear, RowParallelLinear):
        k = target.in_features
        if a.shape[1] == k * world_size:
            a = a[:, rank * k:(rank + 1) * k]
        return a, b
    # The rank holds chunk `rank * chunks // world_size` of the part's `chunks` equal row
    # chunks: its own shard (chunks == world_size), or one replicated KV head
    # (QKVParallelLinear with fewer KV heads than ranks).
    n = target.part_sizes[part]
    chunks = b.shape[0] // n if n else 0
    if chunks >= 1 and chunks * n == b.shape[0] and (chunks % world_size == 0
                                                     or world_size % chunks == 0):
        index = rank * chunks // world_size
        b = b[index * n:(index + 1) * n]
    return a, b


def _zeroed_counters(device: torch.device) -> torch.Tensor:
    """The shrink ops' arrival counters (see ``tgraph.ir.ops.lora``): allocated once, a buffer
    of their own (never an engine's reused arena), left zeroed by every launch."""
    return torch.zeros(LORA_COUNTER_SLOTS, dtype=torch.int32, device=device)


def _lora_features(model: Any, requester: _LoraFeature) -> list[_LoraFeature]:
    """The model's LoRA features in storage order (``requester`` alone outside a model)."""
    features = getattr(model, "features", None)
    if not isinstance(features, dict) or requester not in features.values():
        return [requester]
    lora = [f for f in features.values() if isinstance(f, _LoraFeature)]
    return sorted(lora, key=lambda f: f.bank_order)


def _lay_out_banks(model: Any, requester: _LoraFeature) -> None:
    """Give every target linear of every LoRA feature its shared storage, once."""
    # a feature with no columns (a merged single adapter) keeps no storage
    features = [f for f in _lora_features(model, requester) if f.takes_columns]
    regions: dict[int, tuple[Any, list[tuple[str, int]]]] = {}
    for feature in features:
        for target in feature.targets:
            entry = regions.setdefault(id(target.linear), (target.linear, []))
            entry[1].append((feature.name, feature.region_width(target)))
    engines = _EngineWeights(model)
    banks: dict[int, LoraWeightBank] = {}
    for key, (linear, spans) in regions.items():
        banks[key], created = attach_bank(linear, spans)
        if created:
            # One linear at a time: its old weight is freed before the next storage is allocated,
            # so the re-layout needs one target's worth of extra memory, not a second model.
            engines.rebind(linear)
    for feature in features:
        feature._banks = {t.key: banks[id(t.linear)] for t in feature.targets}
    if requester._banks is None:
        requester._banks = {}


class _EngineWeights:
    """The model's built engines, rebound to re-laid-out weights (``Engine.set_weights``), so
    that none keeps the old tensor (a second copy) alive."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.engines = list(getattr(model, "engines", {}).values())
        self.held = [{v.name for v in engine.weights} for engine in self.engines]
        self.released = False

    def rebind(self, linear: Any) -> None:
        name = linear.weight.name
        users = [e for e, held in zip(self.engines, self.held) if name is not None and name in held]
        if users and not self.released:
            # Captured graphs hold the old weights too: drop them all (captured again on the
            # next step).
            self.model.release_graphs()
            self.released = True
        for engine in users:
            engine.set_weights({name: linear.weight.data})


class SingleLoraDecorator(_LoraFeature):
    """One active adapter applied to every request of a batch (stacked with the multi-LoRA
    adapters that requests name, if any).

    ``model.features["single_lora"].load(name, dir)`` reads a PEFT adapter;
    ``.activate(name)`` makes it the adapter of every following batch (``activate(None)``: the
    base model). No engine is built or rebuilt for either, in both ways of applying it:

    - merged (setting ``merge``, on by default, where every target's weight is dense): the
      adapter's ``B A`` (scaling folded in) is added to the target weights in place, so the
      base engines and the multi-LoRA engines serve it at no cost per step. The weights a
      merge changes are kept on the host (their bytes again, pinned for a GPU model) so that
      switching or clearing the adapter restores them bit for bit (:mod:`tgraph.layers.lora_merge`).
    - recorded (``merge: false``, or a quantized base weight, which a delta cannot be added to):
      activating copies the adapter's A into slot 1 of this feature's A weights (two slots: slot
      0 empty, every token in slot 1) and its B, with the scaling folded in, into this feature's
      columns of each target's storage: the same shrink kernel and single GEMM as multi-LoRA, in
      engines built for this feature (and for both features stacked).
    """

    name = "single_lora"
    bank_order = 1
    input_prefix = "single_lora_"
    compatible_with = frozenset({"multi_lora", "logit_bias", "vocab_parallel"})
    setting_names = _LoraFeature.setting_names | {"merge"}

    def __init__(self, model: Any, settings: dict | None = None) -> None:
        super().__init__(model, settings)
        self.merge = self.settings.get("merge", True)
        if not isinstance(self.merge, bool):
            raise ConfigError(f"single_lora: merge must be true or false, got {self.merge!r}")
        self._merged: bool | None = None
        self._merged_weights = MergedAdapter()
        self.adapters: dict[str, dict[str, torch.Tensor]] = {}
        self.active: str | None = None
        self._resident: dict[str, torch.Tensor] | None = None
        # target key -> A weight [2, width, in_features] (slot 1: the active adapter's)
        self._a: dict[str, Parameter] = {}

    @property
    def merged(self) -> bool:
        """Whether the active adapter is merged into the base weights (decided on first use:
        the ``merge`` setting, and every target's weight dense)."""
        if self._merged is None:
            self._merged = self.merge and not any(is_quantized(t.linear.weight.data)
                                                  for t in self.targets)
        return self._merged

    @property
    def host_bytes(self) -> int:
        """Bytes of base weights kept on the host while an adapter is merged (0 otherwise)."""
        return self._merged_weights.host_bytes

    @property
    def takes_columns(self) -> bool:
        return not self.merged

    def region_width(self, target: LoraTarget) -> int:
        return aligned_width(target.width(self.max_rank))

    def load(self, name: str, path: str | Path) -> None:
        """Read the PEFT adapter at ``path`` under ``name`` (replacing one of that name; if it
        is the active adapter, the new weights apply from the next step).

        Raises:
            WeightLoadError / ConfigError: see :func:`tgraph.layers.lora.load_peft_adapter` and
                :func:`tgraph.layers.lora.check_adapter`.
        """
        adapter = self._read(name, path)
        packed = {}
        for t in self.targets:
            a, b = pack_adapter(adapter, t, self.max_rank, scale=adapter.scaling)
            packed[f"lora_a_{t.key}"] = a.to(self._device, self._dtype)
            packed[f"lora_b_{t.key}"] = b.to(self._device, self._dtype)
        self.adapters[name] = packed
        if self.active == name:
            self.activate(name)

    def activate(self, name: str | None) -> None:
        """Apply adapter ``name`` to every following batch (``None``: no adapter).

        The adapter is merged into the weights, or copied into the A weights and the weight
        storage, in place, so engines (and captured graphs) serve it without being rebuilt.

        Raises:
            KeyError: ``name`` is not loaded.
        """
        if name is not None and name not in self.adapters:
            raise KeyError(f"single_lora: adapter {name!r} is not loaded; loaded: "
                           f"{sorted(self.adapters)}")
        if self.merged:
            weights = {t.key: t.linear.weight.data for t in self.targets}
            if name is None:
                self._merged_weights.restore(weights)
            else:
                packed = self.adapters[name]
                self._merged_weights.merge(weights, {
                    t.key: (packed[f"lora_a_{t.key}"], packed[f"lora_b_{t.key}"])
                    for t in self.targets})
        elif name is not None:
            self._copy_in(name)
        self.active = name

    def _copy_in(self, name: str) -> None:
        for t in self.targets:
            weight = self._a.get(t.key)
            if weight is not None:
                weight.data[1].copy_(self.adapters[name][f"lora_a_{t.key}"])
            b = self.adapters[name][f"lora_b_{t.key}"]
            self.banks[t.key].region(self.name)[:, :b.shape[1]].copy_(b)

    def _a_operand(self, target: LoraTarget, inputs: dict[str, Tensor]) -> Tensor:
        weight = self._a.get(target.key)
        if weight is None:
            data = torch.zeros(2, target.width(self.max_rank), target.in_features,
                               dtype=self._dtype, device=self._device)
            if self.active is not None:
                data[1].copy_(self.adapters[self.active][f"lora_a_{target.key}"])
            weight = Parameter(data, name=f"{self.name}.{target.key}.lora_a")
            self._a[target.key] = weight
        return weight

    def unload(self, name: str) -> None:
        """Forget adapter ``name`` (deactivating it if active)."""
        if name not in self.adapters:
            raise KeyError(f"single_lora: adapter {name!r} is not loaded")
        if self.active == name:
            self.activate(None)
        del self.adapters[name]

    def symbolic_inputs(self, is_prefill: bool) -> dict[str, Tensor]:
        return self._shared_inputs(is_prefill, 2)

    def is_used(self, batch: BatchMeta) -> bool:
        return self.active is not None and not self.merged

    def resident_inputs(self) -> dict[str, torch.Tensor]:
        if self.active is None:
            raise ConfigError("single_lora: no adapter is active; activate(name) first")
        if self._resident is None:
            # slot 0 ("no adapter") is never used; the scaling is folded into B
            self._resident = {
                "single_lora_scaling": torch.tensor([0.0, 1.0], device=self._device),
                "single_lora_counters": _zeroed_counters(self._device)}
        return dict(self._resident)

    def batch_arrays(self, batch: BatchMeta) -> dict[str, np.ndarray]:
        return self.padded_batch_arrays(batch, int(sum(batch.query_lens)))

    def padded_batch_arrays(self, batch: BatchMeta, tokens: int) -> dict[str, np.ndarray]:
        # Every token in slot 1 (pad tokens too: their rows are never read), already grouped.
        return {"single_lora_token_slots": np.ones(tokens, dtype=np.int32),
                "single_lora_token_order": np.arange(tokens, dtype=np.int32),
                "single_lora_seg_start": np.array([0, 0, tokens], dtype=np.int32)}


class MultiLoraDecorator(_LoraFeature):
    """Up to ``max_loras`` adapters at once; each request names its own (``BatchMeta.loras``,
    ``None``: the base model, or the single adapter alone while one is active).

    Adapters live in slots ``1..max_loras`` (slot 0 is "no adapter"): A in stacked tensors
    ``[max_loras + 1, ...]``, B in this feature's columns of each target's storage, one block per
    slot. ``load`` and ``unload`` write a slot in place at run time, between steps.
    """

    name = "multi_lora"
    bank_order = 0
    input_prefix = "lora_"
    compatible_with = frozenset({"single_lora", "logit_bias", "vocab_parallel"})
    setting_names = _LoraFeature.setting_names | {"max_loras"}

    def __init__(self, model: Any, settings: dict | None = None) -> None:
        super().__init__(model, settings)
        self.max_loras = int(self.settings.get("max_loras", 4))
        if self.max_loras < 1:
            raise ConfigError(f"multi_lora: max_loras must be >= 1, got {self.max_loras}")
        self.slots: dict[str, int] = {}
        self._stacks: dict[str, torch.Tensor] | None = None
        # The last batch's arrays and what they were computed from (see batch_arrays).
        self._arrays_key: tuple | None = None
        self._arrays: dict[str, np.ndarray] = {}

    @property
    def num_slots(self) -> int:
        return self.max_loras + 1

    def region_width(self, target: LoraTarget) -> int:
        return aligned_width(self.max_loras * target.width(self.max_rank))

    @property
    def stacks(self) -> dict[str, torch.Tensor]:
        """The resident engine inputs: stacked A, scaling, counters (allocated on first use)."""
        if self._stacks is None:
            stacks = {"lora_scaling": torch.zeros(self.num_slots, device=self._device),
                      "lora_counters": _zeroed_counters(self._device)}
            for t in self.targets:
                stacks[f"lora_a_stack_{t.key}"] = torch.zeros(
                    self.num_slots, t.width(self.max_rank), t.in_features, dtype=self._dtype,
                    device=self._device)
            self._stacks = stacks
        return self._stacks

    def load(self, name: str, path: str | Path) -> int:
        """Read the PEFT adapter at ``path`` into a free slot (or the slot of the adapter of
        that name, replacing it).

        Returns:
            The slot (1..max_loras).

        Raises:
            ConfigError: all ``max_loras`` slots are taken; see also
                :func:`tgraph.layers.lora.load_peft_adapter` and
                :func:`tgraph.layers.lora.check_adapter`.
        """
        adapter = self._read(name, path)
        slot = self.slots.get(name)
        if slot is None:
            free = sorted(set(range(1, self.num_slots)) - set(self.slots.values()))
            if not free:
                raise ConfigError(f"multi_lora: cannot load {name!r}: all max_loras="
                                  f"{self.max_loras} slots hold adapters ({sorted(self.slots)}); "
                                  "unload one or raise 'max_loras'")
            slot = free[0]
        self._write(slot, adapter)
        self.slots[name] = slot
        return slot

    def unload(self, name: str) -> None:
        """Free adapter ``name``'s slot."""
        if name not in self.slots:
            raise KeyError(f"multi_lora: adapter {name!r} is not loaded; loaded: "
                           f"{sorted(self.slots)}")
        self._write(self.slots.pop(name), None)

    def _write(self, slot: int, adapter: LoraAdapter | None) -> None:
        self._arrays_key = None  # the name -> slot map changes: recompute the token slots
        stacks = self.stacks
        for t in self.targets:
            a, b = pack_adapter(adapter, t, self.max_rank)
            stacks[f"lora_a_stack_{t.key}"][slot].copy_(a)
            width = b.shape[1]
            self.banks[t.key].region(self.name)[:, (slot - 1) * width:slot * width].copy_(b)
        stacks["lora_scaling"][slot] = 0.0 if adapter is None else adapter.scaling

    def symbolic_inputs(self, is_prefill: bool) -> dict[str, Tensor]:
        inputs = self._shared_inputs(is_prefill, self.num_slots)
        for t in self.targets:
            name = f"lora_a_stack_{t.key}"
            inputs[name] = Tensor(name, self._dtype,
                                  (self.num_slots, t.width(self.max_rank), t.in_features))
        return inputs

    def _a_operand(self, target: LoraTarget, inputs: dict[str, Tensor]) -> Tensor:
        return inputs[f"lora_a_stack_{target.key}"]

    def is_used(self, batch: BatchMeta) -> bool:
        return any(n is not None for n in (batch.loras or ()))

    def token_slots(self, batch: BatchMeta) -> list[int]:
        """The adapter slot of every token of ``batch``.

        Raises:
            ValueError: ``loras`` does not have one entry per sequence, or names an adapter
                that is not loaded.
        """
        loras = list(batch.loras or [None] * batch.num_seqs)
        if len(loras) != batch.num_seqs:
            raise ValueError(f"BatchMeta.loras has {len(loras)} entries for {batch.num_seqs} "
                             "sequences; expected one adapter name (or None) per sequence")
        unknown = sorted({n for n in loras if n is not None and n not in self.slots})
        if unknown:
            raise ValueError(f"multi_lora: adapter(s) {unknown} are not loaded; loaded: "
                             f"{sorted(self.slots)}")
        slots: list[int] = []
        for n, q in zip(loras, batch.query_lens):
            slots += [0 if n is None else self.slots[n]] * q
        return slots

    def resident_inputs(self) -> dict[str, torch.Tensor]:
        return dict(self.stacks)

    def batch_arrays(self, batch: BatchMeta) -> dict[str, np.ndarray]:
        """The slot of every token, and the tokens grouped by slot (computed here once per step,
        so the kernels of every adapted linear skip the sort).

        NOTE: consecutive decode steps of the same requests give the same arrays, so the last
        ones are kept (read-only) and returned again while the requests' adapters, their query
        lengths and the loaded adapters are unchanged, sparing the sort at every step.
        """
        key = (tuple(batch.loras or ()), tuple(batch.query_lens), batch.num_seqs)
        if key == self._arrays_key:
            return self._arrays
        arrays = self._grouped(np.asarray(self.token_slots(batch), dtype=np.int32))
        for a in arrays.values():
            a.setflags(write=False)
        self._arrays_key, self._arrays = key, arrays
        return arrays

    def padded_batch_arrays(self, batch: BatchMeta, tokens: int) -> dict[str, np.ndarray]:
        """The prefill's arrays with its pad tokens in slot 0 (no adapter)."""
        slots = np.zeros(tokens, dtype=np.int32)
        real = self.token_slots(batch)
        slots[:len(real)] = real
        return self._grouped(slots)

    def _grouped(self, slots: np.ndarray) -> dict[str, np.ndarray]:
        order = np.argsort(slots, kind="stable").astype(np.int32)
        seg_start = np.searchsorted(slots[order], np.arange(self.num_slots + 1)).astype(np.int32)
        return {"lora_token_slots": slots, "lora_token_order": order, "lora_seg_start": seg_start}
