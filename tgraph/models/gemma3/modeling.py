"""Gemma 3 (text): every norm scales by ``1 + weight``; the embeddings are multiplied by
``sqrt(hidden_size)``; each block is normalised before and after (four norms a layer); q and k
are normalised per head and scaled by ``query_pre_attn_scalar``; five sliding-window layers
(local RoPE base) to one full layer (:meth:`ModelConfig.layer_config`); a GELU-tanh gated MLP.
"""
from __future__ import annotations

import torch

from tgraph.errors import ConfigError
from tgraph.io.model_config import gemma3_text_config
from tgraph.layers.attention import Attention
from tgraph.layers.mlp import Mlp
from tgraph.layers.norm import GemmaRmsNorm
from tgraph.models.base.decoder import BaseModel
from tgraph.models.base.graph import torch_to_graph
from tgraph.models.base.logit_bias import LogitBiasDecorator
from tgraph.models.base.lora_features import MultiLoraDecorator, SingleLoraDecorator
from tgraph.models.base.vocab_parallel import VocabParallelDecorator
from tgraph.models.llama.modeling import LlamaLikeForCausalLM
from tgraph.models.registry import register_model
from tgraph.nn import functional as F
from tgraph.nn.module import Module


class Gemma3Attention(Attention):
    def __init__(self, config, loader, prefix, layer_idx, **kwargs):
        super().__init__(config, loader, prefix, layer_idx, **kwargs)
        scalar = gemma3_text_config(config.hf_config)["query_pre_attn_scalar"]
        if isinstance(scalar, bool) or not isinstance(scalar, (int, float)) or scalar <= 0:
            raise ConfigError(f"query_pre_attn_scalar must be a positive number, got {scalar!r}")
        self.scale = float(scalar) ** -0.5
        eps = config.rms_norm_eps
        self.q_norm = GemmaRmsNorm(loader, f"{prefix}.q_norm", config.head_dim, eps)
        self.k_norm = GemmaRmsNorm(loader, f"{prefix}.k_norm", config.head_dim, eps)

    def qk_norm(self, q, k):
        return self.q_norm(q), self.k_norm(k)  # per head: (tokens, heads, head_dim)


class Gemma3Layer(Module):
    """``h += norm(attn(norm(h))); h += norm(mlp(norm(h)))``."""

    def __init__(self, config, loader, prefix, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        hidden, eps = config.hidden_size, config.rms_norm_eps
        bias = config.attention_bias
        self.input_layernorm = GemmaRmsNorm(loader, f"{prefix}.input_layernorm", hidden, eps)
        self.self_attn = Gemma3Attention(config, loader, f"{prefix}.self_attn", layer_idx,
                                         qkv_bias=bias, o_bias=bias,
                                         sliding_window=config.sliding_window)
        self.post_attention_layernorm = GemmaRmsNorm(
            loader, f"{prefix}.post_attention_layernorm", hidden, eps)
        self.pre_feedforward_layernorm = GemmaRmsNorm(
            loader, f"{prefix}.pre_feedforward_layernorm", hidden, eps)
        self.mlp = Mlp(config, loader, f"{prefix}.mlp", bias=config.mlp_bias)
        self.post_feedforward_layernorm = GemmaRmsNorm(
            loader, f"{prefix}.post_feedforward_layernorm", hidden, eps)

    def forward(self, h, meta):
        h = h + self.post_attention_layernorm(self.self_attn(self.input_layernorm(h), meta))
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class Gemma3Model(BaseModel):
    layer_cls = Gemma3Layer
    norm_cls = GemmaRmsNorm

    def __init__(self, config, loader, prefix="model", max_positions=None):
        super().__init__(config, loader, prefix, max_positions)
        # transformers rounds sqrt(hidden) to the weights' dtype before multiplying.
        dtype = self.embed_tokens.weight.dtype
        self.embed_scale = float(torch.tensor(config.hidden_size ** 0.5, dtype=dtype))

    def embed(self, input_ids):
        return F.mul(self.embed_tokens(input_ids), self.embed_scale)


@register_model(model_types=("gemma3_text",), architectures=("Gemma3ForCausalLM",))
@torch_to_graph(SingleLoraDecorator, MultiLoraDecorator, LogitBiasDecorator,
                VocabParallelDecorator)
class FlashGemma3ForCausalLM(LlamaLikeForCausalLM):
    model_cls = Gemma3Model


# Where a vision-language checkpoint keeps its language model: transformers 5 saves
# ``model.language_model.*``, 4.x ``language_model.model.*`` (and ``language_model.lm_head``).
_TEXT_PREFIXES = ("model.language_model.", "language_model.model.")
_HEAD_NAMES = ("language_model.lm_head.weight",)
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                    "model.multi_modal_projector.")


@register_model(model_types=("gemma3",), architectures=("Gemma3ForConditionalGeneration",))
@torch_to_graph(SingleLoraDecorator, MultiLoraDecorator, LogitBiasDecorator,
                VocabParallelDecorator)
class FlashGemma3ForConditionalGeneration(LlamaLikeForCausalLM):
    """The language model of a Gemma 3 vision-language checkpoint (4B, 12B, 27B), for text: its
    tensors are read under the text model's names; the vision tower's are not read."""

    model_cls = Gemma3Model

    def __init__(self, llm_config, weight_loader, **kwargs):
        for name in weight_loader.names():
            prefix = next((p for p in _TEXT_PREFIXES if name.startswith(p)), None)
            if prefix is not None:
                weight_loader.alias("model." + name[len(prefix):], name)
            elif name in _HEAD_NAMES:
                weight_loader.alias("lm_head.weight", name)
            elif name.startswith(_VISION_PREFIXES):
                weight_loader.mark_used(name)  # images are not an input here
        super().__init__(llm_config, weight_loader, **kwargs)
