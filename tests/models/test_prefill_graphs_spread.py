"""Which prefills of a model spread over several devices replay CUDA graphs: tensor parallel
engines and engines placed on several GPUs get token buckets as a single-GPU model's do; an
engine with work placed on the CPU runs its prefills uncaptured and says why once.

The decision is taken on a CUDA model's step runner without a GPU: a :class:`GraphState` over a
model that is never built (its config, features and prefill engines' placements are all the
decision reads). The GPU runs are in ``tests/distributed/test_tp_prefill_graphs.py``.
"""
from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from tests.models.conftest import PROMPTS, load_tiny
from tgraph.io.model_config import ModelConfig
from tgraph.models.base.batch import BatchMeta
from tgraph.models.base.graph import GraphState
from tgraph.models.base.llm_config import LlmConfig
from tgraph.models.base.logit_bias import LogitBiasDecorator
from tgraph.models.base.lora_features import MultiLoraDecorator, SingleLoraDecorator
from tgraph.models.base.vocab_parallel import VocabParallelDecorator
from tgraph.passes.partition import Placement
from tgraph.testing import PagedBatcher

MODEL = ModelConfig.from_dict({"model_type": "llama", "hidden_size": 64,
                               "num_attention_heads": 4, "num_key_value_heads": 2,
                               "num_hidden_layers": 2, "intermediate_size": 128,
                               "vocab_size": 256})
# Llama's features, as torch_to_graph gives them.
FEATURES = (SingleLoraDecorator, MultiLoraDecorator, LogitBiasDecorator, VocabParallelDecorator)
BASE = (True, ())
LORA = (True, ("multi_lora", "single_lora"))
BIAS = (True, ("logit_bias",))


def _state(devices: tuple[str, ...] | None = None, **options) -> GraphState:
    """The step runner of a model on cuda:0 (bf16) whose prefill engines run on ``devices``
    (placement labels, the main one first; ``None``: one device)."""
    config = LlmConfig(MODEL, dtype=torch.bfloat16, **{"device": "cuda:0", **options})
    model = SimpleNamespace(llm_config=config, feature_classes=FEATURES,
                            placement=None if devices is None else devices[0])
    state = GraphState(model)
    placement = None if devices is None else Placement(devices[0], {}, list(devices))
    for key in (BASE, LORA, BIAS):
        state.engines[key] = SimpleNamespace(placement=placement)  # all the decision reads
    return state


def _prefill(lengths: list[int]) -> BatchMeta:
    tokens = sum(lengths)
    return BatchMeta(input_ids=[1] * tokens, position_ids=list(range(tokens)),
                     slots_mapping=list(range(tokens)), query_lens=lengths, seq_len=lengths,
                     block_table=[[0]] * len(lengths))


BATCHES = {"37 tokens, 3 sequences": ([17, 5, 15], (128, 4)),
           "128 tokens, 4 sequences": ([50, 40, 30, 8], (128, 4)),
           "1100 tokens, 1 sequence": ([1100], (1280, 1)),
           "4096 tokens": ([2048, 2048], (4096, 2)),
           "4097 tokens": ([4097], None),  # beyond prefill_graph_tokens
           "65 sequences": ([1] * 65, None)}  # beyond the largest batch bucket


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("batch", list(BATCHES))
def test_tensor_parallel_prefills_get_the_single_gpu_buckets(batch, rank):
    """At world size 2 every rank pads a prefill to the same buckets as one GPU would (the
    decision reads only the config and the batch, so the ranks capture in lockstep), for the
    base engine and the LoRA one; the logit-bias engine cannot pad its arrays."""
    lengths, want = BATCHES[batch]
    single, tp = _state(), _state(rank=rank, world_size=2)
    for key in (BASE, LORA):
        assert tp._prefill_buckets(_prefill(lengths), key) == want
        assert single._prefill_buckets(_prefill(lengths), key) == want
    assert tp._prefill_buckets(_prefill(lengths), BIAS) is None


@pytest.mark.parametrize("options", [{"prefill_graph_tokens": 0}, {"cuda_graph": False},
                                     {"graph": "eager"}, {"device": "cpu"}],
                         ids=["prefill_graph_tokens=0", "cuda_graph=False", "eager", "cpu"])
def test_tensor_parallel_prefills_follow_the_graph_settings(options):
    state = _state(world_size=2, **options)
    assert state._prefill_buckets(_prefill([17, 5, 15]), BASE) is None


@pytest.mark.parametrize("world_size", [1, 2])
def test_placed_on_gpus_gets_buckets(world_size, caplog):
    state = _state(("cuda:0", "cuda:1"), world_size=world_size)
    with caplog.at_level(logging.WARNING, logger="tgraph.models"):
        assert state._prefill_buckets(_prefill([17, 5, 15]), BASE) == (128, 4)
        assert state._prefill_buckets(_prefill([17, 5, 15]), LORA) == (128, 4)
    assert not caplog.records


@pytest.mark.parametrize("devices", [("cuda:0", "cpu:0"), ("cuda:0", "cuda:1", "cpu:0")])
def test_work_placed_on_the_cpu_keeps_prefill_uncaptured_and_says_why_once(devices, caplog):
    state = _state(devices)
    with caplog.at_level(logging.WARNING, logger="tgraph.models"):
        for key in (BASE, LORA, BASE):
            assert state._prefill_buckets(_prefill([17, 5, 15]), key) is None
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1, messages
    assert "prefill steps run without CUDA graphs: work is placed on cpu:0" in messages[0]
    assert "pad tokens" in messages[0]
    # Decode of the same model still gets its batch bucket (its CPU work runs between graphs).
    decode = BatchMeta(input_ids=[1, 2, 3], position_ids=[5, 5, 5], slots_mapping=[5, 6, 7],
                       query_lens=[1, 1, 1], seq_len=[6, 6, 6], block_table=[[0]] * 3,
                       is_prefill=False)
    assert state._decode_bucket(decode) == 4


def test_a_dump_keeps_prefill_uncaptured():
    state = _state(world_size=2)
    state.dump_dir = "/nonexistent"
    assert state._prefill_buckets(_prefill([17, 5, 15]), BASE) is None


def test_the_refusal_reads_the_built_engines_placement(tiny_model):
    """On a real model: an engine spread by rules carries the labels the refusal names, a
    single-device engine none (CPU models: the decision itself never captures there)."""
    from pathlib import Path

    rules = Path(__file__).parents[2] / "configs" / "rules" / "cpu_two_devices.yaml"
    path = tiny_model("llama").path
    for rule_file, want in ((None, ""), (rules, "work is placed on cpu:0, cpu:1")):
        model = load_tiny(path, rules=rule_file)
        batcher = PagedBatcher.for_model(model)
        model.run(batcher.step([batcher.add(p) for p in PROMPTS[:2]]))
        why = model._graph_state()._prefill_refusal(BASE)
        assert why.startswith(want) if want else why == ""
