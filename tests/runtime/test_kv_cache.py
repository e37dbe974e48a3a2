from __future__ import annotations

import pytest

from tgraph.runtime.kv_cache import profile_batch


@pytest.mark.parametrize("tokens,max_len,block", [(4096, 256, 16), (100, 4096, 16), (33, 16, 4)])
def test_profile_batch_fits_the_model_limits(tokens, max_len, block):
    batch, blocks = profile_batch(tokens, max_len, block)
    batch.validate()
    assert batch.num_tokens == tokens
    assert all(q <= max_len for q in batch.query_lens)
    assert all(len(t) * block <= max_len + block - 1 for t in batch.block_table)
    used = sorted(b for t in batch.block_table for b in t)
    assert used == list(range(blocks))  # distinct blocks, all counted
    assert len(set(batch.slots_mapping)) == tokens
