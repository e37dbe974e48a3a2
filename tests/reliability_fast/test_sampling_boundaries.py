"""Sampling filters at their boundaries, checked exactly on the processed logits.

Every case is built so that the quantity a filter compares is exactly at its threshold in fp32:
uniform distributions over 2^n tokens (probabilities and their prefix sums are exact binary
fractions), or thresholds read back from the same fp32 computation the sampler does. So a
comparison turned from ``>=`` into ``>`` (or ``<`` into ``<=``) changes which tokens survive and
fails here, with no statistics involved: the tests compare the set of finite processed logits.
"""
from __future__ import annotations

import math

import pytest
import torch

from tgraph.runtime.sampler import Sampler
from tgraph.runtime.sampling_params import SamplingParams

NEG_INF = float("-inf")


def _kept(logits: torch.Tensor, params: SamplingParams) -> list[int]:
    """Token ids whose processed logit is finite (the support of the draw)."""
    x = Sampler(seed=0).process_logits(logits[None].float(), [params])[0]
    return torch.isfinite(x).nonzero()[:, 0].tolist()


def _sorted_mass_before(logits: torch.Tensor) -> torch.Tensor:
    """The fp32 mass before each token in descending order, computed as the sampler does."""
    probs = logits[None].float().sort(dim=-1, descending=True, stable=True).values.softmax(-1)
    return (probs.cumsum(dim=-1) - probs)[0]


# ---- top-p ----------------------------------------------------------------------------------

@pytest.mark.parametrize("top_p, kept", [
    (0.125, 1), (0.25, 2), (0.5, 4), (0.75, 6), (0.875, 7),  # mass exactly at p: stop there
    (0.25 + 1e-6, 3), (0.5 + 1e-6, 5), (0.5 - 1e-6, 4),      # just above / below the boundary
])
def test_top_p_with_the_mass_exactly_at_p_keeps_the_prefix_that_reaches_it(top_p, kept):
    # 8 equal logits: each token has probability 1/8 and the prefix masses k/8 are exact.
    logits = torch.zeros(8)
    assert _kept(logits, SamplingParams(top_p=top_p)) == list(range(kept))


def test_top_p_at_a_computed_mass_boundary():
    logits = torch.tensor([0.3, 2.0, -1.0, 1.1, 0.7, -0.2])  # order: 1, 3, 4, 0, 5, 2
    order = [1, 3, 4, 0, 5, 2]
    mass_before = _sorted_mass_before(logits)
    for n in range(1, 6):
        # top_p equal to the fp32 mass before the (n+1)-th token: that token is dropped.
        p = float(mass_before[n])
        assert _kept(logits, SamplingParams(top_p=p)) == sorted(order[:n]), f"p = mass of {n}"
        above = float(torch.nextafter(mass_before[n], torch.tensor(2.0)))
        if above < 1.0:
            assert _kept(logits, SamplingParams(top_p=above)) == sorted(order[: n + 1])


def test_top_p_one_keeps_even_tokens_whose_mass_rounds_away():
    # In fp32 the leading token's probability is 1.0 after rounding: the prefix mass reaches 1
    # before the tail, which a filter run at p = 1 would drop. p = 1 means "off".
    logits = torch.tensor([30.0, 0.0, -1.0, -2.0])
    assert float(_sorted_mass_before(logits)[2]) == 1.0
    assert _kept(logits, SamplingParams(top_p=1.0)) == [0, 1, 2, 3]
    assert _kept(logits, SamplingParams(top_p=1.0, top_k=3)) == [0, 1, 2]


def test_top_p_one_is_off_in_a_batch_that_filters_other_rows():
    # The batch takes the sorted top-p path for the second row; the first must stay unfiltered.
    logits = torch.tensor([[30.0, 0.0, -1.0, -2.0], [30.0, 0.0, -1.0, -2.0]])
    x = Sampler().process_logits(logits, [SamplingParams(top_p=1.0), SamplingParams(top_p=0.5)])
    assert torch.isfinite(x).tolist() == [[True, True, True, True], [True, False, False, False]]


def test_top_p_applies_to_the_top_k_renormalised_distribution():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    # Over the top 2 the leading token has 0.731 >= 0.7: alone; over all 4 it has 0.644 < 0.7.
    assert _kept(logits, SamplingParams(top_k=2, top_p=0.7)) == [0]
    assert _kept(logits, SamplingParams(top_p=0.7)) == [0, 1]
    # Uniform top 4 of 8 (the rest far below): mass exactly 1/2 after two tokens of the top 4.
    logits = torch.tensor([0.0, -50.0, 0.0, -50.0, 0.0, -50.0, 0.0, -50.0])
    assert _kept(logits, SamplingParams(top_k=4, top_p=0.5)) == [0, 2]


# ---- top-k ----------------------------------------------------------------------------------

@pytest.mark.parametrize("top_p", [1.0, 0.999])  # the top-k-only path and the sorted path
def test_top_k_at_and_beyond_the_vocabulary(top_p):
    logits = torch.tensor([0.5, -3.0, 2.0, 1.0, -0.5])
    every = [0, 1, 2, 3, 4]
    assert _kept(logits, SamplingParams(top_k=5)) == every
    assert _kept(logits, SamplingParams(top_k=6)) == every
    assert _kept(logits, SamplingParams(top_k=1000)) == every
    assert _kept(logits, SamplingParams(top_k=0)) == every  # 0: off
    assert _kept(logits, SamplingParams(top_k=4, top_p=top_p)) == [0, 2, 3, 4]
    assert _kept(logits, SamplingParams(top_k=1, top_p=top_p)) == [2]


