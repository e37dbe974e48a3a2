"""The model runner: turns one scheduler step into a model call and samples the next tokens."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tgraph.models.base.batch import BatchMeta
from tgraph.runtime.sampler import PenaltyHistory, Sampler, TokenLogprobs
from tgraph.runtime.sampling_params import SamplingParams
from tgraph.runtime.scheduler import SchedulerOutput


@dataclass
class StepResult:
    """Tokens sampled in one step (only for requests whose logits were computed)."""

    tokens: dict[str, int]
    logprobs: dict[str, TokenLogprobs | None]


def batch_from_schedule(out: SchedulerOutput) -> BatchMeta:
    """The model's view of a scheduler step (decodes and prefill chunks packed in order)."""
    scheduled = out.scheduled
    is_prefill = bool(out.prefills)
    indices = out.logits_indices() if is_prefill else None
    if is_prefill and not indices:
        indices = [out.num_batched_tokens - 1]  # nothing is sampled; keep the head's shape valid
    return BatchMeta(
        input_ids=out.flat_token_ids(), positions=out.flat_positions(),
        slots=out.flat_slot_ids(), query_lens=[s.query_len for s in scheduled],
        kv_lens=out.context_lens(), block_tables=[s.block_ids for s in scheduled],
        logits_indices=indices, is_prefill=is_prefill, loras=[s.lora for s in scheduled])


class ModelRunner:
    """Runs a graph model step by step and samples with :class:`Sampler`."""

    def __init__(self, model, sampler: Sampler | None = None) -> None:
        self.model = model
        self.sampler = sampler or Sampler()

    def execute(self, out: SchedulerOutput) -> StepResult:
        batch = batch_from_schedule(out)
        logits = self.model.run(batch)
        wanted = [s for s in out.scheduled if s.needs_logits]
        if not wanted:
            return StepResult({}, {})
        logits = logits[: len(wanted)].float()
        params = [s.request.sampling_params or SamplingParams(temperature=0.0) for s in wanted]
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
    if device.type == "cuda":
        torch.cuda.synchronize(device)
