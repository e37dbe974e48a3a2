"""Probe: 16-row decode linears (Llama-3.2-1B shapes) in a cold chain, with and without the fused
norm, by configuration (session 12, GPU only; results in docs/bench/h100-session12.txt):
PYTHONPATH=. python scripts/probes/probe_m16.py

Each line: microseconds per launch of 40 launches on distinct weight copies in one CUDA graph
(weights cold, as in a decode step), and the weight bytes over that time."""
import torch

import tgraph.kernels.triton.gemv as gemv
from tgraph.kernels.triton.gemv import choose_config, small_m_linear

from graph_timing import replay_ms

N_STEPS = 40
M = 16


def main():
    dev = "cuda"
    torch.manual_seed(0)
    cases = [  # name, N, K, gated, norm, configs (None: the heuristic's)
        ("q|k|v norm", 3072, 2048, False, True, [None, (64, 256, 2, 4, 4), (64, 128, 1, 4, 4)]),
        ("q|k|v plain", 3072, 2048, False, False, [(64, 256, 1, 4, 4), (64, 128, 1, 4, 4)]),
        ("gate|up norm", 8192, 2048, True, True, [None]),
        ("gate|up plain", 8192, 2048, True, False, [(64, 128, 1, 4, 3)]),
        ("down", 2048, 8192, False, False, [None, (64, 256, 4, 4, 3), (128, 128, 8, 4, 3),
                                            (64, 128, 2, 4, 4), (32, 128, 4, 4, 4),
                                            (16, 256, 2, 4, 4)]),
        ("o", 2048, 2048, False, False, [None, (64, 128, 2, 4, 4), (64, 128, 4, 4, 4),
                                         (32, 256, 2, 4, 4), (16, 256, 2, 4, 4)]),
    ]
    for name, N, K, gated, norm, configs in cases:
        rows = 2 * N if gated else N
        ws = [torch.randn(rows, K, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(N_STEPS)]
        x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
        g = torch.ones(K, device=dev, dtype=torch.bfloat16)
        out = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
        work = torch.empty(1 << 22, device=dev, dtype=torch.float32)
        kw = dict(norm_eps=1e-6, norm_weight=g) if norm else {}
        for config in configs:
            cfg = config or choose_config(M, N, K, dev, gated=gated, norm=norm)
            for tma in (True, False):
                gemv.TMA_WEIGHTS = tma

                def chain():
                    for i in range(N_STEPS):
                        small_m_linear(x, ws[i], out, workspace=work, config=cfg, gated=gated, **kw)
                us = replay_ms(chain) * 1e3 / N_STEPS
                mb = rows * K * 2 / 1e6
                print(f"{name:14s} {str(cfg):22s} tma={int(tma)} {us:6.2f} us "
                      f"({mb / us:4.2f} TB/s)", flush=True)
        gemv.TMA_WEIGHTS = True
        del ws


if __name__ == "__main__":
    main()
