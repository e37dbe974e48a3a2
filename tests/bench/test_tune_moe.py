"""The grouped-MoE sweep (``python -m tgraph.bench.tune_moe``): its argument check, and a tiny
layer swept (GPU only)."""
from __future__ import annotations

import sys

import pytest


@pytest.mark.parametrize("shape", ["128,2048,768", "a,b,c,d"])
def test_a_bad_shape_is_refused_before_any_work(monkeypatch, capsys, shape):
    from tgraph.bench import tune_moe

    monkeypatch.setattr(sys, "argv", ["tune_moe", "--shape", shape])
    with pytest.raises(SystemExit):
        tune_moe.main()
    assert "--shape expects four integers E,H,I,TOP_K" in capsys.readouterr().err


@pytest.mark.gpu
def test_the_sweep_times_each_candidate_and_both_groupings(monkeypatch, capsys):
    from tgraph.bench import tune_moe

    monkeypatch.setattr(sys, "argv", ["tune_moe", "--shape", "8,64,32,2", "--tokens", "12",
                                      "--block-n", "32", "--block-k", "32", "--warps", "4",
                                      "--stages", "2", "--tma", "0", "1"])
    tune_moe.main()
    out = capsys.readouterr().out
    assert "grouping (atomics)" in out and "grouping (one program)" in out
    assert out.count(" us (") == 2  # one line per candidate: tma 0 and 1
