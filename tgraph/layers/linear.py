"""Linear layers with tensor-parallel sharding.

Each layer reads only its shard from the weight loader at construction: column-parallel layers
split the output dim (weight dim 0), row-parallel layers the input dim (weight dim 1). A packed
layer (q/k/v, gate/up) reads several checkpoint tensors into one weight so that the model runs
one GEMM; where a checkpoint is already packed the names list has one entry.

Weights may be quantized (:class:`~tgraph.quant.QuantizedWeight`, from a quantized checkpoint):
they stay packed. Parts of a packed layer quantized alike stack into one quantized weight; parts
quantized differently (a GGUF file mixing Q4_K and Q6_K) stay separate weights, run as one
linear each and concatenated. :meth:`LinearBase.configure` lets a rule choose how a quantized
linear runs.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from tgraph.errors import ConfigError
from tgraph.io.weights import WeightLoader
from tgraph.nn import functional as F
from tgraph.nn.module import Module, Parameter
from tgraph.nn.tensor import Tensor
from tgraph.quant import QuantizedWeight, dense, is_quantized

QUANT_MODES = ("kernel", "reference", "dense")


def divide(n: int, world_size: int, what: str) -> int:
    """``n / world_size``, refusing a remainder with a message that names ``what``."""
    if n % world_size:
        raise ConfigError(f"{what} ({n}) is not divisible by the tensor-parallel world size "
                          f"({world_size})")
    return n // world_size


def stack_rows(parts: Sequence[torch.Tensor | QuantizedWeight]
               ) -> torch.Tensor | QuantizedWeight | None:
    """The parts of a packed weight stacked along their rows: dense tensors concatenated,
    quantized ones when their schemes agree (still quantized); ``None`` when they cannot be one
    weight (quantized differently, or dense and quantized mixed)."""
    if all(isinstance(p, torch.Tensor) for p in parts):
        return torch.cat(list(parts))
    if QuantizedWeight.stackable(parts):
        return QuantizedWeight.cat(list(parts))
    return None


class LinearBase(Module):
    """``y = x @ weight.T + bias`` with a weight already sharded for this rank.

    A packed layer whose parts cannot stack (see :func:`stack_rows`) holds them as
    ``weight_0, weight_1, ...`` (and ``bias_i``) and runs one linear per part.
    """

    quant_mode: str = "kernel"
    num_parts: int = 1

    def __init__(self, weight: torch.Tensor | QuantizedWeight | Sequence[Any],
                 bias: torch.Tensor | Sequence[torch.Tensor] | None) -> None:
        super().__init__()
        if isinstance(weight, (torch.Tensor, QuantizedWeight)):
            self.weight = Parameter(weight)
            self.register_parameter("bias", Parameter(bias) if bias is not None else None)
            self.num_parts = 1
            return
        self.num_parts = len(weight)
        for i, w in enumerate(weight):
            self.register_parameter(f"weight_{i}", Parameter(w))
            b = None if bias is None else bias[i]
            self.register_parameter(f"bias_{i}", Parameter(b) if b is not None else None)

    def weights(self) -> list[tuple[Parameter, Parameter | None]]:
        """``(weight, bias)`` of each part (one pair unless the layer holds parts)."""
        if self.num_parts == 1:
            return [(self.weight, self.bias)]
        return [(getattr(self, f"weight_{i}"), getattr(self, f"bias_{i}"))
                for i in range(self.num_parts)]

    @property
    def in_features(self) -> int:
        return self.weights()[0][0].shape[1]

    @property
    def out_features(self) -> int:
        return sum(w.shape[0] for w, _ in self.weights())

    @classmethod
    def check_kwargs(cls, quant: str = "kernel") -> None:
        """Refuse an unknown ``quant`` mode (rules check it before any weight is read)."""
        if quant not in QUANT_MODES:
            raise ValueError(f"quant must be one of {list(QUANT_MODES)}, got {quant!r}")

    def configure(self, quant: str = "kernel") -> None:
        """How a quantized weight runs (a rule's ``kwargs``).

        Args:
            quant: ``"kernel"`` (default: the quantized kernels, packed weights),
                ``"reference"`` (the torch reference dequantizing per call, also on a GPU; the
                linear is left out of fusions), or ``"dense"`` (dequantized once now, then an
                ordinary linear: exact, at the memory of a dense weight).
        """
        self.check_kwargs(quant)
        self.quant_mode = quant
        if quant == "dense":
            for w, _ in self.weights():
                if w.data is not None and is_quantized(w.data):
                    w.data = dense(w.data)

    def _linear(self, x: Tensor, w: Parameter, b: Parameter | None) -> Tensor:
        if self.quant_mode == "reference" and w.data is not None and is_quantized(w.data):
            return F.record("linear", [x, w, b], transpose_a=False, transpose_b=True,
                            impl="reference")
        return F.linear(x, w, b)

    def forward(self, x: Tensor) -> Tensor:
        if self.num_parts == 1:
            return self._linear(x, self.weight, self.bias)
        return F.cat([self._linear(x, w, b) for w, b in self.weights()], dim=-1)

    def extra_repr(self) -> str:
        parts = f", parts={self.num_parts}" if self.num_parts > 1 else ""
        bias = self.weights()[0][1] is not None
        return f"in={self.in_features}, out={self.out_features}, bias={bias}{parts}"


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
    rank 0's copy is applied before the reduction. A module that sums this linear's output with
    other partial sums first sets ``reduce_output = False`` and all-reduces the total once.
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
        self.reduce_output = True

    def forward(self, x: Tensor) -> Tensor:
        out = LinearBase.forward(self, x)
        if self.world_size > 1 and self.reduce_output:
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
        parts = [loader.get_sharded(f"{p}.weight", 0, rank, ws) for p in prefixes]
        biases = [loader.get_sharded(f"{p}.bias", 0, rank, ws) for p in prefixes] \
            if bias else None
        _init_packed(self, parts, biases)
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
            return heads_shard(loader, name, num_kv_heads, rank, ws)

        parts = [loader.get_sharded(f"{q_prefix}.weight", 0, rank, ws),
                 kv_part(f"{k_prefix}.weight"), kv_part(f"{v_prefix}.weight")]
        biases = None
        if bias:
            biases = [loader.get_sharded(f"{q_prefix}.bias", 0, rank, ws),
                      kv_part(f"{k_prefix}.bias"), kv_part(f"{v_prefix}.bias")]
        if num_kv_heads < ws:
            for p in (k_prefix, v_prefix):
                loader.mark_used(f"{p}.weight")
                if bias:
                    loader.mark_used(f"{p}.bias")
        _init_packed(self, parts, biases)
        self.num_heads, self.num_kv_heads, self.head_dim = self_heads, kv_heads, head_dim
        self.output_sizes = [self_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
        self.rank, self.world_size = rank, ws


def heads_shard(loader: WeightLoader, name: str, num_heads: int, rank: int,
                world_size: int) -> torch.Tensor:
    """This rank's rows of ``name``, a tensor of ``num_heads`` equal row blocks split by heads as
    :class:`QKVParallelLinear` splits them: ``num_heads / world_size`` heads a rank, or with
    fewer heads than ranks, head ``rank * num_heads // world_size`` (replicated)."""
    if num_heads >= world_size:
        return loader.get_sharded(name, 0, rank, world_size)
    return loader.get_sharded(name, 0, rank * num_heads // world_size, num_heads)


def _init_packed(layer: LinearBase, parts: list[Any], biases: list[torch.Tensor] | None) -> None:
    """One stacked weight where the parts stack, else the parts side by side."""
    weight = stack_rows(parts)
    if weight is not None:
        LinearBase.__init__(layer, weight, torch.cat(biases) if biases else None)
    else:
        LinearBase.__init__(layer, parts, biases)
