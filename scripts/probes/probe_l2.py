"""Probe: decode linears with weights cold (HBM) vs L2-resident, chained in one CUDA graph
(session 11, GPU only; results in docs/bench/h100-session11-probes.txt):
PYTHONPATH=. python scripts/probes/probe_l2.py"""
import torch
import triton
import triton.language as tl
from tgraph.kernels.triton.gemv import small_m_linear

from graph_timing import replay_ms

N_STEPS = 40


@triton.jit
def _stream(w, out, n_per_prog, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    base = w + pid.to(tl.int64) * n_per_prog
    acc = tl.zeros([BLOCK], tl.float32)
    for i in range(0, n_per_prog, BLOCK):
        acc += tl.load(base + i + tl.arange(0, BLOCK)).to(tl.float32)
    tl.store(out + pid, tl.sum(acc, 0))


def main():
    dev = "cuda"
    torch.manual_seed(0)
    shapes = {"qwen gate|up": (4864, 896, True, True), "qwen down": (896, 4864, False, False),
              "qwen q|k|v": (1152, 896, False, True), "1b gate|up": (8192, 2048, True, True),
              "1b down": (2048, 8192, False, False)}
    for name, (N, K, gated, norm) in shapes.items():
        rows = 2 * N if gated else N
        ws = [torch.randn(rows, K, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(N_STEPS)]
        x = torch.randn(1, K, device=dev, dtype=torch.bfloat16)
        g = torch.ones(K, device=dev, dtype=torch.bfloat16)
        out = torch.empty(1, N, device=dev, dtype=torch.bfloat16)
        kw = dict(norm_eps=1e-6, norm_weight=g) if norm else {}

        def run(hot):
            def f():
                for i in range(N_STEPS):
                    small_m_linear(x, ws[0] if hot else ws[i], out, gated=gated, **kw)
            return f
        mb = rows * K * 2 / 1e6
        cold = replay_ms(run(False)) * 1e3 / N_STEPS
        hot = replay_ms(run(True)) * 1e3 / N_STEPS
        print(f"{name:14s} {mb:6.1f} MB  cold {cold:6.2f} us ({mb / cold:5.2f} TB/s)  "
              f"L2-hot {hot:6.2f} us ({mb / hot:5.2f} TB/s)", flush=True)
        del ws
    # plain streaming read of 16 MB, L2-hot vs cold, for the L2 ceiling
    n = 8 * 1024 * 1024
    bufs = [torch.randn(n, device=dev, dtype=torch.bfloat16) for _ in range(N_STEPS)]
    out = torch.empty(4096, device=dev)
    for progs in (256, 512, 1024, 2048):
        per = n // progs
        blk = 1024

        def runs(hot):
            def f():
                for i in range(N_STEPS):
                    _stream[(progs,)](bufs[0] if hot else bufs[i], out, per, BLOCK=blk, num_warps=4)
            return f
        cold = replay_ms(runs(False)) * 1e3 / N_STEPS
        hot = replay_ms(runs(True)) * 1e3 / N_STEPS
        mb = n * 2 / 1e6
        print(f"stream read {progs} progs {mb:5.1f} MB  cold {cold:6.2f} us ({mb / cold:5.2f} TB/s)  "
              f"L2-hot {hot:6.2f} us ({mb / hot:5.2f} TB/s)", flush=True)


if __name__ == "__main__":
    main()
