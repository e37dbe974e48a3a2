"""The penalties kernel against a hand computation and against the torch reference.

Tolerance: the kernel and the reference do the same fp32 operations in the same order (one
divide or multiply, then two subtractions), so they agree to a few ulps; 1e-6 relative plus 1e-6
absolute leaves room for FMA contraction on GPUs and nothing for a wrong count or a missed token.
"""
from __future__ import annotations

import pytest
import torch

from tgraph.kernels.triton.penalties import (
    apply_penalties,
    apply_penalties_reference,
    token_counts_reference,
)

RTOL = ATOL = 1e-6


def _random_case(batch: int, vocab: int, out_len: int, prompt_len: int, id_dtype: torch.dtype,
                 device: str = "cpu", hot: int | None = None):
    """Random logits and histories; ``hot`` limits ids to a few tokens so repeats are common."""
    g = torch.Generator().manual_seed(1234)
    logits = (torch.randn(batch, vocab, generator=g) * 4).to(device)
    high = hot or vocab
    out_ids = torch.randint(0, high, (batch, out_len), generator=g).to(id_dtype).to(device)
    out_lens = torch.randint(0, out_len + 1, (batch,), generator=g).to(id_dtype)
    out_lens[0] = out_len  # at least one full row and, usually, a short and an empty one
    if batch > 1:
        out_lens[1] = 0
    prompt_ids = torch.randint(0, high, (batch, prompt_len), generator=g).to(id_dtype).to(device)
    prompt_lens = torch.randint(0, prompt_len + 1, (batch,), generator=g).to(id_dtype).to(device)
    rep = (torch.rand(batch, generator=g) * 1.5 + 0.5).to(device)
    freq = (torch.rand(batch, generator=g) - 0.3).to(device)
    pres = (torch.rand(batch, generator=g) * 2 - 1).to(device)
    return logits, out_ids, out_lens.to(device), rep, freq, pres, prompt_ids, prompt_lens


def test_hand_computed_example():
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5, 3.0],
                           [4.0, -4.0, 0.0, 1.0, 2.0, -3.0]])
    # Row 0: token 0 twice, token 1 once; the trailing 5s are padding past output_lens.
    out_ids = torch.tensor([[0, 1, 0, 5, 5], [3, 3, 3, -1, 9]], dtype=torch.int32)
    out_lens = torch.tensor([3, 5], dtype=torch.int32)
    # Row 1: token 1 is in the prompt only (repetition only); token 4 is padding.
    prompt_ids = torch.tensor([[2, 4], [1, 4]], dtype=torch.int32)
    prompt_lens = torch.tensor([1, 1], dtype=torch.int32)
    rep = torch.tensor([2.0, 4.0])
    freq = torch.tensor([0.5, 0.25])
    pres = torch.tensor([0.125, 1.0])
    expected = torch.tensor([
        # token 0: 2/2 - 0.5*2 - 0.125; token 1: -2*2 - 0.5 - 0.125; token 2 (prompt): 1/2
        [2 / 2 - 1.0 - 0.125, -2 * 2 - 0.5 - 0.125, 1 / 2, -1.0, 0.5, 3.0],
        # token 3 three times: 1/4 - 0.25*3 - 1; token 1 (prompt): -4*4; -1 and 9 are ignored
        [4.0, -4.0 * 4, 0.0, 1 / 4 - 0.75 - 1.0, 2.0, -3.0],
    ])
    for fn in (apply_penalties, apply_penalties_reference):
        out = logits.clone()
        fn(out, out_ids, out_lens, rep, freq, pres, prompt_ids, prompt_lens)
        torch.testing.assert_close(out, expected, rtol=0, atol=1e-7, msg=fn.__name__)


@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("with_prompt", [False, True])
def test_kernel_matches_reference(id_dtype, with_prompt):
    logits, out_ids, out_lens, rep, freq, pres, p_ids, p_lens = _random_case(
        batch=6, vocab=50, out_len=40, prompt_len=17, id_dtype=id_dtype, hot=12)
    prompt = (p_ids, p_lens) if with_prompt else (None, None)
    expected = logits.clone()
    apply_penalties_reference(expected, out_ids, out_lens, rep, freq, pres, *prompt)
    out = logits.clone()
    apply_penalties(out, out_ids, out_lens, rep, freq, pres, *prompt)
    torch.testing.assert_close(out, expected, rtol=RTOL, atol=ATOL)
    assert not torch.equal(out, logits), "the case must change some logits"


