"""The :class:`Engine`: a built network that runs on real tensors."""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from tgraph.engine.arena import ArenaSet, Label, buffer_views
from tgraph.engine.binding import (
    Binding,
    InputSpec,
    OutputReads,
    bind_inputs,
    check_output_memory,
    fix_unknowns,
    infer_concrete,
    input_specs,
)
from tgraph.engine.capture import Capture, CapturedSignature, CaptureHandle
from tgraph.engine.plan import LaunchPlan, is_pure_view, is_side_hint, lower
from tgraph.engine.program import build_program
from tgraph.errors import CaptureError, EngineInputError, GraphError
from tgraph.ir.network import Network
from tgraph.ir.ops import get_op
from tgraph.ir.ops.transfer import placement_device
from tgraph.ir.value import Value, ValueKind
from tgraph.kernels.backends import select_kernel
from tgraph.kernels.side_streams import join_forked
from tgraph.passes.manager import PassManager, PassRecord
from tgraph.passes.memory import alias_base, plan_memory
from tgraph.passes.partition import (
    Placement,
    Segment,
    group_transfers,
    infer_placement,
    partition,
    place_outputs,
)
from tgraph.passes.pipeline import default_pipeline
from tgraph.tuning import Tuning

__all__ = ["BACKENDS", "CaptureHandle", "Engine", "EngineStats", "build_engine"]

_MAX_BINDINGS = 64
BACKENDS = ("auto", "reference", "triton", "cpu")


@dataclass
class EngineStats:
    """Counts that describe a built engine (memory figures are for the latest binding)."""

    node_count: int
    segment_count: int
    capturable_segments: int
    kernel_count: int  # the step's launches: nodes that are neither views nor side hints
    peak_intermediate_bytes: int | None
    naive_intermediate_bytes: int | None
    bindings: int
    passes: list[PassRecord] = field(default_factory=list)
    # Views that may launch a hint on a side stream (L2 prefetches), not in kernel_count.
    hint_count: int = 0


@dataclass
class _Call:
    """One call's inputs bound to the engine: checked tensors, dims, device, plan and binding."""

    tensors: dict[str, torch.Tensor]
    device: torch.device | None
    plan: LaunchPlan
    key: tuple
    binding: Binding


