from tgraph.models.olmoe.modeling import FlashOlmoeForCausalLM

__all__ = ["FlashOlmoeForCausalLM"]
