from tgraph.models.mixtral.modeling import FlashMixtralForCausalLM

__all__ = ["FlashMixtralForCausalLM"]