class Engine:
    """Runs a built network.

    Build one with ``network.build_engine()``; call :meth:`forward` with real tensors. The launch
    plan is built once per kind of device; calls whose dynamic dims differ reuse it (only shapes
    and the memory plan are recomputed, once per distinct signature).

    Backends: ``"reference"`` runs every op through its torch reference; ``"triton"`` runs fused
    Triton kernels (and cuBLAS) writing into one arena per device planned by liveness; ``"cpu"``
    runs torch's CPU kernels (in-place GEMMs, packed int4/int8 matmuls, attention reading the
    paged cache in place) into the same kind of arena; ``"auto"`` (default) picks ``triton`` for
    CUDA inputs and ``cpu`` otherwise; on the CPU a signature called again runs as a step program
    (:mod:`tgraph.engine.program`), its steps bound once. ``tuning`` holds the
    kernels' launch settings (:class:`~tgraph.tuning.Tuning`; the measured defaults when None).
    ``features`` names the feature decorators (e.g. LoRA) the network was recorded with, shown by
    ``str(engine)``.
    """

    def __init__(self, net: Network, pass_records: Sequence[PassRecord] = (),
                 backend: str = "auto", declared_inputs: Sequence[Value] | None = None,
                 tuning: Tuning | None = None, features: Sequence[str] = ()) -> None:
        if backend not in BACKENDS:
            raise GraphError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
        if isinstance(features, str) or not all(isinstance(f, str) for f in features):
            raise GraphError(f"features must be a sequence of feature names, got {features!r}")
        self.net = net
        self.backend = backend
        self.features: tuple[str, ...] = tuple(features)
        if tuning is not None and not isinstance(tuning, Tuning):
            raise GraphError(f"tuning must be a tgraph.tuning.Tuning, got {type(tuning).__name__}"
                             " (tgraph.config.tuning_of(settings) builds one from settings)")
        self.tuning = Tuning() if tuning is None else tuning
        self.pass_records = list(pass_records)
        # A network spread over several devices: where each value lives (None: one device).
        # Its outputs are copied to the main device, where the caller gets them.
        self.placement: Placement | None = infer_placement(net)
        placed = self.placement
        if placed is not None:
            place_outputs(net, placed)
            group_transfers(net, placed)
        # The inputs the user recorded define the interface, even if passes made some unused.
        self.specs: dict[str, InputSpec] = input_specs(
            declared_inputs or net.inputs, placed.of if placed else None,
            placed.main if placed else None)
        self.weights: dict[Value, torch.Tensor] = self._checked_weights(net)
        self.segments: list[Segment] = partition(net, placement=placed)
        self._segment_ranges: list[range] = []
        first = 0
        for seg in self.segments:
            self._segment_ranges.append(range(first, first + len(seg.nodes)))
            first += len(seg.nodes)
        self._main_device = placement_device(placed.main) if placed else None
        self._node_devices = None if placed is None else {
            n: placement_device(placed.node_device(n)) for n in net.nodes}
        # Per device label, the values that live elsewhere (not planned in its arena).
        self._off_device: dict[Label, set[Value]] = {} if placed is None else {
            label: {v for v, where in placed.of.items() if where != label}
            for label in placed.devices}
        self._plans: dict[str, LaunchPlan] = {}
        self._bindings: OrderedDict[tuple, Binding] = OrderedDict()
        self._latest: Binding | None = None
        self._checked_devices: set[torch.device] = set()
        self._arenas: ArenaSet | None = None  # the uncaptured calls' buffers
        self._capture = Capture()
        self._output_clone = {name: alias_base(net, v).kind is not ValueKind.INTERMEDIATE
                              for name, v in net.outputs.items()}
        self._mutated_inputs = self._find_mutated_inputs()
        self._output_reads = self._find_output_reads()

    @staticmethod
    def _checked_weights(net: Network) -> dict[Value, torch.Tensor]:
        weights = {}
        for v in net.weights:
            if v.data is None:
                raise GraphError(f"weight {v.name!r} ({v.describe()}) has no data; load the "
                                 "weights before building the engine")
            if tuple(v.data.shape) != tuple(v.shape) or v.data.dtype != v.dtype:
                raise GraphError(f"weight {v.name!r} holds {v.data.dtype}{list(v.data.shape)}, "
                                 f"but the network recorded {v.describe()}")
            weights[v] = v.data
        return weights

    def _find_mutated_inputs(self) -> set[str]:
        """Inputs written in place (KV caches): a captured graph works on the caller's tensor."""
        names = set()
        for node in self.net.nodes:
            for i in get_op(node.op).mutates:
                base = alias_base(self.net, node.inputs[i])
                if base.kind is ValueKind.INPUT:
                    names.add(base.name)
        return names

    def _find_output_reads(self) -> OutputReads:
        """Which inputs the outputs are views of, for the check of given output buffers."""
        readers: dict[str, list[int]] = {}
        for index, v in enumerate(self.net.outputs.values()):
            base = alias_base(self.net, v)
            if base.kind is ValueKind.INPUT:
                readers.setdefault(base.name, []).append(index)
        return OutputReads(tuple(self.net.outputs), {n: tuple(i) for n, i in readers.items()},
                           frozenset(self._mutated_inputs))

    def _label_of(self, v: Value) -> Label:
        return None if self.placement is None else self.placement.of[v]

    # ---- plans --------------------------------------------------------------------------------

    def kernel_kind(self, device: torch.device | None) -> str:
        """``"triton"``, ``"cpu"`` or ``"reference"``: which kernels run for inputs on
        ``device``."""
        if self.backend != "auto":
            return self.backend
        return "triton" if device is not None and device.type == "cuda" else "cpu"

    def plan_for(self, device: torch.device | None) -> LaunchPlan:
        """The launch plan for inputs on ``device`` (built on first use)."""
        kind = self.kernel_kind(device)
        if kind not in self._plans:
            select = None
            if kind != "reference":
                def select(node):
                    return select_kernel(node, self.tuning, kind)
            self._plans[kind] = lower(self.net, select, self._node_devices)
        return self._plans[kind]

    @property
    def plan(self) -> LaunchPlan:
        """The plan of the most recently used kind (the reference plan before any call)."""
        if self._plans:
            return next(reversed(self._plans.values()))
        return self.plan_for(None)

    # ---- binding -----------------------------------------------------------------------------

    def _prepare(self, inputs: Mapping[str, torch.Tensor],
                 runtime_params: Mapping[str, Any] | None) -> _Call:
        """Check and bind one call's inputs (the path every way of running an engine takes)."""
        tensors, env, device = bind_inputs(self.specs, inputs, runtime_params,
                                           self._main_device)
        if not self._bindings:
            fix_unknowns(self.specs, tensors)
        plan = self.plan_for(device)
        key, binding = self._bind(tensors, env, plan)
        if device is not None and device not in self._checked_devices:
            self._check_weight_devices(device)
        return _Call(tensors, device, plan, key, binding)

    def _bind(self, tensors: Mapping[str, torch.Tensor], env: Mapping[str, int],
              plan: LaunchPlan) -> tuple[tuple, Binding]:
        key = (id(plan),) + tuple((name, tuple(t.shape), t.dtype) for name, t in tensors.items())
        binding = self._bindings.get(key)
        if binding is None:
            shapes = infer_concrete(self.net, tensors, env)
            if self.placement is None:
                memory = {None: plan_memory(self.net, shapes)}
            else:
                memory = {label: plan_memory(self.net, shapes, exclude=off)
                          for label, off in self._off_device.items()}
            attrs = {}
            for i, step in enumerate(plan.steps):
                if step.symbolic_attrs:
                    resolved = dict(step.attrs)
                    resolved["shape"] = tuple(env.get(d, d) if isinstance(d, str) else d
                                              for d in step.attrs["shape"])
                    attrs[i] = resolved
            binding = Binding(shapes, memory, attrs)
            self._bindings[key] = binding
            if len(self._bindings) > _MAX_BINDINGS:
                old_key, _ = self._bindings.popitem(last=False)
                self._capture.signatures.pop(old_key, None)
        else:
            self._bindings.move_to_end(key)
        self._latest = binding
        return key, binding

    def _buffers(self, plan: LaunchPlan, binding: Binding, arenas: ArenaSet
                 ) -> list[list[torch.Tensor | None]]:
        """Buffer views of ``binding`` in ``arenas`` (cached while the arena set is the same)."""
        if binding.views is not None and binding.views[0] is arenas:
            return binding.views[1]
        views = buffer_views(plan, binding.memory, binding.shapes, arenas, self._label_of)
        binding.views = (arenas, views)
        return views

    def _uncaptured_buffers(self, call: _Call) -> list[list[torch.Tensor | None]] | None:
        """Buffers of an uncaptured run, in the engine's arena set (grown as needed)."""
        if not call.plan.uses_arena:
            return None
        if self._arenas is None:
            self._arenas = ArenaSet.allocate(call.binding.memory, call.device)
        else:
            grown = self._arenas.grown(call.binding.memory, call.device)
            if grown is not self._arenas:
                self._drop_programs()  # they hold views of the old arenas
            self._arenas = grown
        return self._buffers(call.plan, call.binding, self._arenas)

    # ---- running ---------------------------------------------------------------------------------

    def forward(self, inputs: Mapping[str, torch.Tensor],
                outputs: Mapping[str, torch.Tensor] | None = None,
                runtime_params: Mapping[str, Any] | None = None) -> dict[str, torch.Tensor]:
        """Run the network.

        Args:
            inputs: one tensor per graph input, by name, all on one device.
            outputs: one preallocated tensor per marked output; the results are written into
                them, after every kernel ran, in the order the outputs were marked. When omitted,
                new tensors are returned. Each must have memory of its own: no two outputs may
                share memory, nor may an output's elements (an ``expand``-ed tensor). An output
                may share memory with an input only if the network does not write that input in
                place and no output written at or after it is a view of that input (e.g. with
                ``a + b`` marked before ``a.reshape(-1)``, the sum may not go into ``a``). The
                check is by byte range, so two interleaved views of one tensor count as sharing.
            runtime_params: host-side values (CPU tensors or lists) for inputs declared ``host``.
        Returns:
            the outputs by name (the given tensors when ``outputs`` was passed).
        Raises:
            EngineInputError: on missing/unknown names, wrong dtype, device or shape, or output
                buffers that share memory as described above.
        """
        if outputs is None and not runtime_params:
            # Fast path: the very tensors a graph was captured with (checked when captured).
            signature = self._capture.match_held(inputs)
            if signature is not None:
                self._replay(signature)
                return self._collect(signature.plan, signature.slots, None)
        call = self._prepare(inputs, runtime_params)
        if outputs is not None:
            self._check_outputs(outputs, call)
        signature = self._capture.signatures.get(call.key)
        if signature is not None:
            signature.load(call.tensors, self._mutated_inputs)
            self._replay(signature)
            slots = signature.slots
        else:
            slots = self._run_program(call)
            if slots is None:
                slots = self._initial_slots(call.plan, call.tensors)
                self._run_steps(call.plan, range(len(call.plan.steps)), slots,
                                self._uncaptured_buffers(call), call.binding)
        return self._collect(call.plan, slots, outputs)

    __call__ = forward

    def intermediates(self, inputs: Mapping[str, torch.Tensor],
                      runtime_params: Mapping[str, Any] | None = None) -> dict[str, torch.Tensor]:
        """Run once without CUDA graphs and return every node's outputs by name, for accuracy
        analysis: ``"{index:04d}.{op}.{label}"`` (label as in ``str(network)``). Inputs declared as
        written in place (the KV cache) are updated as by ``forward``."""
        call = self._prepare(inputs, runtime_params)
        plan = call.plan
        slots = self._initial_slots(plan, call.tensors)
        self._run_steps(plan, range(len(plan.steps)), slots, self._uncaptured_buffers(call),
                        call.binding, release=False)
        labels = self.net.local_labels()
        out = {}
        for i, step in enumerate(plan.steps):
            for v, slot in zip(step.node.outputs, step.out_slots):
                value = slots[slot]
                if isinstance(value, torch.Tensor):
                    name = labels.get(v, v.label()).lstrip("%")
                    out[f"{i:04d}.{step.node.op}.{name}"] = value.detach().clone()
        return out

    def _run_program(self, call: _Call) -> list[Any] | None:
        """Run a CPU call through its binding's step program (:mod:`tgraph.engine.program`),
        built at the binding's second call; returns the slots, or ``None`` to run the call
        uncaptured (the binding's first call, a step that cannot be bound, not the CPU)."""
        if self.placement is not None or not call.plan.uses_arena \
                or (call.device is not None and call.device.type != "cpu") \
                or not self.tuning.cpu.step_programs:
            return None
        binding = call.binding
        buffers = self._uncaptured_buffers(call)
        previous, binding.last_inputs = binding.last_inputs, call.tensors
        program = binding.program
        if program is not None and program.arenas is self._arenas \
                and program.load(call.tensors):
            program.run()
            return program.slots
        if previous is None or binding.unbindable:
            return None
        # Inputs written in place or passed as the same tensor again are read where they are.
        held = frozenset(name for name, t in call.tensors.items()
                         if name in self._mutated_inputs or previous.get(name) is t)
        inputs = {name: t if name in held else t.clone() for name, t in call.tensors.items()}
        slots = self._initial_slots(call.plan, inputs)
        binding.program = build_program(call.plan, binding.attrs, buffers, slots, self._arenas,
                                        inputs, held)
        binding.unbindable = binding.program is None
        return slots

    def _drop_programs(self) -> None:
        for binding in self._bindings.values():
            binding.program = None

    def _replay(self, signature: CapturedSignature) -> None:
        if signature.prologue is not None:
            signature.prologue.replay()
        for graph, steps in zip(signature.graphs, self._segment_ranges):
            if graph is not None:
                graph.replay()
            else:
                self._run_steps(signature.plan, steps, signature.slots, signature.buffers,
                                signature.binding, release=False)

    def _initial_slots(self, plan: LaunchPlan, tensors: Mapping[str, torch.Tensor]) -> list[Any]:
        slots: list[Any] = [None] * plan.num_slots
        for v in self.net.inputs:
            slots[plan.slot_of[v]] = tensors[v.name]
        for v, data in self.weights.items():
            slots[plan.slot_of[v]] = data
        for slot, data in plan.constants.items():
            slots[slot] = data
        return slots

    def _run_steps(self, plan: LaunchPlan, steps: range, slots: list[Any],
                   buffers: list[list[torch.Tensor | None]] | None, binding: Binding,
                   release: bool = True) -> None:
        for i in steps:
            step = plan.steps[i]
            args = [None if s is None else slots[s] for s in step.in_slots]
            attrs = binding.attrs.get(i, step.attrs)
            if step.into:
                result = step.kernel(buffers[i], *args, **attrs)
            else:
                result = step.kernel(*args, **attrs)
            if len(step.out_slots) == 1:
                slots[step.out_slots[0]] = result
            else:
                for s, r in zip(step.out_slots, result):
                    slots[s] = r
            if release:
                for s in step.release:
                    slots[s] = None
        # Work a kernel forked onto a side stream (an L2 prefetch) joins the step here.
        join_forked()

    def _collect(self, plan: LaunchPlan, slots: list[Any],
                 outputs: Mapping[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
        results: dict[str, torch.Tensor] = {}
        for name, v in self.net.outputs.items():
            value = slots[plan.slot_of[v]]
            if outputs is not None:
                outputs[name].copy_(value)
                results[name] = outputs[name]
            elif self._output_clone[name] or plan.uses_arena or self._capture.signatures:
                # Arena buffers and captured slots are reused by the next call: hand out a copy.
                results[name] = value.clone()
            else:
                results[name] = value
        return results

    # ---- CUDA graphs -----------------------------------------------------------------------------

    def capture(self, inputs: Mapping[str, torch.Tensor],
                runtime_params: Mapping[str, Any] | None = None, *,
                by_reference: Iterable[str] = (),
                prologue: Callable[[], None] | None = None,
                share_arena: bool = False) -> CaptureHandle:
        """Capture CUDA graphs for the signature (shapes) of ``inputs``.

        Each capturable segment becomes one graph (host segments run eagerly between replays).
        Later ``forward`` calls with the same shapes copy their inputs into static buffers and
        replay. All captures of an engine share one memory pool.

        Args:
            inputs: example inputs; their shapes fix the captured signature.
            runtime_params: host values, as for :meth:`forward`.
            by_reference: input names the graphs read in place instead of from a static copy:
                the caller keeps those tensors alive and passes the same ones to every later
                ``forward`` (writing new values into them between calls). Inputs the network
                writes (KV caches) are always held this way. When every input is held, a
                ``forward`` given the very same tensor objects replays without any checks or
                copies: the cheapest way to run a decode step.
            prologue: stream work recorded ahead of the first kernel and replayed with it, e.g.
                the copy of staged host inputs (pinned memory) into the tensors held by
                reference, so that a step costs one graph launch and no copy call. It runs once
                before the warm-up too.
            share_arena: put the intermediate buffers in one arena set shared by every capture
                made with this flag (one arena per device of the network), sized for the
                largest of them, instead of a set of its own: for many signatures of which one
                runs at a time (prefill token buckets), at the memory of one. Every replay
                recomputes its buffers and outputs are returned as copies, so the captures do
                not disturb one another. A capture that needs more than the shared set holds
                replaces it with a larger one and releases the captures using the old one (see
                :meth:`replay`).

        Returns:
            a handle for :meth:`replay` (``forward`` finds the capture by itself).
        Raises:
            CaptureError: if the inputs are not on CUDA or a kernel cannot be captured; the
                original error is chained.
        """
        call = self._prepare(inputs, runtime_params)
        device = call.device
        if device is None or device.type != "cuda":
            raise CaptureError(f"CUDA graphs need CUDA inputs, got device {device}")
        held = frozenset(self._mutated_inputs | set(by_reference))
        unknown = sorted(set(by_reference) - set(call.tensors))
        if unknown:
            raise CaptureError(f"by_reference names {unknown} are not inputs of engine "
                               f"{self.net.name!r}")
        plan, binding = call.plan, call.binding
        shared = None
        if share_arena:
            shared = self._capture.shared_arena(binding.memory, device)
            arenas = shared
        else:
            arenas = ArenaSet.allocate(binding.memory, device)
        buffers = buffer_views(plan, binding.memory, binding.shapes, arenas, self._label_of)
        static = {name: t if name in held else t.clone() for name, t in call.tensors.items()}

        # Warm up on a side stream: compiles kernels and creates library handles outside capture.
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            if prologue is not None:
                prologue()
            self._run_steps(plan, range(len(plan.steps)), self._initial_slots(plan, static),
                            buffers, binding)
        torch.cuda.current_stream(device).wait_stream(stream)

        slots = self._initial_slots(plan, static)
        prologue_graph = None
        if prologue is not None and not (self.segments and self.segments[0].capturable):
            # The first segment runs on the host: the prologue gets a graph of its own.
            prologue_graph = self._capture_prologue(prologue)
            prologue = None
        graphs = self._capture_segments(plan, slots, buffers, binding, prologue)
        all_held = not runtime_params and held >= set(call.tensors)
        signature = CapturedSignature(static, binding, buffers, slots, graphs, plan, held,
                                      all_held, prologue_graph, shared)
        self._capture.signatures[call.key] = signature
        return CaptureHandle(call.key, signature)

    def _capture_segments(self, plan: LaunchPlan, slots: list[Any],
                          buffers: list[list[torch.Tensor | None]], binding: Binding,
                          prologue: Callable[[], None] | None) -> list[Any]:
        """One graph per capturable segment (``None`` for host segments, which run now)."""
        graphs = []
        for seg_index, (seg, steps) in enumerate(zip(self.segments, self._segment_ranges)):
            # NOTE: slots are not released while capturing: host segments replayed between the
            # graphs read values the graphs produced (they are arena views, so this costs nothing).
            if not seg.capturable:
                self._run_steps(plan, steps, slots, buffers, binding, release=False)
                graphs.append(None)
                continue
            graph = torch.cuda.CUDAGraph()
            try:
                with self._segment_device(seg), torch.cuda.graph(
                        graph, pool=self._capture.pool(), stream=self._capture.stream(seg.device)):
                    if seg_index == 0 and prologue is not None:
                        prologue()
                    self._run_steps(plan, steps, slots, buffers, binding, release=False)
            except Exception as err:
                ops = ", ".join(sorted({n.op for n in seg.nodes}))
                raise CaptureError(f"capturing segment {seg_index} of engine {self.net.name!r} "
                                   f"(ops: {ops}) failed: {err}") from err
            graphs.append(graph)
        return graphs

    def _capture_prologue(self, prologue: Callable[[], None]) -> Any:
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self._capture.pool()):
                prologue()
        except Exception as err:
            raise CaptureError(f"capturing the prologue of engine {self.net.name!r} failed: "
                               f"{err}") from err
        return graph

    def replay(self, handle: CaptureHandle) -> dict[str, torch.Tensor]:
        """Replay a signature whose inputs are all held by reference, with no checks at all.

        For an owner that keeps the captured tensors and writes each step's values into them
        (a decode loop): it skips even the identity check of :meth:`forward`'s fast path.

        Args:
            handle: what :meth:`capture` returned (with every input in ``by_reference``).
        Returns:
            the outputs by name (copies: the graph reuses its buffers on the next replay).
        Raises:
            CaptureError: if the capture was released since, or holds some input by copy.
        """
        self._check_live(handle)
        signature = handle.capture
        if not signature.all_held:
            raise CaptureError("replay() needs every input held by reference; use forward()")
        self._replay(signature)
        return self._collect(signature.plan, signature.slots, None)

    def _check_live(self, handle: CaptureHandle) -> None:
        if not self.is_captured(handle):
            raise CaptureError(f"engine {self.net.name!r}: this capture was released "
                               "(release_captures, set_weights or to); capture again")

    def is_captured(self, handle: CaptureHandle) -> bool:
        """Whether ``handle``'s capture is still live (not released or replaced since)."""
        return self._capture.is_live(handle)

    def _segment_device(self, seg: Segment) -> Any:
        """The segment's CUDA device made current (nothing to do on a single device)."""
        return nullcontext() if seg.device is None else \
            torch.cuda.device(placement_device(seg.device))

    @property
    def captured_signatures(self) -> int:
        return len(self._capture.signatures)

    @property
    def captured_graphs(self) -> list[torch.cuda.CUDAGraph]:
        """The CUDA graphs of every captured signature (for profiling their replay alone)."""
        return [g for signature in self._capture.signatures.values()
                for g in signature.graphs if g is not None]

    def graphs_of(self, handle: CaptureHandle) -> list[torch.cuda.CUDAGraph]:
        """The CUDA graphs of one live capture (its segments' graphs, without the input copy)."""
        self._check_live(handle)
        return [g for g in handle.capture.graphs if g is not None]

    def release_captures(self) -> None:
        """Drop every captured CUDA graph; the next ``forward`` of a signature runs uncaptured
        until ``capture`` is called again. Needed before the memory or the process group the
        graphs use goes away (a KV cache reallocated, NCCL communicators destroyed). The CPU's
        step programs, which hold such memory too, are dropped as well."""
        self._capture.release()
        self._drop_programs()

    # ---- checks ----------------------------------------------------------------------------------

    def _check_weight_devices(self, device: torch.device) -> None:
        for v, data in self.weights.items():
            if self.placement is not None:
                label = self.placement.of.get(v, self.placement.main)
                if data.device != placement_device(label):
                    raise EngineInputError(f"weight {v.name!r} is on {data.device} but the network "
                                           f"places it on {label}; apply the placement rules "
                                           f"before the engine is built")
            elif data.device != device:
                raise EngineInputError(f"weight {v.name!r} is on {data.device} but the inputs "
                                       f"are on {device}; load weights on the inputs' device or "
                                       f"call engine.to({str(device)!r})")
        self._checked_devices.add(device)

    def _check_outputs(self, outputs: Mapping[str, torch.Tensor], call: _Call) -> None:
        names = list(self.net.outputs)
        unknown = [n for n in outputs if n not in self.net.outputs]
        missing = [n for n in names if n not in outputs]
        if unknown or missing:
            raise EngineInputError(f"outputs: missing {missing}, unknown {unknown}; the network's "
                                   f"outputs are {names}")
        for name, v in self.net.outputs.items():
            t = outputs[name]
            if v.kind is ValueKind.INTERMEDIATE:
                shape, dtype = call.binding.shapes[v]
            elif v.kind is ValueKind.INPUT:
                shape, dtype = tuple(call.tensors[v.name].shape), call.tensors[v.name].dtype
            else:
                shape, dtype = tuple(self.weights[v].shape), self.weights[v].dtype
            want = f"{str(dtype).replace('torch.', '')}{list(shape)}"
            if not isinstance(t, torch.Tensor):
                raise EngineInputError(f"output {name!r} must be a torch.Tensor, expected {want}")
            if t.dtype != dtype or tuple(t.shape) != tuple(shape):
                raise EngineInputError(f"output {name!r} is {str(t.dtype).replace('torch.', '')}"
                                       f"{list(t.shape)}, expected {want}")
            if call.device is not None and t.device != call.device:
                raise EngineInputError(f"output {name!r} is on {t.device}, expected "
                                       f"{call.device} (the inputs' device)")
        check_output_memory(outputs, call.tensors, self._output_reads)

    # ---- weights ---------------------------------------------------------------------------------

    def set_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Rebind weights by name (same shape and dtype) without rebuilding anything."""
        by_name = {v.name: v for v in self.weights}
        for name, data in weights.items():
            if name not in by_name:
                raise EngineInputError(f"set_weights: unknown weight {name!r}")
            v = by_name[name]
            old = self.weights[v]
            if tuple(data.shape) != tuple(old.shape) or data.dtype != old.dtype:
                raise EngineInputError(f"set_weights: {name!r} must be "
                                       f"{old.dtype}{list(old.shape)}, "
                                       f"got {data.dtype}{list(data.shape)}")
            self.weights[v] = data
        self._checked_devices.clear()
        self.release_captures()  # the graphs read the old weights' memory

    def to(self, device: torch.device | str) -> Engine:
        """Move the engine's weights to ``device``."""
        if self.placement is not None:
            raise GraphError(f"engine {self.net.name!r} is spread over {self.placement.devices}; "
                             "its weights stay where they were placed")
        for v in self.weights:
            self.weights[v] = self.weights[v].to(device)
        self._checked_devices.clear()
        self.release_captures()
        return self

    # ---- introspection ---------------------------------------------------------------------------

    @property
    def stats(self) -> EngineStats:
        latest = self._latest
        return EngineStats(
            node_count=len(self.net.nodes),
            segment_count=len(self.segments),
            capturable_segments=sum(1 for s in self.segments if s.capturable),
            kernel_count=sum(1 for st in self.plan.steps
                             if not is_pure_view(st.node) and not is_side_hint(st.node)),
            peak_intermediate_bytes=latest.arena_bytes if latest else None,
            naive_intermediate_bytes=latest.naive_bytes if latest else None,
            bindings=len(self._bindings),
            passes=list(self.pass_records),
            hint_count=sum(1 for st in self.plan.steps if is_side_hint(st.node)),
        )

    def __str__(self) -> str:
        s = self.stats
        hints = f" (+{s.hint_count} prefetch hints)" if s.hint_count else ""
        lines = [f'engine "{self.net.name}" ({self.backend}): {s.kernel_count} kernels{hints}, '
                 f"{s.segment_count} segments ({s.capturable_segments} capturable)"]
        if self.placement is not None:
            lines[0] += f", devices {', '.join(self.placement.devices)} " \
                        f"(main {self.placement.main})"
        lines.append(f"  features: {', '.join(self.features) or 'none'}")
        for spec in self.specs.values():
            lines.append(f"  input  {spec.describe()}")
        labels = self.net.local_labels()
        step_of = {st.node: st for st in self.plan.steps}
        for seg_index, seg in enumerate(self.segments):
            kind = "device" if seg.capturable else f"host: {seg.reason}"
            where = f" on {seg.device}" if seg.device is not None else ""
            lines.append(f"  segment {seg_index} [{kind}]{where}")
            for node in seg.nodes:
                outs = ", ".join(labels.get(v, v.label()) for v in node.outputs)
                lines.append(f"    {outs} <- {step_of[node].kernel_name}")
        for name, v in self.net.outputs.items():
            lines.append(f"  output {name} = {labels.get(v, v.label())}")
        if self.pass_records:
            lines.append("  passes: " + "; ".join(str(r) for r in self.pass_records))
        return "\n".join(lines)


def build_engine(net: Network, *, passes: bool = True, disabled_passes: Sequence[str] = (),
                 backend: str = "auto", tuning: Tuning | None = None,
                 features: Sequence[str] = ()) -> Engine:
    """Build an :class:`Engine` from ``net``.

    Args:
        net: the recorded network; it is copied, never changed.
        passes: run the pass pipeline (``False`` builds the network exactly as recorded).
        disabled_passes: pass names to skip (``llm.engine.disabled_passes``).
        backend: ``"auto"``, ``"reference"``, ``"triton"`` or ``"cpu"`` (see :class:`Engine`).
        tuning: the kernels' launch settings (``llm.engine.tuning``; defaults when None).
        features: the feature decorators the network was recorded with (``str(engine)`` lists
            them).
    Returns:
        the engine. If ``net`` is the default network, the default is fresh afterwards.
    """
    from tgraph.nn.network_manager import release_if_default

    if backend not in BACKENDS:
        raise GraphError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
    net.verify()
    if not net.outputs:
        raise GraphError(f"network {net.name!r} has no outputs; call mark_output(tensor, name)")
    work, _ = net.clone()
    records = PassManager(default_pipeline(), disabled_passes).run(work) if passes else []
    engine = Engine(work, records, backend=backend, declared_inputs=net.inputs, tuning=tuning,
                    features=features)
    release_if_default(net)
    return engine
