"""CUDA-graph state of an engine: its captured signatures, graph pool, shared arenas and the
streams it captures on.

A :class:`CapturedSignature` is one captured call signature (shapes): the static inputs, its own
buffers (an arena set of its own, or the engine's shared one), the slots the graphs read and
write, and one graph per capturable segment. :class:`Capture` owns every such signature of one
engine and what they share.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from tgraph.engine.arena import ArenaSet, Label
from tgraph.engine.binding import Binding
from tgraph.engine.plan import LaunchPlan
from tgraph.errors import EngineInputError
from tgraph.ir.ops.transfer import placement_device
from tgraph.passes.memory import MemoryPlan

__all__ = ["Capture", "CaptureHandle", "CapturedSignature"]


@dataclass
class CapturedSignature:
    """A captured signature: static inputs, buffer views, the slots and one graph per segment.

    ``held`` names the inputs the graphs read in place (the caller's tensors, by identity): the
    ones the network writes (KV caches) and those the caller asked to keep by reference.
    ``all_held`` means every input is held, so a call passing the very same tensor objects can
    replay without binding or copying anything.
    """

    inputs: dict[str, torch.Tensor]
    binding: Binding
    buffers: list[list[torch.Tensor | None]]
    slots: list[Any]
    graphs: list[Any]
    plan: LaunchPlan
    held: frozenset[str]
    all_held: bool
    prologue: Any = None  # the prologue's own graph, when the first segment is a host one
    shared: ArenaSet | None = None  # the engine's shared arena set its buffers live in

    def same_objects(self, inputs: Mapping[str, torch.Tensor]) -> bool:
        """Whether ``inputs`` are exactly the captured tensor objects (same names, same objects)."""
        if len(inputs) != len(self.inputs):
            return False
        for name, t in self.inputs.items():
            if inputs.get(name) is not t:
                return False
        return True

    def load(self, tensors: Mapping[str, torch.Tensor], mutated: set[str]) -> None:
        """Copy a call's inputs into the static ones (held inputs must be the captured tensors).

        Raises:
            EngineInputError: a held input is another tensor than the captured one.
        """
        for name, t in tensors.items():
            static = self.inputs[name]
            if name in self.held:
                if static.data_ptr() != t.data_ptr():
                    why = ("updated in place by the captured graph" if name in mutated
                           else "held by reference (by_reference)")
                    raise EngineInputError(
                        f"input {name!r} is {why}, and the graph was captured with another "
                        "tensor; pass the same tensor (e.g. the same KV cache) or capture again")
            else:
                static.copy_(t)


@dataclass(frozen=True, eq=False)
class CaptureHandle:
    """One captured signature of an engine, for :meth:`~tgraph.engine.Engine.replay`."""

    key: tuple
    capture: CapturedSignature


class Capture:
    """Every captured signature of one engine, and what they share: one graph pool, the shared
    arena set per device (see ``Engine.capture(share_arena=True)``) and, for a network spread
    over several devices, one capture stream per device."""

    def __init__(self) -> None:
        self.signatures: dict[tuple, CapturedSignature] = {}
        self._shared: dict[torch.device, ArenaSet] = {}
        self._pool: Any = None
        self._streams: dict[str, torch.cuda.Stream] = {}

    def pool(self) -> Any:
        """The graph memory pool every capture of the engine uses."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        return self._pool

    def stream(self, label: Label) -> Any:
        """The stream a segment on ``label`` is captured on: torch's default capture stream
        (``None``) on a single device, else one side stream per device, since torch's default
        lives on one device."""
        if label is None:
            return None
        if label not in self._streams:
            self._streams[label] = torch.cuda.Stream(placement_device(label))
        return self._streams[label]

    def shared_arena(self, memory: Mapping[Label, MemoryPlan],
                     device: torch.device) -> ArenaSet:
        """The shared arena set of ``device``, large enough for ``memory``; growing it releases
        the signatures whose buffers lived in the old one."""
        old = self._shared.get(device)
        if old is not None and old.holds(memory, device):
            return old
        if old is not None:
            for key in [k for k, s in self.signatures.items() if s.shared is old]:
                del self.signatures[key]
            self._shared.pop(device)  # freed before the larger one is allocated
            del old
        arenas = self._shared[device] = ArenaSet.allocate(memory, device)
        return arenas

    def match_held(self, inputs: Mapping[str, torch.Tensor]) -> CapturedSignature | None:
        """The signature captured with exactly these tensor objects, every input held."""
        for signature in self.signatures.values():
            if signature.all_held and signature.same_objects(inputs):
                return signature
        return None

    def is_live(self, handle: CaptureHandle) -> bool:
        return self.signatures.get(handle.key) is handle.capture

    def release(self) -> None:
        """Drop every signature and shared arena; a pool whose graphs are all gone cannot take
        new captures (PyTorch asserts on its use count), so later ones get a fresh pool."""
        self.signatures.clear()
        self._shared.clear()
        self._pool = None
