"""Vocabulary-parallel embedding: each rank holds a contiguous slice of the vocabulary."""
from __future__ import annotations

from tgraph.io.weights import WeightLoader
from tgraph.layers.linear import divide
from tgraph.nn import functional as F
from tgraph.nn.module import Module, Parameter
from tgraph.nn.tensor import Tensor


class ParallelEmbedding(Module):
    """``weight[ids]`` with the vocabulary split across ranks.

    With several ranks each rank looks up the ids in its slice (others give zero rows) and the
    rows are all-reduced.
    """

    def __init__(self, loader: WeightLoader, prefix: str, vocab: int, hidden_size: int,
                 rank: int | None = None, world_size: int | None = None) -> None:
        super().__init__()
        rank = loader.rank if rank is None else rank
        ws = loader.world_size if world_size is None else world_size
        loader.expect_shape(f"{prefix}.weight", (vocab, hidden_size))
        self.vocab_per_rank = divide(vocab, ws, f"{prefix} vocabulary size")
        self.weight = Parameter(loader.get_sharded(f"{prefix}.weight", 0, rank, ws))
        self.rank, self.world_size = rank, ws

    def forward(self, ids: Tensor) -> Tensor:
        if self.world_size == 1:
            return F.embedding(ids, self.weight)
        from tgraph.nn import distributed

        start = self.rank * self.vocab_per_rank
        local = ids - start
        inside = (local >= 0) * (local < self.vocab_per_rank)
        rows = F.embedding(F.where(inside, local, 0), self.weight)
        rows = F.where(F.unsqueeze(inside, -1), rows, 0.0)
        return distributed.all_reduce(rows)
