"""Probe: where the host time of a captured decode step goes (session 12, GPU only; results in
docs/bench/h100-session12.txt):
PYTHONPATH=. python scripts/probes/probe_host.py [PRESET] [BATCH]

Prints the event-timed ``model.run`` and graph replay, the host time of ``model.run`` and of a
bare ``CUDAGraph.replay``, and a cProfile of many ``model.run`` calls (each after a sync, so the
GPU is idle when the call starts, as in a step loop that samples from the logits)."""
import cProfile
import pstats
import sys

import torch

from tgraph.bench.models import captured_decode, random_model, random_weights
from tgraph.bench.timing import host_ms, time_ms
from tgraph.models.presets import preset


def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else "qwen2.5-0.5b"
    batch = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    hf_config = preset(name)
    model = random_model(hf_config, random_weights(hf_config, torch.bfloat16, "cuda"),
                         max_model_len=4096)
    meta = captured_decode(model, batch)
    graphs = model.decode_graphs(batch)
    run = lambda: model.run(meta)  # noqa: E731
    replay = lambda: [g.replay() for g in graphs]  # noqa: E731
    for _ in range(3):
        print(f"{name} b{batch}: model.run {time_ms(run, iters=200):.4f} ms | replay "
              f"{time_ms(replay, iters=200):.4f} ms | host of model.run "
              f"{host_ms(run, iters=200):.4f} ms | host of replay {host_ms(replay, iters=200):.4f} ms",
              flush=True)
    state = model._graph_state()
    key = (False, ())
    bucket = state._bucket(batch)
    staging, handle = state._staging[(key, bucket)], state.captured[(key, bucket)]
    engine = state.engines[key]
    pieces = {
        "batch.validate": meta.validate,
        "_features_for": lambda: state._features_for(meta),
        "_bucket + _can_capture": lambda: (state._can_capture(), state._bucket(batch)),
        "_update_model_inputs": lambda: model._update_model_inputs(meta),
        "staging.write": lambda: staging.write(meta, {}),
        "CUDAGraph.replay (launch)": graphs[0].replay,
        "engine.replay (launch + output clone)": lambda: engine.replay(handle),
        "staging.mark_replayed": staging.mark_replayed,
        "model.run": run,
    }
    for label, fn in pieces.items():
        print(f"  host us {label:40s} {host_ms(fn, iters=300) * 1e3:7.1f}", flush=True)
    profiler = cProfile.Profile()
    for _ in range(2000):
        torch.cuda.synchronize()
        profiler.enable()
        run()
        profiler.disable()
    stats = pstats.Stats(profiler)
    stats.sort_stats("tottime").print_stats(25)
    stats.sort_stats("cumulative").print_stats(25)


if __name__ == "__main__":
    main()
