"""Folding an Nsight Compute details CSV into one line per kernel (no GPU needed).

The sample is real ncu output (H100, one Qwen2.5-0.5B batch-1 decode step), cut to two
kernels: the q|k|v projection (launch 3) and gate|up (launch 8)."""
from __future__ import annotations

from pathlib import Path

import pytest

from tgraph.bench.ncu_table import format_table, parse_ncu_csv

SAMPLE = Path(__file__).parent / "data" / "ncu_qwen_b1_sample.csv"


def test_sample_folds_into_two_kernels_with_their_metrics():
    kernels = parse_ncu_csv(SAMPLE.read_text())
    assert [k.launch for k in kernels] == [3, 8]
    qkv, gate_up = kernels
    assert qkv.name == gate_up.name == "_small_m_linear_kernel"
    assert (qkv.grid, gate_up.grid) == ("(288, 1, 1)", "(2432, 1, 1)")
    # "4,608" ns -> 4.608 us; thousands separators and units handled.
    assert qkv.value("Duration") == pytest.approx(4.608)
    assert gate_up.value("Duration") == pytest.approx(10.08)
    assert gate_up.value("Registers Per Thread") == 72
    assert gate_up.value("Waves Per SM") == pytest.approx(2.63)
    assert gate_up.value("DRAM Throughput") == pytest.approx(51.72)
    assert qkv.value("Not A Metric") is None


def test_table_has_a_line_per_kernel_and_dashes_for_missing_metrics():
    kernels = parse_ncu_csv(SAMPLE.read_text())
    del kernels[0].metrics["L2 Hit Rate"]
    lines = format_table(kernels).splitlines()
    assert len(lines) == 3 and lines[0].split()[:2] == ["#", "kernel"]
    assert lines[1].split()[0] == "3" and " - " in lines[1]
    assert "2432" in lines[2] and "10.08" in lines[2] and "72" in lines[2].split()


def test_text_without_the_details_header_is_refused():
    with pytest.raises(ValueError, match="not an ncu details CSV"):
        parse_ncu_csv("==PROF== Connected\nsome program output\n")


def test_header_without_metric_columns_is_refused():
    with pytest.raises(ValueError, match="lacks the columns"):
        parse_ncu_csv('"ID","Kernel Name"\n"0","k"\n')


def test_truncated_row_is_refused_with_its_line():
    text = SAMPLE.read_text().splitlines()
    header_at = next(i for i, line in enumerate(text) if line.startswith('"ID"'))
    text.insert(header_at + 1, '"3","694","python3.12"')
    with pytest.raises(ValueError, match=rf"line {header_at + 2}: 3 fields"):
        parse_ncu_csv("\n".join(text))
