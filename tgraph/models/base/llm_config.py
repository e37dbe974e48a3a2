"""Everything a model needs to know at construction: its shapes plus how it will be served."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tgraph.errors import ConfigError
from tgraph.io.model_config import ModelConfig
from tgraph.tuning import Tuning

GRAPH_MODES = ("static", "eager")


@dataclass
class LlmConfig:
    """Model config plus serving settings.

    Attributes:
        model: the model's hyper-parameters (from ``config.json``).
        dtype, device: where and in which dtype weights, activations and the cache live.
        max_model_len: longest sequence (prompt + generated) served; sizes rotary tables and
            the block-table width.
        block_size: tokens per KV-cache block.
        graph: ``"static"`` (passes, fused kernels, CUDA graphs) or ``"eager"`` (reference
            kernels op by op).
        cuda_graph: replay decode steps from captured CUDA graphs (static mode on CUDA).
        batch_buckets: decode batch sizes that get a CUDA graph (a batch is padded up).
        prefill_graph_tokens: prefill steps of up to this many tokens (and at most
            ``max(batch_buckets)`` sequences) replay CUDA graphs captured at token buckets,
            padded up (static mode on CUDA with ``cuda_graph``); 0 runs prefill uncaptured.
        disabled_passes: pass names to skip.
        tuning: the kernels' launch settings (``llm.engine.tuning``).
        rank, world_size: tensor-parallel position.
        features: settings of feature decorators (e.g. ``{"max_loras": 4}``).
    """

    model: ModelConfig
    dtype: torch.dtype = torch.float32
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    max_model_len: int = 2048
    block_size: int = 16
    graph: str = "static"
    cuda_graph: bool = True
    batch_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    prefill_graph_tokens: int = 4096
    disabled_passes: tuple[str, ...] = ()
    tuning: Tuning = field(default_factory=Tuning)
    rank: int = 0
    world_size: int = 1
    features: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.device = torch.device(self.device)
        if self.graph not in GRAPH_MODES:
            raise ConfigError(f"llm.engine.graph must be one of {GRAPH_MODES}, got {self.graph!r}")
        if isinstance(self.prefill_graph_tokens, bool) or not isinstance(
                self.prefill_graph_tokens, int) or self.prefill_graph_tokens < 0:
            raise ConfigError("prefill_graph_tokens must be an int >= 0, got "
                              f"{self.prefill_graph_tokens!r}")
        if not isinstance(self.tuning, Tuning):
            raise ConfigError("tuning must be a tgraph.tuning.Tuning (tgraph.config.tuning_of "
                              f"builds one from settings), got {type(self.tuning).__name__}")
        if self.max_model_len < 1 or self.block_size < 1:
            raise ConfigError("max_model_len and block_size must be positive")

    @property
    def hf_config(self) -> ModelConfig:
        """The model config (named as in Hugging Face-style model code)."""
        return self.model

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)

    @property
    def static(self) -> bool:
        return self.graph == "static"
