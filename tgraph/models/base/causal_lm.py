"""``FlashCausalLM``: the base class of causal language models."""
from __future__ import annotations

from typing import Any

import torch

from tgraph.io.weights import WeightLoader
from tgraph.models.base.batch import BatchMeta
from tgraph.models.base.llm_config import LlmConfig
from tgraph.nn.module import Module
from tgraph.nn.tensor import Tensor


class FlashCausalLM(Module):
    """A causal LM whose ``forward`` runs on symbolic tensors, once per graph.

    Subclasses build their modules in ``__init__`` (reading weights from ``weight_loader``) and
    implement :meth:`forward`; ``@torch_to_graph`` adds the engines that run it.

    ``forward`` receives: ``input_ids``, ``position_ids``, ``slots_mapping``, ``block_table``,
    ``seq_len`` (tokens per sequence in the cache), ``kv_caches`` (``(k, v)`` per layer),
    ``is_prefill`` and, in prefill graphs, ``query_start_loc`` and ``lm_head_indices``, plus the
    inputs of enabled features; it returns ``{"model_out": logits}``.
    """

    def __init__(self, llm_config: LlmConfig, weight_loader: WeightLoader, **kwargs: Any) -> None:
        super().__init__()
        self.llm_config = llm_config
        self.config = llm_config.model
        self.weight_loader = weight_loader

    def forward(self, **kwargs: Any) -> dict[str, Tensor]:
        raise NotImplementedError(f"{type(self).__name__} must implement forward(**kwargs)")

    def _update_model_inputs(self, meta: BatchMeta) -> tuple[dict[str, torch.Tensor],
                                                             dict[str, torch.Tensor],
                                                             dict[str, Any]]:
        """Hook for a model's own inputs: returns updates to ``engine_inputs``,
        ``engine_outputs`` and ``engine_runtime_params`` for this batch."""
        return {}, {}, {}

    def extra_symbolic_inputs(self, is_prefill: bool) -> dict[str, Tensor]:
        """Symbolic inputs of the model's own (filled by :meth:`_update_model_inputs`)."""
        return {}
