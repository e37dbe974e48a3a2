"""``SamplingParams(logit_bias=..., allowed_token_ids=..., allowed_token_ids_fn=...)``: checked at
construction and submission, carried by the request, scheduler and runner to the model's
``logit_bias`` feature, and seen by the sampler (tiny random Llama, fp32, CPU).

The oracle of greedy generation is the Hugging Face model's logits of the whole sequence plus the
request's bias row (0, the biases added, ``-inf`` outside the allow-list), argmax at every step:
exact in fp32, as in test_llm.py (the tiny model's top-two logit gaps are far above rounding).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tgraph.errors import InvalidRequestError, InvalidRequestTypeError
from tgraph.runtime.llm import LLM
from tgraph.runtime.sampling_params import SamplingParams
from tgraph.testing import make_tiny_hf_model

PROMPTS = [[1, 5, 9, 22, 7], [3, 4], [17, 150, 8, 8, 8, 8, 191, 0, 42]]
MAX_TOKENS = 6
VOCAB = 192  # make_tiny_hf_model's Llama


# ---- checked at construction --------------------------------------------------------------
def test_logit_bias_keys_are_token_ids_as_ints_or_strings():
    p = SamplingParams(logit_bias={"5": 1.5, 7: -100, "12": 100.0})
    assert p.logit_bias == {5: 1.5, 7: -100.0, 12: 100.0}
    assert SamplingParams(logit_bias={}).logit_bias is None
    assert p.token_ids_named() == [5, 7, 12]


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(logit_bias={3: 100.5}), InvalidRequestError,
     r"logit_bias\[3\] is 100.5; expected a number in \[-100, 100\]"),
    (dict(logit_bias={3: -101}), InvalidRequestError, r"logit_bias\[3\] is -101"),
    (dict(logit_bias={3: float("inf")}), InvalidRequestError, r"logit_bias\[3\] is inf"),
    (dict(logit_bias={3: "1"}), InvalidRequestError, r"logit_bias\[3\] is '1'"),
    (dict(logit_bias={"abc": 1.0}), InvalidRequestError, "keys must be token ids.*'abc'"),
    (dict(logit_bias={-2: 1.0}), InvalidRequestError, "keys must be token ids.*-2"),
    (dict(logit_bias={True: 1.0}), InvalidRequestError, "keys must be token ids.*True"),
    (dict(logit_bias=[(3, 1.0)]), InvalidRequestTypeError, "must be a mapping"),
    (dict(allowed_token_ids=[]), InvalidRequestError,
     "allowed_token_ids is empty: no token could be generated"),
    (dict(allowed_token_ids=[3, -1]), InvalidRequestError, r"ints >= 0\), got \[-1\]"),
    (dict(allowed_token_ids=[3, False]), InvalidRequestError, r"got \[False\]"),
    (dict(allowed_token_ids=7), InvalidRequestTypeError, "must be a list of token ids"),
    (dict(allowed_token_ids_fn=[1, 2]), InvalidRequestTypeError, "must be a callable"),
    (dict(allowed_token_ids=[1], allowed_token_ids_fn=lambda out: [1]), InvalidRequestError,
     "are exclusive"),
])
def test_bad_bias_parameters_are_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        SamplingParams(**kwargs)


# ---- end to end ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_hf_model("llama", tmp_path_factory.mktemp("bias-llama"), seed=0)


@pytest.fixture(scope="module")
def hf(llama_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()


def _llm(path: Path, graph: str) -> LLM:
    return LLM(path, device="cpu", dtype="float32", graph=graph, max_model_len=64, block_size=4,
               num_blocks=64)


@pytest.fixture(scope="module")
def eager_llm(llama_dir: Path) -> Any:
    llm = _llm(llama_dir, "eager")
    yield llm
    llm.close()


def bias_row(params: SamplingParams, outputs: list[int]) -> torch.Tensor:
    row = torch.zeros(VOCAB)
    for t, v in (params.logit_bias or {}).items():
        row[t] += v
    allowed = params.allowed_token_ids
    if params.allowed_token_ids_fn is not None:
        allowed = params.allowed_token_ids_fn(list(outputs))
    if allowed is not None:
        mask = torch.ones(VOCAB, dtype=torch.bool)
        mask[list(allowed)] = False
        row[mask] = float("-inf")
    return row


@torch.no_grad()
def reference(hf: Any, prompt: list[int], params: SamplingParams) -> list[int]:
    """Greedy tokens of the HF model's logits plus the bias, one full forward per step."""
    tokens = list(prompt)
    for _ in range(params.max_tokens):
        logits = hf(torch.tensor([tokens]), use_cache=False).logits[0, -1].float()
        tokens.append(int(torch.argmax(logits + bias_row(params, tokens[len(prompt):]))))
    return tokens[len(prompt):]


