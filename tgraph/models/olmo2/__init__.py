from tgraph.models.olmo2.modeling import FlashOlmo2ForCausalLM

__all__ = ["FlashOlmo2ForCausalLM"]
