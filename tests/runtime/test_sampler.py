"""Sampler: greedy, seeded reproducibility, filter supports, temperature, penalties, logprobs.

Support tests draw thousands of tokens from one distribution (one batched call of identical
rows) and check that no draw falls outside the support and that every supported token shows up,
so a filter that keeps too little fails as well as one that keeps too much. Frequency checks use
a 5-sigma binomial bound, so a correct sampler fails with negligible probability while a wrong
temperature (which moves the probabilities by > 0.1) fails for sure.
"""
from __future__ import annotations

import math

import pytest
import torch

from tgraph.kernels.triton.penalties import apply_penalties_reference
from tgraph.runtime.sampler import PenaltyHistory, Sampler, step_seed
from tgraph.runtime.sampling_params import SamplingParams

N_DRAWS = 4000


def _draw_many(logits_row: torch.Tensor, params: SamplingParams, n: int = N_DRAWS,
               seed: int = 0) -> torch.Tensor:
    sampler = Sampler(seed=seed)
    out = sampler.sample(logits_row.expand(n, -1).contiguous(), [params] * n)
    return out.token_ids


def _support(tokens: torch.Tensor) -> set[int]:
    return set(tokens.unique().tolist())


# ---------------------------------------------------------------------------------------------
# SamplingParams


def test_sampling_params_defaults_and_normalisation():
    p = SamplingParams(stop="###")
    assert p.stop == ["###"] and p.stop_token_ids == []
    assert p.temperature == 1.0 and p.top_k == 0 and p.top_p == 1.0 and p.min_p == 0.0
    assert not p.greedy and not p.has_penalties
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(presence_penalty=0.5).has_penalties


