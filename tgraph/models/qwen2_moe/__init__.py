from tgraph.models.qwen2_moe.modeling import FlashQwen2MoeForCausalLM

__all__ = ["FlashQwen2MoeForCausalLM"]
