"""Random weights made as the model reads them: the :class:`WeightLoader` of the benchmarks
whose models are too large to hold whole in memory (a 70B model under tensor parallelism, where
each rank may only ever hold its own shard)."""
from __future__ import annotations

from collections.abc import Collection, Sequence
from math import prod

import torch

from tgraph.io.weights import Index, WeightLoader

__all__ = ["RandomWeightLoader", "checkpoint_shapes"]


def checkpoint_shapes(hf_config: dict) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the tensors of the HF model of ``hf_config`` (a tied ``lm_head`` left
    out), from a model built on the meta device."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(**hf_config)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(cfg)
    return {name: tuple(t.shape) for name, t in meta.state_dict().items()
            if not (cfg.tie_word_embeddings and name == "lm_head.weight")}


class RandomWeightLoader(WeightLoader):
    """The checkpoint of ``hf_config`` with random values (norms 1, the rest N(0, 0.02)),
    each tensor, or only this rank's shard of it, drawn on ``device`` when it is read.

    Every read draws new values: two ranks' replicated tensors differ, which a benchmark never
    notices and a correctness test must not rely on (use :class:`DictWeightLoader` there).
    """

    def __init__(self, hf_config: dict, device: str | torch.device = "cuda",
                 dtype: torch.dtype = torch.bfloat16, rank: int = 0, world_size: int = 1,
                 seed: int = 0) -> None:
        super().__init__(device, dtype, rank, world_size, progress=False)
        self._shapes = checkpoint_shapes(hf_config)
        self._gen = torch.Generator(device=self.device).manual_seed(seed)
        self._draw_dtype = dtype

    def _names(self) -> Sequence[str]:
        return list(self._shapes)

    def _name_set(self) -> Collection[str]:
        return self._shapes

    def _shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[name]

    def _read(self, name: str, index: Index | None) -> torch.Tensor:
        shape = self._shapes[name]
        if index is not None:
            shape = tuple(torch.empty(shape, device="meta")[index].shape)
        w = torch.empty(shape, dtype=self._draw_dtype, device=self.device)
        if name.endswith("norm.weight"):
            return w.fill_(1.0)
        return w.normal_(0.0, 0.02, generator=self._gen)

    def _dtype(self, name: str) -> torch.dtype | None:
        return self._draw_dtype

    def _describe_sources(self) -> str:
        return f"random weights ({len(self._shapes)} tensors)"

    def _total_bytes(self) -> int:
        size = torch.empty((), dtype=self._draw_dtype).element_size()
        return sum(prod(s) for s in self._shapes.values()) * size
