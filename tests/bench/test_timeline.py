"""The decode-step timeline's trace parsing and time attribution (synthetic traces, no GPU)."""
from __future__ import annotations

import pytest

from tgraph.bench.timeline import (
    Kernel,
    advances,
    by_kind,
    kernels_of_trace,
    short_name,
    split_steps,
    summarise,
)


def _trace(kernels):
    events = [{"cat": "cpu_op", "name": "aten::mm", "ts": 0.0, "dur": 5.0}]
    events += [{"cat": "kernel", "name": n, "ts": ts, "dur": d} for n, ts, d in kernels]
    return {"traceEvents": events}


def test_kernels_are_read_in_start_order_and_other_events_ignored():
    trace = _trace([("b", 10.0, 2.0), ("a", 1.0, 3.0)])
    assert [k.name for k in kernels_of_trace(trace)] == ["a", "b"]
    assert kernels_of_trace({}) == []


def test_advances_sum_to_the_span_with_gaps_and_overlaps():
    # a: 0-10; b overlaps a (PDL) and ends at 12; gap; c: 15-20; d runs inside c's window.
    step = [Kernel("a", 0, 10), Kernel("b", 8, 4), Kernel("c", 15, 5), Kernel("d", 16, 2)]
    adv = advances(step)
    assert adv == [10, 2, 8, 0]
    assert sum(adv) == max(k.end for k in step) - step[0].start


def test_split_steps_refuses_steps_of_different_kernels():
    ks = [Kernel("a", i, 1) for i in range(6)]
    assert [len(s) for s in split_steps(ks, 3)] == [2, 2, 2]
    with pytest.raises(ValueError, match="7 kernels do not divide into 3 steps"):
        split_steps(ks + [Kernel("x", 9, 1)], 3)


def test_summarise_takes_medians_per_position_and_sums_by_kind():
    steps = [[Kernel("gemv_0d1d2d", 100 * s, 4 + s), Kernel("norm", 100 * s + 6 + s, 2)]
             for s in range(3)]
    rows = summarise(steps)
    assert [r["name"] for r in rows] == ["gemv", "norm"]
    assert rows[0]["duration_us"] == 5 and rows[1]["advance_us"] == 4
    kinds = by_kind(rows + [dict(rows[1], index=2)])
    assert kinds[0]["name"] == "norm" and kinds[0]["count"] == 2 and kinds[0]["advance_us"] == 8


def test_short_name_drops_templates_and_arguments():
    assert short_name("void gemm<float, 128>(Params)") == "void gemm"
    assert len(short_name("k" * 80)) == 48
