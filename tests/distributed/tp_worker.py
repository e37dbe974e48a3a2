"""One rank of the tensor-parallel tests; ``test_tp_gloo.py`` launches it with torchrun.

Each rank joins the process group from torchrun's environment, checks the cross-rank config
check (equal configs pass, a value that differs on rank 1 is refused on every rank), runs the
collective ops on rank-dependent inputs, then loads every given checkpoint at this rank's shard
in each graph mode and generates (prefill + greedy decode steps). Results go to
``OUT/rank<r>.safetensors`` (tensors) and ``OUT/rank<r>.json`` (messages) for the test to compare
with a single-process run. With ``--fusion`` it also builds the all-reduce + add + RMSNorm
networks of :func:`fusion_network` fused and unfused on both backends, and runs the static models
with the ``AllReduceAddRmsNorm`` pass disabled too. With ``--fail-at-end``, rank 1 then raises
while rank 0 waits in a collective: the launch must end with the error, not hang.
"""
from __future__ import annotations

import argparse
import datetime
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch.distributed.elastic.multiprocessing.errors import record

# Three sequences of different lengths, so that prefill packs them and decode runs a batch.
PROMPTS: tuple[tuple[int, ...], ...] = ((1, 5, 9, 22, 7), (3, 4), (8,) * 10 + (9,))
BLOCK_SIZE = 16  # LlmConfig's default
BLOCKS_PER_SEQ = 2
MAX_MODEL_LEN = 64
DELIBERATE_FAILURE = "deliberate failure on rank 1"


