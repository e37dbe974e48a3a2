"""Sweep launch configurations of the small-M linear at real model shapes (run on a GPU).

``python -m tgraph.bench.tune_gemv [OUT.json] [--m 1,16] [--shapes N:K,...] [--fusion F]
[--widths ...] [--block-k ...] [--warps ...] [--stages ...] [--splits ...] [--swap-min N]``
(each list replaces that axis of the default search space).

The weights are read cold, as in a decode step (:func:`tgraph.bench.timing.cold_copies`): each
candidate is timed over a chain of launches inside one CUDA graph, each launch reading its own
copy of the weight.
Prints, per shape, the current heuristic, the best candidate and cuBLAS, as fractions of the
copy bandwidth measured in the same run. ``--fusion`` times the decode fusions instead of the
plain linear: ``residual`` (added in the epilogue), ``norm`` (RMSNorm prologue), ``gated`` (SwiGLU
on a ``[2N, K]`` gate|up weight) or ``norm+gated``; cuBLAS then runs the plain GEMM of the same
weight (its separate norm / SwiGLU / residual kernels are not timed).
"""
from __future__ import annotations

import argparse
import itertools
import json

import torch

from tgraph.bench.timing import cold_copies, cold_ms, measure_ceilings
from tgraph.kernels.triton import gemv
from tgraph.kernels.triton.gemv import choose_config, small_m_linear
from tgraph.tuning import GemvTuning

SHAPES = [  # (N, K): llama-3.2-1b, qwen2.5-0.5b, llama-3-8b linears
    (3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192), (128256, 2048),
    (1152, 896), (896, 896), (9728, 896), (896, 4864),
    (6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336),
]


def _space(m: int, widths=None, block_ks=None, warps=None, stages=None, splits=None):
    """Candidate (BLOCK_N, BLOCK_K, num_warps, num_stages, split_k); None takes the default axis."""
    if m == 1:
        axes = ((4, 8, 16), (512, 1024), (4, 8), (2, 3, 4), (1, 2))
    else:
        # Output blocks of GemvTuning.swap_min_block_n or more swap the MMA operands.
        axes = ((16, 32, 64, 128), (128, 256), (4,), (3, 4), (1, 2, 4))
    given = (widths, block_ks, warps, stages, splits)
    return itertools.product(*(g or default for g, default in zip(given, axes)))


FUSIONS = ("plain", "residual", "norm", "gated", "norm+gated")


def _fusion_kwargs(fusion: str, m: int, n: int, k: int) -> dict:
    kwargs = {}
    if fusion == "residual":
        kwargs["residual"] = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    if "norm" in fusion:
        kwargs["norm_eps"] = 1e-5
        kwargs["norm_weight"] = torch.randn(k, device="cuda", dtype=torch.bfloat16)
    if "gated" in fusion:
        kwargs["gated"] = True
    return kwargs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", nargs="?")
    parser.add_argument("--m", default="1,16", help="row counts to sweep")
    parser.add_argument("--shapes", help="N:K pairs, comma separated (default: all presets')")
    parser.add_argument("--fusion", choices=FUSIONS, default="plain",
                        help="time this decode fusion (N counts output columns)")
    parser.add_argument("--widths", help="BLOCK_N values to sweep, comma separated")
    parser.add_argument("--block-k", help="BLOCK_K values to sweep, comma separated")
    parser.add_argument("--warps", help="num_warps values to sweep, comma separated")
    parser.add_argument("--stages", help="num_stages values to sweep, comma separated")
    parser.add_argument("--splits", help="split_k values to sweep, comma separated")
    parser.add_argument("--swap-min", type=int,
                        help="narrowest 16-row output block that swaps the MMA operands "
                             f"(default {GemvTuning().swap_min_block_n})")
    args = parser.parse_args()
    axes = [tuple(int(v) for v in given.split(",")) if given else None
            for given in (args.widths, args.block_k, args.warps, args.stages, args.splits)]
    tuning = GemvTuning() if args.swap_min is None else GemvTuning(swap_min_block_n=args.swap_min)
    shapes = ([tuple(int(v) for v in s.split(":")) for s in args.shapes.split(",")]
              if args.shapes else SHAPES)
    ceil = measure_ceilings()
    print(f"copy {ceil.copy_gbps:.0f} GB/s")
    results = []
    for m in (int(v) for v in args.m.split(",")):
        for n, k in shapes:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            gated = "gated" in args.fusion
            rows = 2 * n if gated else n
            weights = cold_copies((rows, k))
            out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            wide = torch.empty(m, rows, device="cuda", dtype=torch.bfloat16)
            kw = {**_fusion_kwargs(args.fusion, m, n, k), "tuning": tuning}
            nbytes = (rows * k + m * k + m * n) * 2
            frac = lambda t: nbytes / (t * 1e-3) / 1e9 / ceil.copy_gbps  # noqa: E731
            cur = cold_ms(lambda w: small_m_linear(x, w, out, **kw), weights)
            cublas = cold_ms(lambda w: torch.mm(x, w.t(), out=wide), weights)
            best = (cur, None)
            timed = []
            failed = []
            for bn, bk, warps, stages, split in _space(m, *axes):
                if split > 1 and bk * split > 2 * k:
                    continue
                need = gemv.workspace_size(m, n, split, gated, norm="norm" in args.fusion)
                ws = torch.empty(max(need, 1), device="cuda", dtype=torch.float32)
                cfg = (bn, bk, split, warps, stages)
                try:
                    t = cold_ms(lambda w: small_m_linear(x, w, out, workspace=ws, config=cfg, **kw),
                                weights)
                except Exception as exc:  # a config the compiler or the device refuses
                    torch.cuda.synchronize()
                    failed.append(f"{cfg}: {type(exc).__name__}: {str(exc)[:120]}")
                    continue
                timed.append((cfg, t))
                if t < best[0]:
                    best = (t, cfg)
            row = dict(M=m, N=n, K=k, fusion=args.fusion, current=cur,
                       current_cfg=choose_config(m, n, k, "cuda", gated=gated,
                                                 norm="norm" in args.fusion, tuning=tuning),
                       best=best[0], best_cfg=best[1], cublas=cublas, chain=len(weights),
                       candidates=timed)
            results.append(row)
            print(f"{args.fusion:<10} M={m:<3} N={n:<7} K={k:<6} "
                  f"current {cur * 1e3:7.2f}us {frac(cur):5.1%}  "
                  f"best {best[0] * 1e3:7.2f}us {frac(best[0]):5.1%} {best[1]}  "
                  f"cublas {cublas * 1e3:7.2f}us {frac(cublas):5.1%}", flush=True)
            if failed:
                print(f"  {len(failed)} configs failed, first: {failed[0]}")
            del weights
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main()
