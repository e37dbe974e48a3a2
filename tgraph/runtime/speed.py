"""Tokens per second of greedy generation, measured the same way for tgraph and for Hugging Face
transformers (``tgraph bench cpu`` and ``tgraph demo`` both report these numbers).

A measurement runs ``prompts`` in groups of ``batch`` (one ``generate`` call per group), each
prompt making exactly ``max_tokens`` new tokens (EOS ignored), and divides the new tokens by the
wall time of the calls; prefill is included, loading and the warm-up call are not.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["Speed", "tgraph_speed", "transformers_speed"]


@dataclass
class Speed:
    """One measurement: tokens made, seconds taken, and the tokens of each prompt."""

    batch: int
    tokens: int
    seconds: float
    token_ids: list[list[int]] = field(default_factory=list)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def _groups(prompts: Sequence[Sequence[int]], batch: int) -> list[list[list[int]]]:
    return [[list(p) for p in prompts[i:i + batch]] for i in range(0, len(prompts), batch)]


def tgraph_speed(llm: Any, prompts: Sequence[Sequence[int]], batch: int,
                 max_tokens: int) -> Speed:
    """Greedy generation with a :class:`~tgraph.runtime.llm.LLM`, ``batch`` prompts per call.

    Args:
        llm: the loaded model (warmed up by one short call here).
        prompts: token ids of each prompt.
        batch: prompts per ``generate`` call.
        max_tokens: new tokens per prompt (EOS ignored).
    Returns:
        the measurement, with each prompt's new tokens.
    """
    from tgraph.runtime.sampling_params import SamplingParams

    llm.generate([list(prompts[0])], SamplingParams(temperature=0.0, max_tokens=2,
                                                    ignore_eos=True))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ids: list[list[int]] = []
    start = time.perf_counter()
    for group in _groups(prompts, batch):
        ids += [r.token_ids for r in llm.generate(group, params)]
    seconds = time.perf_counter() - start
    return Speed(batch, sum(len(t) for t in ids), seconds, ids)


def transformers_speed(model: Any, prompts: Sequence[Sequence[int]], batch: int,
                       max_tokens: int, pad_id: int = 0) -> Speed:
    """Greedy generation with a transformers causal LM in eager mode, ``batch`` prompts per
    ``generate`` call (left-padded, with the attention mask).

    Args:
        model: the transformers model (eval mode, on the CPU).
        prompts: token ids of each prompt.
        batch: prompts per ``generate`` call.
        max_tokens: new tokens per prompt (EOS ignored).
        pad_id: the id left padding uses.
    Returns:
        the measurement, with each prompt's new tokens.
    """
    def run(group: list[list[int]], new_tokens: int = max_tokens) -> list[list[int]]:
        width = max(len(p) for p in group)
        x = torch.tensor([[pad_id] * (width - len(p)) + p for p in group])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
        out = model.generate(x, attention_mask=mask, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad_id,
                             eos_token_id=None)
        return [row[width:].tolist() for row in out]

    with torch.no_grad():
        run([list(prompts[0])], 2)  # warm-up (one-time allocations)
        ids: list[list[int]] = []
        start = time.perf_counter()
        for group in _groups(prompts, batch):
            ids += run(group)
        seconds = time.perf_counter() - start
    return Speed(batch, sum(len(t) for t in ids), seconds, ids)
