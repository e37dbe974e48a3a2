"""The grouped-MoE sweep (``python -m tgraph.bench.tune_moe``) on a tiny layer (GPU only)."""
from __future__ import annotations

import sys

import pytest

pytestmark = pytest.mark.gpu


def test_the_sweep_times_each_candidate_and_both_groupings(monkeypatch, capsys):
    from tgraph.bench import tune_moe

    monkeypatch.setattr(sys, "argv", ["tune_moe", "--shape", "8,64,32,2", "--tokens", "12",
                                      "--block-n", "32", "--block-k", "32", "--warps", "4",
                                      "--stages", "2", "--tma", "0", "1"])
    tune_moe.main()
    out = capsys.readouterr().out
    assert "grouping (atomics)" in out and "grouping (one program)" in out
    assert out.count(" us (") == 2  # one line per candidate: tma 0 and 1
