"""Sweep launch configurations of the attention and rope + cache kernels (run on a GPU).

``python -m tgraph.bench.tune_attention [OUT.json] [--only prefill,decode,rope] [--quick]``
times every candidate at the shapes of ``tgraph.bench.kernels`` as CUDA-graph replays and prints
the current heuristic, the ranking and the ceilings (bf16 matmul FLOP/s, copy bandwidth)
measured in the same run:

- prefill: 4 x 2048 tokens, 32/8 heads, d=128, bf16, block size 16, causal. Candidates cross
  GQA packing with tile shapes and pipeline depths (all with page prefetch and the single key
  loop), then the best few are re-timed without page prefetch and with three loops, and the
  previous default (unpacked 64 x 64, 4 warps, 2 stages, neither change) is timed too, so one
  run shows what each change buys. Each entry reports TFLOP/s (causal FLOPs, as the bench
  counts them) and the percentage of bf16 matmul; torch SDPA on dense K/V is timed alongside.
- decode: B=32, context 4096, same heads; tile shapes x stages x page prefetch, in GB/s of K/V.
- rope + cache: 4096 tokens.

Configurations that spill heavily or exceed shared memory on sm_90 (checked by compiling for
sm_90a offline: BLOCK_M=128 on 4 warps, 64 x 128 tiles on 4 warps) are left out to keep a full
run within a few minutes; ``--quick`` keeps only 2- and 3-stage pipelines.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
from collections.abc import Callable

import torch

from tgraph.bench.timing import measure_ceilings, time_ms

# Prefill tile shapes worth compiling: (BLOCK_M, num_warps) -> BLOCK_N values.
_PREFILL_TILES = {(64, 4): (32, 64), (64, 8): (32, 64, 128), (128, 8): (32, 64, 128)}
# How many of the best prefill configs are re-timed with one change each.
_RECHECK = 6
_RECHECK_VARIANTS = {"prefetch_off": {"prefetch_pages": False},
                     "three_loops": {"single_loop": False}}


def _ms(fn: Callable[[], object]) -> float | None:
    try:
        return time_ms(fn, warmup=2, iters=20, graph=True)
    except Exception as err:  # a config that does not compile or fit is skipped
        torch.cuda.synchronize()
        print(f"    skipped: {type(err).__name__}: {str(err)[:120]}")
        return None


def prefill_candidates(stages: tuple[int, ...] = (2, 3, 4)) -> list:
    """The prefill configurations the sweep times (page prefetch on).

    Args:
        stages: pipeline depths to cross with the tile shapes.

    Returns:
        A list of :class:`tgraph.kernels.triton.attention_prefill.PrefillConfig`.
    """
    from tgraph.kernels.triton.attention_prefill import PrefillConfig

    out = []
    for pack in (True, False):
        for (bm, warps), bns in _PREFILL_TILES.items():
            for bn, st in itertools.product(bns, stages):
                if bn * st > 384:
                    continue  # 4 stages of 128-key K/V tiles need 288 KiB of shared memory
                out.append(PrefillConfig(bm, bn, warps, st, pack_gqa=pack, prefetch_pages=True))
    return out


def _entry(cfg, ms: float, **metrics: float) -> dict:
    return {"config": dataclasses.asdict(cfg), "ms": ms, **metrics}


def _paged_cache(batch: int, seq: int, kv_heads: int, head_dim: int, block_size: int):
    """Random bf16 K/V caches holding ``batch`` full sequences of ``seq`` tokens: ``(k_cache,
    v_cache, block_table, seq_len)``. The pages are shuffled, like a cache that has served other
    requests (gathers cost the same either way, but this keeps the sweeps honest)."""
    blocks = batch * seq // block_size
    kc = torch.randn(blocks, block_size, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    table = torch.randperm(blocks, device="cuda").to(torch.int32).view(batch, seq // block_size)
    lens = torch.full((batch,), seq, device="cuda", dtype=torch.int32)
    return kc, vc, table, lens


def tune_prefill(matmul_tflops: float, quick: bool = False) -> dict:
    """Time prefill attention configurations; see the module doc.

    Args:
        matmul_tflops: bf16 matmul TFLOP/s measured in the same run (the 100% mark).
        quick: only 2- and 3-stage pipelines.

    Returns:
        A JSON-able dict: shape, sdpa, current, previous_default, ranked (best first),
        prefetch_off and three_loops (re-timed best few; ``ms_base`` is the ranked time), best.
    """
    import torch.nn.functional as torch_F

    from tgraph.kernels.triton import attention_prefill as ap

    b, seq, hq, hk, d, bs = 4, 2048, 32, 8, 128, 16
    kc, vc, table, lens = _paged_cache(b, seq, hk, d, bs)
    q = torch.randn(b * seq, hq, d, device="cuda", dtype=torch.bfloat16)
    qsl = torch.arange(0, b * seq + 1, seq, device="cuda", dtype=torch.int32)
    out = torch.empty_like(q)
    flops = 4 * b * seq * seq * hq * d / 2  # causal: half of QK^T and PV
    scale = d ** -0.5

    def tflops(ms: float) -> float:
        return flops / (ms * 1e-3) / 1e12

    def metrics(ms: float) -> dict:
        return {"tflops": tflops(ms), "pct_matmul": 100 * tflops(ms) / matmul_tflops}

    def time_cfg(cfg) -> float | None:
        return _ms(lambda: ap.launch_prefill(q, kc, vc, table, lens, qsl, scale, None, out, cfg))

    def show(label: str, cfg, ms: float) -> None:
        print(f"  {label}{cfg}: {ms:.3f} ms, {tflops(ms):.0f} TFLOP/s "
              f"({tflops(ms) / matmul_tflops:.0%} of matmul)")

    k_dense = kc[table.long()].view(b, seq, hk, d).transpose(1, 2)
    v_dense = vc[table.long()].view(b, seq, hk, d).transpose(1, 2)
    qd = q.view(b, seq, hq, d).transpose(1, 2)
    sdpa_ms = _ms(lambda: torch_F.scaled_dot_product_attention(
        qd, k_dense, v_dense, is_causal=True, enable_gqa=True))
    if sdpa_ms is not None:
        print(f"prefill torch SDPA (dense K/V): {sdpa_ms:.3f} ms, {tflops(sdpa_ms):.0f} TFLOP/s "
              f"({tflops(sdpa_ms) / matmul_tflops:.0%} of matmul)")

    current = ap.prefill_config(d, seq, True, group=hq // hk)
    cur_ms = time_cfg(current)
    if cur_ms is not None:
        show("current ", current, cur_ms)

    results = []
    for cfg in prefill_candidates((2, 3) if quick else (2, 3, 4)):
        ms = time_cfg(cfg)
        if ms is not None:
            results.append((ms, cfg))
            show("", cfg, ms)
    results.sort(key=lambda r: r[0])

    # What each change buys: the best few again without page prefetch / with three loops.
    rechecks: dict[str, list[dict]] = {name: [] for name in _RECHECK_VARIANTS}
    for ms_base, cfg in results[:_RECHECK]:
        for name, change in _RECHECK_VARIANTS.items():
            other = dataclasses.replace(cfg, **change)
            ms = time_cfg(other)
            if ms is not None:
                rechecks[name].append(_entry(other, ms, **metrics(ms), ms_base=ms_base))
                show(f"{name} ", other, ms)

    # The kernel as it was before GQA packing, page prefetch and the single loop, same run.
    previous = ap.PrefillConfig(64, 64, 4, 2, pack_gqa=False, prefetch_pages=False,
                                single_loop=False)
    prev_ms = time_cfg(previous)
    if prev_ms is not None:
        show("previous default ", previous, prev_ms)

    ranked = [_entry(c, ms, **metrics(ms)) for ms, c in results]
    every = ranked + [e for entries in rechecks.values() for e in entries]
    best = min(every, key=lambda e: e["ms"]) if every else None
    if best is not None:
        print(f"prefill best {best['config']}: {best['ms']:.3f} ms, {best['tflops']:.0f} TFLOP/s "
              f"({best['pct_matmul']:.0f}% of matmul; target 50%)")
    return {
        "shape": {"batch": b, "seq": seq, "q_heads": hq, "kv_heads": hk, "head_dim": d,
                  "block_size": bs, "dtype": "bfloat16", "causal": True},
        "sdpa": None if sdpa_ms is None else {"ms": sdpa_ms, **metrics(sdpa_ms)},
        "current": None if cur_ms is None else _entry(current, cur_ms, **metrics(cur_ms)),
        "previous_default": None if prev_ms is None else _entry(previous, prev_ms,
                                                                **metrics(prev_ms)),
        "ranked": ranked,
        **rechecks,
        "best": best,
    }


def tune_decode(copy_gbps: float, quick: bool = False) -> dict:
    """Time split-KV decode configurations (B=32, context 4096, 32/8 heads, d=128, bf16).

    Args:
        copy_gbps: device copy bandwidth measured in the same run (bytes read + written).
        quick: only 2- and 3-stage pipelines.

    Returns:
        A JSON-able dict: num_splits, current, ranked (best first), each with GB/s of K/V read.
    """
    from tgraph.kernels.triton import attention_decode as ad
    from tgraph.kernels.triton.device_info import sm_count

    b, ctx, hq, hk, d, bs = 32, 4096, 32, 8, 128, 16
    kc, vc, table, lens = _paged_cache(b, ctx, hk, d, bs)
    q = torch.randn(b, hq, d, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    splits = ad.choose_num_splits(b, hk, ctx, sm_count(q.device))
    workspace = torch.empty(max(1, ad.workspace_numel(b, hq, d, splits)), device="cuda")
    nbytes = 2 * b * ctx * hk * d * kc.element_size()

    def gbps(ms: float) -> float:
        return nbytes / (ms * 1e-3) / 1e9

    def time_cfg(cfg) -> float | None:
        return _ms(lambda: ad.launch_decode(q, kc, vc, table, lens, d ** -0.5, None, out,
                                            splits, workspace, cfg))

    current = ad.decode_config(d, True)
    cur_ms = time_cfg(current)
    if cur_ms is not None:
        print(f"decode current {current} ({splits} splits): {cur_ms:.4f} ms, "
              f"{gbps(cur_ms):.0f} GB/s ({gbps(cur_ms) / copy_gbps:.0%} of copy)")
    results = []
    stages = (2, 3) if quick else (2, 3, 4)
    for bn, warps, st, prefetch in itertools.product((32, 64, 128), (4, 8), stages, (False, True)):
        cfg = ad.DecodeConfig(bn, warps, st, prefetch_pages=prefetch)
        ms = time_cfg(cfg)
        if ms is not None:
            results.append((ms, cfg))
    results.sort(key=lambda r: r[0])
    for ms, cfg in results[:8]:
        print(f"  {cfg}: {ms:.4f} ms, {gbps(ms):.0f} GB/s ({gbps(ms) / copy_gbps:.0%} of copy)")

    def entry(cfg, ms: float) -> dict:
        return _entry(cfg, ms, gbps=gbps(ms), pct_copy=100 * gbps(ms) / copy_gbps)

    return {"num_splits": splits,
            "current": None if cur_ms is None else entry(current, cur_ms),
            "ranked": [entry(c, ms) for ms, c in results]}


def tune_rope(copy_gbps: float) -> dict:
    """Time rope + cache block configurations (4096 tokens, 32/8 heads, d=128, bf16).

    Args:
        copy_gbps: device copy bandwidth measured in the same run.

    Returns:
        A JSON-able dict: current and ranked ``[(BLOCK_HQ, BLOCK_HK, warps), ms, fraction]``.
    """
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
    def run(config=None):
        rope_mod.rope_and_cache(q, k, v, cos, sin, kc, vc, slots, qo, ko, False, config)

    cur_ms = _ms(run)
    current = rope_mod.launch_config(d, hq, hk)
    print(f"rope+cache current {current}: {cur_ms:.4f} ms ({frac(cur_ms):.0%} of copy)")
    results = []
    for bhq, bhk, warps in itertools.product((4, 8, 16, 32), (2, 4, 8), (1, 2, 4, 8)):
        ms = _ms(lambda c=(bhq, bhk, warps): run(c))
        if ms is not None:
            results.append((ms, (bhq, bhk, warps)))
    results.sort(key=lambda r: r[0])
    for ms, cfg in results[:8]:
        print(f"  (BLOCK_HQ, BLOCK_HK, warps)={cfg}: {ms:.4f} ms ({frac(ms):.0%} of copy)")
    return {"current": [cur_ms, frac(cur_ms)],
            "ranked": [[list(c), ms, frac(ms)] for ms, c in results]}


def main(argv: list[str] | None = None) -> None:
    """Run the sweeps named by ``--only`` (all by default) and write them to OUT.json if given."""
    parser = argparse.ArgumentParser(prog="python -m tgraph.bench.tune_attention")
    parser.add_argument("out", nargs="?", help="JSON file for the results")
    parser.add_argument("--only", default="prefill,decode,rope",
                        help="comma-separated subset of prefill, decode, rope")
    parser.add_argument("--quick", action="store_true", help="2- and 3-stage pipelines only")
    args = parser.parse_args(argv)
    only = {s.strip() for s in args.only.split(",") if s.strip()}
    unknown = only - {"prefill", "decode", "rope"}
    if unknown:
        parser.error(f"--only: unknown sweep(s) {sorted(unknown)}; use prefill, decode, rope")

    ceil = measure_ceilings()
    print(f"copy {ceil.copy_gbps:.0f} GB/s, bf16 matmul {ceil.matmul_tflops:.0f} TFLOP/s")
    result = {"copy_gbps": ceil.copy_gbps, "matmul_tflops": ceil.matmul_tflops}
    if "rope" in only:
        result["rope"] = tune_rope(ceil.copy_gbps)
    if "decode" in only:
        result["decode"] = tune_decode(ceil.copy_gbps, args.quick)
    if "prefill" in only:
        result["prefill"] = tune_prefill(ceil.matmul_tflops, args.quick)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
