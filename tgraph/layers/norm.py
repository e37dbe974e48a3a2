"""Normalisation layers."""
from __future__ import annotations

from tgraph.io.weights import WeightLoader
from tgraph.nn import functional as F
from tgraph.nn.module import Module, Parameter
from tgraph.nn.tensor import Tensor


class RmsNorm(Module):
    """RMSNorm over the last dim with a learned scale ``{prefix}.weight``."""

    def __init__(self, loader: WeightLoader, prefix: str, hidden_size: int, eps: float) -> None:
        super().__init__()
        loader.expect_shape(f"{prefix}.weight", (hidden_size,))
        self.weight = Parameter(loader.get_tensor(f"{prefix}.weight"))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
