"""OLMo 3: OLMo 2 whose layers are typed by ``layer_types``: sliding-window layers (three in four)
and full-attention layers, the RoPE scaling (YaRN) applied only to the full ones. The config
gives each layer its window and RoPE (:meth:`ModelConfig.layer_config`); the layers are OLMo 2's.
"""
from __future__ import annotations

from tgraph.models.base.decoder import BaseModel
from tgraph.models.base.graph import torch_to_graph
from tgraph.models.base.logit_bias import LogitBiasDecorator
from tgraph.models.base.lora_features import MultiLoraDecorator, SingleLoraDecorator
from tgraph.models.base.vocab_parallel import VocabParallelDecorator
from tgraph.models.llama.modeling import LlamaLikeForCausalLM
from tgraph.models.olmo2.modeling import Olmo2Layer
from tgraph.models.registry import register_model


class Olmo3Model(BaseModel):
    layer_cls = Olmo2Layer


@register_model(model_types=("olmo3",), architectures=("Olmo3ForCausalLM",))
@torch_to_graph(SingleLoraDecorator, MultiLoraDecorator, LogitBiasDecorator,
                VocabParallelDecorator)
class FlashOlmo3ForCausalLM(LlamaLikeForCausalLM):
    model_cls = Olmo3Model
