"""The model runner: turns one scheduler step into a model call and samples the next tokens.

Under tensor parallelism every rank runs the model on the same batch (the collectives inside
need all of them). A decode step that needs only tokens runs the engines that leave each rank
its slice of the vocabulary, and every rank samples the same tokens from its slice
(:mod:`tgraph.runtime.vocab_parallel`). Other steps gather whole logits rows and only rank 0
samples: it broadcasts the sampled token ids, so every rank feeds the same tokens and its
scheduler takes the same steps, whatever the random draws. Log probabilities stay on rank 0
(the other ranks report ``None``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tgraph.errors import InvalidRequestError, TGraphError
from tgraph.models.base.batch import BatchMeta
from tgraph.models.base.logit_bias import LogitBias
from tgraph.models.base.vocab_parallel import VocabParallelDecorator
from tgraph.nn import distributed
from tgraph.runtime.sampler import PenaltyHistory, Sampler, TokenLogprobs
from tgraph.runtime.sampling_params import SamplingParams
from tgraph.runtime.scheduler import ScheduledRequest, SchedulerOutput
from tgraph.runtime.vocab_parallel import VocabParallelSampler


@dataclass
class StepResult:
    """Tokens sampled in one step (only for requests whose logits were computed)."""

    tokens: dict[str, int]
    logprobs: dict[str, TokenLogprobs | None]


def batch_from_schedule(out: SchedulerOutput, vocab_size: int | None = None) -> BatchMeta:
    """The model's view of a scheduler step (decodes and prefill chunks packed in order).

    Args:
        out: the scheduler's step.
        vocab_size: the model's vocabulary, which the token ids of per-step allow-lists
            (``SamplingParams.allowed_token_ids_fn``) must lie in.

    Raises:
        InvalidRequestError: a request's ``allowed_token_ids_fn`` failed or returned no valid
            allow-list (named with the request).
    """
    scheduled = out.scheduled
    is_prefill = bool(out.prefills)
    indices = out.lm_head_indices() if is_prefill else None
    if is_prefill and not indices:
        indices = [out.num_batched_tokens - 1]  # nothing is sampled; keep the head's shape valid
    biases = [_logit_bias(s, vocab_size) for s in scheduled]
    return BatchMeta(
        input_ids=out.flat_token_ids(), position_ids=out.flat_position_ids(),
        slots_mapping=out.flat_slots_mapping(), query_lens=[s.query_len for s in scheduled],
        seq_len=out.seq_len(), block_table=[s.block_table for s in scheduled],
        lm_head_indices=indices, is_prefill=is_prefill, loras=[s.lora for s in scheduled],
        logit_bias=biases if any(b is not None for b in biases) else None)


def _logit_bias(s: ScheduledRequest, vocab_size: int | None) -> LogitBias | None:
    """What a scheduled request adds to the logits it is sampled from (``None`` when it has no
    bias or is not sampled this step)."""
    params = s.request.sampling_params
    if params is None or not s.needs_logits:
        return None
    try:
        return params.logit_bias_for(s.request.output_token_ids, vocab_size)
    except Exception as err:
        raise InvalidRequestError(f"request {s.request_id!r}: {err}") from err


class RankFailedError(TGraphError, RuntimeError):
    """Another rank failed in a step this rank took part in (its own error names the cause)."""


class ModelRunner:
    """Runs a graph model step by step and samples with :class:`Sampler`.

    Args:
        model: a loaded graph model; its ``llm_config.rank`` / ``world_size`` say whether this
            rank samples (rank 0) or receives rank 0's tokens, unless the step samples from
            the vocabulary slices.
        sampler: the sampler (rank 0's is the one that draws whole rows).

    Attributes:
        vocab_parallel: samples decode steps from the vocabulary slices (``None``: without
            tensor parallelism, when ``llm.engine.tuning.vocab_parallel.enabled`` is off, or
            for a model without the :class:`VocabParallelDecorator` feature).
        vocab_parallel_steps: steps sampled that way so far.
        name_steps: run each step inside a named profiler range (``tgraph.prefill`` /
            ``tgraph.decode``); the CLI's ``--profile`` turns it on. Off by default: entering a
            range costs a few microseconds of host time per step.
    """

    def __init__(self, model, sampler: Sampler | None = None) -> None:
        self.model = model
        self.sampler = sampler or Sampler()
        c = model.llm_config
        self.rank, self.world_size = c.rank, c.world_size
        self.vocab_size = c.model.vocab_size
        self.vocab_parallel: VocabParallelSampler | None = None
        self.vocab_parallel_steps = 0
        self.name_steps = False
        if self.world_size > 1 and c.tuning.vocab_parallel.enabled \
                and VocabParallelDecorator.name in getattr(model, "features", {}):
            self.vocab_parallel = VocabParallelSampler(self.sampler, self.rank, self.world_size,
                                                       self.vocab_size, c.tuning.vocab_parallel)

    def execute(self, out: SchedulerOutput) -> StepResult:
        """Run one scheduler step and return the next token of every request that has logits.

        Raises:
            RankFailedError: when another rank failed to sample this step (rank 0 on whole
                rows, any rank on its vocabulary slice).
        """
        batch = batch_from_schedule(out, self.vocab_size)
        wanted = [s for s in out.scheduled if s.needs_logits]
        sliced = self._samples_slices(batch, wanted)
        if sliced:
            VocabParallelDecorator.mark(batch)
        if self.name_steps:  # a profile then shows the steps, native CPU calls included
            with torch.profiler.record_function("tgraph.prefill" if batch.is_prefill
                                                else "tgraph.decode"):
                logits = self.model.run(batch)
        else:
            logits = self.model.run(batch)
        if not wanted:
            return StepResult({}, {})
        if sliced:
            return self._sample_slices(wanted, logits)
        if self.world_size == 1:
            return self._sample(wanted, logits)
        return self._sample_on_rank0(wanted, logits)

    def _samples_slices(self, batch: BatchMeta, wanted: list) -> bool:
        """Whether this step samples from the vocabulary slices: a decode step whose every
        sequence is sampled, needing only tokens, on no feature's engine that needs whole rows
        (LoRA stacks with it; logit bias does not). The same
        answer on every rank: it reads only the batch and the requests."""
        vp = self.vocab_parallel
        if vp is None or batch.is_prefill or len(wanted) != batch.num_seqs:
            return False
        compatible = VocabParallelDecorator.compatible_with | {VocabParallelDecorator.name}
        others = [f for name, f in self.model.features.items()
                  if name not in compatible and f.needs_engine and f.is_used(batch)]
        return not others and vp.supports([self._params(s) for s in wanted])

    def _sample_slices(self, wanted: list, logits: torch.Tensor) -> StepResult:
        """Every rank samples from its slice of the vocabulary (the same tokens)."""
        assert self.vocab_parallel is not None
        result = self.vocab_parallel.sample(
            logits[: len(wanted)], [self._params(s) for s in wanted],
            [len(s.request.output_token_ids) for s in wanted],
            [s.request.output_token_ids for s in wanted],
            [s.request.prompt_token_ids for s in wanted])
        if result.failed_ranks:
            raise RankFailedError(f"rank(s) {result.failed_ranks} failed while sampling this "
                                  "step; their errors say why")
        self.vocab_parallel_steps += 1
        return StepResult({s.request_id: t for s, t in zip(wanted, result.token_ids)},
                          {s.request_id: None for s in wanted})

    @staticmethod
    def _params(s: ScheduledRequest) -> SamplingParams:
        return s.request.sampling_params or SamplingParams(temperature=0.0)

    def _sample_on_rank0(self, wanted: list, logits: torch.Tensor) -> StepResult:
        """Rank 0 samples and broadcasts ``[status, *token_ids]``; a failed sampling is
        broadcast too (status 1) before it is raised, so no rank waits for tokens forever."""
        payload = torch.zeros(len(wanted) + 1, dtype=torch.int64, device=distributed.comm_device())
        if self.rank != 0:
            distributed.broadcast_from_rank0(payload)
            status, *token_list = payload.tolist()
            if status != 0:
                raise RankFailedError("rank 0 failed while sampling this step; its error says why")
            return StepResult({s.request_id: int(t) for s, t in zip(wanted, token_list)},
                              {s.request_id: None for s in wanted})
        try:
            result = self._sample(wanted, logits)
        except BaseException:
            payload[0] = 1
            distributed.broadcast_from_rank0(payload)
            raise
        payload[1:] = torch.tensor([result.tokens[s.request_id] for s in wanted],
                                   dtype=torch.int64)
        distributed.broadcast_from_rank0(payload)
        return result

    def _sample(self, wanted: list, logits: torch.Tensor) -> StepResult:
        logits = logits[: len(wanted)].float()
        params = [self._params(s) for s in wanted]
        steps = [len(s.request.output_token_ids) for s in wanted]
        history = None
        if any(p.has_penalties for p in params):
            history = PenaltyHistory.from_lists(
                [s.request.output_token_ids for s in wanted],
                [s.request.prompt_token_ids for s in wanted], device=logits.device)
        sampled = self.sampler.sample(logits, params, steps, history)
        token_list = sampled.token_ids.tolist()
        tokens = {s.request_id: int(t) for s, t in zip(wanted, token_list)}
        logprobs = {s.request_id: lp for s, lp in zip(wanted, sampled.logprobs)}
        return StepResult(tokens, logprobs)


def synchronize(device: torch.device) -> None:
    """Wait for ``device``'s queued work (a no-op off CUDA)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def use_device(device: torch.device) -> None:
    """Make ``device`` the calling thread's current CUDA device (a no-op off CUDA).

    A new thread starts on device 0, while collectives (:func:`distributed.comm_device`), CUDA
    graphs and streams use the current device: a thread that steps a model on another GPU calls
    this first.
    """
    if device.type == "cuda":
        torch.cuda.set_device(device)