@pytest.mark.parametrize("kwargs, match", [
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_k": -1}, "top_k"),
    ({"top_k": 2.5}, "top_k"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"min_p": -0.1}, "min_p"),
    ({"min_p": 1.1}, "min_p"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"frequency_penalty": float("inf")}, "frequency_penalty"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"stop": [""]}, "stop"),
    ({"stop_token_ids": [-3]}, "stop_token_ids"),
    ({"logprobs": -1}, "logprobs"),
    ({"seed": "7"}, "seed"),
    ({"lora": ""}, "lora"),
])
def test_sampling_params_rejects(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


# ---------------------------------------------------------------------------------------------
# Greedy and seeded reproducibility


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_is_argmax(dtype):
    logits = torch.randn(8, 64).to(dtype)
    before = logits.clone()
    out = Sampler().sample(logits, [SamplingParams(temperature=0)] * 8)
    assert out.token_ids.tolist() == logits.float().argmax(-1).tolist()
    assert out.token_ids.dtype == torch.int64
    assert torch.equal(logits, before), "sample must not modify the caller's logits"


def test_greedy_ignores_filters_and_temperature_scale():
    logits = torch.randn(4, 32)
    params = [SamplingParams(temperature=0, top_k=1, top_p=0.1, min_p=0.9)] * 4
    assert Sampler().sample(logits, params).token_ids.tolist() == logits.argmax(-1).tolist()


def _seeded_sequence(logits_rows: torch.Tensor, position: int, others: list[SamplingParams],
                     target: SamplingParams, steps: int = 12) -> list[int]:
    """Tokens the target request gets over ``steps`` steps when placed at ``position``."""
    sampler = Sampler(seed=99)
    tokens = []
    for step in range(steps):
        params = list(others)
        params.insert(position, target)
        logits = logits_rows[step].expand(len(params), -1).clone()
        # Other rows see different logits, so a shared draw could not hide a leak.
        logits[torch.arange(len(params)) != position] += torch.randn(len(params) - 1, 1)
        out = sampler.sample(logits, params, steps=[step] * len(params))
        tokens.append(out.token_ids[position].item())
    return tokens


def test_seeded_request_is_reproducible_across_batches():
    # Flat logits over 64 tokens: a draw that depended on the batch would differ ~98% of steps.
    logits_rows = torch.randn(12, 64) * 0.1
    target = SamplingParams(temperature=1.0, seed=1234)
    alone = _seeded_sequence(logits_rows, 0, [], target)
    batch_a = _seeded_sequence(logits_rows, 2, [SamplingParams(), SamplingParams(seed=5),
                                                SamplingParams(temperature=0)], target)
    batch_b = _seeded_sequence(logits_rows, 1, [SamplingParams(seed=1234 + 1),
                                                SamplingParams(top_k=3)], target)
    assert alone == batch_a == batch_b
    assert len(set(alone)) > 3, "the draws must actually be random"
    other_seed = _seeded_sequence(logits_rows, 0, [], SamplingParams(seed=1235))
    assert other_seed != alone


def test_seeded_request_draws_differently_per_step():
    logits = torch.zeros(1, 1000)
    p = [SamplingParams(seed=3)]
    sampler = Sampler()
    tokens = {sampler.sample(logits, p, steps=[s]).token_ids.item() for s in range(10)}
    assert len(tokens) > 5
    assert sampler.sample(logits, p, steps=[4]).token_ids.item() == \
        Sampler().sample(logits, p, steps=[4]).token_ids.item()


def test_unseeded_requests_follow_the_sampler_seed():
    logits = torch.zeros(16, 500)
    params = [SamplingParams()] * 16
    a = Sampler(seed=7).sample(logits, params).token_ids
    b = Sampler(seed=7).sample(logits, params).token_ids
    c = Sampler(seed=8).sample(logits, params).token_ids
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_step_seed_is_spread_and_non_negative():
    seeds = {step_seed(s, t) for s in range(-3, 20) for t in range(20)}
    assert len(seeds) == 23 * 20
    assert all(0 <= s < 2**63 for s in seeds)


# ---------------------------------------------------------------------------------------------
# Filters never sample outside their supports


def test_top_k_support():
    logits = torch.tensor([0.5, 2.0, -1.0, 1.9, 0.0, 1.8, 1.0, -0.5])
    tokens = _draw_many(logits, SamplingParams(top_k=3))
    assert _support(tokens) == {1, 3, 5}


def test_top_p_support():
    probs = torch.tensor([0.05, 0.4, 0.02, 0.3, 0.2, 0.03])
    # Sorted: 0.4, 0.3, 0.2 | 0.05 ...: mass before the 3rd is 0.7 < 0.75, before the 4th 0.9.
    tokens = _draw_many(probs.log(), SamplingParams(top_p=0.75))
    assert _support(tokens) == {1, 3, 4}
    tokens = _draw_many(probs.log(), SamplingParams(top_p=0.65))
    assert _support(tokens) == {1, 3}


def test_min_p_support():
    probs = torch.tensor([0.05, 0.4, 0.02, 0.3, 0.2, 0.03])
    # min_p = 0.4 keeps probabilities >= 0.16.
    tokens = _draw_many(probs.log(), SamplingParams(min_p=0.4))
    assert _support(tokens) == {1, 3, 4}


def test_top_k_then_top_p_on_the_renormalised_distribution():
    probs = torch.tensor([0.3, 0.25, 0.2, 0.15, 0.1])
    # After top-k=2 the distribution is (0.545, 0.455): top_p=0.5 keeps token 0 only, whereas
    # top_p on the original probabilities would keep two tokens.
    tokens = _draw_many(probs.log(), SamplingParams(top_k=2, top_p=0.5))
    assert _support(tokens) == {0}
    tokens = _draw_many(probs.log(), SamplingParams(top_k=3, top_p=0.6))
    assert _support(tokens) == {0, 1}


def test_mixed_batch_applies_each_rows_filter():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0]).expand(6 * 500, -1).contiguous()
    kinds = [SamplingParams(top_k=1), SamplingParams(top_k=2), SamplingParams(),
             SamplingParams(top_p=0.5), SamplingParams(min_p=0.3), SamplingParams(temperature=0)]
    params = kinds * 500
    tokens = Sampler(seed=1).sample(logits, params).token_ids.view(500, 6)
    assert _support(tokens[:, 0]) == {0}
    assert _support(tokens[:, 1]) == {0, 1}
    assert _support(tokens[:, 2]) == {0, 1, 2, 3, 4}
    assert _support(tokens[:, 3]) == {0}  # p(0) = 0.64 already reaches 0.5
    assert _support(tokens[:, 4]) == {0, 1}  # e^-1 = 0.37 >= 0.3 > e^-2
    assert _support(tokens[:, 5]) == {0}


# ---------------------------------------------------------------------------------------------
# Temperature


def _assert_frequencies(tokens: torch.Tensor, probs: torch.Tensor) -> None:
    n = tokens.numel()
    freq = torch.bincount(tokens, minlength=probs.numel()).double() / n
    sigma = (probs * (1 - probs) / n).sqrt()
    assert ((freq - probs).abs() <= 5 * sigma + 1e-9).all(), (freq, probs)


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_scales_the_distribution(temperature):
    logits = torch.tensor([1.0, 0.0, -0.5, 0.5])
    tokens = _draw_many(logits, SamplingParams(temperature=temperature), n=20000)
    _assert_frequencies(tokens, (logits.double() / temperature).softmax(-1))


