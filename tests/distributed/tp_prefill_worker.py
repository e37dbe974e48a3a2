"""One rank of the tensor-parallel prefill-graph test; ``test_tp_prefill_graphs.py`` launches it
with torchrun on 2 GPUs (NCCL).

For each way of placing the collectives (``in_graph``: inside the CUDA graphs, the default;
``between_graphs``: ``capture_collectives=False``, run between them), each rank loads the given
checkpoint at its shard in bf16 twice, with ``prefill_graph_tokens=PREFILL_GRAPH_TOKENS``
(``captured``) and ``0`` (``plain``), loads the multi-LoRA adapters, captures the decode graphs
and runs every case of :data:`CASES` (:func:`run_case`). The logits go to
``OUT/rank<r>.safetensors`` as ``<variant>_<captured|plain>_<case>``; ``OUT/rank<r>.json`` holds,
per model, the CUDA graphs each case's prefill replayed, the captured prefill signatures and the
prefill engines' segments. ``--device cpu`` takes the same steps on gloo with nothing captured (a
dry run of the worker itself).
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch.distributed.elastic.multiprocessing.errors import record

PREFILL_GRAPH_TOKENS = 512
MAX_MODEL_LEN = 512
NUM_BLOCKS = 128  # 16-token blocks: a case needs at most 17 of them
DECODE_BUCKETS = [1, 2, 4]
DECODE_STEPS = 3
MULTI_LORA = {"max_rank": 16, "max_loras": 3}
# Multi-LoRA adapters: name -> write_random_adapter kwargs (ranks and targets differ).
ADAPTERS: dict[str, dict[str, Any]] = {
    "a": dict(seed=1, rank=16, alpha=32),
    "b": dict(seed=2, rank=8, alpha=16, target_modules=["q_proj", "v_proj", "o_proj"]),
    "c": dict(seed=3, rank=4, alpha=8, target_modules=["gate_proj", "up_proj", "down_proj"]),
}
ADAPTER_B_STD = 0.05
# name -> (prompt lengths, adapter per sequence). Run in this order on every model:
# ``exact`` fills the (128 tokens, 4 sequences) signature with no padding, ``exact_256`` the
# (256, 2) one, whose larger shared arena releases the 128-token capture of the base engine,
# captured again by ``padded`` (37 tokens, 3 sequences -> 128, 4).
CASES: dict[str, tuple[tuple[int, ...], tuple[str | None, ...] | None]] = {
    "exact": ((50, 40, 30, 8), None),
    "exact_lora": ((50, 40, 30, 8), ("a", None, "b", "c")),
    "exact_256": ((200, 56), None),
    "padded": ((17, 5, 15), None),
    "padded_lora": ((17, 5, 15), ("b", None, "a")),
}
VARIANTS = {"in_graph": True, "between_graphs": False}  # -> capture_collectives

# CUDA graphs replayed so far in this process (counted by the patched CUDAGraph.replay).
REPLAYS = [0]


def count_replays() -> None:
    """Count every CUDA graph replay of this process in :data:`REPLAYS`."""
    replay = torch.cuda.CUDAGraph.replay

    def counted(graph: torch.cuda.CUDAGraph) -> None:
        REPLAYS[0] += 1
        replay(graph)

    torch.cuda.CUDAGraph.replay = counted


def run_case(model: Any, lengths: Sequence[int], loras: Sequence[str | None] | None,
             seed: int = 0) -> tuple[torch.Tensor, int]:
    """Prefill random prompts of ``lengths`` tokens in one batch, then decode ``DECODE_STEPS``
    fixed random tokens (not the model's own picks, so that runs compare the same tokens).

    Returns:
        fp32 logits ``[DECODE_STEPS + 1, len(lengths), vocab]`` on the CPU (the prefill's last
        token rows first), and the CUDA graphs the prefill step replayed.
    """
    from tgraph.testing import PagedBatcher

    vocab = model.llm_config.model.vocab_size
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]
    fed = torch.randint(0, vocab, (DECODE_STEPS, len(lengths)), generator=g).tolist()
    batcher = PagedBatcher.for_model(model)
    ids = [batcher.add(p) for p in prompts]
    batch = batcher.step(ids)
    assert batch.is_prefill
    batch.loras = loras
    before = REPLAYS[0]
    rows = [model.run(batch).float().cpu()]
    replays = REPLAYS[0] - before
    rows += [r.cpu() for r in batcher.decode_fed(model, ids, fed, loras)]
    return torch.stack(rows), replays


def prefill_report(model: Any) -> dict[str, Any]:
    """The live captured prefill signatures (``[engine, "prefill", tokens, sequences]``) and,
    per prefill engine, its segments and the CUDA graphs a captured step replays."""
    from tgraph.ir.ops import OpCategory, get_op

    engines = {}
    for (is_prefill, features), engine in model.engines.items():
        if not is_prefill:
            continue
        first_on_host = bool(engine.segments) and not engine.segments[0].capturable
        engines["+".join(features) or "base"] = {
            "segments": engine.stats.segment_count,
            # One graph per device segment, and one for the input copy before a host segment.
            "graphs_per_step": engine.stats.capturable_segments + int(first_on_host),
            "collectives_in_graph": [seg.capturable for seg in engine.segments
                                     for n in seg.nodes
                                     if get_op(n.op).category is OpCategory.COLLECTIVE],
        }
    signatures = sorted(["+".join(key[1]) or "base", *sig]
                        for (key, sig), handle in model._graph_state().captured.items()
                        if isinstance(sig, tuple) and model.engines[key].is_captured(handle))
    return {"engines": engines, "signatures": signatures}


def load(model_dir: str, rank: int, world_size: int, graph_tokens: int, adapters: Path,
         device: str) -> Any:
    """The model at this rank's shard, its adapters loaded and its decode graphs captured."""
    from tgraph.models import load_model

    model = load_model(model_dir, rank=rank, world_size=world_size, device=device,
                       dtype="bfloat16", max_model_len=MAX_MODEL_LEN,
                       prefill_graph_tokens=graph_tokens, progress=False,
                       features={"multi_lora": MULTI_LORA})
    for name in ADAPTERS:
        model.features["multi_lora"].load(name, adapters / name)
    model.allocate_kv_cache(NUM_BLOCKS)
    captured = model.capture_decode_graphs(DECODE_BUCKETS)
    assert captured == (sorted(DECODE_BUCKETS, reverse=True) if device == "cuda" else [])
    return model


@record  # torchrun's failure summary then carries the rank's traceback
def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True, help="checkpoint directory")
    parser.add_argument("--adapters", required=True, type=Path,
                        help="holds one PEFT adapter directory per name of ADAPTERS")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--device", default="cuda",
                        help="cpu: the same steps on gloo, nothing captured (a dry run)")
    args = parser.parse_args(argv)

    from safetensors.torch import save_file

    from tgraph.nn import distributed

    count_replays()
    tensors: dict[str, torch.Tensor] = {}
    report: dict[str, Any] = {}
    for variant, in_graph in VARIANTS.items():
        # Joins the group the first time; later it only sets how collectives are recorded.
        info = distributed.init_process_group(
            args.device, timeout=datetime.timedelta(seconds=args.timeout),
            capture_collectives=in_graph)
        report["backend"] = info.backend
        for label, graph_tokens in (("captured", PREFILL_GRAPH_TOKENS), ("plain", 0)):
            model = load(args.model, info.rank, info.world_size, graph_tokens, args.adapters,
                         args.device)
            name = f"{variant}_{label}"
            replays = {}
            for case, (lengths, loras) in CASES.items():
                tensors[f"{name}_{case}"], replays[case] = run_case(model, lengths, loras)
            report[name] = {"replays": replays, **prefill_report(model)}
            model.release_graphs()  # graphs holding NCCL collectives go before the group
            del model
            gc.collect()
            if args.device == "cuda":
                torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(args.out / f"rank{info.rank}.safetensors"))
    (args.out / f"rank{info.rank}.json").write_text(json.dumps(report))
    torch.distributed.barrier()
    distributed.destroy_process_group()


if __name__ == "__main__":
    main()
