"""Tensor-parallel decode latency: ``torchrun --nproc-per-node N -m tgraph.bench.tp PRESET``.

Every rank draws only its own shard of random weights as the model loads it
(:class:`~tgraph.bench.random_loader.RandomWeightLoader`: a 70B model never exists whole), captures
decode graphs and times one decode step at context 512; rank 0 prints the table with the
per-rank weight-read bound (the rank's resident weight bytes over the copy bandwidth the same
run measured), whether the collectives were captured inside the CUDA graphs and how many graphs
one decode step replays. With N=1 it runs without torchrun as well: the one-GPU row of a model
that fits one GPU.

Options: ``--batches 1 16`` (decode batch sizes), ``--no-capture-collectives`` (run every
collective between graphs, as ``llm.engine.capture_collectives=false`` does), ``--nccl-only``
(no all-reduce over peer memory: ``llm.engine.tuning.all_reduce.peer=false``).
"""
from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from tgraph import envs
from tgraph.ir.ops import OpCategory, get_op
from tgraph.nn import distributed
from tgraph.tuning import Tuning


def decode_graph_report(engine: Any) -> dict[str, Any]:
    """How an engine's step splits between CUDA graphs and host segments.

    Args:
        engine: a built :class:`~tgraph.engine.Engine` (e.g. the decode engine).
    Returns:
        ``collectives`` (collective nodes), ``captured_collectives`` (those inside a device
        segment, i.e. replayed within a CUDA graph), ``graphs_per_step`` (device segments: one
        graph each once captured) and ``host_segments`` (run eagerly between the graphs).
    """
    collectives = captured = 0
    for seg in engine.segments:
        for node in seg.nodes:
            if get_op(node.op).category is OpCategory.COLLECTIVE:
                collectives += 1
                captured += int(seg.capturable)
    stats = engine.stats
    return {"collectives": collectives, "captured_collectives": captured,
            "graphs_per_step": stats.capturable_segments,
            "host_segments": stats.segment_count - stats.capturable_segments}


def rank_weight_bytes(engine: Any) -> int:
    """Bytes of the weights an engine holds (each storage counted once): this rank's shard."""
    seen, total = set(), 0
    for w in engine.weights.values():
        data = getattr(w, "qdata", w)
        key = (data.untyped_storage().data_ptr(), data.storage_offset(), tuple(data.shape))
        if key not in seen:
            seen.add(key)
            total += w.nbytes
    return total


def describe(report: dict[str, Any]) -> str:
    """One line for :func:`decode_graph_report`'s result."""
    n, k = report["collectives"], report["captured_collectives"]
    where = ("none" if n == 0 else "all captured" if k == n else
             "none captured" if k == 0 else f"{k} captured")
    return (f"{n} collectives ({where}), {report['graphs_per_step']} CUDA graphs and "
            f"{report['host_segments']} host segments per decode step")


def main(name: str, batches: Sequence[int] = (1, 16), capture_collectives: bool = True,
         peer: bool = True) -> None:
    """Time one decode step of preset ``name`` at each batch size on this rank's shard.

    Args:
        name: a model preset (``tgraph.models.presets``).
        batches: decode batch sizes.
        capture_collectives: record NCCL collectives capturable (one graph per step).
        peer: all-reduce small messages over peer memory (else NCCL only).
    """
    from tgraph.bench.models import CONTEXT, decode_batch
    from tgraph.bench.random_loader import RandomWeightLoader
    from tgraph.bench.timing import measure_ceilings, time_ms
    from tgraph.io.model_config import ModelConfig
    from tgraph.models.loading import build_model
    from tgraph.models.presets import preset

    info = None
    if envs.WORLD_SIZE is not None:  # torchrun (any N); a plain run is tp=1 without a group
        info = distributed.init_process_group(capture_collectives=capture_collectives)
    rank, ws = (info.rank, info.world_size) if info else (0, 1)
    device = torch.device("cuda", torch.cuda.current_device())
    hf_config = preset(name)
    loader = RandomWeightLoader(hf_config, device, torch.bfloat16, rank=rank, world_size=ws)
    tuning = Tuning()
    tuning = dataclasses.replace(tuning, all_reduce=dataclasses.replace(tuning.all_reduce,
                                                                        peer=peer))
    model = build_model(ModelConfig.from_dict(hf_config), loader, max_model_len=1024,
                        tuning=tuning)
    del loader
    torch.cuda.empty_cache()
    copy_gbps = measure_ceilings().copy_gbps
    model.allocate_kv_cache(max(batches) * (CONTEXT // 16 + 2) + 1)
    model.capture_decode_graphs(list(batches))
    rows = []
    for b in batches:
        meta = decode_batch(b, CONTEXT, model.llm_config.block_size)
        logits = model.run(meta)
        ms = time_ms(lambda: model.run(meta), warmup=3, iters=30)
        rows.append((b, ms, tuple(logits.shape)))
    engine = model.engines[(False, ())]
    bound_ms = rank_weight_bytes(engine) / (copy_gbps * 1e9) * 1e3
    if rank == 0:
        comm = "peer memory + NCCL" if peer and ws > 1 else "NCCL"
        print(f"{name} tp={ws} ({info.backend if info else 'no process group'}, {comm}): "
              f"{engine.stats.kernel_count} kernels; {describe(decode_graph_report(engine))}")
        print(f"  per-rank weight-read bound {bound_ms:.3f} ms ({copy_gbps:.0f} GB/s copy)")
        for b, ms, shape in rows:
            print(f"  batch {b:>3}: {ms:.3f} ms per decode step ({ms / bound_ms:.2f}x the "
                  f"bound; logits {shape})")
    model.release_graphs()  # graphs holding NCCL collectives go before the communicator
    distributed.destroy_process_group()


def _parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="torchrun --nproc-per-node N -m tgraph.bench.tp")
    parser.add_argument("preset", help="model preset, e.g. llama-3-8b")
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 16])
    parser.add_argument("--no-capture-collectives", action="store_true",
                        help="run the collectives between CUDA graphs instead of inside them")
    parser.add_argument("--nccl-only", action="store_true",
                        help="all-reduce through NCCL only (no peer-memory kernel)")
    return parser.parse_args(argv)


if __name__ == "__main__":
    args = _parse()
    main(args.preset, args.batches, not args.no_capture_collectives, not args.nccl_only)
