"""Qwen2-MoE: Qwen2 (q/k/v biases by ``qkv_bias``) whose sparse MLP blocks add a shared expert
scaled by a sigmoid gate to the routed experts (softmax top-k, renormalised with
``norm_topk_prob``)."""
from __future__ import annotations

from tgraph.layers.moe import sparse_or_dense_mlp
from tgraph.models.base.decoder import BaseModel
from tgraph.models.base.graph import torch_to_graph
from tgraph.models.base.logit_bias import LogitBiasDecorator
from tgraph.models.base.vocab_parallel import VocabParallelDecorator
from tgraph.models.llama.modeling import LlamaLikeForCausalLM
from tgraph.models.qwen2.modeling import Qwen2Layer
from tgraph.models.registry import register_model


class Qwen2MoeLayer(Qwen2Layer):
    def make_mlp(self, config, loader, prefix):
        return sparse_or_dense_mlp(config, loader, prefix, self.layer_idx, shared=True)


class Qwen2MoeModel(BaseModel):
    layer_cls = Qwen2MoeLayer


@register_model(model_types=("qwen2_moe",), architectures=("Qwen2MoeForCausalLM",))
@torch_to_graph(LogitBiasDecorator, VocabParallelDecorator)
class FlashQwen2MoeForCausalLM(LlamaLikeForCausalLM):
    model_cls = Qwen2MoeModel
