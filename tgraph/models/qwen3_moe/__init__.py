from tgraph.models.qwen3_moe.modeling import FlashQwen3MoeForCausalLM

__all__ = ["FlashQwen3MoeForCausalLM"]