def test_several_blocks_in_both_dims():
    # V > 2048 and L > 1024 exercise more than one program per row in each kernel.
    logits, out_ids, out_lens, rep, freq, pres, p_ids, p_lens = _random_case(
        batch=2, vocab=2500, out_len=1100, prompt_len=30, id_dtype=torch.int32)
    expected = logits.clone()
    apply_penalties_reference(expected, out_ids, out_lens, rep, freq, pres, p_ids, p_lens)
    out = logits.clone()
    apply_penalties(out, out_ids, out_lens, rep, freq, pres, p_ids, p_lens)
    torch.testing.assert_close(out, expected, rtol=RTOL, atol=ATOL)


def test_every_logit_rewritten_when_every_token_was_seen():
    # Each token appears, so every element must change: a block the kernel skipped shows up.
    batch, vocab = 3, 70
    logits = torch.randn(batch, vocab) + 0.1
    out_ids = torch.arange(vocab, dtype=torch.int32).repeat(batch, 2)
    out_lens = torch.full((batch,), 2 * vocab, dtype=torch.int32)
    rep = torch.full((batch,), 1.5)
    freq = torch.full((batch,), 0.5)
    pres = torch.full((batch,), 0.25)
    expected = logits.clone()
    apply_penalties_reference(expected, out_ids, out_lens, rep, freq, pres)
    out = logits.clone()
    apply_penalties(out, out_ids, out_lens, rep, freq, pres)
    torch.testing.assert_close(out, expected, rtol=RTOL, atol=ATOL)
    assert (out != logits).all()


def test_row_strided_logits_leave_the_rest_untouched():
    batch, vocab = 4, 33
    storage = torch.full((batch, vocab + 7), float("nan"))
    logits = storage[:, :vocab]
    logits.copy_(torch.randn(batch, vocab))
    out_ids = torch.randint(0, vocab, (batch, 9), dtype=torch.int32)
    out_lens = torch.full((batch,), 9, dtype=torch.int32)
    rep, freq, pres = (torch.full((batch,), v) for v in (1.3, 0.2, 0.1))
    expected = logits.clone()
    apply_penalties_reference(expected, out_ids, out_lens, rep, freq, pres)
    apply_penalties(logits, out_ids, out_lens, rep, freq, pres)
    torch.testing.assert_close(logits, expected, rtol=RTOL, atol=ATOL)
    assert storage[:, vocab:].isnan().all(), "the kernel wrote past the row's vocabulary"


def test_neutral_penalties_are_the_identity():
    logits, out_ids, out_lens, _, _, _, p_ids, p_lens = _random_case(
        batch=3, vocab=40, out_len=20, prompt_len=5, id_dtype=torch.int32)
    ones, zeros = torch.ones(3), torch.zeros(3)
    out = logits.clone()
    apply_penalties(out, out_ids, out_lens, ones, zeros, zeros, p_ids, p_lens)
    assert torch.equal(out, logits)


def test_token_counts_reference():
    ids = torch.tensor([[1, 1, 2, 7], [0, -1, 3, 3]])
    lens = torch.tensor([3, 4])
    counts = token_counts_reference(ids, lens, vocab=4)
    assert counts.tolist() == [[0, 2, 1, 0], [1, 0, 0, 2]]


@pytest.mark.parametrize("fn", [apply_penalties, apply_penalties_reference])
def test_bad_inputs(fn):
    b, v = 2, 8
    ids, lens = torch.zeros(b, 3, dtype=torch.int32), torch.ones(b, dtype=torch.int32)
    pen = torch.ones(b)
    with pytest.raises(ValueError, match="float32"):
        fn(torch.zeros(b, v, dtype=torch.float16), ids, lens, pen, pen, pen)
    with pytest.raises(ValueError, match="int32/int64"):
        fn(torch.zeros(b, v), ids.float(), lens, pen, pen, pen)
    with pytest.raises(ValueError, match="batch size"):
        fn(torch.zeros(b, v), ids[:1], lens[:1], pen, pen, pen)
    with pytest.raises(ValueError, match="repetition"):
        fn(torch.zeros(b, v), ids, lens, torch.ones(b + 1), pen, pen)
    with pytest.raises(ValueError, match="together"):
        fn(torch.zeros(b, v), ids, lens, pen, pen, pen, ids, None)


@pytest.mark.gpu
@pytest.mark.parametrize("vocab", [32000, 128256, 151936])
def test_kernel_matches_reference_cuda(vocab):
    logits, out_ids, out_lens, rep, freq, pres, p_ids, p_lens = _random_case(
        batch=64, vocab=vocab, out_len=1024, prompt_len=2048, id_dtype=torch.int32,
        device="cuda")
    expected = logits.clone()
    apply_penalties_reference(expected, out_ids, out_lens, rep, freq, pres, p_ids, p_lens)
    out = logits.clone()
    apply_penalties(out, out_ids, out_lens, rep, freq, pres, p_ids, p_lens)
    torch.testing.assert_close(out, expected, rtol=RTOL, atol=ATOL)
