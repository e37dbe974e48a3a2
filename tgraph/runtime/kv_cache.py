"""Sizing the paged KV cache."""
from __future__ import annotations

import logging

import torch

from tgraph.errors import ConfigError
from tgraph.models.base.batch import BatchMeta

logger = logging.getLogger("tgraph.runtime")

CPU_CACHE_BUDGET_BYTES = 2 << 30


def bytes_per_block(model) -> int:
    c = model.llm_config
    m = c.model
    kv_heads = max(1, m.num_key_value_heads // c.world_size)
    elem = torch.tensor([], dtype=c.dtype).element_size()
    return 2 * m.num_hidden_layers * c.block_size * kv_heads * m.head_dim * elem


def profile_batch(num_tokens: int, max_model_len: int, block_size: int) -> tuple[BatchMeta, int]:
    """A prefill of ``num_tokens`` tokens in sequences of at most ``max_model_len`` tokens, the
    largest step the scheduler may run; returns it and the cache blocks it needs."""
    lens = []
    left = num_tokens
    while left > 0:
        lens.append(min(left, max_model_len))
        left -= lens[-1]
    ids, positions, slots, tables = [], [], [], []
    next_block = 0
    for n in lens:
        blocks = list(range(next_block, next_block + -(-n // block_size)))
        next_block += len(blocks)
        tables.append(blocks)
        ids += [0] * n
        positions += list(range(n))
        slots += [blocks[p // block_size] * block_size + p % block_size for p in range(n)]
    return BatchMeta(ids, positions, slots, lens, lens, tables, is_prefill=True), next_block


def profile_activation_peak(model, num_tokens: int) -> int:
    """Peak CUDA bytes of the largest prefill step (weights included)."""
    c = model.llm_config
    batch, blocks = profile_batch(num_tokens, c.max_model_len, c.block_size)
    model.allocate_kv_cache(blocks)
    torch.cuda.synchronize(c.device)
    torch.cuda.reset_peak_memory_stats(c.device)
    model.run(batch)
    torch.cuda.synchronize(c.device)
    peak = torch.cuda.max_memory_allocated(c.device)
    model.allocate_kv_cache(1)
    return peak


def plan_num_blocks(model, num_blocks: int | None, gpu_memory_utilization: float,
                    max_num_seqs: int, max_num_batched_tokens: int) -> int:
    """The number of KV blocks: explicit, or what fits in GPU memory after the weights and a
    profiled prefill peak (``total * utilization - peak``); on CPU, enough for ``max_num_seqs``
    full sequences within a 2 GiB budget."""
    c = model.llm_config
    per_block = bytes_per_block(model)
    if num_blocks is not None:
        return num_blocks
    if c.device.type == "cuda":
        peak = profile_activation_peak(model, max_num_batched_tokens)
        _, total = torch.cuda.mem_get_info(c.device)
        free = int(total * gpu_memory_utilization) - peak
        blocks = free // per_block
        if blocks < c.max_blocks_per_seq:
            raise ConfigError(
                f"only {blocks} KV-cache blocks fit in {gpu_memory_utilization:.0%} of GPU memory "
                f"after the weights and activations ({peak / 2**30:.1f} GiB); one sequence of "
                f"max_model_len {c.max_model_len} needs {c.max_blocks_per_seq}. Lower "
                "max_model_len or raise llm.cache.gpu_memory_utilization")
        return int(blocks)
    want = max_num_seqs * c.max_blocks_per_seq
    return int(max(c.max_blocks_per_seq, min(want, CPU_CACHE_BUDGET_BYTES // per_block)))
