"""One line per kernel from an Nsight Compute CSV: ``python -m tgraph.bench.ncu_table FILE.csv``.

``ncu --csv --page details`` writes one row per (kernel, metric); this folds them into a table of
the numbers that explain a decode kernel's time: duration, DRAM throughput, L2 hit rate, achieved
and theoretical occupancy, registers, waves, shared memory. Produce the CSV with
``tgraph.bench.profile --ncu`` (one decode step between ``cudaProfilerStart`` / ``Stop``)::

    ncu --profile-from-start off --clock-control none --launch-count 11 \\
        --section SpeedOfLight --section LaunchStats --section Occupancy \\
        --section MemoryWorkloadAnalysis --csv --page details \\
        python -m tgraph.bench.profile qwen2.5-0.5b --batch 1 --ncu > step.csv
"""
from __future__ import annotations

import argparse
import csv
import io
from dataclasses import dataclass, field

__all__ = ["KernelMetrics", "COLUMNS", "parse_ncu_csv", "format_table"]

# (ncu metric name, column header) in print order.
COLUMNS: tuple[tuple[str, str], ...] = (
    ("Duration", "us"),
    ("DRAM Throughput", "DRAM %"),
    ("L2 Hit Rate", "L2 hit %"),
    ("Achieved Occupancy", "occ %"),
    ("Theoretical Occupancy", "max occ %"),
    ("Registers Per Thread", "regs"),
    ("Waves Per SM", "waves"),
    ("Dynamic Shared Memory Per Block", "smem B"),
)
_REQUIRED = ("ID", "Kernel Name", "Grid Size", "Block Size", "Metric Name", "Metric Unit",
             "Metric Value")


@dataclass
class KernelMetrics:
    """The metrics ncu reported for one profiled kernel launch."""

    launch: int
    name: str
    grid: str
    block: str
    metrics: dict[str, tuple[str, str]] = field(default_factory=dict)  # name -> (value, unit)

    def value(self, metric: str) -> float | None:
        """The metric as a number (durations in microseconds), or None if absent or not numeric."""
        if metric not in self.metrics:
            return None
        text, unit = self.metrics[metric]
        try:
            number = float(text.replace(",", ""))
        except ValueError:
            return None
        scale = {"ns": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}
        return number * scale.get(unit, 1.0) if metric == "Duration" else number


def parse_ncu_csv(text: str) -> list[KernelMetrics]:
    """The kernels of an ``ncu --csv --page details`` report, in launch order.

    Lines before the CSV header (ncu's ``==PROF==`` messages, the program's own output) are
    skipped.

    Raises:
        ValueError: no header with the columns ncu's details page has, or a row of another width.
    """
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        raise ValueError("not an ncu details CSV: no header line starting with \"ID\" "
                         "(write it with ncu --csv --page details)")
    reader = csv.reader(io.StringIO("\n".join(lines[start:])))
    header = next(reader)
    missing = [c for c in _REQUIRED if c not in header]
    if missing:
        raise ValueError(f"ncu CSV header lacks the columns {missing}")
    col = {name: header.index(name) for name in _REQUIRED}
    kernels: dict[int, KernelMetrics] = {}
    for n, row in enumerate(reader, start=start + 2):
        if not row:
            continue
        if len(row) <= max(col.values()):
            raise ValueError(f"ncu CSV line {n}: {len(row)} fields, expected at least "
                             f"{max(col.values()) + 1}")
        launch = int(row[col["ID"]])
        k = kernels.get(launch)
        if k is None:
            k = kernels[launch] = KernelMetrics(launch, row[col["Kernel Name"]],
                                                row[col["Grid Size"]], row[col["Block Size"]])
        if row[col["Metric Name"]]:
            k.metrics[row[col["Metric Name"]]] = (row[col["Metric Value"]], row[col["Metric Unit"]])
    return [kernels[i] for i in sorted(kernels)]


def format_table(kernels: list[KernelMetrics], name_width: int = 28) -> str:
    """The kernels as a fixed-width table, one per line (``-`` where a metric is missing)."""
    heads = ["#".rjust(3), "kernel".ljust(name_width), "grid".ljust(14), "block".ljust(12)]
    heads += [h.rjust(9) for _, h in COLUMNS]
    out = ["  ".join(heads)]
    for k in kernels:
        cells = [str(k.launch).rjust(3), k.name[:name_width].ljust(name_width), k.grid.ljust(14),
                 k.block.ljust(12)]
        for metric, _ in COLUMNS:
            v = k.value(metric)
            cells.append(("-" if v is None else f"{v:.2f}" if v % 1 else f"{v:.0f}").rjust(9))
        out.append("  ".join(cells))
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv", help="ncu --csv --page details output")
    args = parser.parse_args()
    with open(args.csv, encoding="utf-8", errors="replace") as f:
        kernels = parse_ncu_csv(f.read())
    print(format_table(kernels))


if __name__ == "__main__":
    main()
