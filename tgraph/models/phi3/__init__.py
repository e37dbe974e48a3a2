from tgraph.models.phi3.modeling import FlashPhi3ForCausalLM

__all__ = ["FlashPhi3ForCausalLM"]
