"""Sweep launch configurations of the small-M linear at real model shapes (run on a GPU).

``python -m tgraph.bench.tune_gemv [OUT.json] [--m 1,16] [--shapes N:K,...]``

The weights are read cold, as in a decode step (:func:`tgraph.bench.timing.cold_copies`): each
candidate is timed over a chain of launches inside one CUDA graph, each launch reading its own
copy of the weight.
Prints, per shape, the current heuristic, the best candidate and cuBLAS, as fractions of the
copy bandwidth measured in the same run.
"""
from __future__ import annotations

import argparse
import itertools
import json

import torch

from tgraph.bench.timing import cold_copies, cold_ms, measure_ceilings
from tgraph.kernels.triton.gemv import choose_config, small_m_linear

SHAPES = [  # (N, K): llama-3.2-1b, qwen2.5-0.5b, llama-3-8b linears
    (3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192), (128256, 2048),
    (1152, 896), (896, 896), (9728, 896), (896, 4864),
    (6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336),
]


def _space(m: int):
    if m == 1:
        return itertools.product((4, 8, 16), (512, 1024), (4, 8), (2, 3, 4), (1, 2))
    return itertools.product((16, 32, 64), (128, 256), (4,), (3, 4), (1, 2, 4))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", nargs="?")
    parser.add_argument("--m", default="1,16", help="row counts to sweep")
    parser.add_argument("--shapes", help="N:K pairs, comma separated (default: all presets')")
    args = parser.parse_args()
    shapes = ([tuple(int(v) for v in s.split(":")) for s in args.shapes.split(",")]
              if args.shapes else SHAPES)
    ceil = measure_ceilings()
    print(f"copy {ceil.copy_gbps:.0f} GB/s")
    results = []
    for m in (int(v) for v in args.m.split(",")):
        for n, k in shapes:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            weights = cold_copies((n, k))
            out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            nbytes = (n * k + m * k + m * n) * 2
            frac = lambda t: nbytes / (t * 1e-3) / 1e9 / ceil.copy_gbps  # noqa: E731
            cur = cold_ms(lambda w: small_m_linear(x, w, out), weights)
            cublas = cold_ms(lambda w: torch.mm(x, w.t(), out=out), weights)
            best = (cur, None)
            for bn, bk, warps, stages, split in _space(m):
                if split > 1 and bk * split > 2 * k:
                    continue
                ws = torch.empty(max(split * m * n, 1), device="cuda", dtype=torch.float32)
                cfg = (bn, bk, split, warps, stages)
                try:
                    t = cold_ms(lambda w: small_m_linear(x, w, out, workspace=ws, config=cfg),
                                weights)
                except Exception:
                    torch.cuda.synchronize()
                    continue
                if t < best[0]:
                    best = (t, cfg)
            row = dict(M=m, N=n, K=k, current=cur, current_cfg=choose_config(m, n, k, "cuda"),
                       best=best[0], best_cfg=best[1], cublas=cublas, chain=len(weights))
            results.append(row)
            print(f"M={m:<3} N={n:<7} K={k:<6} current {cur * 1e3:7.2f}us {frac(cur):5.1%}  "
                  f"best {best[0] * 1e3:7.2f}us {frac(best[0]):5.1%} {best[1]}  "
                  f"cublas {cublas * 1e3:7.2f}us {frac(cublas):5.1%}", flush=True)
            del weights
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main()
