"""One generation request and its life cycle (WAITING -> RUNNING <-> PREEMPTED -> FINISHED).

The caller fills in what to generate; everything below ``# state`` is owned by the
:class:`~tgraph.runtime.scheduler.Scheduler` and read by the model runner.
"""

from __future__ import annotations

import enum
import operator
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tgraph.errors import InvalidRequestError, InvalidRequestTypeError, RequestTooLongError

if TYPE_CHECKING:
    from tgraph.runtime.block_manager import BlockTable
    from tgraph.runtime.sampling_params import SamplingParams

__all__ = [
    "FinishReason",
    "InvalidRequestError",
    "Request",
    "RequestStatus",
    "RequestTooLongError",
]


class RequestStatus(enum.Enum):
    """Where a request is in the scheduler."""

    WAITING = "waiting"  # queued, holds no blocks
    RUNNING = "running"  # admitted: holds blocks, in prefill or decode
    PREEMPTED = "preempted"  # evicted for memory, queued again, recomputed from its tokens
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    """Why a request stopped (the strings match the OpenAI / vLLM ``finish_reason``)."""

    STOP = "stop"  # an EOS or stop token was generated (it is kept in the output)
    LENGTH = "length"  # max_tokens were generated
    ABORT = "abort"  # aborted by the caller


def _token_list(name: str, ids: Iterable[int] | int | None) -> list[int]:
    """Return ``ids`` as a list of non-negative ints (a single int or None is accepted)."""
    if ids is None:
        return []
    if isinstance(ids, (str, bytes)):
        raise InvalidRequestTypeError(
            f"{name} must be token ids (ints), got {type(ids).__name__} {ids!r:.40}")
    items = [ids] if not isinstance(ids, Iterable) else list(ids)
    out = []
    for t in items:
        if isinstance(t, bool):
            raise InvalidRequestTypeError(f"{name} must contain ints, got bool {t!r}")
        try:
            t = operator.index(t)
        except TypeError:
            raise InvalidRequestTypeError(
                f"{name} must contain ints, got {type(t).__name__} {t!r:.40}") from None
        if t < 0:
            raise InvalidRequestError(f"{name} must contain non-negative token ids, got {t}")
        out.append(t)
    return out


@dataclass(eq=False)
class Request:
    """A generation request.

    Args:
        request_id: unique among the scheduler's unfinished requests.
        prompt_token_ids: the prompt, at least one token.
        max_tokens: tokens to generate at most (>= 1).
        eos_token_ids: tokens that end generation unless ``ignore_eos``; one int or several
            (HF generation configs often list more than one).
        stop_token_ids: tokens that always end generation.
        ignore_eos: keep generating through EOS (benchmarks use it for fixed output lengths).
        lora: name of the LoRA adapter to apply, or None for the base model.
        sampling_params: carried for the sampler; the scheduler does not read it.
    """

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    eos_token_ids: tuple[int, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    lora: str | None = None
    sampling_params: SamplingParams | None = None

    # state
    arrival: int = field(default=-1, init=False)
    """Admission order given by the scheduler; smaller is older and has priority."""
    status: RequestStatus = field(default=RequestStatus.WAITING, init=False)
    output_token_ids: list[int] = field(default_factory=list, init=False)
    num_computed_tokens: int = field(default=0, init=False)
    """Tokens whose KV entries are in the cache."""
    prefill_len: int = field(default=0, init=False)
    """Tokens the current admission must prefill: the prompt, or prompt + outputs after a
    preemption. Once ``num_computed_tokens`` reaches it the request decodes one token a step."""
    block_table: BlockTable | None = field(default=None, init=False)
    finish_reason: FinishReason | None = field(default=None, init=False)
    num_preemptions: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str):
            raise InvalidRequestTypeError(
                f"request_id must be a str, got {type(self.request_id).__name__}")
        self.prompt_token_ids = _token_list("prompt_token_ids", self.prompt_token_ids)
        if not self.prompt_token_ids:
            raise InvalidRequestError(f"request {self.request_id!r} has an empty prompt")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise InvalidRequestTypeError(
                f"max_tokens must be an int, got {type(self.max_tokens).__name__}")
        if self.max_tokens < 1:
            raise InvalidRequestError(
                f"request {self.request_id!r}: max_tokens must be >= 1, got {self.max_tokens}"
            )
        self.eos_token_ids = tuple(_token_list("eos_token_ids", self.eos_token_ids))
        self.stop_token_ids = tuple(_token_list("stop_token_ids", self.stop_token_ids))
        if self.lora is not None and not isinstance(self.lora, str):
            raise InvalidRequestTypeError(
                f"lora must be a str or None, got {type(self.lora).__name__}")

    @classmethod
    def from_sampling_params(
        cls,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        eos_token_ids: Iterable[int] | int | None = None,
    ) -> Request:
        """Build a request from :class:`~tgraph.runtime.sampling_params.SamplingParams`.

        Args:
            request_id: unique id.
            prompt_token_ids: the prompt.
            params: gives ``max_tokens``, ``stop_token_ids``, ``ignore_eos`` and ``lora``; it is
                kept in ``sampling_params``. Stop *strings* are the detokenizer's business: it
                ends such a request with ``Scheduler.finish_request``.
            eos_token_ids: the tokenizer's / generation config's EOS id(s).

        Returns:
            The new request.
        """
        return cls(
            request_id,
            prompt_token_ids,
            params.max_tokens,
            eos_token_ids=eos_token_ids,
            stop_token_ids=params.stop_token_ids,
            ignore_eos=params.ignore_eos,
            lora=params.lora,
            sampling_params=params,
        )

    @property
    def num_prompt_tokens(self) -> int:
        """Length of the prompt."""
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Tokens generated so far."""
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def max_kv_tokens(self) -> int:
        """KV-cache slots the request can ever need: the last generated token is never fed back."""
        return len(self.prompt_token_ids) + self.max_tokens - 1

    @property
    def all_token_ids(self) -> list[int]:
        """A new list with the prompt followed by the generated tokens."""
        return self.prompt_token_ids + self.output_token_ids

    def token_ids(self, start: int, end: int) -> list[int]:
        """Return tokens ``start .. end - 1`` of prompt + outputs without copying the whole list.

        Args:
            start: first position.
            end: one past the last position (``<= num_tokens``).

        Returns:
            The token ids.
        """
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    @property
    def in_prefill(self) -> bool:
        """True while the current admission still has prompt (or recompute) tokens to process."""
        return self.num_computed_tokens < self.prefill_len

    @property
    def is_finished(self) -> bool:
        """True once the request stopped for any reason."""
        return self.status is RequestStatus.FINISHED

    def stop_reason(self) -> FinishReason | None:
        """Return why the request must stop after its last generated token, or None.

        A stop token, or an EOS token unless ``ignore_eos``, wins over reaching ``max_tokens``.
        """
        if not self.output_token_ids:
            return None
        last = self.output_token_ids[-1]
        if last in self.stop_token_ids or (not self.ignore_eos and last in self.eos_token_ids):
            return FinishReason.STOP
        if len(self.output_token_ids) >= self.max_tokens:
            return FinishReason.LENGTH
        return None
