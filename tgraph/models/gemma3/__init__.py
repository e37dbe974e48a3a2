from tgraph.models.gemma3.modeling import (
    FlashGemma3ForCausalLM,
    FlashGemma3ForConditionalGeneration,
)

__all__ = ["FlashGemma3ForCausalLM", "FlashGemma3ForConditionalGeneration"]
