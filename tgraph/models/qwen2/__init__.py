from tgraph.models.qwen2.modeling import FlashQwen2ForCausalLM

__all__ = ["FlashQwen2ForCausalLM"]
