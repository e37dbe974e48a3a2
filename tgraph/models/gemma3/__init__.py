from tgraph.models.gemma3.modeling import FlashGemma3ForCausalLM

__all__ = ["FlashGemma3ForCausalLM"]
