"""All-reduce latency by message size: NCCL against the peer-memory kernel's polled one-shot
(up to 1 MB), one-shot and two-shot forms, each timed inside a CUDA graph of back-to-back calls
(as a decode step replays them)::

    torchrun --nproc-per-node N -m tgraph.bench.allreduce [--dtype bf16] [--sizes KB ...]

Rank 0 prints microseconds per call and which path ``llm.engine.tuning.all_reduce``'s defaults
pick at each size. Two-shot is timed only from 2 ranks and for messages whose rows split.
"""
from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from tgraph.kernels.triton.peer_allreduce import fits_polled, peer_all_reduce
from tgraph.kernels.triton_backend.peer_memory import (
    path_for,
    peer_buffers,
    release_peer_buffers,
)
from tgraph.nn import distributed
from tgraph.tuning import AllReduceTuning

CALLS_PER_GRAPH = 20
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _graph_us(fn: Callable[[], None], replays: int = 20) -> float:
    """Microseconds per call of ``fn`` captured ``CALLS_PER_GRAPH`` times in one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS_PER_GRAPH):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays * CALLS_PER_GRAPH)


def main(sizes_kb: Sequence[int], dtype: torch.dtype, hidden: int = 4096) -> None:
    """Print NCCL / one-shot / two-shot microseconds per call for each message size."""
    info = distributed.init_process_group()
    largest = max(sizes_kb) * 1024
    tuning = AllReduceTuning(polled_max_bytes=min(largest, 1024 * 1024),
                             one_shot_max_bytes=largest, two_shot_max_bytes=largest)
    device = info.device
    probe = torch.empty(1, hidden, dtype=dtype, device=device)
    buffers = peer_buffers(probe, tuning)
    defaults = AllReduceTuning()
    rows_out = []
    for kb in sizes_kb:
        rows = max(1, kb * 1024 // (hidden * probe.element_size()))
        x = torch.randn(rows, hidden, dtype=dtype, device=device)
        out = torch.empty_like(x)
        nccl_buf = torch.empty_like(x)

        def nccl() -> None:
            nccl_buf.copy_(x)
            dist.all_reduce(nccl_buf)

        timings = {"nccl": _graph_us(nccl)}
        if buffers is not None:
            if fits_polled(buffers, x):
                timings["polled"] = _graph_us(
                    lambda: peer_all_reduce(buffers, x, out, polled=True))
            timings["one-shot"] = _graph_us(lambda: peer_all_reduce(buffers, x, out))
            if info.world_size > 1:
                timings["two-shot"] = _graph_us(
                    lambda: peer_all_reduce(buffers, x, out, two_shot=True))
        nbytes = x.numel() * x.element_size()
        rows_out.append((nbytes, rows, timings, path_for(nbytes, defaults)))
    if info.rank == 0:
        print(f"all-reduce, {info.world_size} ranks, {str(dtype).removeprefix('torch.')}, rows "
              f"of {hidden}; us per call inside a CUDA graph"
              + ("" if buffers is not None else " (no peer memory here: NCCL only)"))
        for nbytes, rows, timings, pick in rows_out:
            cells = "  ".join(f"{k} {v:7.1f}" for k, v in timings.items())
            print(f"  {nbytes / 1024:8.0f} KB ({rows:4d} rows): {cells}   default: {pick}")
    release_peer_buffers()
    distributed.destroy_process_group()


def _parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="torchrun --nproc-per-node N -m tgraph.bench.allreduce")
    parser.add_argument("--sizes", nargs="+", type=int,
                        default=[8, 32, 64, 128, 256, 512, 1024, 2048, 4096],
                        help="message sizes in KB")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--hidden", type=int, default=4096, help="row length")
    return parser.parse_args(argv)


if __name__ == "__main__":
    args = _parse()
    main(args.sizes, DTYPES[args.dtype], args.hidden)
