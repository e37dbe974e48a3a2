"""Profile one decode step of a preset: ``python -m tgraph.bench.profile PRESET [--batch B]``.

Prints the device time of the captured step alone (graph replays), the time of the whole
``model.run`` (input preparation included), and the CUDA kernels by total time (torch profiler).
``--prefill NxL`` profiles a prefill of N prompts of L tokens instead: its time, the host time
of the call, and the CPU and CUDA profiles. ``--ncu`` runs one captured decode step between
``cudaProfilerStart`` and ``cudaProfilerStop`` and nothing else, for Nsight Compute's
``--profile-from-start off`` (see :mod:`tgraph.bench.ncu_table` for the command and a summary).
``--quant int4|int8|fp8`` profiles the preset with its decoder linears quantized as
``tgraph bench models --quant`` holds them.
"""
from __future__ import annotations

import argparse

import torch

from tgraph.bench.models import captured_decode, prefill_batch, random_model, random_weights
from tgraph.bench.quant import QUANT_SCHEMES, quantize_linears, quantized_model
from tgraph.bench.timeline import print_timeline, profile_step
from tgraph.bench.timing import host_ms, time_ms
from tgraph.models.presets import preset


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("preset")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--trace", help="write a Chrome trace")
    parser.add_argument("--timeline", action="store_true",
                        help="also print the replayed step kernel by kernel "
                             "(tgraph.bench.timeline)")
    parser.add_argument("--ncu", action="store_true",
                        help="run one decode step inside cudaProfilerStart/Stop for ncu, no timing")
    parser.add_argument("--prefill", metavar="NxL",
                        help="profile a prefill of N prompts of L tokens instead of a decode step")
    parser.add_argument("--quant", choices=sorted(QUANT_SCHEMES),
                        help="the decoder layers' linears quantized to this scheme (as "
                             "`tgraph bench models --quant` holds them)")
    args = parser.parse_args()
    hf_config = preset(args.preset)
    weights = random_weights(hf_config, torch.bfloat16, "cuda")
    if args.quant:
        model = quantized_model(hf_config, weights, quantize_linears(weights, args.quant),
                                args.quant, max_model_len=4096)
    else:
        model = random_model(hf_config, weights, max_model_len=4096)
    del weights
    if args.prefill:
        profile_prefill(model, args.preset, args.prefill, args.trace)
        return
    b = args.batch
    meta = captured_decode(model, b)
    if args.ncu:
        profiled_step(lambda: model.run(meta))
        print(f"{args.preset} batch {b}: one decode step ran inside cudaProfilerStart/Stop")
        return
    engine = model.engines[(False, ())]
    graphs = model.decode_graphs(b)

    def replay():
        for g in graphs:
            g.replay()

    name = args.preset + (f" {args.quant}" if args.quant else "")
    print(f"{name} batch {b}: {len(graphs)} graph(s), {engine.stats.kernel_count} kernels, "
          f"{len(engine.segments)} segments")
    print(f"  graph replay only: {time_ms(replay, iters=100):.3f} ms")
    print(f"  model.run (inputs + replay + logits): {time_ms(lambda: model.run(meta)):.3f} ms")
    print(f"  host time of model.run (GPU idle before it): "
          f"{host_ms(lambda: model.run(meta), iters=50):.3f} ms")
    prof = _profile(lambda: model.run(meta), 20, args.trace)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25,
                                    max_name_column_width=60))
    if args.timeline:
        print_timeline(profile_step(replay), limit=None)


def profiled_step(step, warmup: int = 3) -> None:
    """Run ``step`` ``warmup`` times, then once between ``cudaProfilerStart`` and ``Stop``: the
    only kernels a profiler started with ``--profile-from-start off`` sees are that step's."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    try:
        step()
        torch.cuda.synchronize()
    finally:
        torch.cuda.profiler.stop()


def profile_prefill(model, name: str, shape: str, trace: str | None) -> None:
    """Time and profile one prefill of ``shape`` ("NxL") on a built model."""
    try:
        n, length = (int(v) for v in shape.lower().split("x"))
    except ValueError:
        raise SystemExit(f"--prefill expects NxL (e.g. 1x2048), got {shape!r}") from None
    block_size = model.llm_config.block_size
    model.allocate_kv_cache(n * -(-length // block_size) + 1)
    meta = prefill_batch(n, length, block_size)
    print(f"{name} prefill {n}x{length}: "
          f"{time_ms(lambda: model.run(meta), warmup=2, iters=10):.2f} ms per call, "
          f"host time {host_ms(lambda: model.run(meta), iters=5):.2f} ms")
    table = _profile(lambda: model.run(meta), 5, trace).key_averages()
    print(table.table(sort_by="cuda_time_total", row_limit=20, max_name_column_width=60))
    print(table.table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=60))


def _profile(step, runs: int, trace: str | None):
    """The torch profiler (CPU and CUDA) over ``runs`` calls of ``step``; writes a Chrome trace
    to ``trace`` when given."""
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(runs):
            step()
        torch.cuda.synchronize()
    if trace:
        prof.export_chrome_trace(trace)
    return prof


if __name__ == "__main__":
    main()
