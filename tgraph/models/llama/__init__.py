from tgraph.models.llama.modeling import FlashLlamaForCausalLM, LlamaModel

__all__ = ["FlashLlamaForCausalLM", "LlamaModel"]
