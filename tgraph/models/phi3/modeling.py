"""Phi-3 and Phi-4 (``Phi3ForCausalLM``): Llama whose checkpoints fuse q|k|v into ``qkv_proj``
and gate|up into ``gate_up_proj``. The fused tensors are read as their parts (row views of the
loader), so the layers are Llama's; LongRoPE and a partial rotary dimension (Phi-4-mini) come
from the config."""
from __future__ import annotations

from tgraph.models.base.graph import torch_to_graph
from tgraph.models.base.logit_bias import LogitBiasDecorator
from tgraph.models.base.vocab_parallel import VocabParallelDecorator
from tgraph.models.llama.modeling import LlamaLikeForCausalLM
from tgraph.models.registry import register_model


@register_model(model_types=("phi3",), architectures=("Phi3ForCausalLM",))
@torch_to_graph(LogitBiasDecorator, VocabParallelDecorator)
class FlashPhi3ForCausalLM(LlamaLikeForCausalLM):
    def __init__(self, llm_config, weight_loader, **kwargs):
        c = llm_config.model
        q_rows, kv_rows = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        for i in range(c.num_hidden_layers):
            attn, mlp = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
            if weight_loader.has(f"{attn}.qkv_proj.weight"):
                for part, start, rows in (("q", 0, q_rows), ("k", q_rows, kv_rows),
                                          ("v", q_rows + kv_rows, kv_rows)):
                    weight_loader.row_view(f"{attn}.{part}_proj.weight",
                                           f"{attn}.qkv_proj.weight", start, rows)
            if weight_loader.has(f"{mlp}.gate_up_proj.weight"):
                inter = c.intermediate_size
                weight_loader.row_view(f"{mlp}.gate_proj.weight", f"{mlp}.gate_up_proj.weight",
                                       0, inter)
                weight_loader.row_view(f"{mlp}.up_proj.weight", f"{mlp}.gate_up_proj.weight",
                                       inter, inter)
        super().__init__(llm_config, weight_loader, **kwargs)
