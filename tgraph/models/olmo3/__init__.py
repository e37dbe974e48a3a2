from tgraph.models.olmo3.modeling import FlashOlmo3ForCausalLM

__all__ = ["FlashOlmo3ForCausalLM"]
