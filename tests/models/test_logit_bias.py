"""The ``logit_bias`` feature (per-request logit bias and allow-lists) against a torch reference,
on a tiny random Llama (fp32, CPU), alone and stacked with LoRA; and the model-inputs hook it
uses, with runtime params.

The reference of a step is the Hugging Face (or PEFT) model's logits of the whole sequence at
that position plus the request's bias row, built here from the raw ``{token: bias}`` and allow-list:
0 everywhere, the biases added, ``-inf`` outside the allow-list. Every step feeds tgraph's own
argmax, and the reference must pick the same token (greedy).

Tolerance: finite logits within ``1e-4 * max|reference|`` (both sides fp32, differing only in
summation order, ~1e-6, as in test_lora.py), and ``-inf`` exactly where the reference has it. The
biases move tokens: each biased sequence's greedy tokens differ from the unbiased model's, so a
feature that dropped a bias, or added it to another row, fails.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pytest
import torch

from tests.models.conftest import load_tiny
from tests.models.test_lora import make_adapter
from tgraph.errors import ConfigError
from tgraph.models.base.graph import GraphState, torch_to_graph
from tgraph.models.base.logit_bias import LogitBias, LogitBiasDecorator
from tgraph.models.llama.modeling import LlamaLikeForCausalLM
from tgraph.nn.tensor import Tensor
from tgraph.testing import PagedBatcher

REL_TOL = 1e-4
PROMPTS = [[1, 5, 9, 22, 7, 3, 100], [3, 4], [17, 150, 8, 8, 191, 0, 42], [121], [11, 12, 13]]
STEPS = 4  # decode steps after the prefill

# A request's raw bias: ({token: bias}, allow-list or None).
Raw = tuple[dict[int, float], list[int] | None]
BiasAt = Callable[[int, int], Raw | None]  # (step, sequence) -> its bias at that step


def cases(step: int, seq: int) -> Raw | None:
    """Per sequence: biases only; none; an allow-list that changes every step; an allow-list
    with biases (one on a token it excludes, which must stay -inf)."""
    return [({11: 3.0, 12: 2.9, 150: -100.0}, None),
            None,
            ({}, [7 + step, 9, 11 + 2 * step, 100, 150 - step]),
            ({21: 0.5, 150: 50.0}, list(range(20, 30))),
            None][seq]


def to_bias(raw: Raw | None) -> LogitBias | None:
    return None if raw is None else LogitBias(*raw)


def dense(raw: Raw | None, vocab: int) -> torch.Tensor:
    """The reference bias row."""
    row = torch.zeros(vocab)
    if raw is None:
        return row
    bias, allowed = raw
    for t, v in bias.items():
        row[t] += v
    if allowed is not None:
        mask = torch.ones(vocab, dtype=torch.bool)
        mask[allowed] = False
        row[mask] = float("-inf")
    return row


def run_trace(model: Any, prompts: list[list[int]], bias_at: BiasAt,
              loras: list[str | None] | None = None, steps: int = STEPS
              ) -> tuple[list[list[int]], list[list[torch.Tensor]]]:
    """Prefill ``prompts`` in one batch, then ``steps`` greedy decode steps, each sequence
    biased by ``bias_at(step, seq)``. Returns each sequence's tokens and its logits per step."""
    b = PagedBatcher.for_model(model)
    ids = [b.add(p) for p in prompts]
    rows: list[list[torch.Tensor]] = [[] for _ in prompts]
    for step in range(steps + 1):
        batch = b.step(ids)
        batch.loras = loras
        batch.logit_bias = [to_bias(bias_at(step, i)) for i in range(len(ids))]
        out = model.run(batch).clone()
        for i, s in enumerate(ids):
            rows[i].append(out[i])
            b.append(s, int(torch.argmax(out[i])))
    return [b.tokens(s) for s in ids], rows


@torch.no_grad()
def oracle_logits(model: Any, tokens: list[int]) -> torch.Tensor:
    return model(torch.tensor([tokens]), use_cache=False).logits[0].float()


