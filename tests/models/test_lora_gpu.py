"""Multi-LoRA decode under CUDA graphs equals multi-LoRA decode without them (CUDA, bf16/fp16).

Two models with the same random weights at Llama-3.2-1B widths (2 layers, 32k vocabulary) and
``multi_lora`` (max_rank 16, 3 slots): one with decode CUDA graphs (``capture_decode_graphs``,
the LoRA decode engine captured lazily), one with ``cuda_graph=False``. Both prefill the same
prompts and then decode the same *fixed* token sequence (not their own argmax, so a tiny
difference cannot make them compare different tokens); every logit row is compared.

Adapters differ in rank (16, 8, 4) and targets, so each slot is padded differently, and every
batch mixes them with base-model (no adapter) requests.

Bounds:

* At 4 requests (a captured bucket, no padding) every decode kernel is a Triton kernel
  (``prefer_small_m`` sends linears of <= 4 rows, the LoRA linears' single GEMMs on
  ``[x | shrink]`` included, to the small-M kernel; attention, norms and ``lora_shrink_concat``
  are Triton): the same deterministic kernels on the same shapes, replayed from a
  graph or launched one by one, give **bit-identical** logits. Both models prefill uncaptured
  (``prefill_graph_tokens=0``): a captured prefill pads 119 tokens to the 128-token bucket, where
  cuBLAS may take another kernel than at 119 rows (on an H200 in fp16 it did: 7e-4 apart), and
  the KV cache it writes would then differ for every decode step after it. Captured LoRA
  prefills are compared with a tolerance in ``test_lora_stacking``.
* At 7 requests the captured run pads to bucket 8, the uncaptured one does not, and cuBLAS may
  pick another GEMM for 8 rows than for 7: fp32 accumulation in another order, each op rounded
  to bf16 (unit roundoff 2^-9) / fp16 (2^-11). Through 2 layers and the LM head that moves
  logits by a few units in the last place of the largest logit: bound ``max|d| <= 2e-2`` (bf16)
  / ``5e-3`` (fp16) times ``max|logits|``.
* Every adapter moves the logits of its requests by more than ``ADAPTER_EFFECT`` = 0.2 relative
  (checked against a base-model run of the same tokens), 10x the loosest bound, so a captured
  graph that dropped the adapters or read stale adapter weights fails.
"""
from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import pytest
import torch

from tgraph.bench.lora import write_random_adapter
from tgraph.bench.models import random_weights
from tgraph.io.model_config import ModelConfig
from tgraph.io.weights import DictWeightLoader
from tgraph.models.loading import build_model
from tgraph.testing import PagedBatcher

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
CONFIG: dict[str, Any] = dict(
    model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=32000, hidden_size=2048,
    intermediate_size=8192, num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=8,
    head_dim=64, rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=4096,
    tie_word_embeddings=False, torch_dtype="bfloat16")
MAX_RANK = 16
MAX_LORAS = 3
MAX_MODEL_LEN = 512
NUM_BLOCKS = 128  # 16-token blocks: 8 sequences of up to ~130 tokens need < 80
BUCKETS = [4, 8]
DECODE_STEPS = 4
PROMPT_LENGTHS = (5, 17, 33, 64, 3, 120, 9, 40)

# name -> write_random_adapter kwargs. B's scale is chosen so each adapter matters (see above).
ADAPTERS: dict[str, dict[str, Any]] = {
    "a": dict(seed=1, rank=16, alpha=32),
    "b": dict(seed=2, rank=8, alpha=16, target_modules=["q_proj", "v_proj", "o_proj"]),
    "c": dict(seed=3, rank=4, alpha=8, target_modules=["gate_proj", "up_proj", "down_proj"]),
    "d": dict(seed=4, rank=16, alpha=32, target_modules=["q_proj", "k_proj", "v_proj",
                                                          "o_proj", "down_proj"]),
}
B_STD = 0.05
TOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3}
ADAPTER_EFFECT = 0.2


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("lora_gpu")
    config = ModelConfig.from_dict(CONFIG)
    for name, kwargs in ADAPTERS.items():
        write_random_adapter(root / name, config, b_std=B_STD, **kwargs)
    return root


