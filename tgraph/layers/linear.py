"""Linear layers with tensor-parallel sharding.

Each layer reads only its shard from the weight loader at construction: column-parallel layers
split the output dim (weight dim 0), row-parallel layers the input dim (weight dim 1). A packed
layer (q/k/v, gate/up) reads several checkpoint tensors into one weight so that the model runs
one GEMM; where a checkpoint is already packed the names list has one entry.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from tgraph.errors import ConfigError
from tgraph.io.weights import WeightLoader
from tgraph.nn import functional as F
from tgraph.nn.module import Module, Parameter
from tgraph.nn.tensor import Tensor


def divide(n: int, world_size: int, what: str) -> int:
    """``n / world_size``, refusing a remainder with a message that names ``what``."""
    if n % world_size:
        raise ConfigError(f"{what} ({n}) is not divisible by the tensor-parallel world size "
                          f"({world_size})")
    return n // world_size


class LinearBase(Module):
    """``y = x @ weight.T + bias`` with a weight already sharded for this rank."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight = Parameter(weight)
        self.register_parameter("bias", Parameter(bias) if bias is not None else None)

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}"


def expect(loader: WeightLoader, prefix: str, out_features: int, in_features: int,
           bias: bool) -> None:
    """Check the checkpoint's full (unsharded) shapes before reading a shard."""
    loader.expect_shape(f"{prefix}.weight", (out_features, in_features))
    if bias:
        loader.expect_shape(f"{prefix}.bias", (out_features,))


class ReplicatedLinear(LinearBase):
    """A linear every rank holds whole."""

    def __init__(self, loader: WeightLoader, prefix: str, in_features: int, out_features: int,
                 bias: bool = False) -> None:
        expect(loader, prefix, out_features, in_features, bias)
        super().__init__(loader.get_tensor(f"{prefix}.weight"),
                         loader.get_tensor(f"{prefix}.bias") if bias else None)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks (weight dim 0); each rank computes its slice."""

    def __init__(self, loader: WeightLoader, prefix: str, in_features: int, out_features: int,
                 bias: bool = False, rank: int | None = None,
                 world_size: int | None = None) -> None:
        rank = loader.rank if rank is None else rank
        ws = loader.world_size if world_size is None else world_size
        expect(loader, prefix, out_features, in_features, bias)
        divide(out_features, ws, f"{prefix} output features")
        super().__init__(
            loader.get_sharded(f"{prefix}.weight", 0, rank, ws),
            loader.get_sharded(f"{prefix}.bias", 0, rank, ws) if bias else None)
        self.rank, self.world_size = rank, ws


    @classmethod
    def tied(cls, weight: Parameter, rank: int = 0, world_size: int = 1) -> ColumnParallelLinear:
        """A linear sharing another module's (already sharded) weight, e.g. an LM head tied to
        the vocabulary-parallel embedding: no copy is read or kept."""
        layer = cls.__new__(cls)
        Module.__init__(layer)
        layer.weight = weight
        layer.register_parameter("bias", None)
        layer.rank, layer.world_size = rank, world_size
        return layer


class RowParallelLinear(LinearBase):
    """Input features split across ranks (weight dim 1); partial sums are all-reduced.

    The bias is added once (by the all-reduced result), so every rank holds it whole and only
    rank 0's copy is applied before the reduction.
    """

    def __init__(self, loader: WeightLoader, prefix: str, in_features: int, out_features: int,
                 bias: bool = False, rank: int | None = None,
                 world_size: int | None = None) -> None:
        rank = loader.rank if rank is None else rank
        ws = loader.world_size if world_size is None else world_size
        expect(loader, prefix, out_features, in_features, bias)
        divide(in_features, ws, f"{prefix} input features")
        has_bias = bias and rank == 0
        super().__init__(loader.get_sharded(f"{prefix}.weight", 1, rank, ws),
                         loader.get_tensor(f"{prefix}.bias") if has_bias else None)
        if bias and not has_bias:
            loader.mark_used(f"{prefix}.bias")
        self.rank, self.world_size = rank, ws

    def forward(self, x: Tensor) -> Tensor:
        out = F.linear(x, self.weight, self.bias)
        if self.world_size > 1:
            from tgraph.nn import distributed

            out = distributed.all_reduce(out)
        return out


class MergedColumnParallelLinear(LinearBase):
    """Several checkpoint tensors (e.g. ``gate_proj`` and ``up_proj``) packed into one
    column-parallel weight: rank r holds the concatenation of each part's r-th shard."""

    def __init__(self, loader: WeightLoader, prefixes: Sequence[str], in_features: int,
                 output_sizes: Sequence[int], bias: bool = False, rank: int | None = None,
                 world_size: int | None = None) -> None:
        rank = loader.rank if rank is None else rank
        ws = loader.world_size if world_size is None else world_size
        for p, n in zip(prefixes, output_sizes, strict=True):
            expect(loader, p, n, in_features, bias)
            divide(n, ws, f"{p} output features")
        weight = torch.cat([loader.get_sharded(f"{p}.weight", 0, rank, ws) for p in prefixes])
        b = torch.cat([loader.get_sharded(f"{p}.bias", 0, rank, ws) for p in prefixes]) \
            if bias else None
        super().__init__(weight, b)
        self.output_sizes = [n // ws for n in output_sizes]
        self.rank, self.world_size = rank, ws


class QKVParallelLinear(LinearBase):
    """q, k and v projections packed into one column-parallel weight, sharded by heads.

    When there are fewer KV heads than ranks, KV heads are replicated: rank r holds KV head
    ``r * num_kv_heads // world_size``.
    """

    def __init__(self, loader: WeightLoader, prefixes: Sequence[str], hidden_size: int,
                 head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False,
                 rank: int | None = None, world_size: int | None = None) -> None:
        rank = loader.rank if rank is None else rank
        ws = loader.world_size if world_size is None else world_size
        for p, heads in zip(prefixes, (num_heads, num_kv_heads, num_kv_heads), strict=True):
            expect(loader, p, heads * head_dim, hidden_size, bias)
        self_heads = divide(num_heads, ws, "num_attention_heads")
        if num_kv_heads >= ws:
            kv_heads = divide(num_kv_heads, ws, "num_key_value_heads")
        else:
            divide(ws, num_kv_heads, "world size over num_key_value_heads (for KV replication)")
            kv_heads = 1
        q_prefix, k_prefix, v_prefix = prefixes

        def kv_part(name: str) -> torch.Tensor:
            if num_kv_heads >= ws:
                return loader.get_sharded(name, 0, rank, ws)
            head = rank * num_kv_heads // ws
            return loader.get_sharded(name, 0, head, num_kv_heads)

        weight = torch.cat([loader.get_sharded(f"{q_prefix}.weight", 0, rank, ws),
                            kv_part(f"{k_prefix}.weight"), kv_part(f"{v_prefix}.weight")])
        b = None
        if bias:
            b = torch.cat([loader.get_sharded(f"{q_prefix}.bias", 0, rank, ws),
                           kv_part(f"{k_prefix}.bias"), kv_part(f"{v_prefix}.bias")])
        if num_kv_heads < ws:
            for p in (k_prefix, v_prefix):
                loader.mark_used(f"{p}.weight")
                if bias:
                    loader.mark_used(f"{p}.bias")
        super().__init__(weight, b)
        self.num_heads, self.num_kv_heads, self.head_dim = self_heads, kv_heads, head_dim
        self.output_sizes = [self_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
        self.rank, self.world_size = rank, ws
