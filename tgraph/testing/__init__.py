"""Helpers for testing models against Hugging Face transformers (used by tests and the demo).

* :func:`make_tiny_hf_model` writes a tiny random checkpoint of a supported family (safetensors,
  optionally sharded) that :func:`tgraph.models.load_model` can read.
* :class:`PagedBatcher` keeps token lists and paged KV-cache block tables and turns "run these
  sequences this step" into a :class:`~tgraph.models.base.batch.BatchMeta`, the way a scheduler
  would (prefill, chunked prefill, decode).
* :func:`run_greedy` / :func:`generate_greedy` drive a tgraph model through prefill and greedy
  decode; :func:`hf_logits` / :func:`hf_greedy` are the Hugging Face counterparts.

``transformers`` is imported lazily: it is a test and demo dependency, not a runtime one.
"""
from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tgraph.models.base.batch import BatchMeta

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

__all__ = [
    "FAMILIES", "MOE_FAMILIES", "TINY_SHAPES", "GreedyTrace", "PagedBatcher", "generate_greedy",
    "hf_greedy", "hf_logits", "make_tiny_hf_model", "make_tiny_text_model", "random_hf_model",
    "run_greedy", "tiny_hf_config",
]

FAMILIES: tuple[str, ...] = ("llama", "qwen2", "qwen3", "mistral", "olmo2", "olmo3",
                              "gemma3_text", "phi3")
# Mixture-of-experts families (tiny configs need their expert keys: see tests/models/test_moe.py).
MOE_FAMILIES: tuple[str, ...] = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe")

# Small enough for the CPU interpreter, big enough to exercise GQA (4 query heads share 2 KV
# heads), several layers and several vocabulary shards (192 divides by 2, 3, 4 and 6).
# NOTE: initializer_range 0.1 (HF default 0.02): at width 64 the default gives near-uniform
# attention, so position-dependent bugs (rope, windows) would barely move the logits.
TINY_SHAPES: dict[str, Any] = dict(
    vocab_size=192, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    rms_norm_eps=1e-6, initializer_range=0.1,
)


def _family_classes(family: str) -> tuple[type, type]:
    import transformers

    names = {"llama": ("LlamaConfig", "LlamaForCausalLM"),
             "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
             "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
             "mistral": ("MistralConfig", "MistralForCausalLM"),
             "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
             "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
             "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
             "olmo2": ("Olmo2Config", "Olmo2ForCausalLM"),
             "olmo3": ("Olmo3Config", "Olmo3ForCausalLM"),
             "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
             "phi3": ("Phi3Config", "Phi3ForCausalLM"),
             "olmoe": ("OlmoeConfig", "OlmoeForCausalLM")}
    if family not in names:
        raise ValueError(f"unknown family {family!r}; expected one of {list(names)}")
    config_name, model_name = names[family]
    return getattr(transformers, config_name), getattr(transformers, model_name)


def tiny_hf_config(family: str, **overrides: Any) -> PretrainedConfig:
    """A tiny Hugging Face config of ``family`` (:data:`TINY_SHAPES` updated by ``overrides``).

    Args:
        family: one of :data:`FAMILIES`.
        overrides: config keys to set (``tie_word_embeddings``, ``rope_scaling``, ``head_dim``,
            ``sliding_window``...); they may also replace the tiny shapes.

    Returns:
        The config object (not saved).
    """
    config_cls, _ = _family_classes(family)
    return config_cls(**{**TINY_SHAPES, **overrides})


