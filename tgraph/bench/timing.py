"""Timing helpers: device ceilings measured in the same run, and CUDA-event medians."""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch


def host_ms(fn: Callable[[], object], iters: int = 20) -> float:
    """Median CPU milliseconds of ``fn`` started on an idle GPU (its host overhead)."""
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    torch.cuda.synchronize()
    return sorted(times)[len(times) // 2]


def time_ms(fn: Callable[[], object], warmup: int = 5, iters: int = 50,
            graph: bool = False) -> float:
    """Median milliseconds of ``fn`` over ``iters`` runs, timed with CUDA events.

    With ``graph`` the call is captured once into a CUDA graph and the replays are timed, which
    removes launch gaps (what a decode step under CUDA graphs sees).
    """
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    if graph:
        g = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(g):
            fn()
        run = g.replay
    else:
        run = fn
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


@dataclass
class Ceilings:
    copy_gbps: float  # bytes read + written per second / 1e9
    matmul_tflops: float


def measure_ceilings() -> Ceilings:
    """A 2 GiB device-to-device copy and an 8192^3 bf16 matmul on random data."""
    n = 1 << 30  # 1 Gi bf16 elements = 2 GiB
    src = torch.randn(n // 2, device="cuda", dtype=torch.float32).view(torch.bfloat16)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), warmup=3, iters=20)
    copy = 2 * src.numel() * src.element_size() / (ms * 1e-3) / 1e9
    del src, dst
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = time_ms(lambda: a @ b, warmup=3, iters=20)
    tflops = 2 * 8192 ** 3 / (ms * 1e-3) / 1e12
    return Ceilings(copy, tflops)