def build(weights: dict[str, torch.Tensor], dtype: torch.dtype, cuda_graph: bool,
          merge: bool = False) -> Any:
    """A multi-LoRA model over ``weights`` with its KV cache (and graphs when ``cuda_graph``);
    the single adapter recorded in its own engines unless ``merge``."""
    model = build_model(ModelConfig.from_dict(CONFIG),
                        DictWeightLoader(weights, device=DEVICE, dtype=dtype),
                        max_model_len=MAX_MODEL_LEN, cuda_graph=cuda_graph,
                        prefill_graph_tokens=0,
                        features={"multi_lora": {"max_rank": MAX_RANK, "max_loras": MAX_LORAS},
                                  "single_lora": {"max_rank": MAX_RANK, "merge": merge}})
    model.allocate_kv_cache(NUM_BLOCKS)
    captured = model.capture_decode_graphs(BUCKETS)
    assert captured == (sorted(BUCKETS, reverse=True) if cuda_graph else [])
    return model


@pytest.fixture(scope="module", params=[torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def models(request, adapter_dir: Path):
    """``(captured, uncaptured)`` models with the same weights; multi-LoRA adapters a, b, c
    loaded, single-LoRA adapters a and d loaded (none active)."""
    dtype = request.param
    # NOTE: each model gets its own copy of the (seeded, identical) weights: a loader may hand
    # out the given tensors themselves, and load-time rewrites must not see another model's.
    pair = tuple(build(random_weights(CONFIG, dtype, DEVICE), dtype, graphs)
                 for graphs in (True, False))
    for model in pair:
        for name in ("a", "b", "c"):
            model.features["multi_lora"].load(name, adapter_dir / name)
        for name in ("a", "d"):
            model.features["single_lora"].load(name, adapter_dir / name)
    yield dtype, pair
    del pair
    gc.collect()
    torch.cuda.empty_cache()


def decode_trace(model: Any, loras: list[str | None], seed: int = 0) -> torch.Tensor:
    """Prefill ``len(loras)`` prompts in one batch, then decode ``DECODE_STEPS`` fixed tokens.

    Returns:
        fp32 logits ``[DECODE_STEPS + 1, len(loras), vocab]``: the prefill's last-token row,
        then one row per decode step.
    """
    g = torch.Generator().manual_seed(seed)
    vocab = CONFIG["vocab_size"]
    n = len(loras)
    prompts = [torch.randint(0, vocab, (length,), generator=g).tolist()
               for length in PROMPT_LENGTHS[:n]]
    fed = torch.randint(0, vocab, (DECODE_STEPS, n), generator=g).tolist()
    batcher = PagedBatcher.for_model(model)
    ids = [batcher.add(p) for p in prompts]
    batch = batcher.step(ids)
    batch.loras = loras
    rows = [model.run(batch).float().clone()] + batcher.decode_fed(model, ids, fed, loras)
    out = torch.stack(rows)
    assert torch.isfinite(out).all(), "non-finite logits"
    return out


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """``max|got - ref| / max|ref|``: the error relative to the logit scale."""
    return float((got.double() - ref.double()).abs().max() / ref.double().abs().max())


def lora_decode_captures(model: Any, feature: str = "multi_lora") -> int:
    """Captured signatures of the decode engine of ``feature`` (0 if it was never built)."""
    engine = model.engines.get((False, (feature,)))
    return 0 if engine is None else engine.captured_signatures


def check_adapters_matter(model: Any, trace: torch.Tensor, loras: list[str | None],
                          tol: float) -> None:
    """Every adapted request's logits are far (> ADAPTER_EFFECT) from a base-model run of the
    same tokens; the requests without adapter are within ``tol`` of it (the base run uses the
    engine without LoRA, whose fusions may round differently, so not bit for bit)."""
    base = decode_trace(model, [None] * len(loras))
    for i, name in enumerate(loras):
        effect = rel_err(trace[:, i], base[:, i])
        if name is None:
            assert effect <= tol, f"request {i} (no adapter) differs from the base run: {effect}"
        else:
            assert effect > ADAPTER_EFFECT, f"adapter {name!r} barely matters ({effect})"


# 4 requests: a bucket, Triton kernels only -> bit-identical. 7: padded to 8 -> tolerance.
MIXES = {"bucket4": ["a", None, "b", "c"], "padded7": ["a", None, "b", "c", None, "a", "b"]}


@pytest.mark.parametrize("mix", list(MIXES))
def test_captured_mixed_lora_decode_equals_uncaptured(models, mix):
    dtype, (graphed, plain) = models
    loras = MIXES[mix]
    got, want = decode_trace(graphed, loras), decode_trace(plain, loras)
    err = rel_err(got, want)
    print(f"\n{mix} {dtype}: max relative difference captured vs uncaptured {err:.2e}, "
          f"bit-identical {torch.equal(got, want)}")
    if mix == "bucket4":
        assert torch.equal(got, want), f"captured != uncaptured at a bucket size ({err:.2e})"
    else:
        assert err <= TOL[dtype], f"relative difference {err:.2e} > {TOL[dtype]}"
    check_adapters_matter(plain, want, loras, TOL[dtype])
    assert lora_decode_captures(plain) == 0
    assert lora_decode_captures(graphed) > 0, "the multi-LoRA decode engine ran uncaptured"


def test_adapter_swapped_into_a_captured_slot_is_used(models, adapter_dir):
    """Unload ``b``, load ``d`` into its slot between steps: the already-captured graph must
    compute with ``d`` (equal to the uncaptured run), and the other requests are untouched."""
    dtype, (graphed, plain) = models
    before_loras, after_loras = ["a", "b", "c", None], ["a", "d", "c", None]
    before = decode_trace(graphed, before_loras)
    assert torch.equal(before, decode_trace(plain, before_loras))
    captures = lora_decode_captures(graphed)
    assert captures > 0, "the multi-LoRA decode engine ran uncaptured"

    for model in (graphed, plain):
        multi = model.features["multi_lora"]
        slot = multi.slots["b"]
        multi.unload("b")
        assert multi.load("d", adapter_dir / "d") == slot
    try:
        after = decode_trace(graphed, after_loras)
        want = decode_trace(plain, after_loras)
        assert torch.equal(after, want), \
            f"captured != uncaptured after the swap ({rel_err(after, want):.2e})"
        # d is not b: the swapped request's logits moved by far more than any bound
        changed = rel_err(after[:, 1], before[:, 1])
        assert changed > ADAPTER_EFFECT, f"the swap barely changed request 1's logits ({changed})"
        # per-row kernels: the other requests (same tokens, same adapters) are bit-identical
        keep = [0, 2, 3]
        assert torch.equal(after[:, keep], before[:, keep])
        check_adapters_matter(plain, want, after_loras, TOL[dtype])
        # the swap reused the captured graph (the stacks are held by reference)
        assert lora_decode_captures(graphed) == captures
    finally:
        for model in (graphed, plain):  # restore the fixture's adapters for later tests
            multi = model.features["multi_lora"]
            multi.unload("d")
            multi.load("b", adapter_dir / "b")


def decode_with_single(graphed: Any, plain: Any, name: str,
                       loras: list[str | None]) -> torch.Tensor:
    """Activate single adapter ``name`` on both models and decode ``loras``; the captured trace
    must equal the uncaptured one bit for bit (bucket 4). Returns the trace."""
    for model in (graphed, plain):
        model.features["single_lora"].activate(name)
    got, want = decode_trace(graphed, loras), decode_trace(plain, loras)
    assert torch.equal(got, want), \
        f"single adapter {name}: captured != uncaptured ({rel_err(got, want):.2e})"
    return got


def test_single_adapter_switch_under_a_captured_graph(models):
    """``single_lora``: switching the active adapter between steps rewrites the resident
    buffers in place; the captured graph must serve the new adapter (bucket 4: bit-identical
    to the uncaptured run)."""
    dtype, (graphed, plain) = models
    loras: list[str | None] = [None] * 4
    try:
        traces = {"a": decode_with_single(graphed, plain, "a", loras)}
        captures = lora_decode_captures(graphed, "single_lora")
        assert captures > 0, "the single-LoRA decode engine ran uncaptured"
        traces["d"] = decode_with_single(graphed, plain, "d", loras)
    finally:
        for model in (graphed, plain):
            model.features["single_lora"].activate(None)
    changed = rel_err(traces["d"], traces["a"])
    assert changed > ADAPTER_EFFECT, f"switching a -> d barely changed the logits ({changed})"
    assert lora_decode_captures(graphed, "single_lora") == captures


STACKED = ("multi_lora", "single_lora")
SHRINK_OPS = ("lora_shrink_concat", "rms_norm_lora_concat", "add_rms_norm_lora_concat")


def test_stacked_single_and_multi_under_a_captured_graph(models):
    """Single + multi LoRA in one engine: each adapted linear's one stacked shrink (both adapter
    sets, the norm before q/k/v and gate/up folded in, one launch) captured and replayed equals
    the uncaptured run (bucket 4: bit-identical), a single adapter switched under the captured
    graph is served, and the single adapter matters on top of the multi ones."""
    dtype, (graphed, plain) = models
    loras = MIXES["bucket4"]
    try:
        traces = {name: decode_with_single(graphed, plain, name, loras) for name in ("a", "d")}
        engine = graphed.engines[(False, STACKED)]
        assert engine.captured_signatures > 0, "the stacked decode engine ran uncaptured"
        shrinks = [n for n in engine.net.nodes if n.op in SHRINK_OPS]
        assert len(shrinks) == len(graphed.features["single_lora"].targets)
        assert all(n.attrs.get("second_width", 0) > 0 for n in shrinks)
        assert sum(n.op != "lora_shrink_concat" for n in shrinks) == 2 * CONFIG["num_hidden_layers"]
    finally:
        for model in (graphed, plain):
            model.features["single_lora"].activate(None)
    multi_only = decode_trace(plain, loras)
    assert rel_err(traces["a"], multi_only) > ADAPTER_EFFECT, "the single adapter barely matters"
    assert rel_err(traces["d"], traces["a"]) > ADAPTER_EFFECT, "switching a -> d barely matters"


def test_merged_single_adapter_under_a_captured_graph(adapter_dir: Path):
    """``single_lora`` merged into the weights (the default): the base decode graph, captured
    before any adapter, serves the merged weights (captured == uncaptured, bit for bit, at
    bucket 4), switching adapters moves the logits, and clearing the adapter restores the base
    weights exactly (the base trace again, bit for bit)."""
    dtype = torch.bfloat16
    graphed, plain = (build(random_weights(CONFIG, dtype, DEVICE), dtype, graphs, merge=True)
                      for graphs in (True, False))
    loras: list[str | None] = [None] * 4
    base = decode_trace(graphed, loras)
    traces = {}
    for name in ("a", "d", None):
        for model in (graphed, plain):
            if name is not None and name not in model.features["single_lora"].adapters:
                model.features["single_lora"].load(name, adapter_dir / name)
            model.features["single_lora"].activate(name)
        traces[name] = decode_trace(graphed, loras)
        assert torch.equal(traces[name], decode_trace(plain, loras)), name
    assert set(graphed.engines) == {(True, ()), (False, ())}
    assert graphed.engines[(False, ())].captured_signatures > 0
    assert rel_err(traces["a"], base) > ADAPTER_EFFECT and rel_err(traces["d"], traces["a"]) \
        > ADAPTER_EFFECT
    assert torch.equal(traces[None], base), "clearing the merged adapter left the weights changed"
