"""The :class:`Engine`: a built network that runs on real tensors."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch

from tgraph.engine.binding import (
    InputSpec,
    bind_inputs,
    fix_unknowns,
    infer_concrete,
    input_specs,
)
from tgraph.engine.plan import LaunchPlan, lower
from tgraph.errors import EngineInputError, GraphError
from tgraph.ir.network import Network
from tgraph.ir.value import Value, ValueKind
from tgraph.passes.manager import PassManager, PassRecord
from tgraph.passes.memory import MemoryPlan, alias_base, plan_memory
from tgraph.passes.partition import Segment, partition
from tgraph.passes.pipeline import default_pipeline

_MAX_BINDINGS = 64


@dataclass
class EngineStats:
    """Counts that describe a built engine (memory figures are for the latest binding)."""

    node_count: int
    segment_count: int
    capturable_segments: int
    kernel_count: int
    peak_intermediate_bytes: int | None
    naive_intermediate_bytes: int | None
    bindings: int
    passes: list[PassRecord] = field(default_factory=list)


@dataclass
class _Binding:
    """What depends on the concrete dims of one call signature."""

    shapes: dict[Value, tuple[tuple[int, ...], torch.dtype]]
    memory: MemoryPlan
    attrs: dict[int, dict[str, Any]]


class Engine:
    """Runs a built network.

    Build one with ``network.build_engine()``; call :meth:`forward` with real tensors. The launch
    plan is built once; calls whose dynamic dims differ reuse it (only shapes and the memory plan
    are recomputed, once per distinct signature).
    """

    def __init__(self, net: Network, pass_records: Sequence[PassRecord] = (),
                 backend: str = "reference") -> None:
        self.net = net
        self.backend = backend
        self.pass_records = list(pass_records)
        self.specs: dict[str, InputSpec] = input_specs(net)
        self.weights: dict[Value, torch.Tensor] = {}
        for v in net.weights:
            if v.data is None:
                raise GraphError(f"weight {v.name!r} ({v.describe()}) has no data; load the "
                                 "weights before building the engine")
            if tuple(v.data.shape) != tuple(v.shape) or v.data.dtype != v.dtype:
                raise GraphError(f"weight {v.name!r} holds {v.data.dtype}{list(v.data.shape)}, "
                                 f"but the network recorded {v.describe()}")
            self.weights[v] = v.data
        self.segments: list[Segment] = partition(net)
        self.plan: LaunchPlan = lower(net)
        self._bindings: OrderedDict[tuple, _Binding] = OrderedDict()
        self._latest: _Binding | None = None
        self._checked_devices: set[torch.device] = set()
        self._output_clone = {name: alias_base(net, v).kind is not ValueKind.INTERMEDIATE
                              for name, v in net.outputs.items()}

    # ---- running ----------------------------------------------------------------------------------

    def forward(self, inputs: Mapping[str, torch.Tensor],
                outputs: Mapping[str, torch.Tensor] | None = None,
                runtime_params: Mapping[str, Any] | None = None) -> dict[str, torch.Tensor]:
        """Run the network.

        Args:
            inputs: one tensor per graph input, by name, all on one device.
            outputs: one preallocated tensor per marked output; the results are written into
                them. When omitted, new tensors are returned.
            runtime_params: host-side values (CPU tensors or lists) for inputs declared ``host``.
        Returns:
            the outputs by name (the given tensors when ``outputs`` was passed).
        Raises:
            EngineInputError: on missing/unknown names, wrong dtype, device or shape.
        """
        tensors, env, device = bind_inputs(self.specs, inputs, runtime_params)
        if not self._bindings:
            fix_unknowns(self.specs, tensors)
        binding = self._bind(tensors, env)
        if device is not None and device not in self._checked_devices:
            self._check_weight_devices(device)
        if outputs is not None:
            self._check_outputs(outputs, binding, device)

        plan = self.plan
        slots: list[Any] = [None] * plan.num_slots
        for v in self.net.inputs:
            slots[plan.slot_of[v]] = tensors[v.name]
        for v, data in self.weights.items():
            slots[plan.slot_of[v]] = data
        for slot, data in plan.constants.items():
            slots[slot] = data
        for i, step in enumerate(plan.steps):
            args = [None if s is None else slots[s] for s in step.in_slots]
            attrs = binding.attrs.get(i, step.attrs)
            result = step.kernel(*args, **attrs)
            if len(step.out_slots) == 1:
                slots[step.out_slots[0]] = result
            else:
                for s, r in zip(step.out_slots, result):
                    slots[s] = r
            for s in step.release:
                slots[s] = None

        results: dict[str, torch.Tensor] = {}
        for name, v in self.net.outputs.items():
            value = slots[plan.slot_of[v]]
            if outputs is not None:
                outputs[name].copy_(value)
                results[name] = outputs[name]
            else:
                results[name] = value.clone() if self._output_clone[name] else value
        return results

    __call__ = forward

    def _bind(self, tensors: Mapping[str, torch.Tensor], env: Mapping[str, int]) -> _Binding:
        key = tuple((name, tuple(t.shape), t.dtype) for name, t in tensors.items())
        binding = self._bindings.get(key)
        if binding is None:
            shapes = infer_concrete(self.net, tensors, env)
            memory = plan_memory(self.net, shapes)
            attrs = {}
            for i, step in enumerate(self.plan.steps):
                if step.symbolic_attrs:
                    resolved = dict(step.attrs)
                    resolved["shape"] = tuple(env.get(d, d) if isinstance(d, str) else d
                                              for d in step.attrs["shape"])
                    attrs[i] = resolved
            binding = _Binding(shapes, memory, attrs)
            self._bindings[key] = binding
            if len(self._bindings) > _MAX_BINDINGS:
                self._bindings.popitem(last=False)
        else:
            self._bindings.move_to_end(key)
        self._latest = binding
        return binding

    def _check_weight_devices(self, device: torch.device) -> None:
        for v, data in self.weights.items():
            if data.device != device:
                raise EngineInputError(f"weight {v.name!r} is on {data.device} but the inputs are on"
                                       f" {device}; load weights on the inputs' device or call "
                                       f"engine.to({str(device)!r})")
        self._checked_devices.add(device)

    def _check_outputs(self, outputs: Mapping[str, torch.Tensor], binding: _Binding,
                       device: torch.device | None) -> None:
        names = list(self.net.outputs)
        unknown = [n for n in outputs if n not in self.net.outputs]
        missing = [n for n in names if n not in outputs]
        if unknown or missing:
            raise EngineInputError(f"outputs: missing {missing}, unknown {unknown}; the network's "
                                   f"outputs are {names}")
        for name, v in self.net.outputs.items():
            t = outputs[name]
            if v.kind is ValueKind.INTERMEDIATE:
                shape, dtype = binding.shapes[v]
            else:
                shape, dtype = tuple(self._leaf_shape(v)), v.dtype
            want = f"{str(dtype).replace('torch.', '')}{list(shape)}"
            if not isinstance(t, torch.Tensor):
                raise EngineInputError(f"output {name!r} must be a torch.Tensor, expected {want}")
            if t.dtype != dtype or tuple(t.shape) != tuple(shape):
                raise EngineInputError(f"output {name!r} is {str(t.dtype).replace('torch.', '')}"
                                       f"{list(t.shape)}, expected {want}")
            if device is not None and t.device != device:
                raise EngineInputError(f"output {name!r} is on {t.device}, expected {device} "
                                       "(the inputs' device)")

    def _leaf_shape(self, v: Value) -> tuple[int, ...]:
        if v.kind is ValueKind.WEIGHT:
            return tuple(self.weights[v].shape)
        return tuple(self.specs[v.name].shape)

    # ---- weights -----------------------------------------------------------------------------------

    def set_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Rebind weights by name (same shape and dtype) without rebuilding anything."""
        by_name = {v.name: v for v in self.weights}
        for name, data in weights.items():
            if name not in by_name:
                raise EngineInputError(f"set_weights: unknown weight {name!r}")
            v = by_name[name]
            old = self.weights[v]
            if tuple(data.shape) != tuple(old.shape) or data.dtype != old.dtype:
                raise EngineInputError(f"set_weights: {name!r} must be {old.dtype}{list(old.shape)},"
                                       f" got {data.dtype}{list(data.shape)}")
            self.weights[v] = data
        self._checked_devices.clear()

    def to(self, device: torch.device | str) -> "Engine":
        """Move the engine's weights to ``device``."""
        for v in self.weights:
            self.weights[v] = self.weights[v].to(device)
        self._checked_devices.clear()
        return self

    # ---- introspection -----------------------------------------------------------------------------

    @property
    def stats(self) -> EngineStats:
        memory = self._latest.memory if self._latest else None
        return EngineStats(
            node_count=len(self.net.nodes),
            segment_count=len(self.segments),
            capturable_segments=sum(1 for s in self.segments if s.capturable),
            kernel_count=len(self.plan.steps),
            peak_intermediate_bytes=memory.arena_bytes if memory else None,
            naive_intermediate_bytes=memory.naive_bytes if memory else None,
            bindings=len(self._bindings),
            passes=list(self.pass_records),
        )

    def __str__(self) -> str:
        s = self.stats
        lines = [f'engine "{self.net.name}" ({self.backend}): {s.kernel_count} kernels, '
                 f"{s.segment_count} segments ({s.capturable_segments} capturable)"]
        for spec in self.specs.values():
            lines.append(f"  input  {spec.describe()}")
        labels = self.net.local_labels()
        for seg_index, seg in enumerate(self.segments):
            kind = "device" if seg.capturable else f"host: {seg.reason}"
            lines.append(f"  segment {seg_index} [{kind}]")
            for node in seg.nodes:
                step = next(st for st in self.plan.steps if st.node is node)
                outs = ", ".join(labels.get(v, v.label()) for v in node.outputs)
                lines.append(f"    {outs} <- {step.kernel_name}")
        for name, v in self.net.outputs.items():
            lines.append(f"  output {name} = {labels.get(v, v.label())}")
        if self.pass_records:
            lines.append("  passes: " + "; ".join(str(r) for r in self.pass_records))
        return "\n".join(lines)


def build_engine(net: Network, *, passes: bool = True, disabled_passes: Sequence[str] = (),
                 backend: str = "reference") -> Engine:
    """Build an :class:`Engine` from ``net``.

    Args:
        net: the recorded network; it is copied, never changed.
        passes: run the pass pipeline (``False`` builds the network exactly as recorded).
        disabled_passes: pass names to skip (``llm.engine.disabled_passes``).
        backend: ``"reference"`` runs every op with its torch reference kernel.
    Returns:
        the engine. If ``net`` is the default network, the default is fresh afterwards.
    """
    from tgraph.nn.network_manager import release_if_default

    if backend not in ("reference",):
        raise GraphError(f"unknown backend {backend!r}; expected 'reference'")
    net.verify()
    if not net.outputs:
        raise GraphError(f"network {net.name!r} has no outputs; call mark_output(tensor, name)")
    work, _ = net.clone()
    records = PassManager(default_pipeline(), disabled_passes).run(work) if passes else []
    engine = Engine(work, records, backend=backend)
    release_if_default(net)
    return engine
