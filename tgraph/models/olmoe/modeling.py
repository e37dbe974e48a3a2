"""OLMoE: Llama whose q and k are each RMS-normalised over all heads (as OLMo 2's, optionally
clamped by ``clip_qkv``) and whose every MLP is a sparse block of routed experts (softmax top-k,
renormalised only with ``norm_topk_prob``)."""
from __future__ import annotations

from tgraph.errors import ConfigError
from tgraph.layers.moe import MoeConfig, SparseMoeBlock
from tgraph.models.base.decoder import BaseLayer, BaseModel
from tgraph.models.base.graph import torch_to_graph
from tgraph.models.base.logit_bias import LogitBiasDecorator
from tgraph.models.base.vocab_parallel import VocabParallelDecorator
from tgraph.models.llama.modeling import LlamaLikeForCausalLM
from tgraph.models.olmo2.modeling import WholeQkNormAttention
from tgraph.models.registry import register_model


def clip_qkv(config) -> float | None:
    """The config's ``clip_qkv`` (a positive number or null), checked."""
    value = config.hf_config.get("clip_qkv")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ConfigError(f"{config.model_type}: 'clip_qkv' must be a positive number or null, "
                          f"got {value!r}")
    return float(value)


class OlmoeLayer(BaseLayer):
    def make_attention(self, config, loader, prefix, layer_idx):
        bias = config.attention_bias
        return WholeQkNormAttention(config, loader, prefix, layer_idx, qkv_bias=bias,
                                    o_bias=bias, clip_qkv=clip_qkv(config))

    def make_mlp(self, config, loader, prefix):
        return SparseMoeBlock(config, loader, prefix, MoeConfig(config,
                                                                inter_key="intermediate_size"))


class OlmoeModel(BaseModel):
    layer_cls = OlmoeLayer


@register_model(model_types=("olmoe",), architectures=("OlmoeForCausalLM",))
@torch_to_graph(LogitBiasDecorator, VocabParallelDecorator)
class FlashOlmoeForCausalLM(LlamaLikeForCausalLM):
    model_cls = OlmoeModel
