"""Sweep launch configurations of the prefill attention and rope + cache kernels (run on a GPU).

``python -m tgraph.bench.tune_attention [OUT.json]`` times every candidate at the shapes of
``tgraph.bench.kernels`` (prefill: 4 x 2048 tokens, 32/8 heads, d=128; rope + cache: 4096 tokens)
as CUDA-graph replays, and prints the current heuristic, the best candidate and the ceilings
(bf16 matmul FLOP/s, copy bandwidth) measured in the same run.
"""
from __future__ import annotations

import itertools
import json
import sys

import torch

from tgraph.bench.timing import measure_ceilings, time_ms


def _ms(fn) -> float | None:
    try:
        return time_ms(fn, warmup=2, iters=20, graph=True)
    except Exception as err:  # a config that does not compile or fit is skipped
        torch.cuda.synchronize()
        print(f"    skipped: {type(err).__name__}: {str(err)[:120]}")
        return None


def tune_prefill(matmul_tflops: float) -> dict:
    from tgraph.kernels.triton import attention_prefill as ap

    b, seq, hq, hk, d, bs = 4, 2048, 32, 8, 128, 16
    blocks = b * seq // bs
    kc = torch.randn(blocks, bs, hk, d, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    table = torch.arange(blocks, device="cuda", dtype=torch.int32).view(b, seq // bs)
    lens = torch.full((b,), seq, device="cuda", dtype=torch.int32)
    q = torch.randn(b * seq, hq, d, device="cuda", dtype=torch.bfloat16)
    qsl = torch.arange(0, b * seq + 1, seq, device="cuda", dtype=torch.int32)
    out = torch.empty_like(q)
    flops = 4 * b * seq * seq * hq * d / 2
    scale = d ** -0.5

    def run(cfg):
        return lambda: ap.launch_prefill(q, kc, vc, table, lens, qsl, scale, None, out, cfg)

    tflops = lambda ms: flops / (ms * 1e-3) / 1e12  # noqa: E731
    current = ap.prefill_config(d, seq, True)
    results = []
    cur_ms = _ms(run(current))
    print(f"prefill current {current}: {cur_ms:.3f} ms, {tflops(cur_ms):.0f} TFLOP/s "
          f"({tflops(cur_ms) / matmul_tflops:.0%} of matmul)")
    for bm, bn, warps, stages in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3, 4)):
        cfg = ap.PrefillConfig(bm, bn, warps, stages)
        ms = _ms(run(cfg))
        if ms is not None:
            results.append((ms, cfg))
            print(f"  {cfg}: {ms:.3f} ms {tflops(ms):.0f} TFLOP/s")
    results.sort(key=lambda r: r[0])
    best_ms, best = results[0]
    print(f"prefill best {best}: {best_ms:.3f} ms, {tflops(best_ms):.0f} TFLOP/s "
          f"({tflops(best_ms) / matmul_tflops:.0%} of matmul)")
    return {"current": [str(current), cur_ms, tflops(cur_ms)],
            "ranked": [[str(c), ms, tflops(ms)] for ms, c in results]}


def tune_rope(copy_gbps: float) -> dict:
    from tgraph.kernels.triton import rope as rope_mod

    t, hq, hk, d, bs = 4096, 32, 8, 128, 16
    q = torch.randn(t, hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(t, hk, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(t, hk, d, device="cuda", dtype=torch.bfloat16)
    cos = torch.randn(t, d // 2, device="cuda")
    sin = torch.randn(t, d // 2, device="cuda")
    blocks = t // bs + 8
    kc = torch.zeros(blocks, bs, hk, d, device="cuda", dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    slots = torch.randperm(blocks * bs, device="cuda")[:t].to(torch.int32)
    qo, ko = torch.empty_like(q), torch.empty_like(k)
    nbytes = (2 * q.numel() + 3 * k.numel() + 2 * v.numel()) * 2 + 2 * cos.numel() * 4
    frac = lambda ms: nbytes / (ms * 1e-3) / 1e9 / copy_gbps  # noqa: E731
    run = lambda: rope_mod.rope_and_cache(q, k, v, cos, sin, kc, vc, slots, qo, ko, False)  # noqa
    original = rope_mod._config
    cur_ms = _ms(run)
    print(f"rope+cache current {original(d, hq, hk)}: {cur_ms:.4f} ms ({frac(cur_ms):.0%} of copy)")
    results = []
    try:
        for bhq, bhk, warps in itertools.product((4, 8, 16, 32), (2, 4, 8), (1, 2, 4, 8)):
            rope_mod._config = lambda *_a, c=(bhq, bhk, warps): c
            ms = _ms(run)
            if ms is not None:
                results.append((ms, (bhq, bhk, warps)))
    finally:
        rope_mod._config = original
    results.sort(key=lambda r: r[0])
    for ms, cfg in results[:8]:
        print(f"  (BLOCK_HQ, BLOCK_HK, warps)={cfg}: {ms:.4f} ms ({frac(ms):.0%} of copy)")
    return {"current": [cur_ms, frac(cur_ms)],
            "ranked": [[list(c), ms, frac(ms)] for ms, c in results]}


def main() -> None:
    ceil = measure_ceilings()
    print(f"copy {ceil.copy_gbps:.0f} GB/s, bf16 matmul {ceil.matmul_tflops:.0f} TFLOP/s")
    result = {"copy_gbps": ceil.copy_gbps, "matmul_tflops": ceil.matmul_tflops,
              "rope": tune_rope(ceil.copy_gbps), "prefill": tune_prefill(ceil.matmul_tflops)}
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
