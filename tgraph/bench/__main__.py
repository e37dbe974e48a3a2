"""``python -m tgraph.bench [kernels|models|lora|serve|cpu] [--json/--out FILE] [--png FILE]
[--presets ...]``

``cpu`` (no GPU needed): tokens/s of tgraph (fp32 and quantized) against transformers eager on
the CPU, SmolLM2-135M-Instruct's GGUF at batch 1 and 4; see :mod:`tgraph.bench.cpu`. Every
other bench needs a CUDA device.

``lora``: decode-step latency of the base model, a mixed batch of 4 adapters and a single
adapter (default: llama-3.2-1b, batch 16, context 512); see :mod:`tgraph.bench.lora`.

``serve``: ``tgraph serve`` under a replayed request mix (shared system prompt, Poisson arrivals
and a saturation run), with and without prefix caching, against offline ``LLM.generate``; see
:mod:`tgraph.bench.serve`.
"""
from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tgraph.bench")
    parser.add_argument("what", choices=("kernels", "models", "lora", "serve", "cpu", "all"),
                        nargs="?", default="all", help="all: kernels and models")
    parser.add_argument("--json", "--out", dest="json", help="write results as JSON")
    parser.add_argument("--png", help="draw a chart (models)")
    parser.add_argument("--presets", nargs="*", help="model presets (models, lora)")
    parser.add_argument("--batches", nargs="*", type=int,
                        help="decode batch sizes (models: 1 16 64; lora: 16)")
    parser.add_argument("--peers", nargs="*", default=["hf", "compile"],
                        help="peers to measure: hf (eager), compile (StaticCache + torch.compile)")
    parser.add_argument("--quant", nargs="*", choices=("int4", "int8", "fp8", "fp8-a8", "all"),
                        help="models: the quantized models (int4 g128, int8 and fp8 per channel; "
                             "fp8-a8: fp8 with e4m3 activations in prefill) next to bf16 in the "
                             "same run")
    parser.add_argument("--cpu-experts", action="store_true",
                        help="models: MoE presets run tgraph static against the same model with "
                             "half the layers' experts on the CPU (no peers)")
    parser.add_argument("--profile", action="store_true",
                        help="lora: also print each system's kernels by time (torch profiler) and "
                             "its step kernel by kernel (tgraph.bench.timeline)")
    parser.add_argument("--rates", nargs="*", type=float, default=[4.0, 16.0],
                        help="serve: Poisson arrival rates, requests/s (besides saturation)")
    parser.add_argument("--num-requests", type=int, default=256, help="serve: requests per run")
    parser.add_argument("--system-tokens", type=int, default=1024,
                        help="serve: length of the shared system prompt")
    parser.add_argument("--max-tokens", type=int,
                        help="serve: tokens generated per request (128); cpu: new tokens per "
                             "prompt (64)")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", help="serve: a setting for the model and server")
    parser.add_argument("--server-arg", dest="server_args", action="append", default=[],
                        metavar="ARG", help="serve: an option for `tgraph serve` (repeat: "
                                            "--server-arg=--in-process)")
    parser.add_argument("--gguf", help="cpu: the GGUF file (default: SmolLM2-135M-Instruct Q4_1)")
    parser.add_argument("--random-model", action="store_true",
                        help="cpu: the smollm2-135m shape with random weights (fp32 only)")
    parser.add_argument("--threads", type=int, help="cpu: torch threads (default: all cores)")
    args = parser.parse_args(argv)
    import torch

    if args.what == "cpu":
        from tgraph.bench.cpu import run_cpu_bench

        run_cpu_bench(args.gguf, args.batches or [1, 4], args.max_tokens or 64, args.json,
                      random_model=args.random_model, threads=args.threads)
        return 0
    if not torch.cuda.is_available():
        print("tgraph.bench needs a CUDA device", file=sys.stderr)
        return 2
    if args.what in ("kernels", "all"):
        from tgraph.bench.kernels import run_kernel_bench

        run_kernel_bench(args.json if args.what == "kernels" else None)
    if args.what in ("models", "all"):
        from tgraph.bench.models import run_model_bench

        quant = None
        if args.quant is not None:
            quant = ["int4", "int8", "fp8", "fp8-a8"] if "all" in args.quant or not args.quant \
                else list(dict.fromkeys(args.quant))
        run_model_bench(args.presets, args.batches or [1, 16, 64], args.peers, args.json,
                        args.png, quant, cpu_experts=args.cpu_experts)
    if args.what == "serve":
        from tgraph.bench.serve import run_serve_bench

        for name in args.presets or [None]:
            run_serve_bench(name, num_requests=args.num_requests, rates=args.rates,
                            system_tokens=args.system_tokens, max_tokens=args.max_tokens or 128,
                            settings=args.overrides, json_path=args.json, png_path=args.png,
                            server_args=args.server_args)
    if args.what == "lora":
        from tgraph.bench.lora import run_lora_bench

        run_lora_bench(args.presets, args.batches or [1, 16, 64], args.json, profile=args.profile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
