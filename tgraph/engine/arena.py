"""The memory the intermediate buffers of a launch plan live in: one arena per device.

A memory plan (:mod:`tgraph.passes.memory`) gives every intermediate an offset in an arena; a
network spread over several devices has one plan per device label. An :class:`ArenaSet` holds one
uint8 arena per label, where a single-device network is the one-entry case under the label
``None`` (its device is the call's). Buffer views are built from an arena set by
:func:`buffer_views` and cached by the binding that asked for them, keyed by the arena set's
identity: growing replaces the set, so stale views are never reused.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from tgraph.engine.plan import LaunchPlan
from tgraph.ir.ops.transfer import placement_device
from tgraph.ir.value import Value
from tgraph.passes.memory import MemoryPlan

__all__ = ["ArenaSet", "Label", "buffer_views"]

Label = str | None  # a placement label, or None for a single-device network


@dataclass(frozen=True, eq=False)
class ArenaSet:
    """One uint8 arena per device label."""

    arenas: Mapping[Label, torch.Tensor]

    @staticmethod
    def device_of(label: Label, device: torch.device | None) -> torch.device | None:
        """Where the arena of ``label`` lives: the label's device, or the call's for ``None``."""
        return device if label is None else placement_device(label)

    @classmethod
    def allocate(cls, memory: Mapping[Label, MemoryPlan],
                 device: torch.device | None) -> ArenaSet:
        """A new set sized for ``memory`` (``device``: the single-device network's)."""
        return cls({label: torch.empty(max(plan.arena_bytes, 1), dtype=torch.uint8,
                                       device=cls.device_of(label, device))
                    for label, plan in memory.items()})

    def holds(self, memory: Mapping[Label, MemoryPlan], device: torch.device | None) -> bool:
        """Whether every arena ``memory`` needs is here, on its device and large enough."""
        for label, plan in memory.items():
            arena = self.arenas.get(label)
            if arena is None or arena.device != self.device_of(label, device) \
                    or arena.numel() < max(plan.arena_bytes, 1):
                return False
        return True

    def grown(self, memory: Mapping[Label, MemoryPlan],
              device: torch.device | None) -> ArenaSet:
        """This set if it holds ``memory``, else a new one where each short arena is replaced
        (the others are shared)."""
        if self.holds(memory, device):
            return self
        arenas = dict(self.arenas)
        for label, plan in memory.items():
            need, where = max(plan.arena_bytes, 1), self.device_of(label, device)
            have = arenas.get(label)
            if have is None or have.device != where or have.numel() < need:
                arenas.pop(label, None)  # freed before the larger one is allocated
                arenas[label] = torch.empty(need, dtype=torch.uint8, device=where)
        return ArenaSet(arenas)

    @property
    def nbytes(self) -> int:
        return sum(a.numel() for a in self.arenas.values())


def buffer_views(plan: LaunchPlan, memory: Mapping[Label, MemoryPlan],
                 shapes: Mapping[Value, tuple[tuple[int, ...], torch.dtype]], arenas: ArenaSet,
                 label_of: Callable[[Value], Label]) -> list[list[torch.Tensor | None]]:
    """Views of ``arenas`` for every planned output of every step (``None`` for outputs that
    alias an input or are not planned)."""
    buffers = []
    for step in plan.steps:
        outs: list[torch.Tensor | None] = []
        for v in step.node.outputs:
            label = label_of(v)
            offset = memory[label].offsets.get(v)
            if offset is None:
                outs.append(None)
                continue
            shape, dtype = shapes[v]
            nbytes = memory[label].sizes[v]
            outs.append(arenas.arenas[label][offset:offset + nbytes].view(dtype).view(shape))
        buffers.append(outs)
    return buffers