@pytest.mark.parametrize("top_p", [1.0, 0.999])
def test_top_k_keeps_ties_with_the_kth_value(top_p):
    logits = torch.tensor([1.0, 3.0, 1.0, 2.0, 0.0, 1.0])
    assert _kept(logits, SamplingParams(top_k=3, top_p=top_p)) == [0, 1, 2, 3, 5]
    assert _kept(logits, SamplingParams(top_k=2, top_p=top_p)) == [1, 3]


@pytest.mark.parametrize("top_k", [4, 5, 1000])
def test_top_k_at_or_beyond_vocab_in_a_batch_with_a_smaller_k(top_k):
    logits = torch.tensor([[0.5, -3.0, 2.0, 1.0], [0.5, -3.0, 2.0, 1.0]])
    for top_p in (1.0, 0.999):
        x = Sampler().process_logits(logits, [SamplingParams(top_k=top_k, top_p=top_p),
                                              SamplingParams(top_k=2, top_p=top_p)])
        assert torch.isfinite(x).tolist() == [[True, True, True, True],
                                              [False, False, True, True]]


# ---- min-p ----------------------------------------------------------------------------------

def test_min_p_keeps_tokens_exactly_at_the_threshold():
    # Four equal tokens and four far below: the four have probability p_max exactly.
    logits = torch.tensor([0.0, -60.0, 0.0, -60.0, 0.0, -60.0, 0.0, -60.0])
    assert _kept(logits, SamplingParams(min_p=1.0)) == [0, 2, 4, 6]
    assert _kept(logits, SamplingParams(min_p=0.0)) == list(range(8))


def test_min_p_at_a_computed_threshold():
    logits = torch.tensor([1.0, 0.25, -0.5, 0.0, 2.0])
    probs = logits[None].softmax(-1)[0]
    p_max = probs.max()
    for tok in (0, 1, 3):
        # The largest fp32 min_p whose threshold p_max * min_p still equals p(tok) or less.
        min_p = probs[tok] / p_max
        while p_max * min_p > probs[tok]:
            min_p = torch.nextafter(min_p, torch.tensor(0.0))
        while p_max * torch.nextafter(min_p, torch.tensor(2.0)) <= probs[tok]:
            min_p = torch.nextafter(min_p, torch.tensor(2.0))
        kept = [i for i in range(5) if probs[i] >= probs[tok]]
        assert _kept(logits, SamplingParams(min_p=float(min_p))) == kept, f"at token {tok}"
        above = float(torch.nextafter(min_p, torch.tensor(2.0)))
        assert _kept(logits, SamplingParams(min_p=above)) == [i for i in kept if i != tok]


# ---- temperature ----------------------------------------------------------------------------

def test_temperature_one_leaves_the_logits_unchanged_and_zero_is_greedy():
    logits = torch.tensor([[0.3, -1.2, 2.5, 0.1]] * 3)
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.0, top_k=1, top_p=0.1,
                                                              min_p=0.9),
              SamplingParams(temperature=0.25)]
    x = Sampler().process_logits(logits, params)
    assert torch.equal(x[0], logits[0])
    assert torch.equal(x[1], logits[1])  # greedy rows are never scaled or filtered
    assert torch.equal(x[2], logits[2] * 4)  # division by a power of two is exact
    out = Sampler(seed=0).sample(logits, params, steps=[0, 0, 0])
    assert out.token_ids[1].item() == 2


@pytest.mark.parametrize("temperature", [1e-6, 1e-3])
def test_tiny_temperature_samples_the_argmax_without_overflow(temperature):
    logits = torch.tensor([0.3, -1.2, 2.5, 2.49, 0.1]).expand(64, -1).contiguous()
    params = [SamplingParams(temperature=temperature, seed=s) for s in range(64)]
    x = Sampler().process_logits(logits, params)
    assert not x.isnan().any()
    out = Sampler(seed=0).sample(logits, params, steps=[0] * 64)
    assert out.token_ids.tolist() == [2] * 64


def test_huge_temperature_flattens_but_keeps_the_order():
    logits = torch.tensor([0.3, -1.2, 2.5, 0.1])
    x = Sampler().process_logits(logits[None], [SamplingParams(temperature=1e6)])[0]
    assert torch.equal(x.argsort(), logits.argsort())
    assert float(x.softmax(-1).min()) > 0.2499
    assert _kept(logits, SamplingParams(temperature=1e6, top_k=2)) == [0, 2]


def test_temperature_is_applied_before_top_p_and_min_p():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    # At T=1, p(0) = 0.644 < 0.7 keeps two tokens; at T=0.5, p(0) = 0.867 >= 0.7 keeps one.
    assert _kept(logits, SamplingParams(top_p=0.7)) == [0, 1]
    assert _kept(logits, SamplingParams(top_p=0.7, temperature=0.5)) == [0]
    # min_p = 0.3: e^-1 = 0.37 passes at T=1; e^-2 = 0.14 fails at T=0.5.
    assert _kept(logits, SamplingParams(min_p=0.3)) == [0, 1]
    assert _kept(logits, SamplingParams(min_p=0.3, temperature=0.5)) == [0]
    # At T=2: e^-0.5 = 0.61, e^-1 = 0.37, e^-1.5 = 0.22 all pass.
    assert _kept(logits, SamplingParams(min_p=0.2, temperature=2.0)) == [0, 1, 2, 3]
    assert math.exp(-1.5) > 0.2
