"""Kernel timeline of one decode step: which kernel advances the step by how much.

A kernel table sorted by total time (``tgraph.bench.profile``) hides the cost that decides a
latency-bound step: the time between kernels. With programmatic dependent launch, kernels also
overlap, so a kernel's own duration includes the time it waited for its predecessor. This module
reads the kernels of profiled steps from a torch profiler trace and attributes the step's time by
*advance*: how much later kernel ``i`` ends than kernel ``i - 1`` (the advances of a step sum to
its span, overlaps and gaps included).

Use :func:`profile_step` on a GPU (``python -m tgraph.bench.profile PRESET --timeline``); the
parsing and summing functions are plain Python, tested on synthetic traces.
"""
from __future__ import annotations

import json
import os
import re
import statistics
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Kernel", "kernels_of_trace", "print_timeline", "profile_step", "short_name",
           "split_steps", "summarise"]


@dataclass(frozen=True)
class Kernel:
    """One kernel execution: ``name``, ``start`` and ``duration`` in microseconds."""

    name: str
    start: float
    duration: float

    @property
    def end(self) -> float:
        return self.start + self.duration


def kernels_of_trace(trace: dict[str, Any]) -> list[Kernel]:
    """The GPU kernels of a Chrome trace (``torch.profiler`` export), ordered by start time."""
    events = trace.get("traceEvents", []) if isinstance(trace, dict) else []
    kernels = [Kernel(str(e["name"]), float(e["ts"]), float(e.get("dur", 0.0)))
               for e in events if e.get("cat") == "kernel" and "ts" in e]
    return sorted(kernels, key=lambda k: k.start)


def split_steps(kernels: Sequence[Kernel], steps: int) -> list[list[Kernel]]:
    """Cut ``kernels`` of ``steps`` identical steps into one list per step.

    Raises:
        ValueError: the kernel count is not a multiple of ``steps`` (the steps differ).
    """
    if steps < 1 or len(kernels) % steps:
        raise ValueError(f"split_steps: {len(kernels)} kernels do not divide into {steps} steps "
                         "of the same kernels")
    per = len(kernels) // steps
    return [list(kernels[i * per:(i + 1) * per]) for i in range(steps)]


_TRITON_SUFFIX = re.compile(r"_\d+d\d+.*$|_0d1d.*$")


def short_name(name: str) -> str:
    """A kernel name without template arguments and Triton's specialisation suffix."""
    name = name.split("(")[0].split("<")[0]
    name = _TRITON_SUFFIX.sub("", name)
    return name if len(name) <= 48 else name[:45] + "..."


def advances(step: Sequence[Kernel]) -> list[float]:
    """Per kernel: its end minus the latest end before it (the first kernel: its duration)."""
    out, last_end = [], None
    for k in step:
        out.append(k.duration if last_end is None else max(k.end - last_end, 0.0))
        last_end = k.end if last_end is None else max(last_end, k.end)
    return out


def summarise(steps: Sequence[Sequence[Kernel]]) -> list[dict[str, Any]]:
    """Per kernel position: name, median duration and median advance over the steps (us)."""
    rows = []
    adv = [advances(s) for s in steps]
    for i, k in enumerate(steps[0]):
        rows.append({"index": i, "name": short_name(k.name),
                     "duration_us": statistics.median(s[i].duration for s in steps),
                     "advance_us": statistics.median(a[i] for a in adv)})
    return rows


def by_kind(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows of :func:`summarise` summed by kernel name, largest advance first."""
    kinds: dict[str, dict[str, Any]] = {}
    for r in rows:
        k = kinds.setdefault(r["name"], {"name": r["name"], "count": 0, "duration_us": 0.0,
                                         "advance_us": 0.0})
        k["count"] += 1
        k["duration_us"] += r["duration_us"]
        k["advance_us"] += r["advance_us"]
    return sorted(kinds.values(), key=lambda k: -k["advance_us"])


def print_timeline(rows: Sequence[dict[str, Any]], limit: int | None = 40) -> None:
    """Print the per-kernel rows (the first ``limit``), then the sums by kernel name."""
    span = sum(r["advance_us"] for r in rows)
    busy = sum(r["duration_us"] for r in rows)
    print(f"  step: {len(rows)} kernels, span {span:.1f} us (sum of advances), "
          f"sum of kernel durations {busy:.1f} us")
    print(f"  {'#':>4} {'kernel':<48} {'dur us':>8} {'adv us':>8}")
    for r in rows[:limit]:
        print(f"  {r['index']:>4} {r['name']:<48} {r['duration_us']:8.2f} {r['advance_us']:8.2f}")
    print(f"  {'kernel (all positions)':<48} {'count':>5} {'dur us':>9} {'adv us':>9} {'adv %':>6}")
    for k in by_kind(rows):
        print(f"  {k['name']:<48} {k['count']:>5} {k['duration_us']:9.1f} {k['advance_us']:9.1f} "
              f"{100 * k['advance_us'] / max(span, 1e-9):6.1f}")


def profile_step(step: Callable[[], object], steps: int = 10) -> list[dict[str, Any]]:
    """Profile ``steps`` calls of ``step`` on the GPU and summarise them (:func:`summarise`).

    Args:
        step: one decode step (e.g. a CUDA-graph replay, or ``model.run`` of a captured batch).
        steps: calls profiled; each must launch the same kernels.

    Returns:
        One row per kernel of the step.
    """
    import torch

    step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
            torch.cuda.synchronize()  # steps apart: no step's kernels overlap the next one's
    fd, path = tempfile.mkstemp(suffix=".json", prefix="tgraph-timeline-")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    finally:
        os.unlink(path)
    return summarise(split_steps(kernels_of_trace(trace), steps))
