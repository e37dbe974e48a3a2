"""LoRA feature decorators: one adapter for every request, or one adapter per request.

Both features keep adapter weights as engine *inputs* of fixed shapes (every adapter is padded
to ``max_rank``) in resident buffers that loading, activating or unloading an adapter rewrites in
place: no engine is rebuilt, and captured decode graphs read the new weights at their next
replay. Recording wraps the target linears so that their output gets
a LoRA delta; packed q/k/v and gate/up carry block-diagonal B matrices, so one delta covers the
packed output (see :mod:`tgraph.layers.lora`).

Settings (``LlmConfig.features["single_lora"]`` / ``["multi_lora"]``):
    ``max_rank`` (16): the largest adapter rank accepted.
    ``target_modules`` (all of q/k/v/o/gate/up/down_proj): which linears get a delta.
    ``max_loras`` (4, multi only): adapters loaded at once.

Single and multi on one model: while a single adapter is active it applies to every request, so
a batch in which a request also names a multi-LoRA adapter (``BatchMeta.loras``) would need both
graphs at once. The two features do not declare each other compatible, so such a batch is
refused with a ``ConfigError``: deactivate the single adapter (``activate(None)``) to serve
per-request adapters.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from tgraph.errors import ConfigError
from tgraph.layers.lora import (
    LORA_TARGET_MODULES,
    LoraAdapter,
    LoraTarget,
    check_adapter,
    find_lora_targets,
    load_peft_adapter,
    lora_delta,
    pack_adapter,
)
from tgraph.models.base.batch import BatchMeta
from tgraph.models.base.features import FeatureDecorator
from tgraph.nn.tensor import Tensor

__all__ = ["MultiLoraDecorator", "SingleLoraDecorator"]

_SETTINGS = {"max_rank", "target_modules", "max_loras"}


class _LoraFeature(FeatureDecorator):
    """What both LoRA features share: settings, targets, and wrapping the target linears."""

    def __init__(self, model: Any, settings: dict | None = None) -> None:
        super().__init__(model, settings)
        unknown = sorted(set(self.settings) - _SETTINGS)
        if unknown:
            raise ConfigError(f"feature {self.name!r}: unknown settings {unknown}; expected "
                              f"{sorted(_SETTINGS)}")
        self.max_rank = int(self.settings.get("max_rank", 16))
        if self.max_rank < 1:
            raise ConfigError(f"feature {self.name!r}: max_rank must be >= 1, got {self.max_rank}")
        self.target_modules = tuple(self.settings.get("target_modules", LORA_TARGET_MODULES))
        self._targets: list[LoraTarget] | None = None
        self._wrapped: list[Any] = []

    # ---- model facts -----------------------------------------------------------------------------
    @property
    def targets(self) -> list[LoraTarget]:
        """The linears this feature adapts (found on first use)."""
        if self._targets is None:
            config = self.model.llm_config
            if config.world_size > 1:
                raise ConfigError(f"feature {self.name!r}: LoRA with tensor parallelism "
                                  f"(world_size {config.world_size}) is not supported yet")
            self._targets = find_lora_targets(self.model, self.target_modules)
        return self._targets

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
        adapter = load_peft_adapter(path, name)
        check_adapter(adapter, self.targets, self.max_rank,
                      self.model.llm_config.model.num_hidden_layers)
        return adapter

    # ---- recording -------------------------------------------------------------------------------
    def _wrap(self, delta: Callable[[LoraTarget, Tensor], Tensor]) -> None:
        """Make every target linear return ``base(x) + delta(target, x)`` while recording."""
        for target in self.targets:
            linear = target.linear
            base = type(linear).forward.__get__(linear)

            def forward(x: Tensor, base: Callable = base, target: LoraTarget = target) -> Tensor:
                return base(x) + delta(target, x)

            # NOTE: an instance attribute shadows the class's forward; exit_graph deletes it.
            object.__setattr__(linear, "forward", forward)
            self._wrapped.append(linear)

    def exit_graph(self) -> None:
        for linear in self._wrapped:
            linear.__dict__.pop("forward", None)
        self._wrapped.clear()


class SingleLoraDecorator(_LoraFeature):
    """One active adapter applied to every request of a batch.

    ``model.features["single_lora"].load(name, dir)`` reads a PEFT adapter;
    ``.activate(name)`` makes it the adapter of every following batch (``activate(None)``: the
    base model). The delta ``(x @ A.T) @ (scaling B).T`` runs as the multi-LoRA ``lora_delta``
    with two slots (slot 0 empty, slot 1 the active adapter, every token in slot 1): the same
    split-K shrink/expand pair, which fills the GPU where a GEMM with ``E * max_rank`` output
    columns cannot.
    """

    name = "single_lora"

    def __init__(self, model: Any, settings: dict | None = None) -> None:
        super().__init__(model, settings)
        self.adapters: dict[str, dict[str, torch.Tensor]] = {}
        self.active: str | None = None
        self._resident: dict[str, torch.Tensor] | None = None

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
            self._copy_in(name)

    def activate(self, name: str | None) -> None:
        """Apply adapter ``name`` to every following batch (``None``: no adapter).

        The adapter is copied into the resident input buffers, so engines (and captured decode
        graphs) serve it without being rebuilt.

        Raises:
            KeyError: ``name`` is not loaded.
        """
        if name is not None and name not in self.adapters:
            raise KeyError(f"single_lora: adapter {name!r} is not loaded; loaded: "
                           f"{sorted(self.adapters)}")
        if name is not None:
            self._copy_in(name)
        self.active = name

    def _copy_in(self, name: str) -> None:
        if self._resident is None:
            # [2, ...] stacks: slot 0 ("no adapter") stays zero; scaling is folded into B.
            self._resident = {k: v.new_zeros((2, *v.shape)) for k, v in self.adapters[name].items()}
            self._resident["lora_scaling"] = torch.tensor([0.0, 1.0], device=self._device)
        for k, v in self.adapters[name].items():
            self._resident[k][1].copy_(v)

    def unload(self, name: str) -> None:
        """Forget adapter ``name`` (deactivating it if active)."""
        if name not in self.adapters:
            raise KeyError(f"single_lora: adapter {name!r} is not loaded")
        del self.adapters[name]
        if self.active == name:
            self.active = None

    def symbolic_inputs(self, is_prefill: bool) -> dict[str, Tensor]:
        tokens = "num_tokens" if is_prefill else "batch"
        inputs = {"lora_scaling": Tensor("lora_scaling", torch.float32, (2,)),
                  "lora_token_slots": Tensor("lora_token_slots", torch.int32, (tokens,)),
                  "lora_token_order": Tensor("lora_token_order", torch.int32, (tokens,)),
                  "lora_seg_start": Tensor("lora_seg_start", torch.int32, (3,))}
        for t in self.targets:
            width = t.width(self.max_rank)
            inputs[f"lora_a_{t.key}"] = Tensor(f"lora_a_{t.key}", self._dtype,
                                               (2, width, t.in_features))
            inputs[f"lora_b_{t.key}"] = Tensor(f"lora_b_{t.key}", self._dtype,
                                               (2, t.out_features, width))
        return inputs

    def enter_graph(self, inputs: dict[str, Tensor]) -> None:
        def delta(target: LoraTarget, x: Tensor) -> Tensor:
            return lora_delta(x, inputs[f"lora_a_{target.key}"], inputs[f"lora_b_{target.key}"],
                              inputs["lora_scaling"], inputs["lora_token_slots"],
                              inputs["lora_token_order"], inputs["lora_seg_start"])
        self._wrap(delta)

    def is_used(self, batch: BatchMeta) -> bool:
        return self.active is not None

    def resident_inputs(self) -> dict[str, torch.Tensor]:
        if self.active is None or self._resident is None:
            raise ConfigError("single_lora: no adapter is active; activate(name) first")
        return dict(self._resident)

    def batch_arrays(self, batch: BatchMeta) -> dict[str, np.ndarray]:
        named = {n for n in (batch.loras or ()) if n is not None and n != self.active}
        if named:
            raise ValueError(f"single_lora: adapter {self.active!r} is active for every request, "
                             f"but the batch names {sorted(named)}; deactivate it "
                             "(activate(None)) to serve per-request adapters")
        tokens = int(sum(batch.query_lens))
        # Every token in slot 1, already grouped: no sort.
        return {"lora_token_slots": np.ones(tokens, dtype=np.int32),
                "lora_token_order": np.arange(tokens, dtype=np.int32),
                "lora_seg_start": np.array([0, 0, tokens], dtype=np.int32)}


class MultiLoraDecorator(_LoraFeature):
    """Up to ``max_loras`` adapters at once; each request names its own (``BatchMeta.loras``,
    ``None``: the base model).

    Adapters live in stacked tensors ``[max_loras + 1, ...]``; slot 0 is "no adapter". ``load``
    and ``unload`` write a slot in place at run time, between steps.
    """

    name = "multi_lora"

    def __init__(self, model: Any, settings: dict | None = None) -> None:
        super().__init__(model, settings)
        self.max_loras = int(self.settings.get("max_loras", 4))
        if self.max_loras < 1:
            raise ConfigError(f"multi_lora: max_loras must be >= 1, got {self.max_loras}")
        self.slots: dict[str, int] = {}
        self._stacks: dict[str, torch.Tensor] | None = None

    @property
    def num_slots(self) -> int:
        return self.max_loras + 1

    @property
    def stacks(self) -> dict[str, torch.Tensor]:
        """The stacked engine inputs (allocated on first use)."""
        if self._stacks is None:
            stacks = {"lora_scaling": torch.zeros(self.num_slots, device=self._device)}
            for t in self.targets:
                width = t.width(self.max_rank)
                stacks[f"lora_a_stack_{t.key}"] = torch.zeros(
                    self.num_slots, width, t.in_features, dtype=self._dtype, device=self._device)
                stacks[f"lora_b_stack_{t.key}"] = torch.zeros(
                    self.num_slots, t.out_features, width, dtype=self._dtype, device=self._device)
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
        stacks = self.stacks
        for t in self.targets:
            a, b = pack_adapter(adapter, t, self.max_rank)
            stacks[f"lora_a_stack_{t.key}"][slot].copy_(a)
            stacks[f"lora_b_stack_{t.key}"][slot].copy_(b)
        stacks["lora_scaling"][slot] = 0.0 if adapter is None else adapter.scaling

    def symbolic_inputs(self, is_prefill: bool) -> dict[str, Tensor]:
        tokens = "num_tokens" if is_prefill else "batch"
        inputs = {"lora_scaling": Tensor("lora_scaling", torch.float32, (self.num_slots,)),
                  "lora_token_slots": Tensor("lora_token_slots", torch.int32, (tokens,)),
                  "lora_token_order": Tensor("lora_token_order", torch.int32, (tokens,)),
                  "lora_seg_start": Tensor("lora_seg_start", torch.int32,
                                           (self.num_slots + 1,))}
        for t in self.targets:
            width = t.width(self.max_rank)
            for name, shape in ((f"lora_a_stack_{t.key}", (width, t.in_features)),
                                (f"lora_b_stack_{t.key}", (t.out_features, width))):
                inputs[name] = Tensor(name, self._dtype, (self.num_slots, *shape))
        return inputs

    def enter_graph(self, inputs: dict[str, Tensor]) -> None:
        def delta(target: LoraTarget, x: Tensor) -> Tensor:
            return lora_delta(x, inputs[f"lora_a_stack_{target.key}"],
                              inputs[f"lora_b_stack_{target.key}"], inputs["lora_scaling"],
                              inputs["lora_token_slots"], inputs["lora_token_order"],
                              inputs["lora_seg_start"])
        self._wrap(delta)

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
        so the kernels of every adapted linear skip the sort)."""
        slots = np.asarray(self.token_slots(batch), dtype=np.int32)
        order = np.argsort(slots, kind="stable").astype(np.int32)
        seg_start = np.searchsorted(slots[order], np.arange(self.num_slots + 1)).astype(np.int32)
        return {"lora_token_slots": slots, "lora_token_order": order, "lora_seg_start": seg_start}