def check_trace(tokens: list[list[int]], rows: list[list[torch.Tensor]],
                prompts: list[list[int]], oracles: list[Any], bias_at: BiasAt) -> None:
    for i, (seq, prompt, oracle) in enumerate(zip(tokens, prompts, oracles)):
        ref_all = oracle_logits(oracle, seq)
        for step, got in enumerate(rows[i]):
            pos = len(prompt) - 1 + step
            ref = ref_all[pos] + dense(bias_at(step, i), ref_all.shape[-1])
            where = f"sequence {i}, step {step}"
            assert torch.equal(torch.isinf(got), torch.isinf(ref)), f"{where}: -inf differ"
            finite = torch.isfinite(ref)
            scale = ref[finite].abs().max()
            err = float((got[finite] - ref[finite]).abs().max() / scale)
            assert err <= REL_TOL, f"{where}: relative error {err}"
            assert seq[pos + 1] == int(torch.argmax(ref)), f"{where}: greedy token differs"


def unbiased_tokens(oracle: Any, prompt: list[int], steps: int = STEPS) -> list[int]:
    tokens = list(prompt)
    for _ in range(steps + 1):
        tokens.append(int(torch.argmax(oracle_logits(oracle, tokens)[-1])))
    return tokens


def check_biases_matter(tokens, prompts, oracles, bias_at: BiasAt) -> None:
    for i, (seq, prompt, oracle) in enumerate(zip(tokens, prompts, oracles)):
        if any(bias_at(step, i) is not None for step in range(STEPS + 1)):
            assert seq != unbiased_tokens(oracle, prompt), f"sequence {i}: the bias changed nothing"


# ---- alone --------------------------------------------------------------------------------------
@pytest.mark.parametrize("graph", ["static", "eager"])
def test_bias_and_allow_lists_match_reference(tiny_model, graph):
    tm = tiny_model("llama")
    model = load_tiny(tm.path, graph)
    tokens, rows = run_trace(model, PROMPTS, cases)
    check_trace(tokens, rows, PROMPTS, [tm.hf] * len(PROMPTS), cases)
    check_biases_matter(tokens, PROMPTS, [tm.hf] * len(PROMPTS), cases)
    assert set(model.engines) == {(True, ("logit_bias",)), (False, ("logit_bias",))}


def test_engines_are_built_per_used_combination(tiny_model):
    """A batch without any bias runs the base engines; biased batches add the feature's, once."""
    tm = tiny_model("llama")
    model = load_tiny(tm.path)
    tokens, _ = run_trace(model, PROMPTS[:2], lambda step, seq: None, steps=1)
    assert set(model.engines) == {(True, ()), (False, ())}
    assert tokens == [unbiased_tokens(tm.hf, p, steps=1) for p in PROMPTS[:2]]
    base = dict(model.engines)
    run_trace(model, PROMPTS[:2], lambda step, seq: cases(step, 2), steps=1)
    run_trace(model, PROMPTS[:2], lambda step, seq: None, steps=1)
    assert set(model.engines) == {(True, ()), (False, ()), (True, ("logit_bias",)),
                                  (False, ("logit_bias",))}
    assert all(model.engines[k] is e for k, e in base.items())


def test_allow_list_forces_tokens(tiny_model):
    """A one-token allow-list per step writes a chosen sequence, for more distinct allow-lists
    in one step than the table first holds (it grows)."""
    tm = tiny_model("llama")
    model = load_tiny(tm.path)
    feature = model.features["logit_bias"]
    n = 20
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(n)]
    forced = [[(7 * seq + 3 * step + 1) % 192 for step in range(3)] for seq in range(n)]
    tokens, _ = run_trace(model, prompts, lambda step, seq: ({}, [forced[seq][step]]), steps=2)
    assert [seq[len(p):] for seq, p in zip(tokens, prompts)] == forced
    assert feature.table.shape[0] >= n + 1