def test_temperature_in_processed_logits():
    logits = torch.randn(3, 20)
    params = [SamplingParams(temperature=0.7), SamplingParams(temperature=0),
              SamplingParams(temperature=1.3)]
    x = Sampler().process_logits(logits, params)
    torch.testing.assert_close(x[0], logits[0] / 0.7, rtol=1e-6, atol=0)
    assert torch.equal(x[1], logits[1])
    torch.testing.assert_close(x[2], logits[2] / 1.3, rtol=1e-6, atol=0)


# ---------------------------------------------------------------------------------------------
# Penalties in the sampler


def test_penalties_are_applied_before_greedy():
    logits = torch.tensor([[5.0, 4.0, 1.0, 0.0]])
    history = PenaltyHistory.from_lists([[0, 0]])
    # Token 0 was generated twice: 5 - 2 * 1.0 = 3 < 4, so greedy now picks token 1.
    params = [SamplingParams(temperature=0, frequency_penalty=1.0)]
    assert Sampler().sample(logits, params, history=history).token_ids.tolist() == [1]
    assert Sampler().sample(logits, [SamplingParams(temperature=0)]).token_ids.tolist() == [0]


def test_process_logits_penalties_match_reference():
    logits = torch.randn(3, 30) * 3
    outputs = [[1, 2, 2, 29], [], [5, 5, 5]]
    prompts = [[3, 4], [7], []]
    params = [SamplingParams(repetition_penalty=1.3, frequency_penalty=0.2, temperature=0),
              SamplingParams(repetition_penalty=2.0, temperature=0),
              SamplingParams(presence_penalty=-0.5, temperature=0)]
    history = PenaltyHistory.from_lists(outputs, prompts)
    x = Sampler().process_logits(logits, params, history)
    expected = logits.clone()
    for b, (out, prompt, p) in enumerate(zip(outputs, prompts, params)):
        for tok in set(out) | set(prompt):
            v = expected[b, tok]
            expected[b, tok] = v / p.repetition_penalty if v > 0 else v * p.repetition_penalty
        for tok in set(out):
            expected[b, tok] -= p.frequency_penalty * out.count(tok) + p.presence_penalty
    torch.testing.assert_close(x, expected, rtol=1e-6, atol=1e-6)
    # The padded-tensor reference agrees too.
    ref = logits.clone()
    apply_penalties_reference(
        ref, history.output_token_ids, history.output_lens,
        torch.tensor([1.3, 2.0, 1.0]), torch.tensor([0.2, 0.0, 0.0]), torch.tensor([0, 0, -0.5]),
        history.prompt_token_ids, history.prompt_lens)
    torch.testing.assert_close(x, ref, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# Logprobs


def test_logprobs_are_log_softmax_of_processed_logits():
    logits = torch.randn(4, 40)
    params = [SamplingParams(temperature=0.8, top_k=5, logprobs=3, seed=1),
              SamplingParams(temperature=0, logprobs=0),
              SamplingParams(temperature=1.2, min_p=0.05, logprobs=7, seed=2),
              SamplingParams()]
    out = Sampler().sample(logits, params, steps=[0] * 4)
    assert out.logprobs[3] is None
    expected0 = logits[0] / 0.8
    expected0[expected0 < expected0.topk(5).values[-1]] = float("-inf")
    expected2 = logits[2] / 1.2
    probs2 = expected2.softmax(-1)
    expected2[probs2 < 0.05 * probs2.max()] = float("-inf")
    for row, expected, n in ((0, expected0, 3), (1, logits[1], 0), (2, expected2, 7)):
        lp = expected.double().log_softmax(-1)
        got = out.logprobs[row]
        token = out.token_ids[row].item()
        assert got.token_id == token
        assert math.isclose(got.logprob, lp[token].item(), rel_tol=1e-5, abs_tol=1e-6)
        assert len(got.top_token_ids) == len(got.top_logprobs) == n
        top = lp.topk(n)
        assert got.top_token_ids == top.indices.tolist()
        torch.testing.assert_close(torch.tensor(got.top_logprobs, dtype=torch.float64),
                                   top.values, rtol=1e-5, atol=1e-6)
    assert out.token_ids[1].item() == logits[1].argmax().item()
    assert math.isfinite(out.logprobs[0].logprob), "a sampled token is inside the support"


def test_raw_logprobs_mode():
    logits = torch.randn(2, 16)
    params = [SamplingParams(temperature=0.5, top_k=2, logprobs=4)] * 2
    out = Sampler(seed=0, logprobs_mode="raw").sample(logits, params)
    lp = logits.log_softmax(-1)
    for row in range(2):
        assert out.logprobs[row].top_token_ids == lp[row].topk(4).indices.tolist()
        assert math.isclose(out.logprobs[row].logprob, lp[row, out.token_ids[row]].item(),
                            rel_tol=1e-5)


# ---------------------------------------------------------------------------------------------
# Bad input


def test_sample_rejects_bad_input():
    sampler = Sampler()
    with pytest.raises(ValueError, match="SamplingParams for 3 rows"):
        sampler.sample(torch.zeros(3, 8), [SamplingParams()] * 2)
    with pytest.raises(ValueError, match="floating-point"):
        sampler.sample(torch.zeros(2, 8, dtype=torch.int64), [SamplingParams()] * 2)
    with pytest.raises(ValueError, match="steps"):
        sampler.sample(torch.zeros(1, 8), [SamplingParams(seed=1)])
    with pytest.raises(ValueError, match="history"):
        sampler.sample(torch.zeros(1, 8), [SamplingParams(presence_penalty=1.0)])
    with pytest.raises(TypeError, match="SamplingParams"):
        sampler.sample(torch.zeros(1, 8), [{"temperature": 0}])
    with pytest.raises(ValueError, match="logprobs_mode"):
        Sampler(logprobs_mode="unprocessed")


# ---------------------------------------------------------------------------------------------
# CUDA, realistic shapes


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_mixed_batch(dtype):
    batch, vocab = 32, 128256
    logits = (torch.randn(batch, vocab, device="cuda") * 2).to(dtype)
    outputs = [torch.randint(0, vocab, (int(n),)).tolist()
               for n in torch.randint(0, 300, (batch,))]
    prompts = [torch.randint(0, vocab, (int(n),)).tolist()
               for n in torch.randint(1, 1000, (batch,))]
    history = PenaltyHistory.from_lists(outputs, prompts, device="cuda")
    params = [SamplingParams(temperature=0.0 if i % 4 == 0 else 0.8,
                             top_k=50 if i % 3 == 0 else 0, top_p=0.9 if i % 5 == 0 else 1.0,
                             min_p=0.05 if i % 7 == 0 else 0.0,
                             repetition_penalty=1.1, frequency_penalty=0.2, presence_penalty=0.1,
                             seed=i if i % 2 else None, logprobs=5)
              for i in range(batch)]
    steps = [len(o) for o in outputs]
    out = Sampler(seed=0).sample(logits, params, steps=steps, history=history)
    # Penalties on CUDA (Triton kernel) match penalties on CPU (torch reference); greedy params
    # isolate them from the filters, whose boundaries may move with summation order.
    greedy = [SamplingParams(temperature=0, repetition_penalty=p.repetition_penalty,
                             frequency_penalty=p.frequency_penalty,
                             presence_penalty=p.presence_penalty) for p in params]
    x_cuda = Sampler().process_logits(logits, greedy, history)
    x_cpu = Sampler().process_logits(logits.cpu(), greedy,
                                     PenaltyHistory.from_lists(outputs, prompts))
    torch.testing.assert_close(x_cuda.cpu(), x_cpu, rtol=1e-5, atol=1e-5)
    # Every token lies in its row's support, and greedy rows take a maximum.
    processed = Sampler().process_logits(logits, params, history)
    tokens = out.token_ids
    picked = processed[torch.arange(batch, device="cuda"), tokens]
    assert picked.isfinite().all()
    for i in range(0, batch, 4):
        assert picked[i] == processed[i].max()
    for i, p in enumerate(params):
        if p.top_k and not p.greedy and p.top_p == 1.0 and p.min_p == 0.0:
            # Exactly the values >= the 50th largest survive (ties with it are kept).
            kth = x_cuda[i].topk(50).values[-1] / p.temperature
            assert processed[i].isfinite().sum() == (x_cuda[i] / p.temperature >= kth).sum()
    tokens = tokens.cpu()
    # Seeded rows give the same token alone as in the batch.
    for i in range(1, batch, 2):
        alone = Sampler().sample(logits[i:i + 1], [params[i]], steps=[steps[i]],
                                 history=PenaltyHistory.from_lists([outputs[i]], [prompts[i]],
                                                                   device="cuda"))
        assert alone.token_ids.item() == tokens[i].item()
