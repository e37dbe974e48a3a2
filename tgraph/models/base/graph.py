"""``torch_to_graph``: the decorator that turns a ``FlashCausalLM`` into an inference model.

On the first call for a kind of batch it records ``forward`` on symbolic inputs (once per graph:
prefill, decode, and one per combination of features used) and builds and caches the engine.
Each step then goes through one flow (:meth:`GraphState.run`): pick the engine, let the model and
the engine's features add their own inputs (the model-inputs hook: ``_update_model_inputs``,
``FeatureDecorator.update_model_inputs``), and either run the step uncaptured or from the CUDA
graph of its padded signature (captured on first use). The engine inputs themselves are built by
:mod:`tgraph.models.base.step_inputs`.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch

from tgraph.engine import CaptureHandle, Engine
from tgraph.errors import ConfigError
from tgraph.ir.ops.transfer import placement_device
from tgraph.models.base.batch import BatchMeta, pad_decode, prefill_token_bucket
from tgraph.models.base.causal_lm import FlashCausalLM
from tgraph.models.base.dump import dump_intermediates
from tgraph.models.base.features import FeatureDecorator, check_stackable
from tgraph.models.base.step_inputs import Staging, StepInputs
from tgraph.nn import functional as F
from tgraph.nn.network_manager import new_network, recording
from tgraph.nn.tensor import Tensor

logger = logging.getLogger("tgraph.models")

GraphKey = tuple[bool, tuple[str, ...]]


class GraphModel:
    """Mixed into a decorated ``FlashCausalLM``: engines, KV cache and the batch entry point."""

    feature_classes: tuple[type[FeatureDecorator], ...] = ()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._graph = GraphState(self)

    def _graph_state(self) -> GraphState:
        return self._graph

    # ---- public API --------------------------------------------------------------------------
    def allocate_kv_cache(self, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Allocate the paged KV cache: per layer ``[num_blocks, block_size, kv_heads, head_dim]``
        for this rank's heads."""
        return self._graph.allocate_kv_cache(num_blocks)

    @property
    def kv_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return self._graph.kv_caches

    @property
    def features(self) -> dict[str, FeatureDecorator]:
        return self._graph.features

    @property
    def engines(self) -> dict[GraphKey, Engine]:
        """Built engines by (is_prefill, features)."""
        return self._graph.engines

    @property
    def dump_dir(self) -> str | None:
        """Where each engine's first step writes its intermediates (``None``: nowhere)."""
        return self._graph.dump_dir

    @dump_dir.setter
    def dump_dir(self, directory: str | None) -> None:
        self._graph.dump_dir = directory

    def run(self, batch: BatchMeta) -> torch.Tensor:
        """Run one step; returns logits ``[num_logits, vocab]`` (one row per logits index, or
        one per sequence in decode)."""
        return self._graph.run(batch)

    def release_graphs(self) -> None:
        """Drop every captured CUDA graph (they are captured again on the next decode step).
        Needed before leaving a process group whose collectives the graphs captured."""
        self._graph.release_graphs()

    def capture_decode_graphs(self, buckets: Sequence[int] | None = None) -> list[int]:
        """Capture decode CUDA graphs for the batch buckets (largest first). Returns the
        buckets captured."""
        return self._graph.capture_decode(buckets)

    def decode_graphs(self, num_seqs: int) -> list[torch.cuda.CUDAGraph]:
        """The captured CUDA graphs that run a base decode step of ``num_seqs`` sequences (its
        batch bucket's), or ``[]`` when that bucket is not captured. For timing the GPU's part
        of a step alone: a replay reads the step inputs the latest :meth:`run` of that bucket
        staged (the capture's placeholder batch before any run)."""
        return self._graph.decode_graphs(num_seqs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and not kwargs and isinstance(args[0], BatchMeta):
            return self.run(args[0])
        return super().__call__(*args, **kwargs)  # type: ignore[misc]


def torch_to_graph(*feature_decorators: type[FeatureDecorator]) -> Callable[[type], type]:
    """Class decorator: make a ``FlashCausalLM`` subclass an inference model with engines.

    Args:
        feature_decorators: feature classes that may add graphs (e.g. LoRA).

    Returns:
        The decorator; it returns a subclass of the decorated class and :class:`GraphModel`.
    """
    for f in feature_decorators:
        if not (isinstance(f, type) and issubclass(f, FeatureDecorator)):
            raise TypeError(f"torch_to_graph takes FeatureDecorator subclasses, got {f!r}")
    names = [f.name for f in feature_decorators]
    if len(set(names)) != len(names):
        raise TypeError(f"torch_to_graph: duplicate feature names {names}")

    def decorate(cls: type) -> type:
        if not (isinstance(cls, type) and issubclass(cls, FlashCausalLM)):
            raise TypeError(f"torch_to_graph decorates FlashCausalLM subclasses, got {cls!r}")
        graph_cls = type(cls.__name__, (GraphModel, cls),
                         {"feature_classes": tuple(feature_decorators),
                          "__module__": cls.__module__, "__qualname__": cls.__qualname__,
                          "__doc__": cls.__doc__})
        return graph_cls

    return decorate


class GraphState:
    """Per-model engines, caches and captured graphs, and the step runner.

    Attributes:
        engines: built engines by (is_prefill, feature names).
        build_seconds: how long each engine took to record and build.
        captured: each captured signature's handle, keyed ``(engine key, batch bucket)`` at
            decode and ``(engine key, ("prefill", tokens, sequences))`` at prefill.
        step_inputs: builds each step's engine inputs and holds the captured signatures' staging.
        dump_dir: where each engine's first step writes its intermediates (``None``: nowhere).
        features: the model's features by name.
    """

    def __init__(self, model: Any) -> None:
        self.model = model
        self.config = model.llm_config
        self.engines: dict[GraphKey, Engine] = {}
        self.build_seconds: dict[GraphKey, float] = {}
        self.captured: dict[Hashable, CaptureHandle] = {}
        self.dump_dir: str | None = None
        self._dumped: set[GraphKey] = set()
        self._warned: set[str] = set()
        self.features: dict[str, FeatureDecorator] = {
            f.name: f(model, self.config.features.get(f.name)) for f in model.feature_classes}
        self.step_inputs = StepInputs(self.config, self.features)
        self._kv_heads = max(1, self.config.model.num_key_value_heads // self.config.world_size)

    @property
    def kv_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return self.step_inputs.kv_caches

    def _kv_cache_placements(self) -> list[str | None]:
        """Each layer's KV-cache placement: that of the attention module using the cache (the
        one whose ``layer_idx`` it is), ``None`` for a model without placements."""
        labels: list[str | None] = [None] * self.config.model.num_hidden_layers
        if self.model.placement is None:
            return labels
        for _, module in self.model.named_modules():
            idx = module.__dict__.get("layer_idx")
            if isinstance(idx, int) and 0 <= idx < len(labels) and module.placement is not None:
                labels[idx] = module.placement
        return labels

    def allocate_kv_cache(self, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        m, c = self.config.model, self.config
        shape = (num_blocks, c.block_size, self._kv_heads, m.head_dim)
        # Each layer's cache lives on its layer's device (placement rules), else the model's.
        devices = [c.device if label is None else placement_device(label)
                   for label in self._kv_cache_placements()]
        kv_caches = [(torch.zeros(shape, dtype=c.dtype, device=dev),
                      torch.zeros(shape, dtype=c.dtype, device=dev))
                     for dev in devices]
        self.step_inputs.reset(kv_caches)
        self._release_captures()
        return kv_caches

    def release_graphs(self) -> None:
        """Drop every captured graph and its staging (see :meth:`GraphModel.release_graphs`)."""
        self.step_inputs.stagings.clear()
        self._release_captures()
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def _release_captures(self) -> None:
        self.captured.clear()
        for engine in self.engines.values():
            engine.release_captures()

    # ---- recording ----------------------------------------------------------------------------
    def _symbolic_inputs(self, is_prefill: bool) -> dict[str, Any]:
        c, m = self.config, self.config.model
        i32 = torch.int32
        tokens = "num_tokens" if is_prefill else "batch"
        cache_shape = ("num_blocks", c.block_size, self._kv_heads, m.head_dim)
        inputs: dict[str, Any] = {
            "input_ids": Tensor("input_ids", i32, (tokens,)),
            "position_ids": Tensor("position_ids", i32, (tokens,)),
            "slots_mapping": Tensor("slots_mapping", i32, (tokens,)),
            "block_table": Tensor("block_table", i32, ("batch", c.max_blocks_per_seq)),
            "seq_len": Tensor("seq_len", i32, ("batch",)),
            "kv_caches": [(Tensor(f"k_cache_{i}", c.dtype, cache_shape),
                           Tensor(f"v_cache_{i}", c.dtype, cache_shape))
                          for i in range(m.num_hidden_layers)],
            "is_prefill": is_prefill,
        }
        if is_prefill:
            inputs["query_start_loc"] = Tensor("query_start_loc", i32, ("batch_plus_one",))
            inputs["lm_head_indices"] = Tensor("lm_head_indices", i32, ("num_logits",))
        inputs.update(self.model.extra_symbolic_inputs(is_prefill))
        if self.model.placement is not None:
            self._declare_placements(inputs)
        return inputs

    def _declare_placements(self, inputs: dict[str, Any]) -> None:
        """A model spread over devices: each KV cache is read where its layer runs, every other
        input on the model's own device (where the batch is staged)."""
        for value in inputs.values():
            if isinstance(value, Tensor):
                F.place(value, self.model.placement)
        for label, pair in zip(self._kv_cache_placements(), inputs["kv_caches"]):
            for cache in pair:
                F.place(cache, label or self.model.placement)

    def _build(self, key: GraphKey) -> Engine:
        is_prefill, feature_names = key
        features = [self.features[n] for n in feature_names]
        name = f"{type(self.model).__name__}:{'prefill' if is_prefill else 'decode'}"
        name += "".join(f"+{n}" for n in feature_names)
        start = time.perf_counter()
        inputs = self._symbolic_inputs(is_prefill)
        for f in features:
            inputs.update(f.symbolic_inputs(is_prefill))
        with recording(new_network(name)) as net:
            for f in features:
                f.enter_graph(inputs)
            try:
                outputs = self.model.forward(**inputs)
            finally:
                for f in reversed(features):
                    f.exit_graph()
            if not isinstance(outputs, dict) or "model_out" not in outputs:
                raise ConfigError(f"{type(self.model).__name__}.forward must return a dict with "
                                  "'model_out'")
            for f in features:
                outputs = f.transform_outputs(outputs, inputs)
            for out_name, value in outputs.items():
                net.mark_output(value, out_name)
        c = self.config
        engine = net.build_engine(passes=c.static, disabled_passes=c.disabled_passes,
                                  backend="auto" if c.static else "reference", tuning=c.tuning,
                                  features=feature_names)
        seconds = time.perf_counter() - start
        self.build_seconds[key] = seconds
        logger.info("built engine %s in %.2f s (%d kernels)", name, seconds,
                    engine.stats.kernel_count)
        self.engines[key] = engine
        return engine

    # ---- running ---------------------------------------------------------------------------------
    def run(self, batch: BatchMeta) -> torch.Tensor:
        """Run one step: pad, pick the engine, then run uncaptured or from a CUDA graph.

        Args:
            batch: the step's batch.

        Returns:
            The logits: one row per logits index at prefill, per sequence at decode.
        """
        self._check_ready(batch)
        num_seqs = batch.num_seqs
        bucket = self._decode_bucket(batch)
        if bucket is not None:
            batch = pad_decode(batch, bucket)
        key = (batch.is_prefill, self._features_for(batch))
        engine = self.engines.get(key) or self._build(key)
        extra_in, extra_out, runtime = self._model_inputs(batch, key[1])
        own_inputs = bool(extra_in or extra_out or runtime)
        staged = self._staged(batch, key, bucket, own_inputs)
        if own_inputs:
            self._explain_own_inputs(batch, key, staged, extra_in, extra_out, runtime)
        if staged is None:
            inputs = {**self.step_inputs.uncaptured(batch, key[1]), **extra_in}
            self._dump_first(key, engine, inputs, runtime)
            logits = engine.forward(inputs, extra_out or None, runtime or None)["model_out"]
            return logits if batch.is_prefill else logits[:num_seqs]
        signature, staging = staged
        if extra_in:
            # Copied into tensors of the staging's own, which the graph reads by reference.
            staging.hold(extra_in)
        inputs = staging.inputs
        handle = self.captured.get(signature)
        if handle is None or not engine.is_captured(handle):
            staging.upload()
            self._dump_first(key, engine, inputs, runtime)
            # Prefill token buckets share one arena: one signature runs at a time.
            handle = engine.capture(inputs, runtime or None, by_reference=list(staging.inputs),
                                    prologue=staging.upload, share_arena=batch.is_prefill)
            self.captured[signature] = handle
        if extra_out or runtime:
            outputs = engine.forward(inputs, extra_out or None, runtime or None)
        else:
            # Every input is a staging or resident tensor: one launch copies them in and runs.
            outputs = engine.replay(handle)
        staging.mark_replayed()
        rows = len(batch.default_lm_head_indices()) if batch.is_prefill else num_seqs
        return outputs["model_out"][:rows]

    def _model_inputs(self, batch: BatchMeta, feature_names: tuple[str, ...]
                      ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, Any]]:
        """The model-inputs hook of the step: the model's ``_update_model_inputs`` and that of
        each feature whose engine runs it, merged (a name given twice is refused)."""
        parts = [self.model._update_model_inputs(batch)]
        parts += [self.features[n].update_model_inputs(batch) for n in feature_names]
        if len(parts) == 1:
            return parts[0]
        merged: tuple[dict, dict, dict] = ({}, {}, {})
        for part in parts:
            for into, values in zip(merged, part):
                clash = sorted(into.keys() & values.keys())
                if clash:
                    raise ConfigError(f"the model-inputs hooks of {type(self.model).__name__} "
                                      f"and features {list(feature_names)} all give {clash}")
                into.update(values)
        return merged

    def _explain_own_inputs(self, batch: BatchMeta, key: GraphKey,
                            staged: tuple[Hashable, Staging] | None, extra_in: dict,
                            extra_out: dict, runtime: dict) -> None:
        """Log once per reason when the hook's returns cost a fast path CUDA graphs would
        otherwise take: an uncaptured prefill, or a decode step bound through
        ``Engine.forward`` instead of one graph launch."""
        names = sorted({*extra_in, *extra_out, *runtime})
        if batch.is_prefill and staged is None and self._prefill_buckets(batch, key) is not None:
            self._warn_once("prefill", "prefill steps given inputs by the model-inputs hook "
                            f"({names}) run without CUDA graphs: the hook's inputs cannot be "
                            "padded to the captured token buckets")
        elif not batch.is_prefill and staged is not None and (extra_out or runtime):
            what = sorted({*extra_out, *runtime})
            self._warn_once("decode", f"decode steps given runtime params or outputs ({what}) by "
                            "the model-inputs hook are bound and copied at every step "
                            "(Engine.forward) instead of replayed in one launch; ops reading "
                            "runtime params (host values) run uncaptured between the graphs")

    def _warn_once(self, reason: str, message: str) -> None:
        if reason not in self._warned:
            self._warned.add(reason)
            logger.warning("%s: %s", type(self.model).__name__, message)

    def _check_ready(self, batch: BatchMeta) -> None:
        if not self.kv_caches:
            raise ConfigError("allocate the KV cache (model.allocate_kv_cache(num_blocks)) before "
                              "running the model")
        batch.validate()
        if max(batch.position_ids, default=0) >= self.config.max_model_len:
            raise ConfigError(f"position {max(batch.position_ids)} is beyond max_model_len "
                              f"{self.config.max_model_len}")

    def _features_for(self, batch: BatchMeta) -> tuple[str, ...]:
        used = [f for f in self.features.values() if f.needs_engine and f.is_used(batch)]
        check_stackable(used)
        return tuple(sorted(f.name for f in used))

    def _can_capture(self) -> bool:
        c = self.config
        return c.static and c.cuda_graph and c.device.type == "cuda"

    def _bucket(self, num_seqs: int) -> int | None:
        return next((b for b in sorted(self.config.batch_buckets) if b >= num_seqs), None)

    def _decode_bucket(self, batch: BatchMeta) -> int | None:
        """The batch bucket a decode step is padded to for its CUDA graph, or None to run it
        uncaptured (a prefill, no CUDA graphs, or more sequences than the largest bucket)."""
        if batch.is_prefill or not self._can_capture():
            return None
        return self._bucket(batch.num_seqs)

    def _staged(self, batch: BatchMeta, key: GraphKey, bucket: int | None,
                own_inputs: bool) -> tuple[Hashable, Staging] | None:
        """The signature of the CUDA graph that runs this step and its staging holding the
        step, or None to run the step uncaptured."""
        if bucket is not None:
            signature: Hashable = (key, bucket)
            return signature, self.step_inputs.decode_staged(signature, batch, key[1])
        padded = self._prefill_buckets(batch, key) if batch.is_prefill and not own_inputs \
            else None
        if padded is None:
            return None
        tokens, seqs = padded
        signature = (key, ("prefill", tokens, seqs))
        return signature, self.step_inputs.prefill_staged(signature, batch, tokens, seqs, key[1])

    def _prefill_buckets(self, batch: BatchMeta, key: GraphKey) -> tuple[int, int] | None:
        """(tokens, sequences) a prefill is padded to for a CUDA graph, or None to run it
        uncaptured: too many tokens, sequences or logits rows, the engine of a feature that
        cannot pad its arrays (``FeatureDecorator.pads_prefill``), a dump, or an engine with
        work placed on the CPU (see :meth:`_prefill_refusal`; logged once).

        Captured as at decode: tensor-parallel engines (NCCL collectives inside the graphs, or
        between them with ``capture_collectives=False``; the peer all-reduce takes a message
        only where it fits its buffers, else NCCL) and engines placed on several GPUs (one
        graph per device segment, the copies between them; the buckets share one arena per
        GPU). Every rank decides alike, since the config, the batch, the engine and the dump
        setting are the same on every rank: the ranks capture the same bucket at the same step
        and replay its collectives together.

        Prefill is otherwise bound by the host: a few hundred uncaptured launches, each costing
        more CPU time than small models' kernels take on the GPU."""
        if not self._can_capture() or self.dump_dir is not None:
            return None
        if not all(self.features[n].pads_prefill for n in key[1]):
            return None
        why = self._prefill_refusal(key)
        if why:
            self._warn_once("prefill placement", f"prefill steps run without CUDA graphs: {why}")
            return None
        tokens = prefill_token_bucket(batch.num_tokens, self.config.prefill_graph_tokens)
        seqs = self._bucket(max(batch.num_seqs, len(batch.default_lm_head_indices())))
        if tokens is None or seqs is None:
            return None
        return tokens, seqs

    def _prefill_refusal(self, key: GraphKey) -> str:
        """Why the prefill engine of ``key`` replays no CUDA graphs although decode engines do
        ('' when it may): work a rule placed on the CPU (MoE experts) runs between the graphs,
        so it would compute the token bucket's pad tokens too (a 5-token prompt runs as 128
        tokens there), on the model's slowest device: more than the graphs save."""
        engine = self.engines.get(key)
        placement = None if engine is None else engine.placement
        if placement is None:
            return ""
        cpu = [label for label in placement.devices if placement_device(label).type == "cpu"]
        if not cpu:
            return ""
        return (f"work is placed on {', '.join(cpu)}, which a CUDA graph cannot hold; padded "
                "to a token bucket, it would compute the pad tokens too")

    def _dump_first(self, key: GraphKey, engine: Engine, inputs: dict[str, Any],
                    runtime: dict[str, Any]) -> None:
        """Dump the intermediates of the engine's first step, when a dump directory is set."""
        if self.dump_dir is None or key in self._dumped:
            return
        count = dump_intermediates(engine, inputs, runtime or None, self.kv_caches,
                                   self.dump_dir)
        self._dumped.add(key)
        logger.info("dumped %d intermediates of %s to %s", count, engine.net.name, self.dump_dir)

    # ---- captured decode graphs, ahead of time ---------------------------------------------------
    def decode_graphs(self, num_seqs: int) -> list[torch.cuda.CUDAGraph]:
        if isinstance(num_seqs, bool) or not isinstance(num_seqs, int) or num_seqs < 1:
            raise ValueError(f"decode_graphs: num_seqs must be a positive int, got {num_seqs!r}")
        bucket = self._bucket(num_seqs) if self._can_capture() else None
        handle = self.captured.get(((False, ()), bucket)) if bucket is not None else None
        engine = self.engines.get((False, ()))
        if handle is None or engine is None or not engine.is_captured(handle):
            return []  # never captured, or released since (set_weights, to)
        return engine.graphs_of(handle)

    def capture_decode(self, buckets: Sequence[int] | None) -> list[int]:
        """Capture the base decode engine for ``buckets`` (largest first) ahead of time, and
        the engines of features that ask for it (:meth:`FeatureDecorator.decode_capture_batch`);
        other engines (feature combinations) are captured on their first decode step."""
        if not self._can_capture():
            return []
        if not self.kv_caches:
            raise ConfigError("allocate the KV cache before capturing decode graphs")
        buckets = sorted(buckets or self.config.batch_buckets, reverse=True)
        for b in buckets:
            dummy = BatchMeta(input_ids=[0] * b, position_ids=[0] * b, slots_mapping=[-1] * b,
                              query_lens=[1] * b, seq_len=[0] * b, block_table=[[]] * b,
                              is_prefill=False)
            self.run(dummy)
            for feature in self.features.values():
                marked = feature.decode_capture_batch(dummy)
                if marked is not None:
                    self.run(marked)
        return buckets
