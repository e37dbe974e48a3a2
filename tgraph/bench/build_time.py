"""Measure one preset's engine build (record + passes + lowering + first decode step, which
compiles or loads the Triton kernels). Run as a subprocess by the model benchmark."""
from __future__ import annotations

import json
import sys
import time

import torch


def main(name: str) -> None:
    from tgraph.bench.models import decode_batch, random_model, random_weights
    from tgraph.models.presets import preset

    hf_config = preset(name)
    model = random_model(hf_config, random_weights(hf_config, torch.bfloat16, "cuda"),
                         max_model_len=1024)
    model.allocate_kv_cache(64)
    torch.cuda.synchronize()
    start = time.perf_counter()
    model.run(decode_batch(1, 512, model.llm_config.block_size))
    torch.cuda.synchronize()
    decode = time.perf_counter() - start
    print(json.dumps({"decode_engine_s": round(decode, 3),
                      "record_and_passes_s": round(sum(
                          model._graph_state().build_seconds.values()), 3)}))


if __name__ == "__main__":
    main(sys.argv[1])
