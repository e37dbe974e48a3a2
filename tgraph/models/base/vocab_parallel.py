"""The vocabulary-parallel LM head: engines that leave each tensor-parallel rank its slice of
the logits, for decode steps that only need tokens (the ranks then sample together,
:mod:`tgraph.runtime.vocab_parallel`)."""
from __future__ import annotations

import dataclasses
from typing import Any

from tgraph.models.base.batch import BatchMeta
from tgraph.models.base.features import FeatureDecorator
from tgraph.nn.tensor import Tensor

__all__ = ["VocabParallelDecorator"]


class VocabParallelDecorator(FeatureDecorator):
    """Engines whose ``model_out`` is this rank's vocabulary slice of the logits,
    ``(rows, vocab / world_size)``, the LM head's all-gather left out.

    For steps that need only tokens: the runner samples from the slices, reducing across ranks
    (:mod:`tgraph.runtime.vocab_parallel`), and marks such a batch with :meth:`mark`. A batch
    not marked runs the engines that gather whole rows. Settings: none (see
    ``llm.engine.tuning.vocab_parallel``).
    """

    name = "vocab_parallel"
    # The LoRA deltas come before the head; only logit_bias needs whole rows.
    compatible_with = frozenset({"single_lora", "multi_lora"})
    takes_settings = False

    def __init__(self, model: Any, settings: dict | None = None) -> None:
        super().__init__(model, settings)
        self._gather = True

    @classmethod
    def mark(cls, batch: BatchMeta) -> None:
        """Ask for this feature's engine for ``batch``."""
        batch.extra[cls.name] = True

    def is_used(self, batch: BatchMeta) -> bool:
        return self.model.llm_config.world_size > 1 and bool(batch.extra.get(self.name))

    def decode_capture_batch(self, batch: BatchMeta) -> BatchMeta | None:
        """Under tensor parallelism most decode steps sample from the slices: capture them too."""
        config = self.model.llm_config
        if config.world_size == 1 or not config.tuning.vocab_parallel.enabled:
            return None
        marked = dataclasses.replace(batch, extra=dict(batch.extra))
        self.mark(marked)
        return marked

    def enter_graph(self, inputs: dict[str, Tensor]) -> None:
        self._gather = self.model.gather_logits
        self.model.gather_logits = False

    def exit_graph(self) -> None:
        self.model.gather_logits = self._gather