def greedy(**kwargs: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, **kwargs)


def mixed_params() -> list[SamplingParams]:
    return [greedy(logit_bias={"11": 3.0, "12": 2.9, "150": -100}),
            greedy(),
            greedy(allowed_token_ids=[7, 9, 11, 100, 150], logit_bias={9: 0.7, 13: 80.0})]


@pytest.mark.parametrize("graph", ["static", "eager"])
def test_greedy_with_biases_matches_reference(llama_dir, hf, eager_llm, graph):
    """A batch mixing biased and unbiased requests: each gets the reference's tokens, and the
    biased ones differ from what the model generates without a bias."""
    llm = eager_llm if graph == "eager" else _llm(llama_dir, graph)
    params = mixed_params()
    outputs = llm.generate(PROMPTS, params)
    plain = llm.generate(PROMPTS, greedy())
    for i, (out, prompt, p) in enumerate(zip(outputs, PROMPTS, params)):
        assert out.token_ids == reference(hf, prompt, p), f"request {i}"
        if p.logit_bias or p.allowed_token_ids:
            assert out.token_ids != plain[i].token_ids, f"request {i}: the bias changed nothing"
        else:
            assert out.token_ids == plain[i].token_ids
    if llm is not eager_llm:
        llm.close()


def test_allowed_token_ids_fn_drives_every_step(eager_llm, hf):
    """A constrained-decoding driver: the allow-list is a function of the tokens generated so
    far (here, one token per step spells a fixed sequence; then two tokens, biased)."""
    forced = [7, 8, 9, 10, 11, 12]
    seen: list[list[int]] = []

    def spell(outputs: list[int]) -> list[int]:
        seen.append(list(outputs))
        return [forced[len(outputs)]]

    out = eager_llm.generate([PROMPTS[0]], greedy(allowed_token_ids_fn=spell))[0]
    assert out.token_ids == forced
    assert seen == [forced[:i] for i in range(MAX_TOKENS)]

    def pair(outputs: list[int]) -> list[int] | None:
        return None if len(outputs) % 2 else [40 + len(outputs), 60]

    p = greedy(allowed_token_ids_fn=pair, logit_bias={60: -1.0})
    out = eager_llm.generate([PROMPTS[1]], p)[0]
    assert out.token_ids == reference(hf, PROMPTS[1], p)
    assert all(t in (40 + i, 60) for i, t in enumerate(out.token_ids) if i % 2 == 0)


def test_sampling_stays_in_the_allow_list(eager_llm):
    """The sampler sees the biased logits: temperature, top-p and penalties never bring back a
    disallowed token, and reported log-probabilities are those of the allowed tokens."""
    allowed = [3, 30, 33, 99]
    p = SamplingParams(temperature=1.5, top_p=0.95, seed=7, max_tokens=12, ignore_eos=True,
                       repetition_penalty=1.3, presence_penalty=0.5, logprobs=3,
                       allowed_token_ids=allowed)
    out = eager_llm.generate([PROMPTS[0]], p)[0]
    assert set(out.token_ids) <= set(allowed)
    assert len(set(out.token_ids)) > 1  # sampled, not forced
    for lp in out.logprobs:
        assert set(lp.top_token_ids) <= set(allowed)
        assert lp.logprob > float("-inf")


def test_bad_token_ids_are_refused_at_submission(eager_llm):
    with pytest.raises(InvalidRequestError, match=r"logit_bias / allowed_token_ids holds token "
                                                  r"id\(s\) \[192\]; expected ids below the "
                                                  r"vocabulary size 192"):
        eager_llm.generate([PROMPTS[0]], greedy(logit_bias={192: 1.0}))
    with pytest.raises(InvalidRequestError, match=r"id\(s\) \[500\]"):
        eager_llm.generate([PROMPTS[0]], greedy(allowed_token_ids=[1, 500]))


@pytest.mark.parametrize("result, match", [
    ([], "returned an empty allow-list after 0 tokens"),
    ([5, 192], r"must hold token ids \(ints >= 0 below the vocabulary size 192\), got \[192\]"),
])
def test_a_bad_allow_list_function_fails_its_request(eager_llm, result, match):
    p = greedy(allowed_token_ids_fn=lambda outputs: result)
    with pytest.raises(InvalidRequestError, match=r"request 'req-\d+': SamplingParams\."
                                                  r"allowed_token_ids_fn.*" + match):
        eager_llm.generate([PROMPTS[0]], p)
    # the engine goes on
    assert eager_llm.generate([PROMPTS[1]], greedy())[0].finish_reason == "length"
