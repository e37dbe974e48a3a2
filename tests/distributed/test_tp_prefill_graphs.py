"""Prefill from CUDA graphs on models spread over several GPUs: tensor parallel at 2 ranks
(``tp_prefill_worker.py`` under torchrun, NCCL) and a model whose layers rules split over 2 GPUs
(in this process). Both need 2 GPUs; the check of the all-reduce route at prefill sizes runs on
the CPU.

Each GPU test runs the same cases on a model with prefill graphs (``prefill_graph_tokens`` 512)
and on one without (0), both in bf16 with decode graphs, and feeds both the same fixed decode
tokens (see :func:`tests.distributed.tp_prefill_worker.run_case`).

Bounds:

* ``exact`` cases fill their signature (128 tokens in 4 sequences, or 256 in 2): the captured
  graph runs the very kernels the uncaptured step launches, on the same shapes (cuBLAS GEMMs,
  Triton kernels, the same all-reduce path for the same message size; the peer all-reduce's sum
  equals NCCL's bit for bit at 2 ranks, ``test_peer_allreduce_gpu.py``), so the prefill logits,
  the KV cache and every decode step after it are **bit-identical**.
* ``padded`` cases (37 tokens in 3 sequences, run as 128 in 4) hand cuBLAS 128 rows instead of
  37, for which it may pick another GEMM: fp32 accumulation in another order, each op rounded to
  bf16 (unit roundoff 2^-9). Through 2 layers and the LM head that moves logits by a few units
  in the last place of the largest logit, as in ``tests/models/test_lora_gpu.py``: bound
  ``max|d| <= 2e-2 * max|logits|``, and every prefill row's argmax agrees unless its top two
  logits are within that bound (a near-tie rounding may flip).
* The adapters of the LoRA cases move their sequences' logits by more than ``ADAPTER_EFFECT``
  (5x the padded bound) against the base model's, so a graph that dropped them fails.

Structure: every prefill of the captured model replays its engine's CUDA graphs (one graph per
step when the collectives are inside it, several with ``capture_collectives=False``, one per
device segment when placed), the plain model's none; the captured signatures are the expected
buckets, and the placed model's buckets share one arena set spanning both GPUs.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.distributed.launch import run_torchrun
from tests.distributed.tp_prefill_worker import (
    ADAPTER_B_STD,
    ADAPTERS,
    CASES,
    DECODE_BUCKETS,
    MAX_MODEL_LEN,
    NUM_BLOCKS,
    PREFILL_GRAPH_TOKENS,
    VARIANTS,
    count_replays,
    run_case,
)
from tgraph.kernels.triton.peer_allreduce import PeerBuffers, fits, fits_polled
from tgraph.models.base.batch import prefill_token_bucket
from tgraph.tuning import AllReduceTuning, Tuning

TWO_GPUS = torch.cuda.is_available() and torch.cuda.device_count() >= 2

WORKER = Path(__file__).resolve().with_name("tp_prefill_worker.py")
LAUNCH_TIMEOUT_S = 600.0
# A tiny Llama: heads, KV heads, MLP and vocabulary split 2 ways.
SHAPES: dict[str, Any] = dict(hidden_size=256, intermediate_size=512, num_attention_heads=8,
                              num_key_value_heads=2, num_hidden_layers=2, vocab_size=2048,
                              tie_word_embeddings=False)
TOL = 2e-2  # bf16, padded cases (see the module docstring)
ADAPTER_EFFECT = 0.1
# Signatures each model captures (engine, tokens, sequences): ``exact_256`` grew the base
# engine's arena, which released its first (128, 4) capture; ``padded`` captured it again.
SIGNATURES = [["base", "prefill", 128, 4], ["base", "prefill", 256, 2],
              ["multi_lora", "prefill", 128, 4]]


# ---- CPU: the all-reduce route at prefill sizes ------------------------------------------------

def _peer_buffers_as_made(tuning: AllReduceTuning, world_size: int = 2) -> PeerBuffers:
    """Peer buffers of the sizes ``peer_memory`` makes for ``tuning`` (bf16, no allocation of
    the peer memory itself)."""
    largest = max(tuning.one_shot_max_bytes, tuning.two_shot_max_bytes)
    half = -(-largest * world_size // 256) * 256
    polled = -(-tuning.polled_max_bytes * world_size // 256) * 256
    data_offset, polled_offset, _ = PeerBuffers.layout(world_size, tuning.programs, half, polled)
    return PeerBuffers(torch.zeros(world_size, dtype=torch.int64),
                       torch.zeros(tuning.programs, dtype=torch.int32), 0, world_size,
                       tuning.programs, data_offset, half, polled_offset, polled, 2,
                       torch.zeros(2, tuning.programs, dtype=torch.int32))


def test_prefill_messages_take_the_peer_all_reduce_only_where_they_fit(monkeypatch):
    """The peer buffers are sized for decode messages: a prefill's all-reduce goes over them
    only when its rows fit the programs' slots, else NCCL, for every token bucket and for the
    odd row counts of uncaptured prefills (where a message under the size limit may still not
    fit: 100 rows of 10240 put 4 rows in a program's 64 KB slot)."""
    from tgraph.kernels.triton_backend import collective

    tuning = AllReduceTuning()
    settings = Tuning(all_reduce=tuning)
    buffers = _peer_buffers_as_made(tuning)
    monkeypatch.setattr(collective, "peer_buffers", lambda x, t: buffers)
    buckets = sorted({prefill_token_bucket(n, 4096) for n in range(1, 4097)})
    routes = {}
    for rows in [*buckets, 37, 100, 129]:
        for hidden in (1024, 2048, 4096, 8192, 10240):
            x = torch.empty(rows, hidden, dtype=torch.bfloat16)
            peer, path = collective._peer_route(x, settings)
            routes[rows, hidden] = path
            if peer is None:
                assert path == "nccl"
            else:
                assert (fits_polled if path == "polled" else fits)(peer, x), (rows, hidden, path)
            if x.numel() * 2 > tuning.one_shot_max_bytes:
                assert path == "nccl", (rows, hidden)
    # Small buckets do go over peer memory, larger ones and the misfit over NCCL.
    assert routes[128, 1024] == "polled" and routes[128, 2048] == "one-shot"
    assert routes[256, 4096] == "one-shot" and routes[512, 4096] == "nccl"
    assert routes[100, 10240] == "nccl"


# ---- GPU: tensor parallel at 2 ranks ---------------------------------------------------------

def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """``max|got - ref| / max|ref|``: the difference relative to the logit scale."""
    return float((got.double() - ref.double()).abs().max() / ref.double().abs().max())


def _check_case(case: str, got: torch.Tensor, ref: torch.Tensor, where: str) -> None:
    """Captured (``got``) against uncaptured (``ref``) logits of one case, by the bounds of the
    module docstring."""
    assert got.shape == ref.shape and torch.isfinite(got).all(), where
    err = _rel_err(got, ref)
    print(f"\n{where}: max relative difference {err:.2e}, bit-identical {torch.equal(got, ref)}")
    if case.startswith("exact"):
        assert torch.equal(got, ref), f"{where}: captured != uncaptured at an exact bucket " \
                                      f"({err:.2e})"
        return
    assert err <= TOL, f"{where}: relative difference {err:.2e} > {TOL}"
    prefill, want = got[0], ref[0]
    top2 = want.topk(2, dim=-1).values
    near_tie = (top2[:, 0] - top2[:, 1]) <= 2 * TOL * want.abs().max()
    agree = prefill.argmax(-1) == want.argmax(-1)
    assert bool((agree | near_tie).all()), f"{where}: a prefill row picks another token"


def _check_adapters_matter(traces: dict[str, torch.Tensor], where: str) -> None:
    """The LoRA cases' adapted sequences are far from the same prompts run without adapters."""
    for case, (_, loras) in CASES.items():
        if loras is None:
            continue
        base = traces[case.removesuffix("_lora")]
        for i, name in enumerate(loras):
            if name is not None:
                effect = _rel_err(traces[case][:, i], base[:, i])
                assert effect > ADAPTER_EFFECT, f"{where} {case}: adapter {name!r} barely " \
                                                f"matters ({effect:.2e})"


@pytest.fixture(scope="module")
def tp_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny Llama checkpoint and its multi-LoRA adapters (random, non-zero B)."""
    from tgraph.bench.lora import write_random_adapter
    from tgraph.io.model_config import ModelConfig
    from tgraph.testing import make_tiny_hf_model

    root = tmp_path_factory.mktemp("tp_prefill")
    path = make_tiny_hf_model("llama", root / "llama", seed=11, **SHAPES)
    config = ModelConfig.from_dict(json.loads((path / "config.json").read_text()))
    for name, kwargs in ADAPTERS.items():
        write_random_adapter(root / "adapters" / name, config, b_std=ADAPTER_B_STD, **kwargs)
    return path, root / "adapters"


@pytest.mark.gpu
@pytest.mark.skipif(not TWO_GPUS, reason="needs 2 GPUs")
def test_tp2_captured_prefill_matches_uncaptured(tp_checkpoint, tmp_path):
    from safetensors.torch import load_file

    model_dir, adapters = tp_checkpoint
    out = tmp_path / "out"
    job = run_torchrun([str(WORKER), "--model", str(model_dir), "--adapters", str(adapters),
                        "--out", str(out)], timeout=LAUNCH_TIMEOUT_S, nproc=2,
                       TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NCCL_NVLS_ENABLE="0")
    assert job.rc == 0, f"the launch failed:\n{job.output[-8000:]}"
    ranks = [load_file(str(out / f"rank{r}.safetensors")) for r in range(2)]
    for r in range(2):
        report = json.loads((out / f"rank{r}.json").read_text())
        assert report["backend"] == "nccl"
        for variant, in_graph in VARIANTS.items():
            captured, plain = report[f"{variant}_captured"], report[f"{variant}_plain"]
            assert captured["signatures"] == SIGNATURES, captured["signatures"]
            assert plain["signatures"] == []
            for engine, seen in captured["engines"].items():
                assert seen["collectives_in_graph"], f"{engine}: no collective at world size 2"
                if in_graph:
                    # The whole prefill step, its collectives included, is one graph.
                    assert seen["segments"] == seen["graphs_per_step"] == 1, (engine, seen)
                    assert all(seen["collectives_in_graph"]), (engine, seen)
                else:
                    assert not any(seen["collectives_in_graph"]), (engine, seen)
                    assert seen["graphs_per_step"] > 1, (engine, seen)
            graphs = {"base": captured["engines"]["base"]["graphs_per_step"],
                      "lora": captured["engines"]["multi_lora"]["graphs_per_step"]}
            for case, (_, loras) in CASES.items():
                want = graphs["base" if loras is None else "lora"]
                assert captured["replays"][case] == want, (r, variant, case, captured["replays"])
                assert plain["replays"][case] == 0, (r, variant, case, plain["replays"])
            traces = {case: ranks[r][f"{variant}_captured_{case}"] for case in CASES}
            for case in CASES:
                _check_case(case, traces[case], ranks[r][f"{variant}_plain_{case}"],
                            f"rank {r} {variant} {case}")
            _check_adapters_matter(traces, f"rank {r} {variant}")
    # Both ranks hold the same all-gathered logits.
    for key in ranks[0]:
        assert torch.equal(ranks[0][key], ranks[1][key]), key


# ---- GPU: layers placed on 2 GPUs by rules ---------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not TWO_GPUS, reason="needs 2 GPUs")
def test_prefill_of_a_model_split_over_two_gpus_replays_graphs(tmp_path, monkeypatch):
    """Rules put layer 1 and the final norm on cuda:1 (as ``configs/rules/two_gpus.yaml`` does
    for Llama-3.2-1B's layers 8-15): the prefill replays one graph per device segment, like
    decode, and its buckets share one arena set holding an arena on each GPU."""
    from tgraph.models import load_model
    from tgraph.testing import make_tiny_hf_model

    # Restored after the test: count_replays wraps it.
    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", torch.cuda.CUDAGraph.replay)
    count_replays()
    path = make_tiny_hf_model("llama", tmp_path / "llama", seed=4, **SHAPES)
    rules = [{"match": {"name": pattern}, "replace": {"class": "default",
                                                      "kwargs": {"device": "cuda:1"}}}
             for pattern in (r"^model\.layers\.1$", r"^model\.norm$")]
    cases = {case: lengths for case, (lengths, loras) in CASES.items() if loras is None}
    traces: dict[str, dict[str, torch.Tensor]] = {}
    for label, graph_tokens in (("captured", PREFILL_GRAPH_TOKENS), ("plain", 0)):
        model = load_model(path, device="cuda:0", dtype="bfloat16", max_model_len=MAX_MODEL_LEN,
                           rules=rules, prefill_graph_tokens=graph_tokens)
        model.allocate_kv_cache(NUM_BLOCKS)
        assert model.capture_decode_graphs(DECODE_BUCKETS)
        assert model.kv_caches[1][0].device == torch.device("cuda", 1)
        engine_key = (True, ())
        traces[label] = {}
        for case, lengths in cases.items():
            traces[label][case], replays = run_case(model, lengths, None)
            engine = model.engines[engine_key]
            devices = {s.device for s in engine.segments if s.capturable}
            assert devices == {"cuda:0", "cuda:1"}, devices
            first_on_host = not engine.segments[0].capturable  # then the copy has a graph
            want = engine.stats.capturable_segments + first_on_host if graph_tokens else 0
            assert replays == want, (label, case, replays, want)
        captured = model._graph_state().captured
        signatures = sorted(sig for key, sig in captured if key == engine_key
                            and isinstance(sig, tuple))
        if graph_tokens:
            assert signatures == [("prefill", 128, 4), ("prefill", 256, 2)], signatures
            small, large = (captured[engine_key, sig].capture for sig in signatures)
            assert small.shared is not None and small.shared is large.shared
            assert set(small.shared.arenas) == {"cuda:0", "cuda:1"}
        else:
            assert signatures == []
        model.release_graphs()
        del model
    for case in cases:
        _check_case(case, traces["captured"][case], traces["plain"][case], f"two GPUs {case}")
