"""Per-request sampling and stopping parameters (the vLLM / OpenAI vocabulary)."""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from tgraph.errors import InvalidRequestError, InvalidRequestTypeError
from tgraph.models.base.logit_bias import BIAS_LIMIT, LogitBias

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
        logit_bias: OpenAI's ``logit_bias``: ``{token id: bias}`` added to those tokens' logits
            before sampling, biases in ``[-100, 100]`` (``-100`` all but bans a token, ``100``
            all but forces it). Keys may be ints or decimal strings (as OpenAI's JSON sends
            them); they are stored as ints.
        allowed_token_ids: the only tokens this request may generate (the others' logits become
            ``-inf``); non-empty. ``None`` allows every token.
        allowed_token_ids_fn: for constrained decoding (e.g. a grammar): called before every
            generated token with the tokens generated so far, it returns that step's
            allow-list (``None``: no restriction at that step). Runs on the engine's thread, so
            it must be quick; only for an in-process engine (``LLM``, ``EngineCore``) without
            tensor parallelism. Not together with ``allowed_token_ids``.

    The bias and the allow-list are added to the model's logits inside its engine (see
    :mod:`tgraph.models.base.logit_bias`): the sampler sees the biased logits, so penalties,
    temperature, top-k / top-p / min-p and greedy's argmax all apply to them, and reported
    log-probabilities are those of the biased distribution.
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
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    allowed_token_ids_fn: Callable[[list[int]], Iterable[int] | None] | None = None

    def __post_init__(self) -> None:
        # A single stop string is the common OpenAI spelling; store lists only.
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = _as_list("stop", self.stop, "a string or a list of strings")
        self.stop_token_ids = _as_list("stop_token_ids", self.stop_token_ids,
                                       "a list of token ids (ints >= 0)")
        self.logit_bias = _logit_bias(self.logit_bias)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _as_list("allowed_token_ids", self.allowed_token_ids,
                                              "a list of token ids (ints >= 0)")
        self._validate()
        self._validate_bias()
        # What every step adds to the logits when no allowed_token_ids_fn changes it; not a
        # dataclass field (asdict and the equality compare the fields only).
        self._static_bias = None if self.logit_bias is None and self.allowed_token_ids is None \
            else LogitBias(self.logit_bias, self.allowed_token_ids)

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

    def _validate_bias(self) -> None:
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise InvalidRequestError(
                    "SamplingParams.allowed_token_ids is empty: no token could be generated; "
                    "give at least one token id, or None to allow every token")
            _check_ids("allowed_token_ids", self.allowed_token_ids)
        if self.allowed_token_ids_fn is not None:
            if not callable(self.allowed_token_ids_fn):
                raise InvalidRequestTypeError(
                    "SamplingParams.allowed_token_ids_fn must be a callable (tokens generated so "
                    f"far -> allowed token ids), got {type(self.allowed_token_ids_fn).__name__}")
            if self.allowed_token_ids is not None:
                raise InvalidRequestError(
                    "SamplingParams.allowed_token_ids and allowed_token_ids_fn are exclusive: "
                    "give the fixed list or the per-step function")

    def token_ids_named(self) -> list[int]:
        """Every token id the fixed bias and allow-list name (checked against the vocabulary
        at submission)."""
        return sorted({*(self.logit_bias or {}), *(self.allowed_token_ids or ())})

    def logit_bias_for(self, output_token_ids: Sequence[int],
                       vocab_size: int | None = None) -> LogitBias | None:
        """What this request adds to its next-token logits after ``output_token_ids``.

        Args:
            output_token_ids: the tokens generated so far (given to ``allowed_token_ids_fn``).
            vocab_size: the model's vocabulary; the function's token ids must lie below it.

        Returns:
            The bias, or ``None`` when the logits are left as they are.

        Raises:
            InvalidRequestError: ``allowed_token_ids_fn`` returned no token, or ids that are not
                token ids of the vocabulary.
        """
        fn = self.allowed_token_ids_fn
        if fn is None:
            return self._static_bias
        allowed = fn(list(output_token_ids))
        if allowed is None:
            return self._static_bias
        allowed = _as_list("allowed_token_ids_fn's result", allowed, "token ids (ints >= 0)")
        if not allowed:
            raise InvalidRequestError(
                "SamplingParams.allowed_token_ids_fn returned an empty allow-list after "
                f"{len(output_token_ids)} tokens: no token could be generated")
        _check_ids("allowed_token_ids_fn's result", allowed, vocab_size)
        return LogitBias(self.logit_bias, allowed)

    @property
    def greedy(self) -> bool:
        """Whether this request takes the argmax (temperature 0)."""
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        """Whether any of the repetition / frequency / presence penalties is active."""
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0
                or self.presence_penalty != 0.0)


def _check_ids(name: str, ids: Iterable[object], vocab_size: int | None = None) -> None:
    bad = [t for t in ids if not _is_int(t) or t < 0
           or (vocab_size is not None and t >= vocab_size)]
    if bad:
        limit = "" if vocab_size is None else f" below the vocabulary size {vocab_size}"
        raise InvalidRequestError(
            f"SamplingParams.{name} must hold token ids (ints >= 0{limit}), got {bad[:8]!r}")


def _logit_bias(value: object) -> dict[int, float] | None:
    """``logit_bias`` with int keys (OpenAI's JSON sends decimal strings), checked."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise InvalidRequestTypeError(
            "SamplingParams.logit_bias must be a mapping {token id: bias}, got "
            f"{type(value).__name__} {value!r:.60}")
    out: dict[int, float] = {}
    for key, bias in value.items():
        token = key
        if isinstance(key, str) and key.isascii() and key.isdigit():
            token = int(key)
        if not _is_int(token) or token < 0:
            raise InvalidRequestError(
                "SamplingParams.logit_bias keys must be token ids (ints >= 0, or their decimal "
                f"strings), got {key!r}")
        if not _is_real(bias) or not math.isfinite(bias) or not -BIAS_LIMIT <= bias <= BIAS_LIMIT:
            raise InvalidRequestError(
                f"SamplingParams.logit_bias[{token}] is {bias!r}; expected a number in "
                f"[-{BIAS_LIMIT:g}, {BIAS_LIMIT:g}]")
        out[token] = float(bias)
    return out or None


def _as_list(name: str, value: object, expected: str) -> list:
    """``value`` as a list, refusing a scalar or a mapping with a message naming the field."""
    if isinstance(value, (str, bytes, dict)) or not isinstance(value, Iterable):
        raise InvalidRequestTypeError(
            f"SamplingParams.{name} must be {expected}, got {type(value).__name__} {value!r:.60}")
    return list(value)
