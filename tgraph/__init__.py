"""tgraph: graph capture and fused kernels for fast LLM inference."""
from tgraph import nn
from tgraph.engine import Engine, build_engine
from tgraph.errors import TGraphError

__version__ = "0.1.0"

__all__ = ["Engine", "TGraphError", "build_engine", "nn", "__version__"]
