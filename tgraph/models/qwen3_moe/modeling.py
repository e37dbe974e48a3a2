"""Qwen3-MoE: Qwen3 whose MLPs are sparse blocks of routed experts (softmax top-k, renormalised
with ``norm_topk_prob``), dense on ``mlp_only_layers`` and off the ``decoder_sparse_step``."""
from __future__ import annotations

from tgraph.layers.moe import sparse_or_dense_mlp
from tgraph.models.base.decoder import BaseModel
from tgraph.models.base.graph import torch_to_graph
from tgraph.models.base.logit_bias import LogitBiasDecorator
from tgraph.models.base.vocab_parallel import VocabParallelDecorator
from tgraph.models.llama.modeling import LlamaLikeForCausalLM
from tgraph.models.qwen3.modeling import Qwen3Layer
from tgraph.models.registry import register_model


class Qwen3MoeLayer(Qwen3Layer):
    def make_mlp(self, config, loader, prefix):
        return sparse_or_dense_mlp(config, loader, prefix, self.layer_idx)


class Qwen3MoeModel(BaseModel):
    layer_cls = Qwen3MoeLayer


@register_model(model_types=("qwen3_moe",), architectures=("Qwen3MoeForCausalLM",))
@torch_to_graph(LogitBiasDecorator, VocabParallelDecorator)
class FlashQwen3MoeForCausalLM(LlamaLikeForCausalLM):
    model_cls = Qwen3MoeModel
