"""Repetition / frequency / presence penalties on a batch of logits, in place.

Semantics follow vLLM and HF transformers, per request ``b`` and token ``v``:

- repetition (HF / CTRL): if ``v`` appeared in the output (or in the prompt, when prompt ids are
  given), ``logit = logit / p if logit > 0 else logit * p``;
- frequency: ``logit -= f * count(v in output)``;
- presence: ``logit -= pres * (count(v in output) > 0)``;

applied in that order. Only the generated tokens count for frequency and presence (as in vLLM
and the OpenAI API); the prompt counts for the repetition penalty only (as in HF).

Token ids are padded ``[B, L]`` tensors with per-row lengths; entries at or past the row's length,
and ids outside ``[0, V)`` (e.g. ``-1`` padding), are ignored.

The Triton path runs two kernels and never syncs with the host: one scatters token counts into a
``[B, V]`` int32 scratch buffer with atomics, one rewrites the logits block by block.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_ID_DTYPES = (torch.int32, torch.int64)


@triton.jit
def _count_tokens_kernel(
    ids_ptr, lens_ptr, counts_ptr,
    stride_ids, stride_counts, L, V,
    BLOCK_L: tl.constexpr,
):
    # One program per (request, block of history positions).
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
    length = tl.load(lens_ptr + row)
    in_row = (offs < L) & (offs < length)
    tok = tl.load(ids_ptr + row * stride_ids + offs, mask=in_row, other=-1).to(tl.int64)
    valid = in_row & (tok >= 0) & (tok < V)
    # NOTE: the same id may occur several times in one block; atomics count each occurrence.
    tl.atomic_add(counts_ptr + row * stride_counts + tok, tl.full([BLOCK_L], 1, tl.int32),
                  mask=valid)


@triton.jit
def _apply_penalties_kernel(
    logits_ptr, counts_ptr, prompt_counts_ptr, rep_ptr, freq_ptr, pres_ptr,
    stride_logits, stride_counts, V,
    HAS_PROMPT: tl.constexpr, BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask = offs < V
    logit = tl.load(logits_ptr + row * stride_logits + offs, mask=mask, other=0.0)
    count = tl.load(counts_ptr + row * stride_counts + offs, mask=mask, other=0)
    rep = tl.load(rep_ptr + row)
    freq = tl.load(freq_ptr + row)
    pres = tl.load(pres_ptr + row)

    in_output = count > 0
    seen = in_output
    if HAS_PROMPT:
        prompt_count = tl.load(prompt_counts_ptr + row * stride_counts + offs, mask=mask, other=0)
        seen = seen | (prompt_count > 0)
    penalised = tl.where(logit > 0, logit / rep, logit * rep)
    logit = tl.where(seen, penalised, logit)
    logit = logit - freq * count.to(tl.float32)
    logit = logit - pres * in_output.to(tl.float32)
    tl.store(logits_ptr + row * stride_logits + offs, logit, mask=mask)


def _check_history(name: str, ids: torch.Tensor, lens: torch.Tensor, logits: torch.Tensor) -> None:
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.dtype not in _ID_DTYPES:
        raise ValueError(
            f"{name}_token_ids must be an int32/int64 tensor [B, L], got "
            f"{getattr(ids, 'dtype', type(ids))} of shape {tuple(getattr(ids, 'shape', ()))}")
    if not isinstance(lens, torch.Tensor) or lens.dim() != 1 or lens.dtype not in _ID_DTYPES:
        raise ValueError(
            f"{name}_lens must be an int32/int64 tensor [B], got "
            f"{getattr(lens, 'dtype', type(lens))} of shape {tuple(getattr(lens, 'shape', ()))}")
    batch = logits.shape[0]
    if ids.shape[0] != batch or lens.shape[0] != batch:
        raise ValueError(
            f"{name}_token_ids {tuple(ids.shape)} and {name}_lens {tuple(lens.shape)} must have "
            f"the logits' batch size {batch}")
    if ids.device != logits.device or lens.device != logits.device:
        raise ValueError(
            f"{name}_token_ids ({ids.device}) and {name}_lens ({lens.device}) must be on the "
            f"logits' device {logits.device}")


def _check_inputs(
    logits: torch.Tensor,
    output_token_ids: torch.Tensor,
    output_lens: torch.Tensor,
    repetition: torch.Tensor,
    frequency: torch.Tensor,
    presence: torch.Tensor,
    prompt_token_ids: torch.Tensor | None,
    prompt_lens: torch.Tensor | None,
) -> None:
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or logits.dtype != torch.float32:
        raise ValueError(
            "logits must be a float32 tensor [B, V], got "
            f"{getattr(logits, 'dtype', type(logits))} of shape "
            f"{tuple(getattr(logits, 'shape', ()))}")
    if logits.stride(1) != 1:
        raise ValueError("logits must be contiguous in the vocabulary dim (stride(1) == 1)")
    _check_history("output", output_token_ids, output_lens, logits)
    if (prompt_token_ids is None) != (prompt_lens is None):
        raise ValueError("prompt_token_ids and prompt_lens must be given together")
    if prompt_token_ids is not None:
        _check_history("prompt", prompt_token_ids, prompt_lens, logits)
    for name, t in (("repetition", repetition), ("frequency", frequency), ("presence", presence)):
        if (not isinstance(t, torch.Tensor) or t.dtype != torch.float32
                or tuple(t.shape) != (logits.shape[0],) or t.device != logits.device):
            raise ValueError(
                f"{name} must be a float32 tensor of shape ({logits.shape[0]},) on "
                f"{logits.device}, got {getattr(t, 'dtype', type(t))} of shape "
                f"{tuple(getattr(t, 'shape', ()))} on {getattr(t, 'device', None)}")


def _launch_count(ids: torch.Tensor, lens: torch.Tensor, counts: torch.Tensor) -> None:
    if ids.shape[1] == 0:
        return
    ids = ids if ids.stride(1) == 1 else ids.contiguous()
    block_l = min(1024, triton.next_power_of_2(ids.shape[1]))
    grid = (ids.shape[0], triton.cdiv(ids.shape[1], block_l))
    _count_tokens_kernel[grid](
        ids, lens, counts, ids.stride(0), counts.stride(0), ids.shape[1], counts.shape[1],
        BLOCK_L=block_l)


def apply_penalties(
    logits: torch.Tensor,
    output_token_ids: torch.Tensor,
    output_lens: torch.Tensor,
    repetition: torch.Tensor,
    frequency: torch.Tensor,
    presence: torch.Tensor,
    prompt_token_ids: torch.Tensor | None = None,
    prompt_lens: torch.Tensor | None = None,
) -> None:
    """Apply the penalties to ``logits`` in place with Triton kernels (no host sync).

    Args:
        logits: float32 ``[B, V]``, contiguous in ``V``; rewritten in place.
        output_token_ids: int32/int64 ``[B, L]``, the tokens generated so far, right-padded.
        output_lens: int32/int64 ``[B]``, how many entries of each row are real.
        repetition: float32 ``[B]``, repetition penalty per request (1.0 = off).
        frequency: float32 ``[B]``, frequency penalty per request (0.0 = off).
        presence: float32 ``[B]``, presence penalty per request (0.0 = off).
        prompt_token_ids: optional int32/int64 ``[B, P]`` prompt tokens, right-padded; they
            count for the repetition penalty only.
        prompt_lens: int32/int64 ``[B]`` prompt lengths; required with ``prompt_token_ids``.

    Returns:
        None; ``logits`` holds the penalised values.
    """
    _check_inputs(logits, output_token_ids, output_lens, repetition, frequency, presence,
                  prompt_token_ids, prompt_lens)
    batch, vocab = logits.shape
    if batch == 0 or vocab == 0:
        return
    counts = torch.zeros((batch, vocab), dtype=torch.int32, device=logits.device)
    _launch_count(output_token_ids, output_lens, counts)
    prompt_counts = counts  # a dummy pointer when HAS_PROMPT is off
    if prompt_token_ids is not None:
        prompt_counts = torch.zeros_like(counts)
        _launch_count(prompt_token_ids, prompt_lens, prompt_counts)
    block_v = min(2048, triton.next_power_of_2(vocab))
    grid = (batch, triton.cdiv(vocab, block_v))
    _apply_penalties_kernel[grid](
        logits, counts, prompt_counts, repetition, frequency, presence,
        logits.stride(0), counts.stride(0), vocab,
        HAS_PROMPT=prompt_token_ids is not None, BLOCK_V=block_v)


def token_counts_reference(ids: torch.Tensor, lens: torch.Tensor, vocab: int) -> torch.Tensor:
    """Count each token id per row of a padded id tensor (torch reference).

    Args:
        ids: int ``[B, L]`` right-padded token ids.
        lens: int ``[B]`` real lengths per row.
        vocab: vocabulary size ``V``; ids outside ``[0, V)`` are ignored.

    Returns:
        int64 ``[B, V]`` counts.
    """
    batch, length = ids.shape
    positions = torch.arange(length, device=ids.device)
    ids = ids.long()
    valid = (positions[None, :] < lens[:, None]) & (ids >= 0) & (ids < vocab)
    # Invalid entries go to an extra bin that is dropped afterwards.
    binned = torch.where(valid, ids, torch.full_like(ids, vocab))
    counts = torch.zeros((batch, vocab + 1), dtype=torch.int64, device=ids.device)
    counts.scatter_add_(1, binned, torch.ones_like(binned))
    return counts[:, :vocab]


def apply_penalties_reference(
    logits: torch.Tensor,
    output_token_ids: torch.Tensor,
    output_lens: torch.Tensor,
    repetition: torch.Tensor,
    frequency: torch.Tensor,
    presence: torch.Tensor,
    prompt_token_ids: torch.Tensor | None = None,
    prompt_lens: torch.Tensor | None = None,
) -> None:
    """Torch reference of :func:`apply_penalties`: same arguments, same in-place result.

    Args:
        logits: float32 ``[B, V]``; rewritten in place.
        output_token_ids: int32/int64 ``[B, L]`` generated tokens, right-padded.
        output_lens: int32/int64 ``[B]`` real lengths.
        repetition: float32 ``[B]`` repetition penalties.
        frequency: float32 ``[B]`` frequency penalties.
        presence: float32 ``[B]`` presence penalties.
        prompt_token_ids: optional int ``[B, P]`` prompt tokens (repetition penalty only).
        prompt_lens: int ``[B]`` prompt lengths; required with ``prompt_token_ids``.

    Returns:
        None; ``logits`` holds the penalised values.
    """
    _check_inputs(logits, output_token_ids, output_lens, repetition, frequency, presence,
                  prompt_token_ids, prompt_lens)
    vocab = logits.shape[1]
    counts = token_counts_reference(output_token_ids, output_lens, vocab)
    in_output = counts > 0
    seen = in_output
    if prompt_token_ids is not None:
        seen = seen | (token_counts_reference(prompt_token_ids, prompt_lens, vocab) > 0)
    rep = repetition[:, None]
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits.copy_(torch.where(seen, penalised, logits))
    logits -= frequency[:, None] * counts.to(torch.float32)
    logits -= presence[:, None] * in_output.to(torch.float32)
