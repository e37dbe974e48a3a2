"""``PagedBatcher.decode_fed``: decode steps on given tokens (tiny Llama, fp32, CPU)."""
from __future__ import annotations

import pytest
import torch

from tests.models.conftest import load_tiny
from tgraph.testing import PagedBatcher


def test_decode_fed_runs_the_steps_one_by_one_would(tiny_model):
    """The same logits as appending each fed token and running each decode step by hand, and
    the fed tokens end up in the sequences."""
    model = load_tiny(tiny_model("llama").path)
    prompts, fed = [[1, 5, 9, 22], [3, 4]], [[7, 8], [11, 12], [2, 40]]
    runs = []
    for by_hand in (False, True):
        b = PagedBatcher.for_model(model)
        ids = [b.add(p) for p in prompts]
        model.run(b.step(ids))
        if by_hand:
            rows = []
            for tokens in fed:
                for s, t in zip(ids, tokens):
                    b.append(s, t)
                rows.append(model.run(b.step(ids)).float().clone())
        else:
            rows = b.decode_fed(model, ids, fed)
        runs.append(torch.stack(rows))
        assert [b.tokens(s)[len(p):] for s, p in zip(ids, prompts)] == [[7, 11, 2], [8, 12, 40]]
    assert torch.equal(runs[0], runs[1])


def test_decode_fed_needs_prefilled_sequences(tiny_model):
    model = load_tiny(tiny_model("llama").path)
    b = PagedBatcher.for_model(model)
    ids = [b.add([1, 2, 3])]
    with pytest.raises(ValueError, match="prefilled first"):
        b.decode_fed(model, ids, [[5]])
