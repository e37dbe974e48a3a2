"""``python -m tgraph.bench [kernels|models] [--json FILE] [--png FILE] [--presets ...]``"""
from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tgraph.bench")
    parser.add_argument("what", choices=("kernels", "models", "all"), nargs="?", default="all")
    parser.add_argument("--json", help="write results as JSON")
    parser.add_argument("--png", help="draw a chart (models)")
    parser.add_argument("--presets", nargs="*", help="model presets (models)")
    parser.add_argument("--batches", nargs="*", type=int, default=[1, 16, 64])
    parser.add_argument("--peers", nargs="*", default=["hf", "compile"],
                        help="peers to measure: hf (eager), compile (StaticCache + torch.compile)")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("tgraph.bench needs a CUDA device", file=sys.stderr)
        return 2
    if args.what in ("kernels", "all"):
        from tgraph.bench.kernels import run_kernel_bench

        run_kernel_bench(args.json if args.what == "kernels" else None)
    if args.what in ("models", "all"):
        from tgraph.bench.models import run_model_bench

        run_model_bench(args.presets, args.batches, args.peers, args.json, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
