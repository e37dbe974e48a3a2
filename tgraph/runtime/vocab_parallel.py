"""Sampling from each tensor-parallel rank's slice of the vocabulary, without gathering logits.

Under tensor parallelism the LM head leaves rank ``r`` the logits of tokens
``[r * V / W, (r + 1) * V / W)``. When a decode step needs only tokens (no logprobs, no logit
bias), the runner runs the engines of
:class:`~tgraph.models.base.vocab_parallel.VocabParallelDecorator` (no all-gather of
``[rows, V]``) and every rank samples the same tokens as the sampler would on whole rows
(:class:`~tgraph.runtime.sampler.Sampler`):

* penalties and temperature act on each entry alone: each rank applies them to its slice, with
  the token history of its slice;
* greedy and plain temperature rows: the sampler's token is ``argmax(x - log E)`` (``E = 1`` for
  greedy), with ``E`` the same whole-vocabulary noise row the sampler draws, sliced; each rank
  sends its slice's ``(max, argmax)`` and the lowest rank holding the largest value wins, which
  is ``torch.argmax``'s lowest index on the whole row;
* top-k rows (``top_k <= max_top_k``, with or without top-p / min-p): each rank sends its
  ``top_k`` largest ``(value, token id, noise)``; top-k, top-p and min-p are then finished on
  these candidates, sorted as the sampler sorts whole rows (value descending, id ascending).
  Ties with the k-th value that a rank could not send (rare: it needs a tie at a rank's last
  candidate) are found after the exchange; those rows gather their whole rows and finish as the
  sampler does.

One all-gather of a small float64 payload per step (its first entry says whether the rank
failed, so that no rank waits for one that raised), plus one only for such ties. The token ids
come to the host once, as the sampler's do. Top-p and min-p sum probabilities over the
candidates instead of the whole row: the same sums up to float rounding.

NOTE: unseeded rows draw their noise from each rank's own shared generator: ranks whose
samplers have one seed draw what a single process draws; otherwise each rank's slice gets
independent draws, which still samples exactly (the race needs i.i.d. noise per token only).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tgraph.nn import distributed
from tgraph.runtime.sampler import PenaltyHistory, Sampler, race_scores, to_device
from tgraph.runtime.sampling_params import SamplingParams
from tgraph.tuning import VocabParallelTuning

__all__ = ["VocabParallelResult", "VocabParallelSampler", "all_gather_ranks", "pick_over_ranks"]

AllGather = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class VocabParallelResult:
    """What :meth:`VocabParallelSampler.sample` returns.

    Attributes:
        token_ids: one token per row, equal on every rank (empty when a rank failed).
        failed_ranks: the ranks whose sampling raised this step (this rank's own error is
            raised instead); their tokens are not valid.
        tie_rows: rows whose top-k ties made them gather their whole rows.
    """

    token_ids: list[int]
    failed_ranks: list[int]
    tie_rows: list[int]


def pick_over_ranks(values: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Each row's winner of the ranks' local ``(max, argmax)``: the largest value, and on ties
    the lowest rank, whose slice holds the lowest ids: ``torch.argmax`` on the whole row.

    Args:
        values: ``[world_size, rows]`` each rank's largest value of its slice.
        ids: ``[world_size, rows]`` the (global) id where it first occurs.

    Returns:
        int64 ``[rows]`` token ids.
    """
    winner = values.argmax(dim=0)  # the first maximum: the lowest rank
    return ids.gather(0, winner[None])[0].long()


