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

from tgraph.engine import Engine
from tgraph.errors import ConfigError
from tgraph.models.base.batch import BatchMeta, block_table_array, pad_decode
from tgraph.models.base.causal_lm import FlashCausalLM
from tgraph.models.base.features import FeatureDecorator, check_stackable
from tgraph.nn.network_manager import new_network, recording
from tgraph.nn.tensor import Tensor

logger = logging.getLogger("tgraph.models")

GraphKey = tuple[bool, tuple[str, ...]]


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

    def capture_decode_graphs(self, buckets: Sequence[int] | None = None) -> list[int]:
        """Capture decode CUDA graphs for the batch buckets (largest first). Returns the
        buckets captured."""
        return self._graph_state().capture_decode(buckets)

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
        self.captured: set[int] = set()
        self.dump_dir: str | None = None  # write each engine's intermediates of its first step
        self._dumped: set[GraphKey] = set()
        self.features: dict[str, FeatureDecorator] = {
            f.name: f(model, self.config.features.get(f.name)) for f in model.feature_classes}
        self._kv_heads = self._local_kv_heads()

    def _local_kv_heads(self) -> int:
        m, ws = self.config.model, self.config.world_size
        return max(1, m.num_key_value_heads // ws)

    def allocate_kv_cache(self, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        m, c = self.config.model, self.config
        shape = (num_blocks, c.block_size, self._kv_heads, m.head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=c.dtype, device=c.device),
                           torch.zeros(shape, dtype=c.dtype, device=c.device))
                          for _ in range(m.num_hidden_layers)]
        self.captured.clear()
        for engine in self.engines.values():
            engine._captures.clear()
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
        return inputs

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

    def _engine_inputs(self, batch: BatchMeta, is_prefill: bool) -> dict[str, Any]:
        """The batch's integer inputs, staged in one host array and sent in one copy."""
        c = self.config
        parts: dict[str, Any] = {
            "input_ids": batch.input_ids, "position_ids": batch.positions,
            "slots_mapping": batch.slots, "seq_len": batch.kv_lens,
        }
        if is_prefill:
            parts["query_start_loc"] = np.concatenate(([0], np.cumsum(batch.query_lens)))
            parts["lm_head_indices"] = batch.default_logits_indices()
        arrays = {k: np.asarray(v, dtype=np.int32) for k, v in parts.items()}
        arrays["block_table"] = block_table_array(batch.block_tables, c.max_blocks_per_seq)
        flat = np.concatenate([a.reshape(-1) for a in arrays.values()])
        device_flat = torch.from_numpy(flat).to(c.device, non_blocking=True)
        inputs: dict[str, Any] = {}
        offset = 0
        for name, a in arrays.items():
            inputs[name] = device_flat[offset:offset + a.size].view(a.shape)
            offset += a.size
        for i, (k, v) in enumerate(self.kv_caches):
            inputs[f"k_cache_{i}"], inputs[f"v_cache_{i}"] = k, v
        return inputs

    def run(self, batch: BatchMeta) -> torch.Tensor:
        if not self.kv_caches:
            raise ConfigError("allocate the KV cache (model.allocate_kv_cache(num_blocks)) before "
                              "running the model")
        batch.validate()
        if max(batch.positions, default=0) >= self.config.max_model_len:
            raise ConfigError(f"position {max(batch.positions)} is beyond max_model_len "
                              f"{self.config.max_model_len}")
        is_prefill = batch.is_prefill
        num_seqs = batch.num_seqs
        if not is_prefill and self.captured:
            bucket = next((b for b in sorted(self.captured) if b >= num_seqs), None)
            if bucket is not None:
                batch = pad_decode(batch, bucket)
        key = (is_prefill, self._features_for(batch))
        engine = self.engines.get(key) or self._build(key)
        inputs = self._engine_inputs(batch, is_prefill)
        for name in key[1]:
            self.features[name].fill_inputs(batch, inputs)
        extra_in, extra_out, runtime = self.model._update_model_inputs(batch)
        inputs.update(extra_in)
        if self.dump_dir is not None and key not in self._dumped:
            self._dump(key, engine, inputs, runtime or None)
        outputs = engine.forward(inputs, extra_out or None, runtime or None)
        logits = outputs["model_out"]
        return logits if is_prefill else logits[:num_seqs]

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

    def capture_decode(self, buckets: Sequence[int] | None) -> list[int]:
        c = self.config
        if not (c.static and c.cuda_graph and c.device.type == "cuda"):
            return []
        if not self.kv_caches:
            raise ConfigError("allocate the KV cache before capturing decode graphs")
        buckets = sorted(buckets or c.batch_buckets, reverse=True)
        key = (False, ())
        engine = self.engines.get(key) or self._build(key)
        for b in buckets:
            dummy = BatchMeta(input_ids=[0] * b, positions=[0] * b, slots=[-1] * b,
                              query_lens=[1] * b, kv_lens=[0] * b, block_tables=[[]] * b,
                              is_prefill=False)
            engine.capture(self._engine_inputs(dummy, False))
            self.captured.add(b)
        return buckets
