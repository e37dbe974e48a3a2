"""Model families, the registry, and loading from checkpoint directories."""
from tgraph.models.loading import check_model, load_model
from tgraph.models.registry import register_model, resolve_model_class, supported_model_types

__all__ = ["check_model", "load_model", "register_model", "resolve_model_class",
           "supported_model_types"]