class VocabParallelSampler:
    """Samples from this rank's vocabulary slice, in step with the other ranks.

    Args:
        sampler: the rank's sampler (its generators draw the noise).
        rank: this rank.
        world_size: ranks sharing the vocabulary.
        vocab_size: the whole vocabulary (a multiple of ``world_size``).
        settings: ``llm.engine.tuning.vocab_parallel``.
        all_gather: ``t -> [world_size, *t.shape]``, every rank's ``t`` in rank order
            (:func:`all_gather_ranks` over the default process group if None).
    """

    def __init__(self, sampler: Sampler, rank: int, world_size: int, vocab_size: int,
                 settings: VocabParallelTuning, all_gather: AllGather | None = None) -> None:
        if vocab_size % world_size:
            raise ValueError(f"vocab_size {vocab_size} is not a multiple of the world size "
                             f"{world_size}")
        self.sampler = sampler
        self.rank, self.world_size, self.vocab_size = rank, world_size, vocab_size
        self.settings = settings
        self.all_gather = all_gather or all_gather_ranks
        self.width = vocab_size // world_size
        self.lo = rank * self.width

    # ---- which steps ---------------------------------------------------------------------------
    def supports(self, params: Sequence[SamplingParams]) -> bool:
        """Whether a batch of these requests can be sampled from the slices: it needs no
        logprobs and no logit bias, and a sampled row filters only with a top-k within
        ``max_top_k`` (top-p / min-p only on top of such a top-k)."""
        if not 0 < len(params) <= self.settings.max_batch:
            return False
        for p in params:
            if p.logprobs is not None or p.logit_bias is not None \
                    or p.allowed_token_ids is not None or p.allowed_token_ids_fn is not None:
                return False
            if p.greedy:
                continue
            k = self._top_k(p)
            if k > self.settings.max_top_k or (k == 0 and (p.top_p < 1.0 or p.min_p > 0.0)):
                return False
        return True

    def _top_k(self, p: SamplingParams) -> int:
        """The row's top-k filter as the sampler applies it (0: off; so is a k >= vocab)."""
        return p.top_k if not p.greedy and 0 < p.top_k < self.vocab_size else 0

    # ---- sampling ------------------------------------------------------------------------------
    def sample(self, logits: torch.Tensor, params: Sequence[SamplingParams],
               steps: Sequence[int], outputs: Sequence[Sequence[int]],
               prompts: Sequence[Sequence[int]]) -> VocabParallelResult:
        """Sample one token per row on every rank (each must call this with its own slice).

        Args:
            logits: float ``[rows, vocab / world_size]`` this rank's slice.
            params: one :class:`SamplingParams` per row (:meth:`supports` them).
            steps: per row, tokens generated so far (keys seeded draws).
            outputs: per row, the generated tokens (penalties).
            prompts: per row, the prompt tokens (repetition penalty).

        Returns:
            the tokens (equal on every rank), or the ranks that failed.
        """
        rows = len(params)
        device = logits.device
        k_rows = [i for i, p in enumerate(params) if self._top_k(p)]
        cands = min(max((self._top_k(params[i]) for i in k_rows), default=0), self.width)
        # [failed, max per row, argmax per row, candidates' values, ids, noise]
        payload = torch.zeros(1 + 2 * rows + 3 * len(k_rows) * cands, dtype=torch.float64,
                              device=device)
        try:
            x, noise = self._local(logits, params, steps, outputs, prompts, payload, k_rows,
                                   cands)
        except BaseException:
            payload.zero_()
            payload[0] = 1
            self.all_gather(payload)
            raise
        gathered = self.all_gather(payload)  # [world_size, payload]
        tokens = pick_over_ranks(gathered[:, 1:1 + rows], gathered[:, 1 + rows:1 + 2 * rows])
        ties = torch.zeros(rows, dtype=torch.bool, device=device)
        if k_rows:
            sel = to_device(torch.tensor(k_rows), device)
            k_tokens, k_ties = self._finish_candidates(
                gathered[:, 1 + 2 * rows:], [params[i] for i in k_rows], cands)
            tokens[sel] = k_tokens
            ties[sel] = k_ties
        failed = gathered[:, 0] != 0
        # The step's one host sync, as the sampler's token ids are.
        host = torch.cat([tokens, ties.long(), failed.long()]).tolist()
        token_ids, tie_flags, failed_flags = host[:rows], host[rows:2 * rows], host[2 * rows:]
        failed_ranks = [r for r, f in enumerate(failed_flags) if f]
        if failed_ranks:
            return VocabParallelResult([], failed_ranks, [])
        tie_rows = [i for i, t in enumerate(tie_flags) if t]
        if tie_rows:
            redrawn = self._whole_rows(x, noise, params, tie_rows)
            for i, t in zip(tie_rows, redrawn):
                token_ids[i] = t
        return VocabParallelResult(token_ids, [], tie_rows)

    def _local(self, logits: torch.Tensor, params: Sequence[SamplingParams],
               steps: Sequence[int], outputs: Sequence[Sequence[int]],
               prompts: Sequence[Sequence[int]], payload: torch.Tensor, k_rows: list[int],
               cands: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This rank's part, written into ``payload``; returns its scaled slice and noise."""
        rows, device = len(params), logits.device
        history = None
        if any(p.has_penalties for p in params):
            history = PenaltyHistory.from_lists(outputs, prompts, device=device,
                                                vocab_range=(self.lo, self.lo + self.width))
        x = self.sampler.scale_logits(logits, params, history)  # (rows, width)
        full = self.sampler.noise(params, steps, self.vocab_size, device)  # (rows, vocab)
        noise = None if full is None else full[:, self.lo:self.lo + self.width]
        scores = x if noise is None else race_scores(x, noise)
        best = scores.argmax(dim=-1)
        payload[1:1 + rows] = scores.gather(1, best[:, None])[:, 0]
        payload[1 + rows:1 + 2 * rows] = best + self.lo
        if k_rows:
            assert noise is not None  # top-k rows are sampled rows
            sel = to_device(torch.tensor(k_rows), device)
            values, ids = x[sel].topk(cands, dim=-1)  # (k_rows, cands)
            drawn = noise[sel].gather(1, ids)
            payload[1 + 2 * rows:] = torch.cat([values.flatten(), (ids + self.lo).flatten(),
                                                drawn.flatten()])
        return x, noise

    def _finish_candidates(self, part: torch.Tensor, params: list[SamplingParams],
                           cands: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k / top-p / min-p and the draw on the gathered candidates.

        Args:
            part: ``[world_size, 3 * rows * cands]`` every rank's values, ids and noise.
            params: the top-k rows' params.
            cands: candidates per rank and row.

        Returns:
            int64 ``[rows]`` tokens, bool ``[rows]`` rows with a tie the candidates miss.
        """
        ws, rows, device = self.world_size, len(params), part.device

        def by_row(i: int) -> torch.Tensor:  # (rows, ws * cands), in rank order
            return part[:, i * rows * cands:(i + 1) * rows * cands].reshape(
                ws, rows, cands).permute(1, 0, 2).reshape(rows, ws * cands)

        values, ids, noise = by_row(0).float(), by_row(1).long(), by_row(2).float()
        # A rank that sent only part of its slice sent its largest: what it kept back is at
        # most its last candidate.
        last = values.view(rows, ws, cands)[:, :, -1]
        kept_back = last if cands < self.width else torch.full_like(last, float("-inf"))
        bound = kept_back.amax(dim=-1)
        # The sampler's order on whole rows: value descending, ties by ascending id.
        order = ids.argsort(dim=-1)
        values, ids, noise = (t.gather(1, order) for t in (values, ids, noise))
        order = values.sort(dim=-1, descending=True, stable=True).indices
        values, ids, noise = (t.gather(1, order) for t in (values, ids, noise))

        def column(vals: list[float]) -> torch.Tensor:
            return to_device(torch.tensor(vals, dtype=torch.float32), device)[:, None]

        k = to_device(torch.tensor([p.top_k for p in params]), device)
        kth = values.gather(1, (k - 1)[:, None])
        # The k-th value is never below a rank's last candidate; equal to it, tokens kept back
        # may tie with it and belong to the top-k.
        ties = kth[:, 0] <= bound
        x = values.masked_fill(values < kth, float("-inf"))
        top_p = [p.top_p if p.top_p < 1.0 else float("inf") for p in params]
        if any(p < 1.0 for p in top_p):
            probs = x.softmax(dim=-1)
            mass_before = probs.cumsum(dim=-1) - probs
            x.masked_fill_(mass_before >= column(top_p), float("-inf"))
        min_p = [p.min_p for p in params]
        if any(m > 0.0 for m in min_p):
            probs = x.softmax(dim=-1)
            x.masked_fill_(probs < probs.amax(dim=-1, keepdim=True) * column(min_p),
                           float("-inf"))
        scores = race_scores(x, noise)
        best = scores.amax(dim=-1, keepdim=True)
        # torch.argmax's tie rule on the whole row: the lowest id.
        tokens = torch.where(scores == best, ids, self.vocab_size).amin(dim=-1)
        return tokens, ties

    def _whole_rows(self, x: torch.Tensor, noise: torch.Tensor | None,
                    params: Sequence[SamplingParams], rows: list[int]) -> list[int]:
        """Gather the whole scaled rows (and their noise) of ``rows`` and draw as the sampler
        does on whole rows."""
        assert noise is not None
        sel = to_device(torch.tensor(rows), x.device)
        mine = torch.cat([x[sel], noise[sel]], dim=-1)  # (rows, 2 * width)
        parts = self.all_gather(mine)  # (ws, rows, 2 * width)
        whole = parts.permute(1, 0, 2).reshape(len(rows), self.world_size, 2, self.width)
        xs = whole[:, :, 0].reshape(len(rows), self.vocab_size).contiguous()
        drawn = whole[:, :, 1].reshape(len(rows), self.vocab_size)
        self.sampler.filter_logits(xs, [params[i] for i in rows])
        return race_scores(xs, drawn).argmax(dim=-1).tolist()


def all_gather_ranks(t: torch.Tensor) -> torch.Tensor:
    """Every rank's ``t`` (same shape and dtype) in rank order, ``[world_size, *t.shape]``, on
    ``t``'s device: a host-side collective over the default process group.

    On NCCL it is queued on the device like a kernel (no host sync).
    """
    comm = distributed.comm_device()
    local = t.contiguous().to(comm)
    out = torch.empty((distributed.world_size(), *t.shape), dtype=t.dtype, device=comm)
    if dist.get_backend() == "nccl":
        dist.all_gather_into_tensor(out, local)
    else:  # gloo has no all_gather_into_tensor everywhere: the list form
        dist.all_gather(list(out.unbind(0)), local)
    return out.to(t.device)
