"""The decode / prefill profiler's argument handling and its prefill batch (no GPU needed)."""
from __future__ import annotations

import pytest

from tgraph.bench.models import prefill_batch
from tgraph.bench.profile import profile_prefill


@pytest.mark.parametrize("shape", ["2048", "1x", "ax2048", "1x2x3"])
def test_prefill_shape_must_be_n_x_l(shape):
    # Refused before the model is touched.
    with pytest.raises(SystemExit, match="--prefill expects NxL"):
        profile_prefill(None, "llama-3.2-1b", shape, None)


def test_prefill_batch_puts_each_prompt_in_its_own_blocks():
    meta = prefill_batch(2, 5, block_size=4)
    assert meta.is_prefill and meta.query_lens == [5, 5] and meta.seq_len == [5, 5]
    assert meta.block_table == [[0, 1], [2, 3]]
    assert meta.position_ids == [0, 1, 2, 3, 4] * 2
    # Token p of prompt i sits at slot block_table[i][p // 4] * 4 + p % 4.
    assert meta.slots_mapping == [0, 1, 2, 3, 4, 8, 9, 10, 11, 12]


def test_profiled_step_runs_exactly_one_step_inside_the_profiler_range(monkeypatch):
    import torch

    from tgraph.bench.profile import profiled_step

    events = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda.profiler, "start", lambda: events.append("start"))
    monkeypatch.setattr(torch.cuda.profiler, "stop", lambda: events.append("stop"))
    profiled_step(lambda: events.append("step"), warmup=2)
    assert events == ["step", "step", "start", "step", "stop"]


def test_profiled_step_stops_the_profiler_when_the_step_fails(monkeypatch):
    import torch

    from tgraph.bench.profile import profiled_step

    events = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda.profiler, "start", lambda: events.append("start"))
    monkeypatch.setattr(torch.cuda.profiler, "stop", lambda: events.append("stop"))

    def step():
        if "start" in events:
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        profiled_step(step, warmup=1)
    assert events == ["start", "stop"]


def test_quant_takes_only_the_bench_schemes(monkeypatch, capsys):
    import sys

    from tgraph.bench import profile

    monkeypatch.setattr(sys, "argv", ["profile", "llama-3.2-1b", "--quant", "int5"])
    with pytest.raises(SystemExit):  # refused by the parser, before any weight is made
        profile.main()
    assert "invalid choice: 'int5'" in capsys.readouterr().err