def test_slots_are_kept_while_biases_repeat(tiny_model):
    tm = tiny_model("llama")
    model = load_tiny(tm.path, "eager")
    feature = model.features["logit_bias"]
    a, b, c = LogitBias({1: 2.0}), LogitBias(allowed=[3, 4]), LogitBias({5: -1.0})
    first = feature.assign_slots([a, None, b, LogitBias({1: 2.0})])
    assert first[1] == 0 and first[0] == first[3] != first[2]
    feature.table[first[0], 7] = 42.0  # a marker: a rewrite of that slot would clear it
    again = feature.assign_slots([None, b, a])
    assert again == [0, first[2], first[0]]
    assert float(feature.table[first[0], 7]) == 42.0
    third = feature.assign_slots([c])
    assert third[0] not in (0, first[0], first[2])
    assert float(feature.table[third[0], 5]) == -1.0
    with pytest.raises(ValueError, match="token id 192; the vocabulary has 192 tokens"):
        feature.assign_slots([LogitBias({192: 1.0})])


def test_bad_biases_are_refused(tiny_model):
    with pytest.raises(ValueError, match="allow-list is empty"):
        LogitBias(allowed=[])
    with pytest.raises(ValueError, match=r"bias of token 3 is 100.5; expected a number in "
                                         r"\[-100, 100\]"):
        LogitBias({3: 100.5})
    with pytest.raises(ValueError, match="bias of token 3 is nan"):
        LogitBias({3: float("nan")})
    with pytest.raises(ValueError, match="token ids must be >= 0"):
        LogitBias(allowed=[-1, 2])
    tm = tiny_model("llama")
    model = load_tiny(tm.path, "eager")
    batch = PagedBatcher.for_model(model)
    batch.add([1, 2])
    step = batch.step([0])
    step.logit_bias = [LogitBias({1: 1.0}), None]
    with pytest.raises(ValueError, match="2 entries for 1 sequences"):
        model.run(step)
    with pytest.raises(ConfigError, match="takes no settings"):
        load_tiny(tm.path, "eager", features={"logit_bias": {"max_slots": 4}})


# ---- stacked with LoRA --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory):
    tm = tiny_model("llama")
    root = tmp_path_factory.mktemp("logit_bias_lora")
    peft = {"qv": make_adapter(tm.hf, root / "qv", 1, r=4, lora_alpha=8,
                               target_modules=["q_proj", "v_proj"]),
            "mlp": make_adapter(tm.hf, root / "mlp", 3, r=2, lora_alpha=4,
                                target_modules=["gate_proj", "down_proj", "o_proj"])}
    return tm, root, peft


@pytest.mark.parametrize("graph", ["static", "eager"])
def test_stacked_with_multi_lora_matches_peft(adapters, graph):
    """Requests with an adapter and a bias, an adapter alone, a bias alone and neither, in one
    batch: PEFT's logits plus the bias."""
    tm, root, peft = adapters
    model = load_tiny(tm.path, graph, features={"multi_lora": {"max_rank": 8, "max_loras": 2}})
    for name in peft:
        model.features["multi_lora"].load(name, root / name)
    loras = ["qv", "qv", None, "mlp", None]
    tokens, rows = run_trace(model, PROMPTS, cases, loras)
    oracles = [peft[n] if n else tm.hf for n in loras]
    check_trace(tokens, rows, PROMPTS, oracles, cases)
    check_biases_matter(tokens, PROMPTS, oracles, cases)
    assert set(model.engines) == {(True, ("logit_bias", "multi_lora")),
                                  (False, ("logit_bias", "multi_lora"))}


@pytest.mark.parametrize("merge", [False, True])
def test_stacked_with_single_lora_matches_peft(adapters, merge):
    """Recorded: one engine for both features; merged: the logit-bias engine on the merged
    weights."""
    tm, root, peft = adapters
    model = load_tiny(tm.path, features={"single_lora": {"max_rank": 8, "merge": merge}})
    model.features["single_lora"].load("mlp", root / "mlp")
    model.features["single_lora"].activate("mlp")
    tokens, rows = run_trace(model, PROMPTS[:4], cases)
    check_trace(tokens, rows, PROMPTS[:4], [peft["mlp"]] * 4, cases)
    features = ("logit_bias",) if merge else ("logit_bias", "single_lora")
    assert set(model.engines) == {(True, features), (False, features)}


