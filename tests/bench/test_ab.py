"""The A/B tool's ``--set`` overrides: parsed strictly, applied only while variant B is built."""
from __future__ import annotations

import pytest

from tgraph.bench.ab import overridden, parse_override
from tgraph.kernels.triton import attention_decode


def test_override_is_applied_and_restored():
    before = attention_decode.MIN_KEYS_PER_SPLIT
    spec = parse_override("tgraph.kernels.triton.attention_decode.MIN_KEYS_PER_SPLIT=100000")
    assert spec == (attention_decode, "MIN_KEYS_PER_SPLIT", 100000)
    with overridden([spec]):
        assert attention_decode.MIN_KEYS_PER_SPLIT == 100000
        assert attention_decode.choose_num_splits(1, 8, 4096) == 1
    assert attention_decode.MIN_KEYS_PER_SPLIT == before


@pytest.mark.parametrize("text, message", [
    ("MIN_KEYS_PER_SPLIT", "MODULE.NAME=VALUE"),
    ("tgraph.kernels.triton.attention_decode.NOPE=1", "no attribute 'NOPE'"),
    ("tgraph.kernels.triton.attention_decode.MAX_SPLITS=many", "not a Python literal"),
])
def test_bad_overrides_are_refused(text, message):
    with pytest.raises(SystemExit, match=message):
        parse_override(text)
