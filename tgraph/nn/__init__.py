"""Model-facing API: symbolic tensors, functional ops, modules and the network manager."""
from tgraph.nn import functional
from tgraph.nn.functional import ActType
from tgraph.nn.module import Module, ModuleDict, ModuleList, Parameter
from tgraph.nn.network_manager import get_default_net, recording, reset_default_net
from tgraph.nn.tensor import Tensor

__all__ = [
    "ActType", "Module", "ModuleDict", "ModuleList", "Parameter", "Tensor", "functional",
    "get_default_net", "recording", "reset_default_net",
]
