"""Normalisation layers."""
from __future__ import annotations

import torch

from tgraph.io.weights import WeightLoader
from tgraph.layers.linear import heads_shard
from tgraph.nn import functional as F
from tgraph.nn.module import Module, Parameter
from tgraph.nn.tensor import Tensor


class RmsNorm(Module):
    """RMSNorm over the last dim with a learned scale ``{prefix}.weight``."""

    def __init__(self, loader: WeightLoader, prefix: str, hidden_size: int, eps: float) -> None:
        super().__init__()
        loader.expect_shape(f"{prefix}.weight", (hidden_size,))
        self.weight = Parameter(self.load_scale(loader, f"{prefix}.weight"))
        self.eps = eps

    def load_scale(self, loader: WeightLoader, name: str) -> torch.Tensor:
        """The scale the norm multiplies by, from the checkpoint tensor ``name``."""
        return loader.get_tensor(name)

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class GemmaRmsNorm(RmsNorm):
    """RMSNorm that scales by ``1 + weight`` (Gemma's checkpoints store the offset from one);
    the one is added at load in fp32, so the graph's norm is the plain one."""

    def load_scale(self, loader: WeightLoader, name: str) -> torch.Tensor:
        dtype = loader.dtype or loader.stored_dtype(name) or torch.float32
        return (1.0 + loader.get_tensor(name, dtype=torch.float32)).to(dtype)


class HeadsRmsNorm(Module):
    """RMSNorm over every head's features of q or k at once (OLMo 2, OLMoE), the heads split
    over tensor-parallel ranks as the q|k|v projection splits them.

    The checkpoint's ``{prefix}.weight`` has ``num_heads * head_dim`` entries; each rank holds
    its heads' slice. With one rank this is a plain RMSNorm over the flattened heads; with
    several, the sum of squares of the rank's slice is all-reduced first. KV heads replicated
    over ranks (fewer KV heads than ranks) are counted once.

    Args:
        loader: weight loader (its rank and world size pick the slice).
        prefix: checkpoint prefix, e.g. ``model.layers.0.self_attn.q_norm``.
        num_heads: heads of the whole model (q heads or KV heads).
        head_dim: features per head.
        eps: RMSNorm epsilon.
    """

    def __init__(self, loader: WeightLoader, prefix: str, num_heads: int, head_dim: int,
                 eps: float) -> None:
        super().__init__()
        name = f"{prefix}.weight"
        loader.expect_shape(name, (num_heads * head_dim,))
        ws = loader.world_size
        self.weight = Parameter(heads_shard(loader, name, num_heads, loader.rank, ws))
        self.replicas = max(1, ws // num_heads)  # ranks holding each head
        self.width, self.head_dim, self.eps, self.world_size = \
            num_heads * head_dim, head_dim, eps, ws

    def forward(self, x: Tensor) -> Tensor:
        """``x``: (tokens, this rank's heads, head_dim) -> the same shape, normalised."""
        local = self.weight.shape[0]
        heads = (-1, local // self.head_dim, self.head_dim)
        flat = F.reshape(x, (-1, local))
        if self.world_size == 1:
            return F.reshape(F.rms_norm(flat, self.weight, self.eps), heads)
        from tgraph.nn import distributed

        # fp32 statistics, as the fused RMSNorm keeps them.
        wide = F.cast(flat, torch.float32)
        squares = distributed.all_reduce(F.sum(F.mul(wide, wide), -1, keepdim=True))
        inv = F.rsqrt(F.add(F.div(squares, float(self.width * self.replicas)), self.eps))
        out = F.mul(F.mul(wide, inv), F.cast(self.weight, torch.float32))
        return F.reshape(F.cast(out, x.dtype or self.weight.dtype), heads)

    def extra_repr(self) -> str:
        return f"{self.width} over all heads, eps={self.eps}"
