"""Mistral: Llama whose attention uses a sliding window when the config sets one (the base
layers already read ``config.sliding_window``, so the family adds nothing but its name)."""
from __future__ import annotations

from tgraph.models.base.graph import torch_to_graph
from tgraph.models.base.logit_bias import LogitBiasDecorator
from tgraph.models.base.lora_features import MultiLoraDecorator, SingleLoraDecorator
from tgraph.models.base.vocab_parallel import VocabParallelDecorator
from tgraph.models.llama.modeling import LlamaLikeForCausalLM
from tgraph.models.registry import register_model


@register_model(model_types=("mistral",), architectures=("MistralForCausalLM",))
@torch_to_graph(SingleLoraDecorator, MultiLoraDecorator, LogitBiasDecorator,
                VocabParallelDecorator)
class FlashMistralForCausalLM(LlamaLikeForCausalLM):
    """Mistral 7B-style models (sliding-window attention where configured)."""
