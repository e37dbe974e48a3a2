"""The gated MLP: packed gate|up projection, gated activation, down projection."""
from __future__ import annotations

from tgraph.errors import ConfigError
from tgraph.io.model_config import ModelConfig
from tgraph.io.weights import WeightLoader
from tgraph.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from tgraph.nn import functional as F
from tgraph.nn.functional import ActType
from tgraph.nn.module import Module
from tgraph.nn.tensor import Tensor

_GATE_ACTS = {"silu": ActType.SILU, "gelu": ActType.GELU, "gelu_pytorch_tanh": ActType.GELU_TANH,
              "gelu_new": ActType.GELU_TANH, "relu": ActType.RELU}


class Mlp(Module):
    """``down(act(gate(x)) * up(x))`` with gate and up packed into one GEMM (of
    ``intermediate_size`` columns each, the config's unless given)."""

    def __init__(self, config: ModelConfig, loader: WeightLoader, prefix: str,
                 bias: bool = False, intermediate_size: int | None = None) -> None:
        super().__init__()
        if config.hidden_act not in _GATE_ACTS:
            raise ConfigError(f"hidden_act {config.hidden_act!r} is not supported; expected one "
                              f"of {sorted(_GATE_ACTS)}")
        self.act = _GATE_ACTS[config.hidden_act]
        hidden = config.hidden_size
        inter = config.intermediate_size if intermediate_size is None else intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            loader, [f"{prefix}.gate_proj", f"{prefix}.up_proj"], hidden, [inter, inter], bias=bias)
        self.down_proj = RowParallelLinear(loader, f"{prefix}.down_proj", inter, hidden, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        gate_up = self.gate_up_proj(x)
        if self.act is ActType.SILU:
            return self.down_proj(F.activation(gate_up, ActType.SWIGLU))
        gate, up = F.split(gate_up, self.gate_up_proj.output_sizes, dim=-1)
        return self.down_proj(F.activation(gate, self.act) * up)
