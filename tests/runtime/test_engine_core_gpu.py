"""On a GPU: ``close()`` and dropping the last reference give the KV cache back to the device, so
a second ``LLM`` in the same process sizes its cache as the first did; the engine thread's
captured decode graphs give the same tokens as a stream read at another pace."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tgraph.runtime.llm import LLM
from tgraph.runtime.sampling_params import SamplingParams
from tgraph.testing import make_tiny_hf_model

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = [[1, 5, 9, 22, 7], [3, 4], [17, 150, 8, 8, 8, 191, 0, 42]]
# The cache takes this fraction of the free memory; what the model and graphs take is small.
UTILIZATION = 0.3
# What may stay allocated: the engine thread's cuBLAS workspaces live as long as the process.
SLACK = 256 * 2**20


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_hf_model("llama", tmp_path_factory.mktemp("engine-gpu"), seed=0)


def _llm(path: Path) -> LLM:
    return LLM(path, device="cuda", dtype="bfloat16", max_model_len=256,
               max_num_batched_tokens=512, gpu_memory_utilization=UTILIZATION)


def test_close_gives_the_cache_back_and_a_second_llm_sizes_the_same(llama_dir: Path) -> None:
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    llm = _llm(llama_dir)
    blocks = llm.scheduler.allocator.num_blocks
    held = torch.cuda.memory_allocated() - before
    assert held > 2**30  # the cache is there: 30% of an H100/H200 is tens of GiB
    first = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    llm.close()
    assert torch.cuda.memory_allocated() - before < SLACK
    second = _llm(llama_dir)
    try:
        # sized from the same free memory, less what stays allocated (within SLACK)
        assert second.scheduler.allocator.num_blocks >= blocks * 0.99
        assert [o.token_ids for o in second.generate(PROMPTS, GREEDY)] == first
    finally:
        second.close()


def test_dropping_the_llm_frees_the_cache_without_the_collector(llama_dir: Path, no_gc) -> None:
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    llm = _llm(llama_dir)
    assert llm.generate(PROMPTS[0], GREEDY)[0].token_ids
    assert torch.cuda.memory_allocated() - before > 2**30
    del llm
    assert torch.cuda.memory_allocated() - before < SLACK


def test_a_slowly_read_stream_matches_generate_with_captured_graphs(llama_dir: Path) -> None:
    llm = _llm(llama_dir)
    try:
        alone = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
        stream = llm.stream(PROMPTS[0], GREEDY)
        first = next(stream)  # suspended while other requests run in the graphs
        others = [o.token_ids for o in llm.generate(PROMPTS[1:], GREEDY)]
        rest = [t for event in stream for t in event.token_ids]
        assert first.token_ids + rest == alone[0]
        assert others == alone[1:]
    finally:
        llm.close()
