"""Per-request sampling and stopping parameters (the vLLM / OpenAI vocabulary)."""
from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from tgraph.errors import InvalidRequestError, InvalidRequestTypeError

SEED_LIMIT = 2**64
"""Seeds lie in ``[0, 2**64)``: the sampler mixes them as 64-bit words, so a larger one would
alias a smaller one."""


def _is_int(value: object) -> bool:
    # NOTE: bool is a subclass of int; `top_k=True` is a bug in the caller, not a 1.
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass
class SamplingParams:
    """How one request picks its tokens and when it stops.

    Attributes:
        temperature: softmax temperature; ``0`` means greedy (argmax, no randomness).
        top_k: keep only the ``top_k`` most likely tokens; ``0`` disables the filter.
        top_p: nucleus sampling: keep the smallest set of most likely tokens whose probability
            mass reaches ``top_p``; ``1.0`` disables the filter. Must lie in ``(0, 1]``.
        min_p: drop tokens whose probability is below ``min_p`` times the most likely token's;
            ``0.0`` disables the filter. Must lie in ``[0, 1]``.
        seed: seeds this request's own random stream, so it draws the same tokens whatever
            batch it runs in; ``None`` shares the sampler's generator. Must lie in
            ``[0, 2**64)``.
        repetition_penalty: HF/CTRL penalty (> 0) on every token already seen in the prompt or
            output: a positive logit is divided by it, a negative one multiplied. ``1.0`` is off.
        frequency_penalty: subtracted from a token's logit once per time it was generated.
        presence_penalty: subtracted from a token's logit if it was generated at least once.
        max_tokens: the most tokens to generate (>= 1).
        stop: strings that end generation; the returned text stops before the match (needs a
            tokenizer: a request with stop strings is refused by a model without one).
        stop_token_ids: token ids that end generation (their text is not returned).
        ignore_eos: keep generating past the tokenizer's end-of-sequence token.
        logprobs: ``None`` returns no log-probabilities; ``n >= 0`` returns the sampled token's
            log-probability plus the ``n`` most likely tokens' at every step.
        lora: name of the LoRA adapter to run this request with, or ``None`` for the base model.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    max_tokens: int = 16
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    lora: str | None = None

    def __post_init__(self) -> None:
        # A single stop string is the common OpenAI spelling; store lists only.
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = _as_list("stop", self.stop, "a string or a list of strings")
        self.stop_token_ids = _as_list("stop_token_ids", self.stop_token_ids,
                                       "a list of token ids (ints >= 0)")
        self._validate()

    def _validate(self) -> None:
        for name in ("temperature", "top_p", "min_p", "repetition_penalty",
                     "frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not math.isfinite(value):
                raise InvalidRequestError(
                    f"SamplingParams.{name} must be a finite number, got {value!r}")
        if self.temperature < 0:
            raise InvalidRequestError(
                f"SamplingParams.temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise InvalidRequestError(
                f"SamplingParams.top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(
                f"SamplingParams.top_p must lie in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError(
                f"SamplingParams.min_p must lie in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise InvalidRequestError(
                "SamplingParams.repetition_penalty must be > 0 (1.0 = off), "
                f"got {self.repetition_penalty}")
        if self.seed is not None and (not _is_int(self.seed)
                                      or not 0 <= self.seed < SEED_LIMIT):
            raise InvalidRequestError(
                f"SamplingParams.seed must be None or an int in [0, 2**64), got {self.seed!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise InvalidRequestError(
                f"SamplingParams.max_tokens must be an int >= 1, got {self.max_tokens!r}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise InvalidRequestError(
                    f"SamplingParams.stop must hold non-empty strings, got {self.stop!r}")
        for t in self.stop_token_ids:
            if not _is_int(t) or t < 0:
                raise InvalidRequestError(
                    "SamplingParams.stop_token_ids must hold ints >= 0, "
                    f"got {self.stop_token_ids!r}")
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequestError(
                f"SamplingParams.ignore_eos must be a bool, got {self.ignore_eos!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or self.logprobs < 0):
            raise InvalidRequestError(
                f"SamplingParams.logprobs must be None or an int >= 0, got {self.logprobs!r}")
        if self.lora is not None and (not isinstance(self.lora, str) or not self.lora):
            raise InvalidRequestError(
                f"SamplingParams.lora must be a non-empty adapter name or None, got {self.lora!r}")

    @property
    def greedy(self) -> bool:
        """Whether this request takes the argmax (temperature 0)."""
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        """Whether any of the repetition / frequency / presence penalties is active."""
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0
                or self.presence_penalty != 0.0)


def _as_list(name: str, value: object, expected: str) -> list:
    """``value`` as a list, refusing a scalar or a mapping with a message naming the field."""
    if isinstance(value, (str, bytes, dict)) or not isinstance(value, Iterable):
        raise InvalidRequestTypeError(
            f"SamplingParams.{name} must be {expected}, got {type(value).__name__} {value!r:.60}")
    return list(value)
