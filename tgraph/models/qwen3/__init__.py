from tgraph.models.qwen3.modeling import FlashQwen3ForCausalLM

__all__ = ["FlashQwen3ForCausalLM"]
