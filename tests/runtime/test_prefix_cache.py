"""End-to-end tests of prefix caching through :class:`tgraph.runtime.llm.LLM` on a tiny model.

Requests share a long system prompt; a run with the prefix cache must give exactly the greedy
tokens of a run without it (fp32 on CPU, where the two paths compute the same attention over the
same keys and values, only read from other blocks), while prefilling fewer tokens. The cache is
small and the token budget low, so the run also goes through chunked prefill and preemption.
The scheduler-level and block-level behaviour is tested in test_scheduler.py and
test_block_manager.py.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tgraph.runtime.llm import LLM
from tgraph.runtime.sampling_params import SamplingParams
from tgraph.testing import make_tiny_hf_model

BLOCK_SIZE = 4
SYSTEM = [(7 * i + 3) % 200 + 1 for i in range(24)]  # 6 full blocks
FIRST = SYSTEM + [5, 6]
LATER = [SYSTEM + [9], SYSTEM + [10, 11, 12], SYSTEM + [13, 14, 15, 16, 17]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
BUDGET = 8  # max_num_batched_tokens: every prompt is prefilled in chunks
NUM_BLOCKS = 12  # 48 token slots: the three later requests cannot all stay, so one is preempted


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_hf_model("llama", tmp_path_factory.mktemp("prefix-llama"), seed=3)


def _run(path: Path, graph: str, prefix_caching: bool
         ) -> tuple[list[list[int]], list[tuple[tuple[int, ...], int, int]], Any]:
    """Generate FIRST, then the LATER prompts together; returns their tokens, every prefill
    chunk as (prompt, start, length), and the scheduler's final stats."""
    llm = LLM(path, device="cpu", dtype="float32", graph=graph, max_model_len=64,
              block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, max_num_batched_tokens=BUDGET,
              **{"llm.cache.prefix_caching": prefix_caching})
    sched = llm.engine.scheduler
    chunks: list[tuple[tuple[int, ...], int, int]] = []
    schedule = sched.schedule

    def recording_schedule():
        out = schedule()
        chunks.extend((tuple(p.request.prompt_token_ids), p.start, p.query_len)
                      for p in out.prefills)
        return out

    sched.schedule = recording_schedule  # the engine's loop calls it through the instance
    try:
        tokens = [o.token_ids for o in llm.generate([FIRST], GREEDY)]
        tokens += [o.token_ids for o in llm.generate(LATER, GREEDY)]
        return tokens, chunks, sched.stats()
    finally:
        llm.close()


@pytest.mark.parametrize("graph", ["static", "eager"])
def test_prefix_cache_gives_the_same_tokens_and_skips_the_shared_prefill(
        llama_dir: Path, graph: str) -> None:
    tokens, chunks, stats = _run(llama_dir, graph, prefix_caching=True)
    ref_tokens, ref_chunks, ref_stats = _run(llama_dir, graph, prefix_caching=False)

    assert tokens == ref_tokens
    assert len({tuple(t) for t in ref_tokens}) > 1  # the prompts' outputs differ
    # chunked prefill and preemption happened with the cache on
    assert all(n <= BUDGET for _, _, n in chunks) and max(n for _, _, n in chunks) == BUDGET
    assert stats.preemptions > 0
    # the switch turns the cache off: nothing is looked up
    assert (ref_stats.prefix_cache_queries, ref_stats.prefix_cache_hits) == (0, 0)
    # with it, each later prompt's first chunk starts after the system prompt: its 6 blocks,
    # written by FIRST, are read from the cache
    first_chunk = {}
    for prompt, start, _ in chunks:
        first_chunk.setdefault(prompt, start)
    assert first_chunk[tuple(FIRST)] == 0
    assert [first_chunk[tuple(p)] for p in LATER] == [len(SYSTEM)] * len(LATER)
    assert stats.prefix_cache_hits >= len(SYSTEM) * len(LATER)
    assert stats.prefix_cache_hits <= stats.prefix_cache_queries
    assert sum(n for _, _, n in chunks) < sum(n for _, _, n in ref_chunks)
    assert stats.kv_blocks_used == 0 and stats.kv_blocks_total == NUM_BLOCKS
