"""``torch_to_graph``: the decorator that turns a ``FlashCausalLM`` into an inference model.

On the first call for a kind of batch it records ``forward`` on symbolic inputs (once per graph:
prefill, decode, and one per combination of features used), builds and caches the engine, and
from then on prepares the engine inputs from the batch metadata, merges what the model's
``_update_model_inputs`` returns, picks the engine, runs it and returns the logits.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, Sequence

import numpy as np
import torch

from tgraph.engine import CaptureHandle, Engine
from tgraph.errors import ConfigError
from tgraph.ir.ops.transfer import placement_device
from tgraph.models.base.batch import (
    BatchMeta,
    block_table_array,
    pad_decode,
    pad_prefill_arrays,
    prefill_token_bucket,
)
from tgraph.models.base.causal_lm import FlashCausalLM
from tgraph.models.base.features import FeatureDecorator, check_stackable
from tgraph.nn import functional as F
from tgraph.nn.network_manager import new_network, recording
from tgraph.nn.tensor import Tensor

logger = logging.getLogger("tgraph.models")

GraphKey = tuple[bool, tuple[str, ...]]
# Engine inputs with one integer per token (per sequence at decode), named as BatchMeta's fields.
_BATCH_FIELDS = ("input_ids", "position_ids", "slots_mapping", "seq_len")


class GraphModel:
    """Mixed into a decorated ``FlashCausalLM``: engines, KV cache and the batch entry point."""

    feature_classes: tuple[type[FeatureDecorator], ...] = ()

    def _graph_state(self) -> "GraphState":
        state = self.__dict__.get("_graph")
        if state is None:
            state = GraphState(self)
            object.__setattr__(self, "_graph", state)
        return state

    # ---- public API --------------------------------------------------------------------------
    def allocate_kv_cache(self, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Allocate the paged KV cache: per layer ``[num_blocks, block_size, kv_heads, head_dim]``
        for this rank's heads."""
        return self._graph_state().allocate_kv_cache(num_blocks)

    @property
    def kv_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return self._graph_state().kv_caches

    @property
    def features(self) -> dict[str, FeatureDecorator]:
        return self._graph_state().features

    @property
    def engines(self) -> dict[GraphKey, Engine]:
        """Built engines by (is_prefill, features)."""
        return self._graph_state().engines

    def run(self, batch: BatchMeta) -> torch.Tensor:
        """Run one step; returns logits ``[num_logits, vocab]`` (one row per logits index, or
        one per sequence in decode)."""
        return self._graph_state().run(batch)

    def release_graphs(self) -> None:
        """Drop every captured CUDA graph (they are captured again on the next decode step).
        Needed before leaving a process group whose collectives the graphs captured."""
        state = self._graph_state()
        state.captured.clear()
        state._staging.clear()
        for engine in state.engines.values():
            engine.release_captures()
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def capture_decode_graphs(self, buckets: Sequence[int] | None = None) -> list[int]:
        """Capture decode CUDA graphs for the batch buckets (largest first). Returns the
        buckets captured."""
        return self._graph_state().capture_decode(buckets)

    def decode_graphs(self, num_seqs: int) -> list[torch.cuda.CUDAGraph]:
        """The captured CUDA graphs that run a base decode step of ``num_seqs`` sequences (its
        batch bucket's), or ``[]`` when that bucket is not captured. For timing the GPU's part
        of a step alone: a replay reads the step inputs the latest :meth:`run` of that bucket
        staged (the capture's placeholder batch before any run)."""
        return self._graph_state().decode_graphs(num_seqs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and not kwargs and isinstance(args[0], BatchMeta):
            return self.run(args[0])
        return super().__call__(*args, **kwargs)  # type: ignore[misc]


def torch_to_graph(*feature_decorators: type[FeatureDecorator]) -> Callable[[type], type]:
    """Class decorator: make a ``FlashCausalLM`` subclass an inference model with engines.

    Args:
        feature_decorators: feature classes that may add graphs (e.g. LoRA).
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
    """Per-model engines, caches and captured decode graphs."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.config = model.llm_config
        self.engines: dict[GraphKey, Engine] = {}
        self.build_seconds: dict[GraphKey, float] = {}
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        # (engine key, batch bucket) -> the engine's capture of that decode signature; prefill
        # signatures are keyed (engine key, ("prefill", tokens, sequences)).
        self.captured: dict[tuple[GraphKey, Any], CaptureHandle] = {}
        self._staging: dict[tuple[GraphKey, Any], _Staging] = {}
        self.dump_dir: str | None = None  # write each engine's intermediates of its first step
        self._dumped: set[GraphKey] = set()
        self.features: dict[str, FeatureDecorator] = {
            f.name: f(model, self.config.features.get(f.name)) for f in model.feature_classes}
        self._kv_heads = self._local_kv_heads()

    def _local_kv_heads(self) -> int:
        m, ws = self.config.model, self.config.world_size
        return max(1, m.num_key_value_heads // ws)

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
        self.kv_caches = [(torch.zeros(shape, dtype=c.dtype, device=dev),
                           torch.zeros(shape, dtype=c.dtype, device=dev))
                          for dev in devices]
        self.captured.clear()
        self._staging.clear()
        for engine in self.engines.values():
            engine.release_captures()
        return self.kv_caches

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
        for name, value in inputs.items():
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
            for out_name, value in outputs.items():
                net.mark_output(value, out_name)
        c = self.config
        engine = net.build_engine(passes=c.static, disabled_passes=c.disabled_passes,
                                  backend="auto" if c.static else "reference")
        seconds = time.perf_counter() - start
        self.build_seconds[key] = seconds
        logger.info("built engine %s in %.2f s (%d kernels)", name, seconds,
                    engine.stats.kernel_count)
        self.engines[key] = engine
        return engine

    # ---- running ---------------------------------------------------------------------------------
    def _features_for(self, batch: BatchMeta) -> tuple[str, ...]:
        used = [f for f in self.features.values() if f.needs_engine and f.is_used(batch)]
        check_stackable(used)
        return tuple(sorted(f.name for f in used))

    def _input_arrays(self, batch: BatchMeta, is_prefill: bool,
                      feature_names: tuple[str, ...]) -> dict[str, np.ndarray]:
        """The batch's integer inputs (the model's and its features') as int32 host arrays."""
        parts: dict[str, Any] = {name: getattr(batch, name) for name in _BATCH_FIELDS}
        if is_prefill:
            parts["query_start_loc"] = np.concatenate(([0], np.cumsum(batch.query_lens)))
            parts["lm_head_indices"] = batch.default_lm_head_indices()
        arrays = {k: np.asarray(v, dtype=np.int32) for k, v in parts.items()}
        arrays["block_table"] = block_table_array(batch.block_table,
                                                  self.config.max_blocks_per_seq)
        arrays.update(self._feature_arrays(batch, feature_names))
        return arrays

    def _feature_arrays(self, batch: BatchMeta,
                        feature_names: tuple[str, ...]) -> dict[str, np.ndarray]:
        arrays: dict[str, np.ndarray] = {}
        for name in feature_names:
            for k, a in self.features[name].batch_arrays(batch).items():
                arrays[k] = np.asarray(a, dtype=np.int32)
        return arrays

    def _decode_shapes(self, bucket: int,
                       extra: dict[str, np.ndarray]) -> dict[str, tuple[int, ...]]:
        """The integer inputs of a decode step of ``bucket`` sequences, by name."""
        shapes: dict[str, tuple[int, ...]] = {
            name: (bucket,) for name in _BATCH_FIELDS}
        shapes["block_table"] = (bucket, self.config.max_blocks_per_seq)
        shapes.update({k: a.shape for k, a in extra.items()})
        return shapes

    def _resident_inputs(self, feature_names: tuple[str, ...]) -> dict[str, torch.Tensor]:
        """Tensors that outlive the step: KV caches and the features' resident inputs."""
        inputs: dict[str, torch.Tensor] = {}
        for i, (k, v) in enumerate(self.kv_caches):
            inputs[f"k_cache_{i}"], inputs[f"v_cache_{i}"] = k, v
        for name in feature_names:
            inputs.update(self.features[name].resident_inputs())
        return inputs

    def _engine_inputs(self, batch: BatchMeta, is_prefill: bool,
                       feature_names: tuple[str, ...] = ()) -> dict[str, Any]:
        """All engine inputs of an uncaptured step; the integer ones in one host-to-device copy."""
        arrays = self._input_arrays(batch, is_prefill, feature_names)
        flat = np.concatenate([a.reshape(-1) for a in arrays.values()])
        device_flat = torch.from_numpy(flat).to(self.config.device, non_blocking=True)
        inputs: dict[str, Any] = {}
        offset = 0
        for name, a in arrays.items():
            inputs[name] = device_flat[offset:offset + a.size].view(a.shape)
            offset += a.size
        inputs.update(self._resident_inputs(feature_names))
        return inputs

    def _can_capture(self) -> bool:
        c = self.config
        return c.static and c.cuda_graph and c.device.type == "cuda"

    def _bucket(self, num_seqs: int) -> int | None:
        return next((b for b in sorted(self.config.batch_buckets) if b >= num_seqs), None)

    def run(self, batch: BatchMeta) -> torch.Tensor:
        if not self.kv_caches:
            raise ConfigError("allocate the KV cache (model.allocate_kv_cache(num_blocks)) before "
                              "running the model")
        batch.validate()
        if max(batch.position_ids, default=0) >= self.config.max_model_len:
            raise ConfigError(f"position {max(batch.position_ids)} is beyond max_model_len "
                              f"{self.config.max_model_len}")
        is_prefill = batch.is_prefill
        num_seqs = batch.num_seqs
        bucket = None if is_prefill or not self._can_capture() else self._bucket(num_seqs)
        if bucket is not None:
            batch = pad_decode(batch, bucket)
        key = (is_prefill, self._features_for(batch))
        engine = self.engines.get(key) or self._build(key)
        extra_in, extra_out, runtime = self.model._update_model_inputs(batch)
        if is_prefill and not (extra_in or extra_out or runtime):
            padded = self._prefill_bucket(batch, key)
            if padded is not None:
                return self._run_prefill_graph(batch, key, engine, *padded)
        if bucket is not None:
            # Decode through a CUDA graph: the step's integers go into the bucket's persistent
            # staging buffers, which the graph reads in place (captured on first use).
            extra = self._feature_arrays(batch, key[1])
            staging = self._staging.get((key, bucket))
            if staging is None:
                staging = self._staging[(key, bucket)] = _Staging(
                    self._decode_shapes(bucket, extra), self.config.device,
                    self._resident_inputs(key[1]))
            staging.write(batch, extra)
            inputs = staging.inputs
            if extra_in:
                inputs = {**inputs, **extra_in}
            handle = self.captured.get((key, bucket))
            if handle is None:
                staging.upload()
                self._dump_first(key, engine, inputs, runtime)
                handle = engine.capture(inputs, runtime or None, by_reference=list(staging.inputs),
                                        prologue=staging.upload)
                self.captured[(key, bucket)] = handle
            if not (extra_in or extra_out or runtime):
                # Every input is a staging or resident tensor: one launch copies them in and runs.
                outputs = engine.replay(handle)
                staging.mark_replayed()
                return outputs["model_out"][:num_seqs]
        else:
            inputs = self._engine_inputs(batch, is_prefill, key[1])
            inputs.update(extra_in)
            self._dump_first(key, engine, inputs, runtime)
        outputs = engine.forward(inputs, extra_out or None, runtime or None)
        if bucket is not None:
            staging.mark_replayed()
        logits = outputs["model_out"]
        return logits if is_prefill else logits[:num_seqs]

    def _prefill_bucket(self, batch: BatchMeta, key: GraphKey) -> tuple[int, int] | None:
        """(tokens, sequences) a prefill is padded to for a CUDA graph, or None to run it
        uncaptured: too many tokens, sequences or logits rows, a feature engine, a dump, or a
        model spread over several devices (tensor parallel or placed: not measured yet)."""
        if key[1] or not self._can_capture() or self.dump_dir is not None:
            return None
        if self.config.world_size > 1 or self.model.placement is not None:
            return None
        tokens = prefill_token_bucket(batch.num_tokens, self.config.prefill_graph_tokens)
        seqs = self._bucket(max(batch.num_seqs, len(batch.default_lm_head_indices())))
        if tokens is None or seqs is None:
            return None
        return tokens, seqs

    def _run_prefill_graph(self, batch: BatchMeta, key: GraphKey, engine: Engine, tokens: int,
                           seqs: int) -> torch.Tensor:
        """A prefill from the CUDA graph of its padded signature (captured on first use).

        Prefill is otherwise bound by the host: a few hundred uncaptured launches, each costing
        more CPU time than small models' kernels take on the GPU. The signatures' buffers share
        one arena (``Engine.capture(share_arena=True)``), so the token buckets cost the memory
        of the largest one."""
        arrays = self._input_arrays(batch, True, ())
        num_logits = len(arrays["lm_head_indices"])
        arrays = pad_prefill_arrays(arrays, tokens, seqs)
        signature = (key, ("prefill", tokens, seqs))
        staging = self._staging.get(signature)
        if staging is None:
            staging = self._staging[signature] = _Staging(
                {name: a.shape for name, a in arrays.items()}, self.config.device,
                self._resident_inputs(()))
        staging.write_arrays(arrays)
        handle = self.captured.get(signature)
        if handle is None or not engine.is_captured(handle):
            staging.upload()
            handle = engine.capture(staging.inputs, by_reference=list(staging.inputs),
                                    prologue=staging.upload, share_arena=True)
            self.captured[signature] = handle
        outputs = engine.replay(handle)
        staging.mark_replayed()
        return outputs["model_out"][:num_logits]

    def _dump_first(self, key: GraphKey, engine: Engine, inputs: dict[str, Any],
                    runtime: dict[str, Any]) -> None:
        if self.dump_dir is not None and key not in self._dumped:
            self._dump(key, engine, inputs, runtime or None)

    def _dump(self, key: GraphKey, engine: Engine, inputs: dict[str, Any],
              runtime: dict[str, Any] | None) -> None:
        """Save the named intermediates of this step to ``dump_dir`` (safetensors + an index).

        The KV caches are snapshotted and restored around the dump run, so the real step that
        follows sees the cache as it was."""
        import json
        from pathlib import Path

        from safetensors.torch import save_file

        saved = [(k.clone(), v.clone()) for k, v in self.kv_caches]
        values = engine.intermediates(inputs, runtime)
        for (k, v), (k0, v0) in zip(self.kv_caches, saved):
            k.copy_(k0)
            v.copy_(v0)
        directory = Path(self.dump_dir)
        directory.mkdir(parents=True, exist_ok=True)
        stem = engine.net.name.replace(":", "_").replace("+", "_")
        save_file({n: t.contiguous().cpu() for n, t in values.items()},
                  str(directory / f"{stem}.safetensors"))
        index = {n: {"shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", "")}
                 for n, t in values.items()}
        (directory / f"{stem}.json").write_text(json.dumps(index, indent=1))
        self._dumped.add(key)
        logger.info("dumped %d intermediates of %s to %s", len(values), engine.net.name, directory)

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
        """Capture the base decode engine for ``buckets`` (largest first) ahead of time; other
        engines (feature combinations) are captured on their first decode step."""
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
        return buckets


class _Staging:
    """Persistent buffers of one captured decode signature: a pinned host array and a device
    array holding every integer input back to back, plus the resident inputs.

    ``inputs`` is the same dict of the same tensor objects at every step, so the engine replays
    its graph without binding anything, and the graph itself copies the host array to the device
    (its captured prologue, :meth:`upload`): a step is :meth:`write`, one graph launch and
    :meth:`mark_replayed`. Block-table rows are converted from Python lists only when they
    change (a decoding sequence gains a block every ``block_size`` steps): converting every row
    at every step cost more host time than the rest of the step at batch 64.
    """

    def __init__(self, shapes: dict[str, tuple[int, ...]], device: torch.device,
                 resident: dict[str, torch.Tensor]) -> None:
        total = sum(int(np.prod(shape)) for shape in shapes.values())
        self.host = torch.zeros(total, dtype=torch.int32, pin_memory=device.type == "cuda")
        host_np = self.host.numpy()
        self.device_flat = torch.zeros(total, dtype=torch.int32, device=device)
        self.views: dict[str, np.ndarray] = {}
        self.inputs: dict[str, torch.Tensor] = {}
        offset = 0
        for name, shape in shapes.items():
            size = int(np.prod(shape))
            self.views[name] = host_np[offset:offset + size].reshape(shape)
            self.inputs[name] = self.device_flat[offset:offset + size].view(shape)
            offset += size
        self.inputs.update(resident)
        self._rows: list[list[int]] = []  # block-table rows as the host array holds them
        self._replayed: torch.cuda.Event | None = None
        # An explicit index: torch.cuda.current_stream() without one looks the device up anew
        # (~10 us of host time per step on a slow host).
        self._device_index = (device.index if device.index is not None else
                              torch.cuda.current_device()) if device.type == "cuda" else None

    def write(self, batch: BatchMeta, extra: dict[str, np.ndarray]) -> None:
        """Put a (bucket-padded) decode batch and the features' arrays into the host array."""
        self._wait_for_replay()
        views = self.views
        for name in _BATCH_FIELDS:
            views[name][:] = getattr(batch, name)
        self._write_tables(batch.block_table)
        for name, a in extra.items():
            views[name][...] = a

    def write_arrays(self, arrays: dict[str, np.ndarray]) -> None:
        """Put whole arrays (a padded prefill's) into the host array."""
        self._wait_for_replay()
        for name, a in arrays.items():
            self.views[name][...] = a

    def _wait_for_replay(self) -> None:
        # The previous replay copies the host array at its start: wait for it (the step's caller
        # reads its logits anyway, so this waits for nothing in a step loop).
        if self._replayed is not None:
            self._replayed.synchronize()

    def _write_tables(self, tables: Sequence[Sequence[int]]) -> None:
        tables = tables if isinstance(tables, list) else list(tables)
        rows = self._rows
        if rows == tables:
            return
        out = self.views["block_table"]
        width = out.shape[1]
        del rows[len(tables):]
        for i, row in enumerate(tables):
            if i < len(rows) and rows[i] == row:
                continue
            if len(row) > width:
                raise ValueError(f"a sequence holds {len(row)} cache blocks, more than the table "
                                 f"width {width} (max_model_len / block_size)")
            # Entries past the row's length are never read (seq_len bound them): left as they are.
            out[i, :len(row)] = row
            if i < len(rows):
                rows[i] = list(row)
            else:
                rows.append(list(row))

    def upload(self) -> None:
        """The host-to-device copy, recorded as the captured graph's prologue."""
        self.device_flat.copy_(self.host, non_blocking=True)

    def mark_replayed(self) -> None:
        """Called after the graph launch: the next :meth:`write` waits for its copy."""
        if self._replayed is None:
            self._replayed = torch.cuda.Event()
        self._replayed.record(torch.cuda.current_stream(self._device_index))
