"""OLMo 2 and OLMo 3: Llama whose q and k are each RMS-normalised over all heads at once, and
whose layers normalise each block's output (``h += norm(attn(h)); h += norm(mlp(h))``) instead of
its input. OLMo 3 differs only in its config: layers typed sliding / full by ``layer_types``, the
RoPE scaling on the full ones (:meth:`ModelConfig.layer_config`)."""
from __future__ import annotations

from tgraph.layers.attention import Attention
from tgraph.layers.mlp import Mlp
from tgraph.layers.norm import HeadsRmsNorm, RmsNorm
from tgraph.models.base.decoder import BaseModel
from tgraph.models.base.graph import torch_to_graph
from tgraph.models.base.logit_bias import LogitBiasDecorator
from tgraph.models.base.lora_features import MultiLoraDecorator, SingleLoraDecorator
from tgraph.models.base.vocab_parallel import VocabParallelDecorator
from tgraph.models.llama.modeling import LlamaLikeForCausalLM
from tgraph.models.registry import register_model
from tgraph.nn.module import Module


class WholeQkNormAttention(Attention):
    """Attention whose q and k go through one RMSNorm over all their heads (OLMo 2, OLMoE)."""

    def __init__(self, config, loader, prefix, layer_idx, **kwargs):
        super().__init__(config, loader, prefix, layer_idx, **kwargs)
        eps, dim = config.rms_norm_eps, config.head_dim
        self.q_norm = HeadsRmsNorm(loader, f"{prefix}.q_norm", config.num_attention_heads, dim,
                                   eps)
        self.k_norm = HeadsRmsNorm(loader, f"{prefix}.k_norm", config.num_key_value_heads, dim,
                                   eps)

    def qk_norm(self, q, k):
        return self.q_norm(q), self.k_norm(k)


class Olmo2Layer(Module):
    """A post-norm decoder layer: each block's output is normalised before the residual add."""

    def __init__(self, config, loader, prefix, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        bias = config.attention_bias
        self.self_attn = WholeQkNormAttention(config, loader, f"{prefix}.self_attn", layer_idx,
                                              qkv_bias=bias, o_bias=bias,
                                              sliding_window=config.sliding_window)
        self.post_attention_layernorm = RmsNorm(loader, f"{prefix}.post_attention_layernorm",
                                                config.hidden_size, config.rms_norm_eps)
        self.mlp = Mlp(config, loader, f"{prefix}.mlp", bias=config.mlp_bias)
        self.post_feedforward_layernorm = RmsNorm(loader, f"{prefix}.post_feedforward_layernorm",
                                                  config.hidden_size, config.rms_norm_eps)

    def forward(self, h, meta):
        h = h + self.post_attention_layernorm(self.self_attn(h, meta))
        return h + self.post_feedforward_layernorm(self.mlp(h))


class Olmo2Model(BaseModel):
    layer_cls = Olmo2Layer


@register_model(model_types=("olmo2", "olmo3"),
                architectures=("Olmo2ForCausalLM", "Olmo3ForCausalLM"))
@torch_to_graph(SingleLoraDecorator, MultiLoraDecorator, LogitBiasDecorator,
                VocabParallelDecorator)
class FlashOlmo2ForCausalLM(LlamaLikeForCausalLM):
    model_cls = Olmo2Model
