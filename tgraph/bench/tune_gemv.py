"""Sweep launch configurations of the small-M linear at real model shapes (run on a GPU).

Each candidate is timed as 10 back-to-back launches inside one CUDA graph (device time per call,
below the ~10 us floor of timing one replayed launch). Prints, per shape, the current heuristic,
the best candidate and cuBLAS, as fractions of the copy bandwidth measured in the same run.
"""
from __future__ import annotations

import itertools
import json
import sys

import torch

from tgraph.bench.timing import measure_ceilings, time_ms
from tgraph.kernels.triton.gemv import choose_config, small_m_linear

SHAPES = [  # (N, K): llama-3.2-1b, qwen2.5-0.5b, llama-3-8b linears
    (3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192), (128256, 2048),
    (1152, 896), (896, 896), (9728, 896), (896, 4864),
    (6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336),
]


def per_call_ms(fn, reps: int = 10) -> float:
    def many():
        for _ in range(reps):
            fn()
    return time_ms(many, warmup=2, iters=20, graph=True) / reps


def main(ms_list=(1, 16)) -> None:
    ceil = measure_ceilings()
    print(f"copy {ceil.copy_gbps:.0f} GB/s")
    results = []
    for m in ms_list:
        if m == 1:
            space = list(itertools.product((8, 16, 32), (256, 512, 1024), (4, 8), (2, 3)))
        else:
            space = list(itertools.product((16, 32, 64), (64, 128, 256), (4, 8), (2, 3, 4)))
        for n, k in SHAPES:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
            out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            nbytes = (n * k + m * k + m * n) * 2
            frac = lambda t: nbytes / (t * 1e-3) / 1e9 / ceil.copy_gbps  # noqa: E731
            cur = per_call_ms(lambda: small_m_linear(x, w, out))
            cublas = per_call_ms(lambda: torch.mm(x, w.t(), out=out))
            best = (cur, None)
            for bn, bk, warps, stages in space:
                for split in (1, 2, 4, 8, 16):
                    if bk * split > 2 * k and split > 1:
                        continue
                    ws = torch.empty(max(split * m * n, 1), device="cuda", dtype=torch.float32)
                    cfg = (bn, bk, split, warps, stages)
                    try:
                        t = per_call_ms(lambda: small_m_linear(x, w, out, workspace=ws, config=cfg))
                    except Exception:
                        torch.cuda.synchronize()
                        continue
                    if t < best[0]:
                        best = (t, cfg)
            row = dict(M=m, N=n, K=k, current=cur, current_cfg=choose_config(m, n, k, "cuda"),
                       best=best[0], best_cfg=best[1], cublas=cublas)
            results.append(row)
            print(f"M={m:<3} N={n:<7} K={k:<6} current {cur * 1e3:7.2f}us {frac(cur):5.1%}  "
                  f"best {best[0] * 1e3:7.2f}us {frac(best[0]):5.1%} {best[1]}  "
                  f"cublas {cublas * 1e3:7.2f}us {frac(cublas):5.1%}", flush=True)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main()
