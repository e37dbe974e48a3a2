"""Probe: a step-long L2 prefetcher on a side stream, driven by progress flags, against per-layer
forked prefetches, and prefetches issued inside the chain's kernels (session 11, GPU only; results in
docs/bench/h100-session11-probes.txt). Synthetic Qwen2.5-0.5B layers: a timed spin standing in for
q|k|v + attention + o, then the real gate|up and down kernels:
PYTHONPATH=. python scripts/probes/probe_prefetcher.py [HIDDEN INTERMEDIATE PROGRAMS]"""
import sys
import torch
import triton
import triton.language as tl
from tgraph.kernels.triton.gemv import small_m_linear
from tgraph.kernels.triton.prefetch import _prefetch_range, prefetch_ahead
from tgraph.kernels.side_streams import join_forked

from graph_timing import replay_ms

NL = 24
CHUNK = 16384


@triton.jit
def _spin(flag, value, ns):
    tl.extra.cuda.gdc_wait()
    tl.extra.cuda.gdc_launch_dependents()
    if tl.program_id(0) == 0:
        tl.store(flag, value)
    t0 = tl.extra.cuda.globaltimer()
    t = t0
    while t - t0 < ns:
        t = tl.extra.cuda.globaltimer()


@triton.jit
def _spin_pf(flag, value, ns, table, layer, NW: tl.constexpr, MODE: tl.constexpr):
    # stand-in for the attention phase that also prefetches its layer's MLP weights
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    tl.extra.cuda.gdc_wait()
    tl.extra.cuda.gdc_launch_dependents()
    for w in tl.static_range(NW):
        addr = tl.load(table + (layer * NW + w) * 2)
        nbytes = tl.load(table + (layer * NW + w) * 2 + 1)
        if MODE == 1:  # per-thread prefetch.global.L2, one 128-byte line each
            lines = nbytes // 128
            for c0 in range(pid * 128, lines, P * 128):
                off = (c0 + tl.arange(0, 128)).to(tl.int64) * 128
                ok = (c0 + tl.arange(0, 128) < lines).to(tl.int32)
                tl.inline_asm_elementwise(
                    "{ .reg .pred p; setp.ne.u32 p, $2, 0; @p prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0; }",
                    "=r,l,r", [addr + off, ok], dtype=tl.int32, is_pure=False, pack=1)
        else:  # bulk 16 KB prefetches
            nchunks = (nbytes + 16383) // 16384
            for c0 in range(pid * 128, nchunks, P * 128):
                _prefetch_range(addr, nbytes, c0, 16384, 128)
    t0 = tl.extra.cuda.globaltimer()
    t = t0
    while t - t0 < ns:
        t = tl.extra.cuda.globaltimer()


@triton.jit
def _prefetcher(table, flag, NL, NW: tl.constexpr, P, max_polls, CHUNK: tl.constexpr):
    pid = tl.program_id(0)
    for layer in range(NL):
        polls = 0
        f = tl.load(flag, volatile=True)
        while (f < layer + 1) & (polls < max_polls):
            f = tl.load(flag, volatile=True)
            polls += 1
        for w in tl.static_range(NW):
            addr = tl.load(table + (layer * NW + w) * 2)
            nbytes = tl.load(table + (layer * NW + w) * 2 + 1)
            nchunks = (nbytes + CHUNK - 1) // CHUNK
            for c0 in range(pid * 32, nchunks, P * 32):
                _prefetch_range(addr, nbytes, c0, CHUNK, 32)


def graph_us(fn):
    return replay_ms(fn, 30) * 1e3


def main():
    dev = "cuda"
    H, I = (896, 4864) if len(sys.argv) < 2 else map(int, sys.argv[1:3])
    spin_ns = 6500
    gu = [torch.randn(2 * I, H, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(NL)]
    dn = [torch.randn(H, I, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(NL)]
    g = torch.ones(H, device=dev, dtype=torch.bfloat16)
    h = torch.randn(1, H, device=dev, dtype=torch.bfloat16)
    act = torch.empty(1, I, device=dev, dtype=torch.bfloat16)
    flag = torch.zeros(1, dtype=torch.int32, device=dev)
    table = torch.tensor([[w.data_ptr(), w.numel() * 2] for L in range(NL) for w in (gu[L], dn[L])],
                         dtype=torch.int64, device=dev).reshape(-1)
    P = int(sys.argv[3]) if len(sys.argv) > 3 else 48

    def layers(hot=False, per_layer_prefetch=False, spin_only=False, inline=0):
        for L in range(NL):
            W1, W2 = (gu[0], dn[0]) if hot else (gu[L], dn[L])
            if per_layer_prefetch:
                prefetch_ahead(h, (W1, W2), (2, 1), 0.5)
            if inline:
                _spin_pf[(132,)](flag, L + 1, spin_ns, table, L, NW=2, MODE=inline, launch_pdl=True)
            else:
                _spin[(1,)](flag, L + 1, spin_ns, launch_pdl=True)
            if spin_only:
                continue
            small_m_linear(h, W1, act, norm_eps=1e-6, norm_weight=g, gated=True)
            small_m_linear(act, W2, h, residual=h)
        join_forked()

    def persistent():
        main_s = torch.cuda.current_stream()
        flag.zero_()
        side = torch.cuda.Stream()
        side.wait_stream(main_s)
        with torch.cuda.stream(side):
            _prefetcher[(P,)](table, flag, NL, NW=2, P=P, max_polls=1_000_000, CHUNK=CHUNK, num_warps=1)
        layers()
        main_s.wait_stream(side)

    res = {
        "spin only": graph_us(lambda: layers(spin_only=True)),
        "no prefetch": graph_us(lambda: layers()),
        "per-layer forked prefetch": graph_us(lambda: layers(per_layer_prefetch=True)),
        "persistent flag prefetcher": graph_us(persistent),
        "hot (same weights every layer)": graph_us(lambda: layers(hot=True)),
        "spin(132 progs)+prefetch.global.L2": graph_us(lambda: layers(inline=1)),
        "spin(132 progs)+bulk prefetch": graph_us(lambda: layers(inline=2)),
        "spin(132 progs)+line prefetch, spin only": graph_us(lambda: layers(inline=1, spin_only=True)),
        "spin(132 progs)+bulk prefetch, spin only": graph_us(lambda: layers(inline=2, spin_only=True)),
    }
    spin = res["spin only"]
    print(f"H={H} I={I} P={P}: us per layer (MLP part = minus the spin-only chain)")
    for k, v in res.items():
        print(f"  {k:32s} {v / NL:7.2f}  MLP {(v - spin) / NL:6.2f}")


if __name__ == "__main__":
    main()
