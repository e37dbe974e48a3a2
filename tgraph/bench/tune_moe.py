"""Sweep the grouped MoE GEMM's launch settings at one layer's real shapes (run on a GPU).

``python -m tgraph.bench.tune_moe [--shape E,H,I,TOP_K] [--tokens 16 64] [--block-n ...]
[--block-k ...] [--warps ...] [--stages ...] [--tma 0 1] [--one-program-max-pairs N]``
(each list replaces that axis of the default search space; the default shape is
Qwen3-30B-A3B's: 128 experts of 768, hidden 2048, top 8).

Each candidate runs :func:`~tgraph.kernels.triton.moe_grouped.moe_grouped_shares` (routing,
grouping, gate|up with SwiGLU, down with the routing weight) on bf16 experts in a CUDA graph
over enough layer copies that every call reads its experts cold, and prints microseconds per
layer and the fraction of the copy bandwidth (measured in the same run) that reading the
experts the tokens picked would take. The grouping alone is timed both ways first (atomics,
and one program: ``MoeTuning.group_one_program_max_pairs``).
"""
from __future__ import annotations

import argparse
import itertools

import torch

from tgraph.bench.timing import measure_ceilings, time_ms
from tgraph.kernels.triton.moe_grouped import moe_grouped_shares
from tgraph.kernels.triton.moe_routing import route_topk, sort_by_expert

AXES = {"block_n": (64, 128), "block_k": (64, 128, 256), "warps": (4, 8), "stages": (3, 4),
        "tma": (0, 1)}
_L2_BYTES = 256 << 20  # layer copies are made until the sweep reads this much per call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="128,2048,768,8", help="E,H,I,TOP_K")
    parser.add_argument("--tokens", nargs="*", type=int, default=[16, 64])
    for axis in AXES:
        parser.add_argument(f"--{axis.replace('_', '-')}", nargs="*", type=int)
    parser.add_argument("--one-program-max-pairs", type=int, default=0)
    args = parser.parse_args()
    try:
        experts, hidden, inter, top_k = (int(v) for v in args.shape.split(","))
    except ValueError:
        parser.error(f"--shape expects four integers E,H,I,TOP_K, got {args.shape!r}")
    gbps = measure_ceilings().copy_gbps
    layer_bytes = 3 * experts * hidden * inter * 2
    copies = max(1, -(-_L2_BYTES // layer_bytes))
    w13 = [torch.randn(experts, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16) * 0.02
           for _ in range(copies)]
    w2 = [torch.randn(experts, hidden, inter, device="cuda", dtype=torch.bfloat16) * 0.02
          for _ in range(copies)]
    print(f"experts {experts} x {inter}, hidden {hidden}, top {top_k}; copy {gbps:.0f} GB/s; "
          f"{copies} layer copies")
    space = list(itertools.product(*(getattr(args, a) or AXES[a] for a in AXES)))
    for tokens in args.tokens:
        x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
        logits = torch.randn(tokens, experts, device="cuda", dtype=torch.float32)
        _, ids = route_topk(logits, top_k, True)
        picked = ids.unique().numel()
        bound_us = picked * 3 * hidden * inter * 2 / (gbps * 1e3)
        print(f"\n{tokens} tokens: {picked} experts picked, their bytes take {bound_us:.1f} us")
        for one in (0, tokens * top_k):
            us = time_ms(lambda one=one: [sort_by_expert(ids, experts, 16, one)
                                          for _ in range(20)], graph=True) * 1e3 / 20
            print(f"  grouping ({'one program' if one else 'atomics'}): {us:.1f} us")
        for block_n, block_k, warps, stages, tma in space:
            def layer(block_n=block_n, block_k=block_k, warps=warps, stages=stages, tma=tma):
                for c in range(copies):
                    moe_grouped_shares(x, logits, w13[c], w2[c], top_k, True, block_n=block_n,
                                       block_k=block_k, num_warps=warps, num_stages=stages,
                                       one_program_max_pairs=args.one_program_max_pairs,
                                       tma_weights=bool(tma))
            label = f"  n {block_n:3d} k {block_k:3d} warps {warps} stages {stages} tma {tma}"
            try:
                us = time_ms(layer, graph=True, iters=20) * 1e3 / copies
            except Exception as err:  # a tile the device cannot hold: reported, not fatal
                print(f"{label}: {type(err).__name__}: {str(err)[:100]}")
                continue
            print(f"{label}: {us:7.1f} us ({bound_us / us:.0%} of copy)", flush=True)


if __name__ == "__main__":
    main()
