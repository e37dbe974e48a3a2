"""One rank of the peer-memory all-reduce GPU check (run under torchrun by
test_peer_allreduce_gpu.py): the kernel against NCCL (+ the add_rms_norm kernel), eager and
replayed from a CUDA graph with new inputs each replay; rank 0 writes the findings as JSON."""
from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from tgraph.kernels.triton.norms import add_rms_norm
from tgraph.kernels.triton.peer_allreduce import fits_polled, peer_all_reduce
from tgraph.kernels.triton_backend.peer_memory import peer_buffers, release_peer_buffers
from tgraph.nn import distributed
from tgraph.tuning import AllReduceTuning

CASES = [(1, 4096, torch.bfloat16), (16, 4096, torch.bfloat16), (64, 8192, torch.bfloat16),
         (3, 2048, torch.float32), (130, 1024, torch.float16)]
EPS = 1e-5


def _reference(x, residual, weight, norm):
    reduced = x.clone()
    dist.all_reduce(reduced)
    if not norm:
        return reduced, None
    out, res_out = torch.empty_like(x), torch.empty_like(x)
    add_rms_norm(reduced, residual, weight, EPS, out, res_out)
    return out, res_out


def _same_on_every_rank(t: torch.Tensor) -> bool:
    every = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(every, t.contiguous())
    return all(torch.equal(every[0], e) for e in every)


def _check(buffers, rows, n, dtype, path, norm, gen) -> dict:
    """One case: eager, then three replays of a graph of two calls with new inputs."""
    dev = buffers.bases.device
    mode = dict(two_shot=path == "two-shot", polled=path == "polled")

    def make():
        return torch.randn(rows, n, device=dev, generator=gen).to(dtype)

    residual = torch.randn(rows, n, device=dev).to(dtype)
    dist.broadcast(residual, 0)
    weight = torch.ones(n, device=dev, dtype=dtype) + 0.01
    x = make()
    out, res_out = torch.empty_like(x), torch.empty_like(x)
    kw = dict(residual=residual, weight=weight, eps=EPS, residual_out=res_out) if norm else {}
    diffs, identical = [], True
    peer_all_reduce(buffers, x, out, **mode, **kw)
    ref, ref_res = _reference(x, residual, weight, norm)
    diffs.append((out.float() - ref.float()).abs().max().item())
    if norm:
        diffs.append((res_out.float() - ref_res.float()).abs().max().item())
    identical &= _same_on_every_rank(out)
    x2 = make()
    out2 = torch.empty_like(x)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        peer_all_reduce(buffers, x, out, **mode, **kw)
        peer_all_reduce(buffers, x2, out2, **mode)
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        peer_all_reduce(buffers, x, out, **mode, **kw)
        peer_all_reduce(buffers, x2, out2, **mode)
    for _ in range(3):
        x.copy_(make())
        x2.copy_(make())
        graph.replay()
        torch.cuda.synchronize()
        ref, _ = _reference(x, residual, weight, norm)
        ref2, _ = _reference(x2, residual, weight, False)
        diffs.append((out.float() - ref.float()).abs().max().item())
        diffs.append((out2.float() - ref2.float()).abs().max().item())
        identical &= _same_on_every_rank(out) and _same_on_every_rank(out2)
    del graph
    return {"rows": rows, "n": n, "dtype": str(dtype), "path": path, "norm": norm,
            "max_diff": max(diffs), "identical": identical}


def main(out_path: str) -> None:
    info = distributed.init_process_group()
    dev = info.device
    found = {"peer": True, "cases": []}
    gen = torch.Generator(device=dev).manual_seed(1 + info.rank)
    for rows, n, dtype in CASES:
        buffers = peer_buffers(torch.empty(1, dtype=dtype, device=dev), AllReduceTuning())
        if buffers is None:
            found["peer"] = False
            break
        for path in ("one-shot", "two-shot", "polled"):
            if path == "polled" and not fits_polled(buffers, torch.empty(rows, n, dtype=dtype)):
                continue
            for norm in (False, True):
                found["cases"].append(_check(buffers, rows, n, dtype, path, norm, gen))
    if info.rank == 0:
        found["world_size"] = info.world_size
        with open(out_path, "w") as f:
            json.dump(found, f)
    release_peer_buffers()
    distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
