"""Timing helpers: device ceilings measured in the same run, and CUDA-event medians."""
from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

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
    # A bound partial, not a lambda: the buffers are deleted below, once timed.
    ms = time_ms(functools.partial(dst.copy_, src), warmup=3, iters=20)
    copy = 2 * src.numel() * src.element_size() / (ms * 1e-3) / 1e9
    del src, dst
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = time_ms(lambda: a @ b, warmup=3, iters=20)
    tflops = 2 * 8192 ** 3 / (ms * 1e-3) / 1e12
    return Ceilings(copy, tflops)


_COLD_BYTES = 256 << 20  # weight bytes one cold chain reads: several times any L2 (50-60 MB)
_MAX_COLD_CHAIN = 64


def cold_copies(shape: tuple[int, ...], dtype: torch.dtype = torch.bfloat16) -> list[torch.Tensor]:
    """Random CUDA tensors of ``shape``, enough of them to pass 256 MB (2 to 64 copies).

    A decode step streams gigabytes of weights, so no linear finds its weight in L2; timing one
    weight again and again would measure L2 for every weight under ~50 MB. Time a call per copy
    with :func:`cold_ms` instead.
    """
    nbytes = dtype.itemsize
    for dim in shape:
        nbytes *= dim
    count = max(2, min(_MAX_COLD_CHAIN, -(-_COLD_BYTES // max(nbytes, 1))))
    return [torch.randn(shape, device="cuda", dtype=dtype) for _ in range(count)]


def cold_ms(fn: Callable[[torch.Tensor], object], copies: list[torch.Tensor],
            iters: int = 10) -> float:
    """Device milliseconds per call of ``fn(copy)``: one CUDA graph calls it on every copy in
    turn, so each call reads its operand from HBM and the graph launch is spread over the chain."""
    def chain():
        for c in copies:
            fn(c)
    return time_ms(chain, warmup=2, iters=iters, graph=True) / len(copies)
