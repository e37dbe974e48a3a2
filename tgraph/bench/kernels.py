"""Kernel benchmark: each Triton kernel at realistic LLM shapes, its achieved bandwidth (or
FLOP/s) as a fraction of what the same run measured for a device copy (or a large matmul), and
its speed-up over the torch eager equivalent. Both sides are timed as CUDA-graph replays, so the
numbers are device time, not Python launch overhead."""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as torch_F

from tgraph.bench.timing import Ceilings, cold_copies, cold_ms, measure_ceilings, time_ms


@dataclass
class KernelResult:
    name: str
    shape: str
    ms: float
    torch_ms: float
    gbps: float | None = None
    tflops: float | None = None
    fraction: float = 0.0  # of copy bandwidth (memory-bound) or matmul FLOP/s (compute-bound)
    target: float | None = None

    @property
    def speedup(self) -> float:
        return self.torch_ms / self.ms if self.ms > 0 else 0.0


def _device_ms(fn: Callable) -> float:
    """Device time of one call: replays of a CUDA graph holding it (no launch gaps, as in a
    captured decode step); eager timing where a call cannot be captured."""
    try:
        return time_ms(fn, graph=True)
    except Exception:
        torch.cuda.synchronize()
        return time_ms(fn)


def _bw(name: str, shape: str, nbytes: int, ours: Callable, theirs: Callable,
        ceil: Ceilings, target: float | None = None) -> KernelResult:
    ms, torch_ms = _device_ms(ours), _device_ms(theirs)
    gbps = nbytes / (ms * 1e-3) / 1e9
    return KernelResult(name, shape, ms, torch_ms, gbps=gbps, fraction=gbps / ceil.copy_gbps,
                        target=target)


def bench_norms(ceil: Ceilings, dtype=torch.bfloat16) -> list[KernelResult]:
    from tgraph.kernels.triton.norms import add_rms_norm, rms_norm

    m, n = 4096, 4096
    x = torch.randn(m, n, device="cuda", dtype=dtype)
    r = torch.randn_like(x)
    w = torch.randn(n, device="cuda", dtype=dtype)
    out, res_out = torch.empty_like(x), torch.empty_like(x)
    es = x.element_size()

    def torch_rms(h):
        f = h.float()
        return w * (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)

    return [
        _bw("rms_norm", f"{m}x{n}", 2 * m * n * es, lambda: rms_norm(x, w, 1e-6, out),
            lambda: torch_rms(x), ceil),
        _bw("add_rms_norm", f"{m}x{n}", 4 * m * n * es,
            lambda: add_rms_norm(x, r, w, 1e-6, out, res_out),
            lambda: torch_rms(x + r), ceil, target=0.8),
    ]


def bench_swiglu(ceil: Ceilings, dtype=torch.bfloat16) -> KernelResult:
    from tgraph.kernels.triton.activations import swiglu

    m, n = 4096, 4096
    gu = torch.randn(m, 2 * n, device="cuda", dtype=dtype)
    out = torch.empty(m, n, device="cuda", dtype=dtype)
    return _bw("swiglu", f"{m}x2*{n}", 3 * m * n * gu.element_size(), lambda: swiglu(gu, out),
               lambda: torch_F.silu(gu[:, :n]) * gu[:, n:], ceil, target=0.8)


