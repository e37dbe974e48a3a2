"""Incremental detokenisation and stop handling for one request.

:class:`StopChecker` is fed the generated token ids one at a time and returns, per token, the text
that can now be shown to the user. Two kinds of text are held back until they are settled:

- an incomplete UTF-8 character: byte-level tokenizers split multi-byte characters (emoji,
  accents) over several tokens, and decoding a prefix of them yields ``U+FFFD``;
- a suffix that is a prefix of a stop string (``"Obs"`` while waiting for ``"Observation:"``):
  if the stop string completes, the text ends before it and the held part is never shown.

NOTE: detokenisation decodes a small sliding window of tokens twice (``prefix`` and
``prefix + new``) and emits the difference; decoding a window rather than single tokens keeps the
spacing rules of tokenizers that strip or add leading spaces at a sequence start (SentencePiece).
This is the scheme of HF TGI and vLLM; its cost per token does not grow with the output length.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from tgraph.runtime.sampling_params import SamplingParams

_REPLACEMENT = "\ufffd"
# How many prompt tokens seed the detokenisation window, so the first generated token decodes
# with the same leading-space context it has in the full text.
_PROMPT_CONTEXT = 5


@dataclass
class StopStep:
    """The outcome of feeding one token to a :class:`StopChecker`.

    Attributes:
        text: newly printable text (may be empty).
        finished: whether the request is done; no more tokens may be fed.
        finish_reason: ``"stop"`` (stop string, stop token or EOS), ``"length"`` (max_tokens)
            or ``None`` while running.
        stop_reason: the matched stop string or stop token id; ``None`` otherwise (also for EOS
            and length).
    """

    text: str
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class StopChecker:
    """Detokenises one request's output incrementally and decides when it stops.

    Args:
        tokenizer: a HF tokenizer (anything with ``decode(ids, skip_special_tokens=...)``).
        params: the request's sampling parameters (``stop``, ``stop_token_ids``, ``ignore_eos``,
            ``max_tokens`` are used).
        eos_token_id: end-of-sequence id(s); ``None`` takes ``tokenizer.eos_token_id``.
        prompt_token_ids: the prompt, whose last tokens give the first output tokens their
            decoding context; optional.
        skip_special_tokens: drop special tokens from the text, as ``decode`` does.
    """

    def __init__(
        self,
        tokenizer: Any,
        params: SamplingParams,
        eos_token_id: int | Iterable[int] | None = None,
        prompt_token_ids: Iterable[int] | None = None,
        skip_special_tokens: bool = True,
    ) -> None:
        if not hasattr(tokenizer, "decode"):
            raise TypeError(f"tokenizer must have a decode method, got {type(tokenizer).__name__}")
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        self.tokenizer = tokenizer
        self.params = params
        self.skip_special_tokens = skip_special_tokens
        if eos_token_id is None:
            eos_token_id = getattr(tokenizer, "eos_token_id", None)
        if eos_token_id is None:
            self.eos_token_ids: frozenset[int] = frozenset()
        elif isinstance(eos_token_id, int):
            self.eos_token_ids = frozenset([eos_token_id])
        else:
            self.eos_token_ids = frozenset(eos_token_id)
        self.stop_token_ids = frozenset(params.stop_token_ids)

        context = list(prompt_token_ids or [])[-_PROMPT_CONTEXT:]
        self._ids: list[int] = context  # decoding window source: prompt tail + output
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._num_output = 0
        self._decoded = ""  # settled text (complete characters), stop strings not yet removed
        self._emitted = 0  # characters of _decoded already returned
        self.finished = False
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None

    @property
    def text(self) -> str:
        """All text returned so far (the final output once finished)."""
        return self._decoded[: self._emitted]

    @property
    def num_tokens(self) -> int:
        """How many tokens have been fed."""
        return self._num_output

    def step(self, token_id: int) -> StopStep:
        """Feed the next generated token.

        Args:
            token_id: the token the sampler produced.

        Returns:
            The newly printable text and whether (and why) the request finished.
        """
        if self.finished:
            raise ValueError("the request has already finished; no more tokens can be fed")
        token_id = int(token_id)
        self._num_output += 1

        stop_id = token_id in self.stop_token_ids
        if stop_id or (token_id in self.eos_token_ids and not self.params.ignore_eos):
            # The stop token's own text is not part of the output.
            return self._finish("stop", token_id if stop_id else None)

        self._ids.append(token_id)
        self._decoded += self._detokenize(final=False)
        matched = self._find_stop()
        if matched is not None:
            start, stop = matched
            return self._finish("stop", stop, end=start)
        if self._num_output >= self.params.max_tokens:
            return self._finish("length", None)
        safe_end = len(self._decoded) - self._stop_prefix_len()
        return StopStep(self._emit(safe_end))

    def _detokenize(self, final: bool) -> str:
        decode = self.tokenizer.decode
        prefix = decode(self._ids[self._prefix_offset:self._read_offset],
                        skip_special_tokens=self.skip_special_tokens)
        full = decode(self._ids[self._prefix_offset:],
                      skip_special_tokens=self.skip_special_tokens)
        if len(full) > len(prefix) and (final or not full.endswith(_REPLACEMENT)):
            # Advance the window: the new text is settled.
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            return full[len(prefix):]
        return ""  # nothing new, or an incomplete character waiting for its remaining bytes

    def _find_stop(self) -> tuple[int, str] | None:
        # Text already returned never holds the start of a stop string (it was held back), so
        # searching from the first unreturned character finds every match.
        best: tuple[int, str] | None = None
        for stop in self.params.stop:
            at = self._decoded.find(stop, self._emitted)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, stop)
        return best

    def _stop_prefix_len(self) -> int:
        """Length of the longest unreturned suffix that could still grow into a stop string."""
        pending = self._decoded[self._emitted:]
        longest = 0
        for stop in self.params.stop:
            for k in range(min(len(stop) - 1, len(pending)), longest, -1):
                if pending.endswith(stop[:k]):
                    longest = k
                    break
        return longest

    def _emit(self, end: int) -> str:
        text = self._decoded[self._emitted:end]
        self._emitted = max(self._emitted, end)
        return text

    def _finish(self, reason: str, stop_reason: str | int | None,
                end: int | None = None) -> StopStep:
        if end is None:
            # Nothing will complete now: flush held text, including incomplete bytes (as U+FFFD).
            self._decoded += self._detokenize(final=True)
            end = len(self._decoded)
        self._decoded = self._decoded[:end]
        text = self._emit(end)
        self.finished = True
        self.finish_reason = reason
        self.stop_reason = stop_reason
        return StopStep(text, True, reason, stop_reason)
