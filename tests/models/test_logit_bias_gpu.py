"""The ``logit_bias`` feature under CUDA graphs equals it without them (CUDA, bf16), and its
decode steps stay one graph launch; a model-inputs hook with runtime params says what it costs.

Two models with the same random weights (2 layers, 32k vocabulary, bf16): one with decode CUDA
graphs, one with ``cuda_graph=False``. Both prefill the same prompts and decode the same fixed
tokens (not their own argmax, so a tiny difference cannot make them compare different tokens),
with biases, allow-lists that change every step, and unbiased requests in one batch. At 4
requests (a captured bucket, no padding) the kernels and shapes are the same, so the logits are
bit-identical; ``-inf`` marks exactly the tokens outside each allow-list.
"""
from __future__ import annotations

import gc
import logging
from typing import Any

import pytest
import torch

from tgraph.bench.models import random_weights
from tgraph.engine import Engine
from tgraph.io.model_config import ModelConfig
from tgraph.io.weights import DictWeightLoader
from tgraph.models.base.logit_bias import LogitBias
from tgraph.models.loading import build_model
from tgraph.testing import PagedBatcher

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
CONFIG: dict[str, Any] = dict(
    model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=32000, hidden_size=512,
    intermediate_size=1024, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
    head_dim=64, rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=4096,
    tie_word_embeddings=False, torch_dtype="bfloat16")
BUCKETS = [4, 8]
STEPS = 4
PROMPT_LENGTHS = (5, 17, 33, 9)


def build(weights: dict[str, torch.Tensor], cuda_graph: bool) -> Any:
    model = build_model(ModelConfig.from_dict(CONFIG),
                        DictWeightLoader(weights, device=DEVICE, dtype=torch.bfloat16),
                        max_model_len=256, cuda_graph=cuda_graph)
    model.allocate_kv_cache(64)
    model.capture_decode_graphs(BUCKETS)
    return model


@pytest.fixture(scope="module")
def models():
    pair = tuple(build(random_weights(CONFIG, torch.bfloat16, DEVICE), graphs)
                 for graphs in (True, False))
    yield pair
    del pair
    gc.collect()
    torch.cuda.empty_cache()


def bias_at(step: int, seq: int) -> LogitBias | None:
    return [LogitBias({11: 3.0, 12: -100.0}),
            None,
            LogitBias(allowed=[7 + step, 9, 1000 * (step + 1), 31999]),
            LogitBias({21: 0.5}, allowed=range(20, 30 + step))][seq]


def trace(model: Any) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    vocab = CONFIG["vocab_size"]
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]
    fed = torch.randint(0, vocab, (STEPS, len(prompts)), generator=g).tolist()
    b = PagedBatcher.for_model(model)
    ids = [b.add(p) for p in prompts]
    rows = []
    for step in range(STEPS + 1):
        batch = b.step(ids)
        batch.logit_bias = [bias_at(step, i) for i in range(len(ids))]
        rows.append(model.run(batch).float().clone())
        if step < STEPS:
            for i, s in enumerate(ids):
                b.append(s, fed[step][i])
    return torch.stack(rows)  # (steps + 1, seqs, vocab)


def test_captured_decode_equals_uncaptured_and_is_one_launch(models, monkeypatch):
    captured, plain = models
    forwards: list[str] = []
    real_forward = Engine.forward

    def spy(self, *args, **kwargs):
        forwards.append(self.net.name)
        return real_forward(self, *args, **kwargs)

    monkeypatch.setattr(Engine, "forward", spy)
    got = trace(captured)
    # Decode steps of the biased engine replay their graph (Engine.replay), never forward.
    assert not [n for n in forwards if "decode" in n], forwards
    monkeypatch.undo()
    want = trace(plain)
    assert torch.equal(got, want)
    for step in range(STEPS + 1):
        for seq in range(4):
            bias = bias_at(step, seq)
            if bias is not None and bias.allowed is not None:
                finite = torch.isfinite(got[step, seq]).nonzero().flatten().tolist()
                assert finite == list(bias.allowed)
    assert (False, ("logit_bias",)) in captured.engines


def test_unbiased_decode_keeps_the_base_graphs(models):
    captured, _ = models
    b = PagedBatcher.for_model(captured)
    ids = [b.add([1, 2, 3]), b.add([4, 5])]
    captured.run(b.step(ids))
    for i in ids:
        b.append(i, 7)
    batch = b.step(ids)
    batch.logit_bias = [None, None]
    before = set(captured.engines)
    captured.run(batch)
    assert set(captured.engines) == before
    assert captured.decode_graphs(2)  # the base engine's graph ran the step


def test_runtime_params_hook_logs_its_cost_once(caplog, monkeypatch):
    """A hook returning runtime params runs its decode steps through Engine.forward (the host
    value is bound every step): right results, one warning naming the params and why."""
    from tests.models.test_logit_bias import Hooked
    from tgraph.models import loading

    monkeypatch.setattr(loading, "resolve_model_class", lambda config: Hooked)
    weights = random_weights(CONFIG, torch.bfloat16, DEVICE)
    models = [build({k: v.clone() for k, v in weights.items()}, graphs)
              for graphs in (True, False)]
    outs = []
    with caplog.at_level(logging.WARNING, logger="tgraph.models"):
        for model in models:
            model.shift = torch.zeros(CONFIG["vocab_size"], device=DEVICE)
            b = PagedBatcher.for_model(model)
            ids = [b.add([1, 2, 3, 4]), b.add([5, 6])]
            rows = [model.run(b.step(ids)).float().clone()]
            for step, scale in enumerate((2.0, -1.0, 0.5)):
                model.scale = scale
                for i in ids:
                    b.append(i, 100 + step)
                rows.append(model.run(b.step(ids)).float().clone())
            outs.append(torch.stack(rows))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    decode = [w for w in warnings if "decode steps given runtime params" in w]
    assert len(decode) == 1, warnings
    assert "['logit_scale']" in decode[0] and "run uncaptured" in decode[0]
    assert torch.equal(outs[0], outs[1])