# ---- the model-inputs hook ----------------------------------------------------------------------
class HookedLlama(LlamaLikeForCausalLM):
    """A Llama whose logits are scaled by a host value and shifted by a device tensor, both
    given per step through ``_update_model_inputs`` (runtime params and inputs)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.scale = 1.0
        self.shift = torch.zeros(self.config.vocab_size, device=self.llm_config.device)

    def extra_symbolic_inputs(self, is_prefill: bool) -> dict[str, Tensor]:
        # A 0-dim host value: torch multiplies a device tensor by a CPU scalar.
        return {"logit_scale": Tensor("logit_scale", torch.float32, (), host=True),
                "logit_shift": Tensor("logit_shift", torch.float32, (self.config.vocab_size,))}

    def _update_model_inputs(self, meta):
        return {"logit_shift": self.shift}, {}, {"logit_scale": torch.tensor(self.scale)}

    def forward(self, **kwargs: Any) -> dict[str, Tensor]:
        logits = super().forward(**kwargs)["model_out"]
        return {"model_out": logits * kwargs["logit_scale"] + kwargs["logit_shift"]}


Hooked = torch_to_graph(LogitBiasDecorator)(HookedLlama)


@pytest.fixture
def hooked(monkeypatch):
    from tgraph.models import loading

    monkeypatch.setattr(loading, "resolve_model_class", lambda config: Hooked)


@pytest.mark.parametrize("graph", ["static", "eager"])
def test_hook_runtime_params_and_inputs_reach_the_engine(tiny_model, hooked, graph):
    """The hook's three returns change every step, and merge with the logit_bias feature's."""
    tm = tiny_model("llama")
    model = load_tiny(tm.path, graph)
    vocab = model.config.vocab_size
    scales = [2.0, -0.5, 3.0]
    shifts = [torch.linspace(-1, 1, vocab) * k for k in (1.0, 0.0, -2.0)]
    b = PagedBatcher.for_model(model)
    ids = [b.add(p) for p in PROMPTS[:3]]
    for step in range(3):
        model.scale, model.shift = scales[step], shifts[step]
        batch = b.step(ids)
        raw = [cases(step, i) for i in range(3)]
        batch.logit_bias = [to_bias(r) for r in raw]
        got = model.run(batch).clone()
        for i, s in enumerate(ids):
            ref = oracle_logits(tm.hf, b.tokens(s))[-1] * scales[step] + shifts[step]
            ref = ref + dense(raw[i], vocab)
            assert torch.equal(torch.isinf(got[i]), torch.isinf(ref))
            finite = torch.isfinite(ref)
            err = float((got[i][finite] - ref[finite]).abs().max() / ref[finite].abs().max())
            assert err <= REL_TOL, f"step {step}, sequence {i}: relative error {err}"
            b.append(s, int(torch.argmax(got[i])))


def test_hook_that_costs_prefill_graphs_says_so_once(tiny_model, hooked, monkeypatch, caplog):
    """Where prefill would replay CUDA graphs, a hook's inputs make it run uncaptured: logged
    once, naming the inputs and why (CUDA graphs are pretended on CPU; prefill only)."""
    tm = tiny_model("llama")
    model = load_tiny(tm.path)
    monkeypatch.setattr(GraphState, "_can_capture", lambda self: True)
    b = PagedBatcher.for_model(model)
    with caplog.at_level(logging.WARNING, logger="tgraph.models"):
        for prompt in PROMPTS[:2]:
            model.run(b.step([b.add(prompt)]))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "HookedLlama: prefill steps given inputs by the model-inputs hook (['logit_scale', " \
           "'logit_shift']) run without CUDA graphs: the hook's inputs cannot be padded" \
           in warnings[0]


def test_hook_inputs_clashing_with_a_feature_are_refused(tiny_model, hooked, monkeypatch):
    tm = tiny_model("llama")
    model = load_tiny(tm.path, "eager")
    monkeypatch.setattr(model, "_update_model_inputs",
                        lambda meta: ({"logit_bias_rows": torch.zeros(1, dtype=torch.int32)},
                                      {}, {}))
    b = PagedBatcher.for_model(model)
    batch = b.step([b.add([1, 2, 3])])
    batch.logit_bias = [LogitBias({1: 1.0})]
    with pytest.raises(ConfigError, match=r"all give \['logit_bias_rows'\]"):
        model.run(batch)
