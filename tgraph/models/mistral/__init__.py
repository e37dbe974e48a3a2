from tgraph.models.mistral.modeling import FlashMistralForCausalLM

__all__ = ["FlashMistralForCausalLM"]