def random_hf_model(family: str, *, seed: int = 0, device: str | torch.device = "cpu",
                    dtype: torch.dtype = torch.float32, **overrides: Any) -> PreTrainedModel:
    """A Hugging Face causal LM of ``family`` with random weights, in eval mode.

    Hugging Face initialises norm scales to one and biases to zero, which would let a model that
    ignores them pass a comparison; here every norm scale is ``1 + 0.2 * N(0, 1)`` and every
    bias ``0.1 * N(0, 1)``, so each tensor matters.

    Args:
        family: one of :data:`FAMILIES`.
        seed: seeds the weights (the global RNG state is left untouched).
        device: where the model is built.
        dtype: the model's dtype (weights are drawn in fp32, then converted).
        overrides: config keys, as for :func:`tiny_hf_config`; without shape keys the model has
            :data:`TINY_SHAPES`.

    Returns:
        The model.
    """
    _, model_cls = _family_classes(family)
    config = tiny_hf_config(family, **overrides)
    dev = torch.device(device)
    devices = [dev.index if dev.index is not None else torch.cuda.current_device()] \
        if dev.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        with torch.device(device):
            model = model_cls(config)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.copy_(1.0 + 0.2 * torch.randn_like(p))
                elif name.endswith(".bias"):
                    p.copy_(0.1 * torch.randn_like(p))
    return model.to(dtype).eval()


def make_tiny_hf_model(family: str, path: str | Path, *, seed: int = 0,
                       max_shard_size: int | str | None = None, **overrides: Any) -> Path:
    """Save a tiny random model of ``family`` as a Hugging Face safetensors checkpoint.

    Args:
        family: one of :data:`FAMILIES` (``"llama"``, ``"qwen2"``, ``"qwen3"``, ``"mistral"``).
        path: the directory to write (created if needed).
        seed: seeds the weights: the same seed and overrides give the same checkpoint.
        max_shard_size: split the weights into shards of at most this size (e.g. ``"20KB"``),
            with a ``model.safetensors.index.json``; ``None`` writes one file.
        overrides: config keys, as for :func:`tiny_hf_config`.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.
    """
    path = Path(path)
    model = random_hf_model(family, seed=seed, **overrides)
    kwargs: dict[str, Any] = {"safe_serialization": True}
    if max_shard_size is not None:
        kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(path, **kwargs)
    return path


def make_tiny_text_model(path: str | Path, *, seed: int = 0, **overrides: Any) -> Path:
    """A tiny random Llama checkpoint with the demo tokenizer saved beside it (text prompts), its
    vocabulary and special tokens the tokenizer's, as a user's directory holds them.

    Args:
        path: the directory to write (created if needed).
        seed, overrides: as for :func:`make_tiny_hf_model`.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.
    """
    import tempfile

    from tgraph.runtime.demo_tokenizer import build_demo_tokenizer

    path = Path(path)
    with tempfile.TemporaryDirectory() as scratch:  # the tokenizer's build files stay out
        tok = build_demo_tokenizer(Path(scratch))
        tok.save_pretrained(path)
    return make_tiny_hf_model("llama", path, seed=seed, vocab_size=len(tok),
                              bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                              **overrides)


# ---------------------------------------------------------------------------------- batching
@dataclass
class _Seq:
    tokens: list[int]
    cached: int = 0
    blocks: list[int] = field(default_factory=list)


