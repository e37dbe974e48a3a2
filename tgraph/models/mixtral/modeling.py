"""Mixtral: Mistral whose every MLP is a sparse block (``block_sparse_moe``) of routed experts
named ``w1 / w3 / w2``, the top-k probabilities always renormalised."""
from __future__ import annotations

from tgraph.layers.moe import MIXTRAL_EXPERT_NAMES, MoeConfig, SparseMoeBlock
from tgraph.models.base.decoder import BaseLayer, BaseModel
from tgraph.models.base.graph import torch_to_graph
from tgraph.models.base.logit_bias import LogitBiasDecorator
from tgraph.models.base.vocab_parallel import VocabParallelDecorator
from tgraph.models.llama.modeling import LlamaLikeForCausalLM
from tgraph.models.registry import register_model


class MixtralLayer(BaseLayer):
    def make_mlp(self, config, loader, prefix):
        moe = MoeConfig(config, inter_key="intermediate_size", renormalize=True)
        # Checkpoints say block_sparse_moe; transformers 5's in-memory state dicts say mlp.
        if not loader.has(f"{prefix}.gate.weight"):
            prefix = prefix.removesuffix(".mlp") + ".block_sparse_moe"
        return SparseMoeBlock(config, loader, prefix, moe, MIXTRAL_EXPERT_NAMES)


class MixtralModel(BaseModel):
    layer_cls = MixtralLayer


@register_model(model_types=("mixtral",), architectures=("MixtralForCausalLM",))
@torch_to_graph(LogitBiasDecorator, VocabParallelDecorator)
class FlashMixtralForCausalLM(LlamaLikeForCausalLM):
    model_cls = MixtralModel