def bench_rope_cache(ceil: Ceilings, dtype=torch.bfloat16) -> KernelResult:
    from tgraph.kernels.triton.rope import rope_and_cache

    t, hq, hk, d, bs = 4096, 32, 8, 128, 16
    q = torch.randn(t, hq, d, device="cuda", dtype=dtype)
    k = torch.randn(t, hk, d, device="cuda", dtype=dtype)
    v = torch.randn(t, hk, d, device="cuda", dtype=dtype)
    cos = torch.randn(t, d // 2, device="cuda")
    sin = torch.randn(t, d // 2, device="cuda")
    blocks = t // bs + 8
    kc = torch.zeros(blocks, bs, hk, d, device="cuda", dtype=dtype)
    vc = torch.zeros_like(kc)
    slots = torch.randperm(blocks * bs, device="cuda")[:t].to(torch.int32)
    qo, ko = torch.empty_like(q), torch.empty_like(k)
    es = q.element_size()
    nbytes = (2 * q.numel() + 3 * k.numel() + 2 * v.numel()) * es + 2 * cos.numel() * 4

    def torch_version():
        def rot(x):
            x1, x2 = x[..., : d // 2].float(), x[..., d // 2:].float()
            c, s = cos[:, None, :], sin[:, None, :]
            return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1).to(dtype)
        qr, kr = rot(q), rot(k)
        flat = slots.long()
        kc.view(-1, hk, d)[flat] = kr
        vc.view(-1, hk, d)[flat] = v
        return qr

    return _bw("rope+cache", f"T={t} {hq}/{hk} heads d={d}", nbytes,
               lambda: rope_and_cache(q, k, v, cos, sin, kc, vc, slots, qo, ko, False),
               torch_version, ceil, target=0.8)


def bench_embedding(ceil: Ceilings, dtype=torch.bfloat16) -> KernelResult:
    from tgraph.kernels.triton.embedding import embedding

    v, h, t = 128256, 4096, 4096
    w = torch.randn(v, h, device="cuda", dtype=dtype)
    ids = torch.randint(0, v, (t,), device="cuda")
    out = torch.empty(t, h, device="cuda", dtype=dtype)
    return _bw("embedding", f"T={t} H={h}", 2 * t * h * w.element_size(),
               lambda: embedding(ids, w, out), lambda: torch_F.embedding(ids, w), ceil)


def _paged(b: int, ctx: int, hq: int, hk: int, d: int, bs: int, dtype):
    blocks_per_seq = ctx // bs
    num_blocks = b * blocks_per_seq
    kc = torch.randn(num_blocks, bs, hk, d, device="cuda", dtype=dtype)
    vc = torch.randn_like(kc)
    table = torch.randperm(num_blocks, device="cuda").to(torch.int32).view(b, blocks_per_seq)
    lens = torch.full((b,), ctx, device="cuda", dtype=torch.int32)
    return kc, vc, table, lens


def bench_decode_attention(ceil: Ceilings, dtype=torch.bfloat16) -> KernelResult:
    from tgraph.kernels.triton.attention import paged_attention_decode

    b, ctx, hq, hk, d, bs = 32, 4096, 32, 8, 128, 16
    kc, vc, table, lens = _paged(b, ctx, hq, hk, d, bs, dtype)
    q = torch.randn(b, hq, d, device="cuda", dtype=dtype)
    out = torch.empty_like(q)
    nbytes = 2 * b * ctx * hk * d * kc.element_size()
    k_dense = kc[table.long()].view(b, ctx, hk, d).transpose(1, 2)
    v_dense = vc[table.long()].view(b, ctx, hk, d).transpose(1, 2)

    def torch_version():
        return torch_F.scaled_dot_product_attention(q[:, :, None, :], k_dense, v_dense,
                                                    enable_gqa=True)

    return _bw("decode attention", f"B={b} ctx={ctx} {hq}/{hk} d={d}", nbytes,
               lambda: paged_attention_decode(q, kc, vc, table, lens, None, None, out),
               torch_version, ceil, target=0.7)


def bench_prefill_attention(ceil: Ceilings, dtype=torch.bfloat16) -> list[KernelResult]:
    """Causal prefill of 4 x 2048 tokens, as a model runs it (each sequence's keys read from the
    step's new k/v rows) and through the page table only (what a chunk after cached context
    reads)."""
    from tgraph.kernels.triton.attention import paged_attention_prefill

    b, seq, hq, hk, d, bs = 4, 2048, 32, 8, 128, 16
    kc, vc, table, lens = _paged(b, seq, hq, hk, d, bs, dtype)
    q = torch.randn(b * seq, hq, d, device="cuda", dtype=dtype)
    qsl = torch.arange(0, b * seq + 1, seq, device="cuda", dtype=torch.int32)
    out = torch.empty_like(q)
    flops = 4 * b * seq * seq * hq * d / 2  # causal: half of QK^T and PV
    k_rows = kc[table.long()].reshape(b * seq, hk, d)  # the same keys, in query order
    v_rows = vc[table.long()].reshape(b * seq, hk, d)
    k_dense = k_rows.view(b, seq, hk, d).transpose(1, 2)
    v_dense = v_rows.view(b, seq, hk, d).transpose(1, 2)
    qd = q.view(b, seq, hq, d).transpose(1, 2)

    def torch_version():
        return torch_F.scaled_dot_product_attention(qd, k_dense, v_dense, is_causal=True,
                                                    enable_gqa=True)

    torch_ms = _device_ms(torch_version)
    results = []
    for name, new_kv in (("prefill attention", (k_rows, v_rows)), ("prefill attn (paged)", None)):
        ms = _device_ms(lambda: paged_attention_prefill(q, kc, vc, table, lens, qsl, None, None,
                                                        out, max_query_len=seq, new_kv=new_kv))
        tflops = flops / (ms * 1e-3) / 1e12
        results.append(KernelResult(name, f"{b}x{seq} {hq}/{hk} d={d}", ms, torch_ms,
                                    tflops=tflops, fraction=tflops / ceil.matmul_tflops,
                                    target=0.5 if new_kv is not None else None))
    return results


def bench_gemv(ceil: Ceilings, dtype=torch.bfloat16) -> list[KernelResult]:
    from tgraph.kernels.triton.gemv import small_m_linear

    results = []
    for n, k in [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192), (6144, 4096),
                 (28672, 4096), (4096, 14336), (128256, 2048)]:
        weights = cold_copies((n, k), dtype)  # read from HBM, as in a decode step
        for m in (1, 16):
            x = torch.randn(m, k, device="cuda", dtype=dtype)
            out = torch.empty(m, n, device="cuda", dtype=dtype)
            nbytes = (n * k + m * k + m * n) * dtype.itemsize
            ms = cold_ms(lambda w: small_m_linear(x, w, out), weights)
            torch_ms = cold_ms(lambda w: torch.matmul(x, w.t(), out=out), weights)
            gbps = nbytes / (ms * 1e-3) / 1e9
            results.append(KernelResult(
                "small-M linear", f"M={m} N={n} K={k}", ms, torch_ms, gbps=gbps,
                fraction=gbps / ceil.copy_gbps,
                target=0.85 if m == 1 and n * k >= 16 << 20 else None))
        del weights
    return results


_QUANT_LAYOUTS = (("int4 g128", dict(kind="int4", group_size=128)),
                  ("int8 channel", dict(kind="int8")), ("fp8 channel", dict(kind="fp8")))


def _quant_copies(n: int, k: int, args: dict) -> list:
    """Quantized ``[n, k]`` weights, enough copies to pass 256 MB (see ``cold_copies``)."""
    from tgraph.quant import QuantizedWeight, quantize

    w = quantize(torch.randn(n, k, device="cuda") * 0.02, **args).to("cuda", torch.bfloat16)
    count = max(2, min(64, -(-(256 << 20) // w.nbytes)))
    return [QuantizedWeight(w.scheme, w.qdata.clone(), w.scale.clone(),
                            None if w.offset is None else w.offset.clone(), w.dtype)
            for _ in range(count)]


def bench_quant_gemv(ceil: Ceilings, dtype=torch.bfloat16) -> list[KernelResult]:
    """The small-M linear on quantized weights (cold, as in a decode step) against the copy
    bandwidth; torch's equivalent dequantizes and multiplies."""
    from tgraph.kernels.triton.gemv import small_m_linear

    results = []
    for label, args in _QUANT_LAYOUTS:
        for n, k in [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]:
            weights = _quant_copies(n, k, args)
            for m in (1, 16):
                x = torch.randn(m, k, device="cuda", dtype=dtype)
                out = torch.empty(m, n, device="cuda", dtype=dtype)
                nbytes = weights[0].nbytes + (m * k + m * n) * dtype.itemsize
                ms = cold_ms(lambda w: small_m_linear(x, w, out), weights)
                torch_ms = cold_ms(lambda w: torch.matmul(x, w.dequantize().t(), out=out),
                                   weights[:2])
                gbps = nbytes / (ms * 1e-3) / 1e9
                results.append(KernelResult(f"{label} GEMV", f"M={m} N={n} K={k}", ms, torch_ms,
                                            gbps=gbps, fraction=gbps / ceil.copy_gbps,
                                            target=0.8 if m == 1 else None))
            del weights
    return results


def bench_quant_gemm(ceil: Ceilings, dtype=torch.bfloat16) -> list[KernelResult]:
    """Prefill GEMMs (M = 4096 tokens) on quantized weights against the bf16 matmul ceiling;
    "torch" is cuBLAS on the dense bf16 weight (the speed-up is over bf16 prefill)."""
    from tgraph.kernels.triton.fp8_linear import fp8_linear
    from tgraph.kernels.triton.quant_linear import quant_linear
    from tgraph.quant import quantize

    m = 4096
    results = []
    for label, args, fn in (("fp8 GEMM", dict(kind="fp8"), fp8_linear),
                            ("fp8 128x128 GEMM", dict(kind="fp8", block=(128, 128)), fp8_linear),
                            ("int4 g128 GEMM", dict(kind="int4", group_size=128), quant_linear)):
        for n, k in [(6144, 4096), (4096, 14336), (28672, 4096)]:
            w = quantize(torch.randn(n, k, device="cuda") * 0.02, **args).to("cuda", dtype)
            dense = w.dequantize(dtype)
            x = torch.randn(m, k, device="cuda", dtype=dtype)
            out = torch.empty(m, n, device="cuda", dtype=dtype)
            ms = _device_ms(lambda: fn(x, w, out))
            torch_ms = _device_ms(lambda: torch.matmul(x, dense.t(), out=out))
            tflops = 2 * m * n * k / (ms * 1e-3) / 1e12
            results.append(KernelResult(label, f"M={m} N={n} K={k}", ms, torch_ms, tflops=tflops,
                                        fraction=tflops / ceil.matmul_tflops))
    return results


def run_kernel_bench(json_path: str | None = None) -> list[KernelResult]:
    """Run every kernel benchmark and print the table."""
    ceil = measure_ceilings()
    print(f"device: {torch.cuda.get_device_name()}  copy {ceil.copy_gbps:.0f} GB/s  "
          f"bf16 matmul {ceil.matmul_tflops:.0f} TFLOP/s")
    results: list[KernelResult] = []
    for fn in (bench_norms, bench_swiglu, bench_rope_cache, bench_embedding,
               bench_decode_attention, bench_prefill_attention, bench_gemv, bench_quant_gemv,
               bench_quant_gemm):
        try:
            r = fn(ceil)
            results.extend(r if isinstance(r, list) else [r])
        except Exception as err:  # report and go on: one broken kernel must not hide the rest
            print(f"  {fn.__name__} FAILED: {type(err).__name__}: {err}")
    print(f"{'kernel':<22} {'shape':<28} {'ms':>8} {'torch ms':>9} {'speedup':>7} "
          f"{'achieved':>14} {'of ceil':>8} {'target':>7}")
    for r in results:
        achieved = f"{r.gbps:.0f} GB/s" if r.gbps is not None else f"{r.tflops:.0f} TFLOP/s"
        target = f"{r.target:.0%}" if r.target else ""
        flag = "" if not r.target or r.fraction >= r.target else " MISS"
        print(f"{r.name:<22} {r.shape:<28} {r.ms:8.4f} {r.torch_ms:9.4f} {r.speedup:6.2f}x "
              f"{achieved:>14} {r.fraction:7.1%} {target:>7}{flag}")
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "ceilings": asdict(ceil),
                       "kernels": [asdict(r) | {"speedup": r.speedup} for r in results]}, f,
                      indent=1)
    return results
