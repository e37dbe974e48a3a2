"""Batched token sampling: penalties, temperature, top-k / top-p / min-p, seeded draws, logprobs.

The pipeline per request, vectorised over the batch:

1. penalties (repetition / frequency / presence) on the fp32 logits: the Triton kernel on CUDA,
   the torch reference on CPU;
2. greedy requests (temperature 0) take the argmax of the penalised logits and skip the rest;
3. ``logits / temperature``, then top-k, top-p (on the top-k-renormalised distribution) and
   min-p (relative to the most likely remaining token) set filtered logits to ``-inf``;
4. one token is drawn from ``softmax`` of what is left with the exponential race
   ``argmax(p / E)``, ``E ~ Exp(1)`` i.i.d. per vocabulary entry, which samples exactly from ``p``;
   it is computed as ``argmax(x - log E)`` on the processed logits ``x`` (the same order, with
   no normalisation), so a vocabulary split across ranks reduces to the same token
   (:mod:`tgraph.runtime.vocab_parallel`).

NOTE: a request with a ``seed`` draws its noise row from a generator re-seeded from
``(seed, step)`` at every step, so its tokens depend only on its own logits, seed and step, not on
the batch it runs in, on the other requests, or on preemption and recomputation. Requests without
a seed share the sampler's generator.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from tgraph.kernels.triton.penalties import apply_penalties, apply_penalties_reference
from tgraph.runtime.sampling_params import SamplingParams

_MASK63 = (1 << 63) - 1
_MASK64 = (1 << 64) - 1


@dataclass
class PenaltyHistory:
    """The token history the penalties need, as padded device tensors.

    Attributes:
        output_token_ids: int ``[B, L]`` generated tokens per request, right-padded.
        output_lens: int ``[B]`` number of generated tokens per request.
        prompt_token_ids: optional int ``[B, P]`` prompt tokens (repetition penalty only).
        prompt_lens: int ``[B]`` prompt lengths, with ``prompt_token_ids``.
    """

    output_token_ids: torch.Tensor
    output_lens: torch.Tensor
    prompt_token_ids: torch.Tensor | None = None
    prompt_lens: torch.Tensor | None = None

    @classmethod
    def from_lists(
        cls,
        outputs: Sequence[Sequence[int]],
        prompts: Sequence[Sequence[int]] | None = None,
        device: torch.device | str = "cpu",
        vocab_range: tuple[int, int] | None = None,
    ) -> PenaltyHistory:
        """Pad per-request token lists into a history on ``device``.

        Args:
            outputs: generated token ids of each request.
            prompts: prompt token ids of each request, or ``None`` to leave the prompt out.
            device: where the tensors live (the logits' device).
            vocab_range: ``(lo, hi)`` for logits holding only the vocabulary slice
                ``[lo, hi)``: ids outside it are left out, the others shifted by ``-lo``.

        Returns:
            The padded history (int32 ids, padding ``-1``).
        """
        if vocab_range is not None:
            outputs = _in_range(outputs, *vocab_range)
            prompts = None if prompts is None else _in_range(prompts, *vocab_range)
        out_ids, out_lens = _pad(outputs, device)
        if prompts is None:
            return cls(out_ids, out_lens)
        if len(prompts) != len(outputs):
            raise ValueError(f"got {len(prompts)} prompts for {len(outputs)} outputs")
        prompt_ids, prompt_lens = _pad(prompts, device)
        return cls(out_ids, out_lens, prompt_ids, prompt_lens)


def _in_range(rows: Sequence[Sequence[int]], lo: int, hi: int) -> list[list[int]]:
    return [[t - lo for t in r if lo <= t < hi] for r in rows]


def _pad(rows: Sequence[Sequence[int]],
         device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    width = max((len(r) for r in rows), default=0)
    ids = torch.full((len(rows), width), -1, dtype=torch.int32)
    for i, r in enumerate(rows):
        if len(r):
            ids[i, : len(r)] = torch.as_tensor(list(r), dtype=torch.int32)
    lens = torch.tensor([len(r) for r in rows], dtype=torch.int32)
    return to_device(ids, device), to_device(lens, device)


@dataclass
class TokenLogprobs:
    """Log-probabilities reported for one generated token.

    Attributes:
        token_id: the sampled token.
        logprob: its log-probability.
        top_token_ids: the ``n`` most likely token ids, most likely first.
        top_logprobs: their log-probabilities.
    """

    token_id: int
    logprob: float
    top_token_ids: list[int]
    top_logprobs: list[float]


@dataclass
class SamplerOutput:
    """What :meth:`Sampler.sample` returns.

    Attributes:
        token_ids: int64 ``[B]`` sampled tokens, on the logits' device.
        logprobs: one entry per request: ``None`` unless the request asked for logprobs.
    """

    token_ids: torch.Tensor
    logprobs: list[TokenLogprobs | None]


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``t`` (a small host tensor) on ``device``, without waiting for the device's queued work.
    """
    device = torch.device(device)
    if device.type == "cuda":
        # Pinned memory lets the copy run asynchronously instead of stalling the host.
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def race_scores(x: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The exponential race's scores ``x - log(noise)``: their argmax is a draw from
    ``softmax(x)``; a noise of 1 leaves ``x`` as it is (greedy rows).

    Args:
        x: fp32 processed logits (filtered entries ``-inf``).
        noise: ``Exp(1)`` draws of ``x``'s shape (see :meth:`Sampler.noise`).

    Returns:
        A new fp32 tensor of ``x``'s shape.
    """
    return x - noise.log()


def step_seed(seed: int, step: int) -> int:
    """Mix a request seed and a step index into a generator seed (splitmix64).

    Args:
        seed: the request's ``SamplingParams.seed``.
        step: how many tokens the request has generated before this one.

    Returns:
        A non-negative 63-bit seed; neighbouring (seed, step) pairs give unrelated values.
    """
    z = (seed * 0x9E3779B97F4A7C15 + step + 0x632BE59BD9B4E019) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & _MASK63


class Sampler:
    """Samples one token per request from a batch of logits.

    Args:
        seed: seed of the generator shared by requests without their own seed; ``None`` seeds
            it non-deterministically.
        logprobs_mode: ``"processed"`` reports log-probabilities of the distribution the token
            was drawn from (after penalties, temperature and filtering; filtered tokens are
            ``-inf``; greedy requests: after penalties); ``"raw"`` reports ``log_softmax`` of the
            logits as given.
    """

    def __init__(self, seed: int | None = None,
                 logprobs_mode: Literal["processed", "raw"] = "processed") -> None:
        if logprobs_mode not in ("processed", "raw"):
            raise ValueError(f"logprobs_mode must be 'processed' or 'raw', got {logprobs_mode!r}")
        self.seed = seed
        self.logprobs_mode = logprobs_mode
        self._shared: dict[torch.device, torch.Generator] = {}
        self._seeded: dict[torch.device, torch.Generator] = {}

    def _shared_generator(self, device: torch.device) -> torch.Generator:
        if device not in self._shared:
            g = torch.Generator(device=device)
            if self.seed is None:
                g.seed()
            else:
                g.manual_seed(self.seed & _MASK63)
            self._shared[device] = g
        return self._shared[device]

    def _seeded_generator(self, device: torch.device, seed: int) -> torch.Generator:
        # One generator per device, re-seeded per row: a CUDA kernel takes the generator's
        # seed/offset by value at launch, so re-seeding for the next row is safe.
        if device not in self._seeded:
            self._seeded[device] = torch.Generator(device=device)
        g = self._seeded[device]
        g.manual_seed(seed)
        return g

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        steps: Sequence[int] | None = None,
        history: PenaltyHistory | None = None,
    ) -> SamplerOutput:
        """Sample one token per row of ``logits``.

        Args:
            logits: float ``[B, V]`` (fp32/fp16/bf16) next-token logits; left unmodified.
            params: one :class:`SamplingParams` per row.
            steps: per row, how many tokens the request has generated so far; required when a
                sampled (temperature > 0) request has a seed, since it keys the request's draw.
            history: the token history; required when a request has penalties.

        Returns:
            The sampled token ids and the requested logprobs.
        """
        self._check(logits, params, steps, history)
        processed = self.process_logits(logits, params, history)
        tokens = self._draw(processed, params, steps)
        logprobs = self._logprobs(logits if self.logprobs_mode == "raw" else processed,
                                  params, tokens)
        return SamplerOutput(tokens, logprobs)

    @staticmethod
    def _check(logits: torch.Tensor, params: Sequence[SamplingParams],
               steps: Sequence[int] | None, history: PenaltyHistory | None) -> None:
        if (not isinstance(logits, torch.Tensor) or logits.dim() != 2
                or not logits.is_floating_point()):
            raise ValueError(
                "logits must be a floating-point tensor [B, V], got "
                f"{getattr(logits, 'dtype', type(logits))} of shape "
                f"{tuple(getattr(logits, 'shape', ()))}")
        if len(params) != logits.shape[0]:
            raise ValueError(
                f"got {len(params)} SamplingParams for {logits.shape[0]} rows of logits")
        for p in params:
            if not isinstance(p, SamplingParams):
                raise TypeError(f"params must hold SamplingParams, got {type(p).__name__}")
        if steps is not None and len(steps) != len(params):
            raise ValueError(f"got {len(steps)} steps for {len(params)} requests")
        if steps is None and any(p.seed is not None and not p.greedy for p in params):
            raise ValueError(
                "steps (tokens generated so far per request) are required when a request has a "
                "seed: they key its random draw")
        if history is None and any(p.has_penalties for p in params):
            raise ValueError("history is required when a request has penalties")

    def process_logits(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        history: PenaltyHistory | None = None,
    ) -> torch.Tensor:
        """Penalties, temperature and top-k / top-p / min-p filtering, on an fp32 copy.

        Greedy rows get the penalties only. Filtered entries are ``-inf``.

        Args:
            logits: float ``[B, V]`` logits; left unmodified.
            params: one :class:`SamplingParams` per row.
            history: the token history; required when a request has penalties.

        Returns:
            fp32 ``[B, V]`` processed logits: ``softmax`` of a row is the distribution its token
            is drawn from.
        """
        x = self.scale_logits(logits, params, history)
        self.filter_logits(x, params)
        return x

    def scale_logits(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        history: PenaltyHistory | None = None,
    ) -> torch.Tensor:
        """Penalties, then temperature (sampled rows), on an fp32 copy: the steps of
        :meth:`process_logits` that act on each entry alone, so they also apply to a slice of
        the vocabulary given the history of that slice (``PenaltyHistory.from_lists``'s
        ``vocab_range``).

        Args:
            logits: float ``[B, V]`` logits (or ``[B, V / world_size]``); left unmodified.
            params: one :class:`SamplingParams` per row.
            history: the token history; required when a request has penalties.

        Returns:
            the fp32 scaled logits, same shape.
        """
        device = logits.device
        x = logits.to(torch.float32, copy=True).contiguous()
        if any(p.has_penalties for p in params):
            if history is None:
                raise ValueError("history is required when a request has penalties")
            penalties = apply_penalties if x.is_cuda else apply_penalties_reference

            def rows(values: list[float]) -> torch.Tensor:
                return to_device(torch.tensor(values, dtype=torch.float32), device)

            penalties(
                x, history.output_token_ids, history.output_lens,
                rows([p.repetition_penalty for p in params]),
                rows([p.frequency_penalty for p in params]),
                rows([p.presence_penalty for p in params]),
                history.prompt_token_ids, history.prompt_lens)

        sampled = [not p.greedy for p in params]
        temps = [p.temperature if s else 1.0 for p, s in zip(params, sampled)]
        if any(t != 1.0 for t in temps):
            x.div_(to_device(torch.tensor(temps, dtype=torch.float32), device)[:, None])
        return x

    @staticmethod
    def filter_logits(x: torch.Tensor, params: Sequence[SamplingParams]) -> None:
        """Top-k, top-p and min-p of the sampled rows, in place (filtered entries ``-inf``).

        Args:
            x: fp32 ``[B, V]`` scaled logits (:meth:`scale_logits`), whole rows.
            params: one :class:`SamplingParams` per row.
        """
        sampled = [not p.greedy for p in params]
        if not any(sampled):
            return
        device, vocab = x.device, x.shape[1]
        top_k = [min(p.top_k, vocab) if s and p.top_k > 0 else vocab
                 for p, s in zip(params, sampled)]
        top_p = [p.top_p if s and p.top_p < 1.0 else float("inf")
                 for p, s in zip(params, sampled)]
        if any(p < 1.0 for p in top_p):
            _filter_top_k_top_p(x, to_device(torch.tensor(top_k), device),
                                to_device(torch.tensor(top_p, dtype=torch.float32), device))
        elif any(k < vocab for k in top_k):
            _filter_top_k(x, top_k)

        min_p = [p.min_p if s else 0.0 for p, s in zip(params, sampled)]
        if any(m > 0.0 for m in min_p):
            probs = x.softmax(dim=-1)
            threshold = probs.amax(dim=-1, keepdim=True) * to_device(
                torch.tensor(min_p, dtype=torch.float32), device)[:, None]
            x.masked_fill_(probs < threshold, float("-inf"))

    def noise(self, params: Sequence[SamplingParams], steps: Sequence[int] | None, vocab: int,
              device: torch.device) -> torch.Tensor | None:
        """The race's ``Exp(1)`` noise of each row over the whole vocabulary: from the shared
        generator for sampled rows without a seed (one draw for all of them), from the
        ``(seed, step)`` generator for seeded rows; greedy rows get 1.

        Args:
            params: one :class:`SamplingParams` per row.
            steps: per row, tokens generated so far (required for seeded sampled rows).
            vocab: the vocabulary size (a draw's length: a seeded row's values depend on it).
            device: where to draw.

        Returns:
            fp32 ``[B, vocab]``, or ``None`` when every row is greedy.
        """
        greedy = [p.greedy for p in params]
        if all(greedy):
            return None
        noise = torch.ones((len(params), vocab), dtype=torch.float32, device=device)
        shared_rows = [i for i, p in enumerate(params) if not greedy[i] and p.seed is None]
        if shared_rows:
            draw = torch.empty((len(shared_rows), vocab), dtype=torch.float32, device=device)
            draw.exponential_(generator=self._shared_generator(device))
            noise[to_device(torch.tensor(shared_rows), device)] = draw
        for i, p in enumerate(params):
            if not greedy[i] and p.seed is not None:
                g = self._seeded_generator(device, step_seed(p.seed, int(steps[i])))
                noise[i].exponential_(generator=g)
        # An exponential draw of exactly 0 would make log(E) infinite.
        return noise.clamp_min_(torch.finfo(torch.float32).tiny)

    def _draw(self, x: torch.Tensor, params: Sequence[SamplingParams],
              steps: Sequence[int] | None) -> torch.Tensor:
        noise = self.noise(params, steps, x.shape[1], x.device)
        if noise is None:
            return x.argmax(dim=-1)
        return race_scores(x, noise).argmax(dim=-1)

    @staticmethod
    def _logprobs(x: torch.Tensor, params: Sequence[SamplingParams],
                  tokens: torch.Tensor) -> list[TokenLogprobs | None]:
        wanted = [p.logprobs for p in params]
        if all(n is None for n in wanted):
            return [None] * len(params)
        logprobs = x.float().log_softmax(dim=-1)
        sampled = logprobs.gather(1, tokens[:, None])[:, 0].tolist()
        top_n = min(max(n for n in wanted if n is not None), x.shape[1])
        if top_n > 0:
            top_vals, top_ids = logprobs.topk(top_n, dim=-1)
            top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
        token_list = tokens.tolist()
        out: list[TokenLogprobs | None] = []
        for i, n in enumerate(wanted):
            if n is None:
                out.append(None)
                continue
            n = min(n, top_n)
            out.append(TokenLogprobs(
                token_id=token_list[i], logprob=sampled[i],
                top_token_ids=top_ids[i][:n] if n else [],
                top_logprobs=top_vals[i][:n] if n else []))
        return out


def _filter_top_k(x: torch.Tensor, top_k: list[int]) -> None:
    # Only the k-th largest value is needed: topk(max k) avoids sorting the whole vocabulary.
    vocab, k_max = x.shape[1], max(top_k)
    k = to_device(torch.tensor(top_k), x.device)
    kth = x.topk(k_max, dim=-1).values.gather(1, (k.clamp_max(k_max) - 1)[:, None])
    # Rows with the filter off (k == V) keep everything; ties with the k-th value are kept.
    kth = torch.where(k[:, None] >= vocab, torch.full_like(kth, float("-inf")), kth)
    x.masked_fill_(x < kth, float("-inf"))


def _filter_top_k_top_p(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> None:
    sorted_x, order = x.sort(dim=-1, descending=True, stable=True)
    # Top-k by value: ties with the k-th value are kept, as in the top-k-only path.
    kth = sorted_x.gather(1, (top_k - 1)[:, None])
    sorted_x.masked_fill_(sorted_x < kth, float("-inf"))
    probs = sorted_x.softmax(dim=-1)
    # Keep the smallest prefix whose mass reaches p: drop a token once the mass before it does.
    mass_before = probs.cumsum(dim=-1) - probs
    sorted_x.masked_fill_(mass_before >= top_p[:, None], float("-inf"))
    x.scatter_(1, order, sorted_x)