class PagedBatcher:
    """Sequences, their paged KV-cache blocks, and the :class:`BatchMeta` of each step.

    Blocks are handed out from a shuffled free list so that a sequence's blocks are not
    contiguous (as after a scheduler has run for a while). Each :meth:`step` assumes the batch it
    returns is run: the scheduled tokens count as cached afterwards.

    Args:
        block_size: tokens per cache block (the model's ``llm_config.block_size``).
        num_blocks: blocks in the cache.
        shuffle_seed: seed of the free-list order; ``None`` hands blocks out in order.
    """

    def __init__(self, block_size: int, num_blocks: int, *, shuffle_seed: int | None = 0) -> None:
        if block_size < 1 or num_blocks < 1:
            raise ValueError(f"block_size and num_blocks must be positive, got {block_size} and "
                             f"{num_blocks}")
        self.block_size = block_size
        self._free = list(range(num_blocks))
        if shuffle_seed is not None:
            random.Random(shuffle_seed).shuffle(self._free)
        self._seqs: list[_Seq] = []

    @classmethod
    def for_model(cls, model: Any, *, shuffle_seed: int | None = 0) -> PagedBatcher:
        """A batcher over ``model``'s allocated KV cache.

        Raises:
            ValueError: the model has no KV cache yet.
        """
        if not model.kv_caches:
            raise ValueError("the model has no KV cache: call model.allocate_kv_cache(n) first")
        return cls(model.llm_config.block_size, model.kv_caches[0][0].shape[0],
                   shuffle_seed=shuffle_seed)

    def add(self, tokens: Sequence[int]) -> int:
        """Add a sequence (none of its tokens cached yet); returns its id."""
        if not tokens:
            raise ValueError("a sequence needs at least one token")
        self._seqs.append(_Seq([int(t) for t in tokens]))
        return len(self._seqs) - 1

    def append(self, seq: int, token: int) -> None:
        """Append a (generated) token to sequence ``seq``."""
        self._seqs[seq].tokens.append(int(token))

    def tokens(self, seq: int) -> list[int]:
        """The tokens of sequence ``seq`` (a copy)."""
        return list(self._seqs[seq].tokens)

    def step(self, seqs: Sequence[int], num_tokens: Sequence[int] | None = None, *,
             all_logits: bool = False) -> BatchMeta:
        """The batch that runs the next uncached tokens of ``seqs``.

        Args:
            seqs: sequence ids, in batch order.
            num_tokens: tokens to schedule per sequence (a prefill chunk); default all uncached.
            all_logits: ask for the logits of every scheduled token, not only each sequence's
                last (prefill batches only).

        Returns:
            The batch: a decode batch when every sequence schedules one token and has context,
            else a prefill batch.
        """
        if num_tokens is None:
            num_tokens = [len(self._seqs[s].tokens) - self._seqs[s].cached for s in seqs]
        if len(num_tokens) != len(seqs):
            raise ValueError(f"{len(seqs)} sequences but {len(num_tokens)} token counts")
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_len: list[int] = []
        tables: list[list[int]] = []
        for s, n in zip(seqs, num_tokens):
            seq = self._seqs[s]
            if not 1 <= n <= len(seq.tokens) - seq.cached:
                raise ValueError(f"sequence {s} has {len(seq.tokens) - seq.cached} uncached "
                                 f"tokens; cannot schedule {n}")
            end = seq.cached + n
            while len(seq.blocks) * self.block_size < end:
                if not self._free:
                    raise ValueError("the KV cache is out of blocks")
                seq.blocks.append(self._free.pop())
            for pos in range(seq.cached, end):
                ids.append(seq.tokens[pos])
                positions.append(pos)
                slots.append(seq.blocks[pos // self.block_size] * self.block_size
                             + pos % self.block_size)
            seq_len.append(end)
            tables.append(list(seq.blocks))
        is_prefill = not all(n == 1 and self._seqs[s].cached > 0
                             for s, n in zip(seqs, num_tokens))
        if all_logits and not is_prefill:
            raise ValueError("all_logits needs a prefill batch (decode gives one row per sequence)")
        for s, n in zip(seqs, num_tokens):
            self._seqs[s].cached += n
        return BatchMeta(input_ids=ids, position_ids=positions, slots_mapping=slots,
                         query_lens=list(num_tokens), seq_len=seq_len, block_table=tables,
                         lm_head_indices=list(range(len(ids))) if all_logits else None,
                         is_prefill=is_prefill)

    def decode_fed(self, model: Any, seqs: Sequence[int], fed: Sequence[Sequence[int]],
                   loras: list[str | None] | None = None) -> list[torch.Tensor]:
        """Decode steps that feed given tokens instead of each step's argmax (so two runs that
        differ a little still compare the same tokens): ``fed[step][i]`` is appended to
        ``seqs[i]`` before step ``step`` runs.

        Returns:
            Each step's logits, fp32 (a copy).

        Raises:
            ValueError: a step is not a decode step (a sequence without cached context).
        """
        rows = []
        for tokens in fed:
            for s, t in zip(seqs, tokens):
                self.append(s, t)
            batch = self.step(seqs)
            if batch.is_prefill:
                raise ValueError("decode_fed: every sequence needs its prompt prefilled first")
            batch.loras = loras
            rows.append(model.run(batch).float().clone())
        return rows


# ---------------------------------------------------------------------------------- driving
@dataclass
class GreedyTrace:
    """What :func:`run_greedy` saw.

    Attributes:
        sequences: each prompt followed by the tokens fed in the decode steps.
        prefill_logits: per prompt, ``[prompt_len, vocab]``: the logits of every prompt token.
        step_logits: per decode step, ``[num_prompts, vocab]``: the logits at the token fed in
            that step (position ``prompt_len + step`` of each sequence).
        generated: per prompt, the greedy tokens (``decode_steps + 1``: the last one is the
            argmax of the final step's logits and was not fed).
    """

    sequences: list[list[int]]
    prefill_logits: list[torch.Tensor]
    step_logits: list[torch.Tensor]
    generated: list[list[int]]

    def logits_of(self, seq: int) -> torch.Tensor:
        """Every logit row of sequence ``seq`` in position order, ``[len(sequences[seq]), vocab]``
        (prefill rows, then one row per decode step)."""
        rows = [self.prefill_logits[seq]] + [step[seq:seq + 1] for step in self.step_logits]
        return torch.cat(rows)


def run_greedy(model: Any, prompts: Sequence[Sequence[int]], decode_steps: int, *,
               batcher: PagedBatcher | None = None) -> GreedyTrace:
    """Prefill ``prompts`` in one packed batch, then run ``decode_steps`` greedy decode steps.

    The prefill asks for the logits of every prompt token; each decode step feeds every
    sequence the argmax of its previous logits.

    Args:
        model: a loaded tgraph model whose KV cache is allocated.
        prompts: token ids per sequence.
        decode_steps: number of decode steps after the prefill.
        batcher: the batcher to use (default: a fresh one over the model's cache).

    Returns:
        The trace of logits and tokens (logits are copies, on the model's device).
    """
    if not prompts:
        raise ValueError("run_greedy needs at least one prompt")
    b = batcher or PagedBatcher.for_model(model)
    ids = [b.add(p) for p in prompts]
    # NOTE: clone every result: an engine (and a replayed CUDA graph) may reuse its output buffer.
    logits = model.run(b.step(ids, all_logits=True)).clone()
    prefill = list(torch.split(logits, [len(p) for p in prompts]))
    last = torch.stack([rows[-1] for rows in prefill])
    generated: list[list[int]] = [[] for _ in ids]
    steps: list[torch.Tensor] = []
    for _ in range(decode_steps):
        for i, s in enumerate(ids):
            token = int(torch.argmax(last[i]))
            generated[i].append(token)
            b.append(s, token)
        last = model.run(b.step(ids)).clone()
        steps.append(last)
    for i in range(len(ids)):
        generated[i].append(int(torch.argmax(last[i])))
    return GreedyTrace([b.tokens(s) for s in ids], prefill, steps, generated)


def generate_greedy(model: Any, prompts: list[list[int]], steps: int) -> list[list[int]]:
    """Greedy generation with a tgraph model: ``steps`` new tokens per prompt.

    Args:
        model: a loaded tgraph model whose KV cache is allocated (and has room for the prompts
            plus ``steps`` tokens).
        prompts: token ids per prompt.
        steps: new tokens per prompt (one from the prefill, the rest from decode steps).

    Returns:
        The new tokens of each prompt.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    return run_greedy(model, prompts, steps - 1).generated


@torch.no_grad()
def hf_logits(hf_model: PreTrainedModel, tokens: Sequence[int]) -> torch.Tensor:
    """Logits of every position of ``tokens`` from one full-sequence forward, ``[len, vocab]``
    in fp32 (on the model's device)."""
    device = next(hf_model.parameters()).device
    out = hf_model(torch.tensor([list(tokens)], device=device), use_cache=False)
    return out.logits[0].float()


@torch.no_grad()
def hf_greedy(hf_model: PreTrainedModel, prompts: list[list[int]], steps: int
              ) -> list[list[int]]:
    """Greedy generation with a Hugging Face model by full-sequence forwards (no cache, no
    generation config): the oracle of :func:`generate_greedy`.

    Returns:
        ``steps`` new tokens per prompt.
    """
    out = []
    for prompt in prompts:
        tokens = list(prompt)
        for _ in range(steps):
            tokens.append(int(torch.argmax(hf_logits(hf_model, tokens)[-1])))
        out.append(tokens[len(prompt):])
    return out
