"""A step's engine inputs, built from the runner's :class:`BatchMeta`.

Three forms, one per way a step runs (the runner in :mod:`tgraph.models.base.graph` picks one):

* uncaptured (:meth:`StepInputs.uncaptured`): every integer input as an int32 array, all sent in
  one host-to-device copy, plus the resident tensors (KV caches, the features' buffers);
* decode-staged (:meth:`StepInputs.decode_staged`): a bucket-padded decode batch written into the
  persistent :class:`Staging` buffers of its captured graph, which copies them to the device
  itself;
* prefill-bucket-staged (:meth:`StepInputs.prefill_staged`): a prefill padded to its token and
  sequence buckets (:func:`pad_prefill_arrays`), written into the staging of that signature.
"""
from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from tgraph.errors import ConfigError
from tgraph.models.base.batch import BatchMeta, block_table_array, pad_prefill_arrays
from tgraph.models.base.features import FeatureDecorator
from tgraph.models.base.llm_config import LlmConfig

__all__ = ["BATCH_FIELDS", "Staging", "StepInputs"]

# Engine inputs with one integer per token (per sequence at decode), named as BatchMeta's fields.
BATCH_FIELDS = ("input_ids", "position_ids", "slots_mapping", "seq_len")

KvCaches = list[tuple[torch.Tensor, torch.Tensor]]


class StepInputs:
    """Turns a :class:`BatchMeta` into engine inputs; keeps the staging of captured signatures.

    Args:
        config: the model's serving config (device, block-table width).
        features: the model's features by name (their batch arrays and resident inputs).

    Attributes:
        kv_caches: the model's KV caches, ``(k, v)`` per layer (set by :meth:`reset`).
        stagings: the :class:`Staging` of each captured signature, keyed as the runner's
            captures are: ``(engine key, bucket)`` or ``(engine key, ("prefill", tokens, seqs))``.
    """

    def __init__(self, config: LlmConfig, features: Mapping[str, FeatureDecorator]) -> None:
        self.config = config
        self.features = features
        self.kv_caches: KvCaches = []
        self.stagings: dict[Hashable, Staging] = {}

    def reset(self, kv_caches: KvCaches) -> None:
        """Use new KV caches; every staging (which holds the old ones) is dropped."""
        self.kv_caches = kv_caches
        self.stagings.clear()

    # ---- the parts -----------------------------------------------------------------------------
    def arrays(self, batch: BatchMeta, feature_names: Sequence[str] = ()) -> dict[str, np.ndarray]:
        """The batch's integer inputs (the model's and its features') as int32 host arrays.

        Args:
            batch: the step's batch (prefill or decode).
            feature_names: the features whose engine runs the step.

        Returns:
            The arrays by engine input name.
        """
        parts: dict[str, Any] = {name: getattr(batch, name) for name in BATCH_FIELDS}
        if batch.is_prefill:
            parts["query_start_loc"] = np.concatenate(([0], np.cumsum(batch.query_lens)))
            parts["lm_head_indices"] = batch.default_lm_head_indices()
        arrays = {k: np.asarray(v, dtype=np.int32) for k, v in parts.items()}
        arrays["block_table"] = block_table_array(batch.block_table,
                                                  self.config.max_blocks_per_seq)
        arrays.update(self.feature_arrays(batch, feature_names))
        return arrays

    def feature_arrays(self, batch: BatchMeta,
                       feature_names: Sequence[str]) -> dict[str, np.ndarray]:
        """The features' per-batch integer inputs, as int32 host arrays."""
        arrays: dict[str, np.ndarray] = {}
        for name in feature_names:
            for k, a in self.features[name].batch_arrays(batch).items():
                arrays[k] = np.asarray(a, dtype=np.int32)
        return arrays

    def resident(self, feature_names: Sequence[str] = ()) -> dict[str, torch.Tensor]:
        """Tensors that outlive the step: the KV caches and the features' resident inputs."""
        inputs: dict[str, torch.Tensor] = {}
        for i, (k, v) in enumerate(self.kv_caches):
            inputs[f"k_cache_{i}"], inputs[f"v_cache_{i}"] = k, v
        for name in feature_names:
            inputs.update(self.features[name].resident_inputs())
        return inputs

    # ---- the three forms -----------------------------------------------------------------------
    def uncaptured(self, batch: BatchMeta,
                   feature_names: Sequence[str] = ()) -> dict[str, torch.Tensor]:
        """All engine inputs of an uncaptured step; the integer ones in one host-to-device copy.

        Args:
            batch: the step's batch.
            feature_names: the features whose engine runs the step.

        Returns:
            The inputs by name, on the model's device.
        """
        arrays = self.arrays(batch, feature_names)
        flat = np.concatenate([a.reshape(-1) for a in arrays.values()])
        device_flat = torch.from_numpy(flat).to(self.config.device, non_blocking=True)
        inputs: dict[str, torch.Tensor] = {}
        offset = 0
        for name, a in arrays.items():
            inputs[name] = device_flat[offset:offset + a.size].view(a.shape)
            offset += a.size
        inputs.update(self.resident(feature_names))
        return inputs

    def decode_staged(self, signature: Hashable, batch: BatchMeta,
                      feature_names: Sequence[str]) -> Staging:
        """Write a decode batch, already padded to its bucket, into its signature's staging.

        Args:
            signature: the captured signature the staging belongs to.
            batch: the bucket-padded decode batch (one sequence per bucket row).
            feature_names: the features whose engine runs the step.

        Returns:
            The staging (created on first use), holding the step.
        """
        extra = self.feature_arrays(batch, feature_names)
        staging = self.stagings.get(signature)
        if staging is None:
            bucket = batch.num_seqs
            shapes: dict[str, tuple[int, ...]] = {name: (bucket,) for name in BATCH_FIELDS}
            shapes["block_table"] = (bucket, self.config.max_blocks_per_seq)
            shapes.update({k: a.shape for k, a in extra.items()})
            staging = self.stagings[signature] = Staging(
                shapes, self.config.device, self.resident(feature_names))
        staging.write(batch, extra)
        return staging

    def prefill_staged(self, signature: Hashable, batch: BatchMeta, tokens: int,
                       seqs: int, feature_names: Sequence[str] = ()) -> Staging:
        """Write a prefill, padded to ``tokens`` tokens and ``seqs`` sequences, into its
        signature's staging.

        Args:
            signature: the captured signature the staging belongs to.
            batch: the prefill batch.
            tokens, seqs: the token and sequence buckets, at least the batch's own.
            feature_names: the features whose engine runs the step (each pads its own arrays:
                ``FeatureDecorator.padded_batch_arrays``).

        Returns:
            The staging (created on first use), holding the step.
        """
        arrays = pad_prefill_arrays(self.arrays(batch), tokens, seqs)
        for name in feature_names:
            for k, a in self.features[name].padded_batch_arrays(batch, tokens).items():
                arrays[k] = np.asarray(a, dtype=np.int32)
        staging = self.stagings.get(signature)
        if staging is None:
            staging = self.stagings[signature] = Staging(
                {name: a.shape for name, a in arrays.items()}, self.config.device,
                self.resident(feature_names))
        staging.write_arrays(arrays)
        return staging