def generate(model: Any, steps: int, forced: Sequence[Sequence[int]] | None = None
             ) -> tuple[list[torch.Tensor], list[list[int]]]:
    """Prefill :data:`PROMPTS`, then run ``steps`` decode steps.

    Args:
        model: a loaded model whose KV cache holds ``len(PROMPTS) * BLOCKS_PER_SEQ`` blocks.
        steps: decode steps after the prefill.
        forced: ``forced[i][s]`` is the token sequence ``s`` receives after step ``i`` instead
            of its greedy choice (teacher forcing, so that low-precision runs cannot diverge).
    Returns:
        the logits of every step (``[num_seqs, vocab]``, fp32 on CPU, prefill first) and the
        tokens fed after each step (``[steps + 1][num_seqs]``; the last row is never fed).
    """
    from tgraph.models.base.batch import BatchMeta

    tables = [[s * BLOCKS_PER_SEQ + b for b in range(BLOCKS_PER_SEQ)] for s in range(len(PROMPTS))]

    def slot(s: int, pos: int) -> int:
        return tables[s][pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE

    seqs = [list(p) for p in PROMPTS]
    meta = BatchMeta(
        input_ids=[t for p in seqs for t in p],
        position_ids=[i for p in seqs for i in range(len(p))],
        slots_mapping=[slot(s, i) for s, p in enumerate(seqs) for i in range(len(p))],
        query_lens=[len(p) for p in seqs], seq_len=[len(p) for p in seqs], block_table=tables)
    all_logits, fed = [], []
    for step in range(steps + 1):
        logits = model.run(meta).float().cpu()
        all_logits.append(logits)
        nxt = [int(t) for t in torch.argmax(logits, dim=-1)]
        if forced is not None:
            nxt = list(forced[step])
        fed.append(nxt)
        if step == steps:
            break
        for s, t in enumerate(nxt):
            seqs[s].append(t)
        meta = BatchMeta(input_ids=nxt, position_ids=[len(p) - 1 for p in seqs],
                         slots_mapping=[slot(s, len(p) - 1) for s, p in enumerate(seqs)],
                         query_lens=[1] * len(seqs), seq_len=[len(p) for p in seqs],
                         block_table=tables, is_prefill=False)
    return all_logits, fed


def collective_inputs(rank: int) -> torch.Tensor:
    """A rank-dependent input, so a wrong sum or a wrong order shows."""
    return torch.arange(12, dtype=torch.float32).reshape(3, 4) * (rank + 1) + 100 * rank


def _run_collectives(rank: int, device: torch.device) -> dict[str, torch.Tensor]:
    """all_reduce and all_gather (dims 0 and -1) through a built engine, outputs poisoned; on
    the default backend (``collective_*``) and on the Triton backend's collective kernels
    (``collective_triton_*``)."""
    from tgraph.nn import distributed
    from tgraph.nn.network_manager import new_network, recording
    from tgraph.nn.tensor import Tensor

    results = {}
    for backend, prefix in (("auto", "collective_"), ("triton", "collective_triton_")):
        with recording(new_network("collectives")) as net:
            x = Tensor("x", torch.float32, ("rows", 4))
            # The + 0.0 puts a pointwise op before the collective, so passes run around it.
            net.mark_output(distributed.all_reduce(x + 0.0), "reduced")
            net.mark_output(distributed.all_gather(x, dim=-1), "gathered_last")
            net.mark_output(distributed.all_gather(x, dim=0), "gathered_first")
        engine = net.build_engine(backend=backend)
        x_real = collective_inputs(rank).to(device)
        ws = distributed.world_size()
        outs = {"reduced": torch.full((3, 4), float("nan"), device=device),
                "gathered_last": torch.full((3, 4 * ws), float("nan"), device=device),
                "gathered_first": torch.full((3 * ws, 4), float("nan"), device=device)}
        engine.forward({"x": x_real}, outs)
        results.update({f"{prefix}{k}": v.cpu() for k, v in outs.items()})
    return results


FUSION_PASS = "AllReduceAddRmsNorm"
FUSION_ROWS, FUSION_IN, FUSION_HIDDEN = 8, 32, 16
FUSION_EPS = 1e-5
# variant -> what the network reduces and which extra outputs it marks
FUSION_VARIANTS = ("linear", "read_elsewhere", "input")
FUSION_BACKENDS = ("reference", "triton")


def fusion_inputs(rank: int) -> dict[str, torch.Tensor]:
    """Rank-dependent partial inputs (``x``, ``w``, ``p``) and shared ones (``residual``,
    ``g``), from a seed, so the test can recompute every rank's."""
    g = torch.Generator().manual_seed(1234)
    shared = {"residual": torch.randn(FUSION_ROWS, FUSION_HIDDEN, generator=g),
              "g": torch.rand(FUSION_HIDDEN, generator=g) + 0.5}
    g.manual_seed(100 + rank)
    return {"x": torch.randn(FUSION_ROWS, FUSION_IN, generator=g),
            "w": torch.randn(FUSION_HIDDEN, FUSION_IN, generator=g) / FUSION_IN ** 0.5,
            "p": torch.randn(FUSION_ROWS, FUSION_HIDDEN, generator=g), **shared}


def fusion_network(variant: str):
    """``rms_norm(residual + all_reduce(partial))`` and the new residual, where ``partial`` is
    ``x @ w.T`` (``linear``, also with the reduced value marked as an output:
    ``read_elsewhere``) or the graph input ``p`` (``input``)."""
    from tgraph.nn import distributed
    from tgraph.nn import functional as F
    from tgraph.nn.network_manager import new_network, recording
    from tgraph.nn.tensor import Tensor

    f32 = torch.float32
    with recording(new_network(f"fusion_{variant}")) as net:
        residual = Tensor("residual", f32, ("rows", FUSION_HIDDEN))
        g = Tensor("g", f32, (FUSION_HIDDEN,))
        if variant == "input":
            partial = Tensor("p", f32, ("rows", FUSION_HIDDEN))
        else:
            partial = F.linear(Tensor("x", f32, ("rows", FUSION_IN)),
                               Tensor("w", f32, (FUSION_HIDDEN, FUSION_IN)))
        reduced = distributed.all_reduce(partial)
        summed = residual + reduced  # the decoder's order: residual first
        net.mark_output(F.rms_norm(summed, g, FUSION_EPS), "normed")
        net.mark_output(summed, "summed")
        if variant == "read_elsewhere":
            net.mark_output(reduced, "reduced")
    return net


def _run_fusion(rank: int, device: torch.device) -> tuple[dict[str, torch.Tensor], dict]:
    """Every variant fused and unfused on both backends, outputs poisoned with NaN."""
    tensors, report = {}, {}
    inputs = {k: v.to(device) for k, v in fusion_inputs(rank).items()}
    for variant in FUSION_VARIANTS:
        for backend in FUSION_BACKENDS:
            for fused in (True, False):
                net = fusion_network(variant)
                names = [v.name for v in net.inputs]
                engine = net.build_engine(backend=backend,
                                          disabled_passes=() if fused else (FUSION_PASS,))
                given = {n: inputs[n].clone() for n in names}
                outs = {n: torch.full((FUSION_ROWS, FUSION_HIDDEN), float("nan"), device=device)
                        for n in engine.net.outputs}
                engine.forward(given, outs)
                key = f"fusion_{variant}_{backend}_{'fused' if fused else 'unfused'}"
                for n, t in outs.items():
                    tensors[f"{key}_{n}"] = t.cpu()
                nodes = [nd for nd in engine.net.nodes if nd.op == "all_reduce_add_rms_norm"]
                report[key] = {
                    "matches": next(r.matches for r in engine.pass_records
                                    if r.name == FUSION_PASS),
                    "in_place": [nd.attrs["reduce_in_place"] for nd in nodes],
                    "kernels": sorted({st.kernel_name for st in engine.plan.steps
                                       if "all_reduce" in st.kernel_name}),
                    "inputs_unchanged": all(torch.equal(given[n], inputs[n]) for n in names),
                }
    return tensors, report


def _config_checks(rank: int) -> dict[str, Any]:
    from tgraph.errors import ConfigError
    from tgraph.nn import distributed

    report: dict[str, Any] = {}
    # Byte strings of different lengths, one empty; the smallest of rank-dependent ints.
    report["gathered_bytes"] = [b.decode() for b in
                                distributed.all_gather_bytes(b"" if rank == 0 else b"xy")]
    report["min_over_ranks"] = distributed.min_over_ranks(10 + rank)
    distributed.check_same_config({"max_model_len": MAX_MODEL_LEN, "rank": rank})
    report["same_config_ok"] = True
    try:
        distributed.check_same_config({"max_model_len": MAX_MODEL_LEN if rank == 0 else 32,
                                       "block_size": BLOCK_SIZE}, what="test config")
        report["mismatch_error"] = None
    except ConfigError as err:
        report["mismatch_error"] = str(err)
    return report


def _engine_report(model: Any) -> dict[str, Any]:
    """Per built engine: fusion matches, collectives (and whether captured), CUDA graphs."""
    from tgraph.ir.ops import OpCategory, get_op

    out = {}
    for (is_prefill, _features), engine in model.engines.items():
        collectives = [(n.op, bool(n.attrs.get("capturable")), seg.capturable)
                       for seg in engine.segments for n in seg.nodes
                       if get_op(n.op).category is OpCategory.COLLECTIVE]
        out["prefill" if is_prefill else "decode"] = {
            "fusion_matches": sum(r.matches for r in engine.pass_records
                                  if r.name == FUSION_PASS),
            "fused_in_place": [n.attrs["reduce_in_place"] for n in engine.net.nodes
                               if n.op == "all_reduce_add_rms_norm"],
            "collectives": collectives,
            "segments": engine.stats.segment_count,
            "graphs_per_step": engine.stats.capturable_segments,
            "captured_signatures": engine.captured_signatures,
        }
    return out


@record  # torchrun's failure summary then carries the rank's traceback
def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--model", action="append", default=[],
                        help="NAME=DIR of a checkpoint (repeatable)")
    parser.add_argument("--modes", default="static,eager")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--forced", type=Path, help="JSON {name: tokens[step][seq]}")
    parser.add_argument("--capture", action="store_true", help="capture decode CUDA graphs")
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--fail-at-end", action="store_true")
    parser.add_argument("--fusion", action="store_true",
                        help="fusion networks, and static models without the fusion pass too")
    args = parser.parse_args(argv)

    from safetensors.torch import save_file

    from tgraph.models import load_model
    from tgraph.nn import distributed

    info = distributed.init_process_group(
        args.device, timeout=datetime.timedelta(seconds=args.timeout))
    r, ws = info.rank, info.world_size
    report = {"rank": r, "world_size": ws, "backend": info.backend, **_config_checks(r)}
    tensors = _run_collectives(r, info.device)
    if args.fusion:
        fusion_tensors, report["fusion"] = _run_fusion(r, info.device)
        tensors.update(fusion_tensors)
    forced = json.loads(args.forced.read_text()) if args.forced else {}
    runs = [(mode, mode, ()) for mode in args.modes.split(",")]
    if args.fusion and "static" in args.modes.split(","):
        runs.append(("static", "static_unfused", (FUSION_PASS,)))
    for spec in args.model:
        name, model_dir = spec.split("=", 1)
        for mode, label, disabled in runs:
            model = load_model(model_dir, graph=mode, rank=r, world_size=ws, device=args.device,
                               dtype=args.dtype, max_model_len=MAX_MODEL_LEN, progress=False,
                               disabled_passes=disabled)
            distributed.check_same_config(model.llm_config)
            model.allocate_kv_cache(len(PROMPTS) * BLOCKS_PER_SEQ)
            if args.capture:
                model.capture_decode_graphs([1, 2, 4])
            logits, fed = generate(model, args.steps, forced.get(name))
            for i, step_logits in enumerate(logits):
                tensors[f"{name}_{label}_step{i}"] = step_logits.contiguous()
            tensors[f"{name}_{label}_tokens"] = torch.tensor(fed, dtype=torch.int64)
            report.setdefault("engines", {})[f"{name}_{label}"] = _engine_report(model)
            model.release_graphs()  # graphs holding NCCL collectives go before the group
    args.out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(args.out / f"rank{r}.safetensors"))
    (args.out / f"rank{r}.json").write_text(json.dumps(report))
    # Both ranks have written their results before either may fail.
    torch.distributed.barrier()
    if args.fail_at_end:
        if r == 1:
            raise RuntimeError(DELIBERATE_FAILURE)
        # Rank 1 never joins: this must end in an error (peer gone / timeout), never hang.
        torch.distributed.all_reduce(torch.ones(1, device=info.device))
        (args.out / f"rank{r}.survived").write_text("the collective completed without rank 1")
    distributed.destroy_process_group()


if __name__ == "__main__":
    main()
