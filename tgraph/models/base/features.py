"""Feature decorators: extra graphs stacked on a model by ``torch_to_graph``.

A feature declares its name, whether it needs engines of its own, which features it stacks with,
the symbolic inputs it adds, how it changes the recorded graph, and its real inputs: tensors that
stay resident across steps and small per-batch integer arrays. The model builds one engine per
combination of features actually used, lazily.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from tgraph.errors import ConfigError
from tgraph.models.base.batch import BatchMeta
from tgraph.nn.tensor import Tensor


class FeatureDecorator:
    """Base class of features. Subclasses set ``name`` and override the hooks they need.

    Attributes:
        name: unique name (also the key in ``LlmConfig.features`` for its settings).
        needs_engine: the feature records graphs of its own (False: it only fills inputs).
        compatible_with: names of features it may share a graph with.
        pads_prefill: its batch arrays can be padded for a prefill CUDA graph
            (:meth:`padded_batch_arrays`); otherwise prefills of its engines run uncaptured.
        takes_settings: False refuses any settings given to the feature.
    """

    name: str = ""
    needs_engine: bool = True
    compatible_with: frozenset[str] = frozenset()
    pads_prefill: bool = False
    takes_settings: bool = True

    def __init__(self, model: Any, settings: dict | None = None) -> None:
        self.model = model
        self.settings = dict(settings or {})
        if self.settings and not self.takes_settings:
            raise ConfigError(f"feature '{self.name}' takes no settings, got "
                              f"{sorted(self.settings)}")

    # ---- recording ----------------------------------------------------------------------------
    def symbolic_inputs(self, is_prefill: bool) -> dict[str, Tensor]:
        """Extra graph inputs, passed to ``forward`` as keyword arguments."""
        return {}

    def enter_graph(self, inputs: dict[str, Tensor]) -> None:
        """Change the model before ``forward`` is recorded (e.g. wrap target linears)."""

    def exit_graph(self) -> None:
        """Undo :meth:`enter_graph`."""

    def transform_outputs(self, outputs: dict[str, Tensor],
                          inputs: dict[str, Any]) -> dict[str, Tensor]:
        """The recorded outputs, changed by the feature (e.g. a bias added to ``model_out``);
        ``inputs`` are the graph's symbolic inputs, the feature's own included."""
        return outputs

    # ---- running --------------------------------------------------------------------------------
    def is_used(self, batch: BatchMeta) -> bool:
        """Whether this batch needs the feature's graph."""
        return False

    def decode_capture_batch(self, batch: BatchMeta) -> BatchMeta | None:
        """A placeholder decode ``batch`` changed to use this feature, when its engine is worth
        capturing ahead of time with the base one (most decode steps will use it); ``None``
        (the default): captured on its first decode step."""
        return None

    def resident_inputs(self) -> dict[str, torch.Tensor]:
        """Inputs that live across steps on the model's device (e.g. adapter weights).

        They must keep their identity: change their contents in place, between steps. Captured
        decode graphs read them by reference, so an update is seen by the next replay."""
        return {}

    def batch_arrays(self, batch: BatchMeta) -> dict[str, np.ndarray]:
        """Small per-batch integer inputs (e.g. the adapter of every token), as host arrays.

        They are sent to the device together with the model's own batch inputs, in one copy."""
        return {}

    def update_model_inputs(self, batch: BatchMeta) -> tuple[dict[str, torch.Tensor],
                                                             dict[str, torch.Tensor],
                                                             dict[str, Any]]:
        """The feature's part of the model-inputs hook (``FlashCausalLM._update_model_inputs``)
        for a batch its engine runs: updates to the engine's inputs, outputs and runtime params.

        Inputs given here are tensors on the model's device, computed per step; at decode they
        must keep their shapes for a batch bucket (the runner copies them into its captured
        graph's own tensors). Outputs and runtime params make a step run through
        ``Engine.forward`` (the runner logs that once)."""
        return {}, {}, {}

    def padded_batch_arrays(self, batch: BatchMeta, tokens: int) -> dict[str, np.ndarray]:
        """:meth:`batch_arrays` of a prefill padded to ``tokens`` tokens for its captured
        graph (see :func:`~tgraph.models.base.batch.pad_prefill_arrays`: the pad tokens follow
        the real ones and belong to no sequence). Only called when :attr:`pads_prefill`."""
        raise NotImplementedError(f"feature {self.name!r} does not pad its prefill arrays")

    def fill_inputs(self, batch: BatchMeta, inputs: dict[str, Any]) -> None:
        """Add this feature's real inputs for ``batch`` (resident tensors and batch arrays)."""
        inputs.update(self.resident_inputs())
        device = self.model.llm_config.device
        for name, array in self.batch_arrays(batch).items():
            inputs[name] = torch.from_numpy(np.ascontiguousarray(array)).to(device)

    def __repr__(self) -> str:
        return f"<feature {self.name}>"


def check_stackable(features: list[FeatureDecorator]) -> None:
    """Refuse a combination in which two features do not declare each other compatible."""
    for i, a in enumerate(features):
        for b in features[i + 1:]:
            if b.name not in a.compatible_with or a.name not in b.compatible_with:
                raise ConfigError(f"features {a.name!r} and {b.name!r} cannot be used in one "
                                  "batch: they do not declare each other compatible")