class Staging:
    """Persistent buffers of one captured signature: a pinned host array and a device array
    holding every integer input back to back, plus the resident inputs.

    ``inputs`` is the same dict of the same tensor objects at every step, so the engine replays
    its graph without binding anything, and the graph itself copies the host array to the device
    (its captured prologue, :meth:`upload`): a step is :meth:`write`, one graph launch and
    :meth:`mark_replayed`. Block-table rows are converted from Python lists only when they
    change (a decoding sequence gains a block every ``block_size`` steps), since converting every
    row at every step would dominate the host time of a large batch's step.

    Args:
        shapes: each integer input's shape, by name.
        device: where the engine reads the inputs.
        resident: tensors added to ``inputs`` as they are (KV caches, feature buffers).
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
        self._held: list[str] | None = None  # names of the hook's inputs (see hold)
        self._replayed: torch.cuda.Event | None = None
        # An explicit index: torch.cuda.current_stream() without one looks the device up anew.
        self._device_index = (device.index if device.index is not None else
                              torch.cuda.current_device()) if device.type == "cuda" else None

    def write(self, batch: BatchMeta, extra: dict[str, np.ndarray]) -> None:
        """Put a (bucket-padded) decode batch and the features' arrays into the host array."""
        self._wait_for_replay()
        views = self.views
        for name in BATCH_FIELDS:
            views[name][:] = getattr(batch, name)
        self._write_tables(batch.block_table)
        for name, a in extra.items():
            views[name][...] = a

    def hold(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy a step's inputs from the model-inputs hook into tensors of the staging's own
        (clones of the first step's), which the captured graph reads by reference.

        Raises:
            ConfigError: the hook gives other names, shapes or dtypes than at the first step.
        """
        if self._held is None:
            self._held = sorted(tensors)
            for name, t in tensors.items():
                self.inputs[name] = t.clone()
            return
        if sorted(tensors) != self._held:
            raise ConfigError(f"the model-inputs hook gave inputs {sorted(tensors)} for a "
                              f"captured step that was captured with {self._held}; give the "
                              "same names at every decode step")
        for name, t in tensors.items():
            held = self.inputs[name]
            if held.shape != t.shape or held.dtype != t.dtype:
                raise ConfigError(f"the model-inputs hook gave {name!r} as {t.dtype} "
                                  f"{list(t.shape)}, captured as {held.dtype} "
                                  f"{list(held.shape)}; a decode step's inputs keep their shape "
                                  "for a batch bucket")
            held.copy_(t, non_blocking=True)

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
