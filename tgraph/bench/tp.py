"""Tensor-parallel decode latency: ``torchrun --nproc-per-node N -m tgraph.bench.tp PRESET``.

Every rank builds the same random weights (same seed), loads its shard, captures decode graphs
and times one decode step at context 512; rank 0 prints the table. With N=1 it runs without
torchrun as well.
"""
from __future__ import annotations

import sys

import torch

from tgraph.bench.models import CONTEXT, _decode_batch, random_weights
from tgraph.bench.timing import time_ms
from tgraph.models.base.config import ModelConfig
from tgraph.models.base.weight_loader import DictWeightLoader
from tgraph.models.loading import build_model
from tgraph.models.presets import preset
from tgraph.nn import distributed


def main(name: str, batches=(1, 16)) -> None:
    info = distributed.init_process_group()
    rank, ws = info.rank, info.world_size
    device = torch.device("cuda", torch.cuda.current_device())
    hf_config = preset(name)
    weights = random_weights(hf_config, torch.bfloat16, str(device))
    loader = DictWeightLoader(weights, device=device, dtype=torch.bfloat16, rank=rank,
                              world_size=ws)
    model = build_model(ModelConfig.from_dict(hf_config), loader, max_model_len=1024)
    del weights, loader
    torch.cuda.empty_cache()
    model.allocate_kv_cache(max(batches) * (CONTEXT // 16 + 2) + 1)
    model.capture_decode_graphs(list(batches))
    rows = []
    for b in batches:
        meta = _decode_batch(b, CONTEXT, model.llm_config.block_size)
        logits = model.run(meta)
        ms = time_ms(lambda: model.run(meta), warmup=3, iters=30)
        rows.append((b, ms, tuple(logits.shape)))
    engine = model.engines[(False, ())]
    if rank == 0:
        print(f"{name} tp={ws}: {len(engine.segments)} segments "
              f"({engine.stats.capturable_segments} captured), {engine.stats.kernel_count} kernels")
        for b, ms, shape in rows:
            print(f"  batch {b:>3}: {ms:.3f} ms per decode step (logits {shape})")
    distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
