"""What a request produces: its running :class:`RequestOutput` and the :class:`StreamEvent` of
each step (re-exported by :mod:`tgraph.runtime.llm` and ``tgraph``)."""
from __future__ import annotations

from dataclasses import dataclass, field

from tgraph.runtime.sampler import TokenLogprobs

__all__ = ["RequestOutput", "StreamEvent", "merge_events"]


@dataclass
class RequestOutput:
    """The result of one prompt.

    Attributes:
        request_id: the request's id.
        prompt_token_ids: the prompt.
        text: generated text (stop strings removed); ``""`` without a tokenizer.
        token_ids: generated token ids.
        finish_reason: ``"stop"``, ``"length"``, or ``"abort"`` (aborted, or ended by an error
            that its stream raised); ``None`` while running.
        logprobs: per generated token, when asked for.
        time_to_first_token, total_seconds: wall-clock timings from submission.
    """

    request_id: str
    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[TokenLogprobs] | None = None
    time_to_first_token: float | None = None
    total_seconds: float = 0.0

    @property
    def tokens_per_second(self) -> float:
        """Generated tokens per second of wall-clock time since submission."""
        return len(self.token_ids) / self.total_seconds if self.total_seconds > 0 else 0.0


@dataclass
class StreamEvent:
    """New output of one request: text and tokens since the last event.

    Attributes:
        request_id: the request's id.
        text: text that became printable with this step (may be empty).
        token_ids: tokens generated in this step (empty for the last event of an abort).
        finished: whether this is the request's last event.
        output: the request's output so far (the same object in every event of a request).
    """

    request_id: str
    text: str
    token_ids: list[int]
    finished: bool
    output: RequestOutput


def merge_events(events: list[StreamEvent]) -> StreamEvent:
    """Consecutive events of one request as one (their text and tokens joined), for a consumer
    that fell behind the engine and sends what is queued at once."""
    if len(events) == 1:
        return events[0]
    rid = events[0].request_id
    if any(e.request_id != rid for e in events):
        raise ValueError("merge_events: the events belong to several requests")
    return StreamEvent(rid, "".join(e.text for e in events),
                       [t for e in events for t in e.token_ids], events[-1].finished,
                       events[-1].output)
