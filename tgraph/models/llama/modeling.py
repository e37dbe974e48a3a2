"""Llama (and the causal-LM head every Llama-like family shares)."""
from __future__ import annotations

from typing import Any

from tgraph.io.weights import WeightLoader
from tgraph.layers.linear import ColumnParallelLinear
from tgraph.models.base.causal_lm import FlashCausalLM
from tgraph.models.base.decoder import BaseModel
from tgraph.models.base.graph import torch_to_graph
from tgraph.models.base.llm_config import LlmConfig
from tgraph.models.base.logit_bias import LogitBiasDecorator
from tgraph.models.base.lora_features import MultiLoraDecorator, SingleLoraDecorator
from tgraph.models.base.vocab_parallel import VocabParallelDecorator
from tgraph.models.registry import register_model
from tgraph.nn import functional as F
from tgraph.nn.tensor import Tensor


class LlamaModel(BaseModel):
    """The Llama decoder stack: exactly the base layers."""


class LlamaLikeForCausalLM(FlashCausalLM):
    """Decoder stack + LM head; a family sets ``model_cls``.

    Under tensor parallelism the head's logits are all-gathered into whole rows unless the graph
    is recorded with ``gather_logits = False`` (:class:`VocabParallelDecorator`).
    """

    model_cls: type[BaseModel] = LlamaModel
    gather_logits: bool = True

    def __init__(self, llm_config: LlmConfig, weight_loader: WeightLoader, **kwargs: Any) -> None:
        super().__init__(llm_config, weight_loader, **kwargs)
        config = llm_config.model
        self.model = self.model_cls(config, weight_loader, prefix="model",
                                    max_positions=llm_config.max_model_len)
        if config.tie_word_embeddings:
            # Tied: the head is the embedding's own Parameter (one copy in memory and graph).
            if weight_loader.has("lm_head.weight"):
                weight_loader.mark_used("lm_head.weight")  # some exports save the tie anyway
            embed = self.model.embed_tokens
            self.lm_head = ColumnParallelLinear.tied(embed.weight, embed.rank, embed.world_size)
        else:
            if not weight_loader.has("lm_head.weight"):
                raise_missing_head(weight_loader)
            self.lm_head = ColumnParallelLinear(weight_loader, "lm_head", config.hidden_size,
                                                config.vocab_size)

    def forward(self, **kwargs: Any) -> dict[str, Tensor]:
        hidden = self.model(**kwargs)
        if kwargs.get("is_prefill", True):
            hidden = F.gather(hidden, 0, kwargs["lm_head_indices"])  # (num_logits, hidden)
        logits = self.lm_head(hidden)  # (rows, vocab / world_size)
        if self.llm_config.world_size > 1 and self.gather_logits:
            from tgraph.nn import distributed

            logits = distributed.all_gather(logits, dim=-1)  # (rows, vocab)
        return {"model_out": logits}


def raise_missing_head(loader: WeightLoader) -> None:
    from tgraph.errors import WeightLoadError

    raise WeightLoadError("the checkpoint has no 'lm_head.weight' and tie_word_embeddings is "
                          "false; expected an untied LM head")


@register_model(model_types=("llama",), architectures=("LlamaForCausalLM",))
@torch_to_graph(SingleLoraDecorator, MultiLoraDecorator, LogitBiasDecorator,
                VocabParallelDecorator)
class FlashLlamaForCausalLM(LlamaLikeForCausalLM):
    """Llama 2/3 (rope scaling, tied or untied embeddings)."""
