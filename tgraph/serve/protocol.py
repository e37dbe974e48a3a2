"""The OpenAI request bodies tgraph serves, checked field by field, and their sampling parameters.

Unknown fields are ignored (clients send many); known fields of the wrong type or out of range
are refused with an OpenAI-style 400 naming the field (:class:`APIError`), and so are the fields
that ask for what tgraph does not do (tools, structured output, suffixes, non-text content parts:
:meth:`_Request.check_supported`), rather than answered as if the request had not asked.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tgraph.runtime.sampling_params import SamplingParams

__all__ = ["APIError", "ChatCompletionRequest", "ChatMessage", "CompletionRequest",
           "LoadLoraRequest", "SingleLoraRequest", "UnloadLoraRequest", "sampling_params"]


class APIError(Exception):
    """An error answered in OpenAI's shape: ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.kind, self.code, self.headers = kind, code, headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


def _none(value: Any) -> bool:
    return value is None


def _empty(value: Any) -> bool:
    return not value


# Fields of the OpenAI API (and vLLM's guided decoding) that change what is generated and that
# tgraph does not implement: what they ask for, and which values ask for nothing.
_UNSUPPORTED: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "tools": ("tool calls", _empty),
    "tool_choice": ("tool calls", lambda v: v in (None, "none", "auto")),
    "functions": ("function calls", _empty),
    "function_call": ("function calls", lambda v: v in (None, "none", "auto")),
    "response_format": ("structured output (JSON mode, JSON schema)",
                        lambda v: v is None or v == {"type": "text"}),
    "guided_json": ("guided decoding", _none),
    "guided_regex": ("guided decoding", _none),
    "guided_choice": ("guided decoding", _none),
    "guided_grammar": ("guided decoding", _none),
    "structured_outputs": ("guided decoding", _none),
    "suffix": ("insertion (a suffix after the completion)", _empty),
    "modalities": ("output other than text", lambda v: v in (None, ["text"])),
    "audio": ("audio output", _none),
}


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")  # kept to be checked (check_supported), else unused

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=16)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    ignore_eos: bool = False
    # OpenAI's {"token id": bias in [-100, 100]}; SamplingParams checks the keys and range.
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None  # extension (as vLLM's): the only tokens allowed
    return_token_ids: bool = False  # extension: token ids in every choice and chunk
    user: str | None = None

    def check_supported(self) -> None:
        """Refuse (400, naming the field) a request that asks for what tgraph does not do."""
        for field, value in (self.model_extra or {}).items():
            what, asks_nothing = _UNSUPPORTED.get(field, ("", _none))
            if what and not asks_nothing(value):
                raise APIError(400, f"{field}: this server does not support {what}", field)
        best_of = (self.model_extra or {}).get("best_of")
        if best_of is not None and best_of != self.n:
            raise APIError(400, f"best_of: choosing the best {self.n} of {best_of} candidates is "
                                "not supported; ask for n choices instead", "best_of")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))


class CompletionRequest(_Request):
    """``POST /v1/completions``: a prompt (text, token ids, or a list of either)."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(t, int) for t in p):
            return [list(p)]
        if not p:
            raise APIError(400, "prompt must not be empty", "prompt")
        return list(p)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        """The message's text (the parts of a multi-part content joined).

        Raises:
            APIError: a part other than text (an image, audio, a file): 400.
        """
        if isinstance(self.content, list):
            other = [str(p.get("type")) for p in self.content if p.get("type") != "text"]
            if other:
                raise APIError(400, f"messages: content parts of type {other[0]!r} are not "
                                    "supported (this model reads text parts only)", "messages")
            return "".join(str(p.get("text", "")) for p in self.content)
        return self.content or ""


class ChatCompletionRequest(_Request):
    """``POST /v1/chat/completions``: messages rendered by the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    max_completion_tokens: int | None = Field(default=None, ge=1)


def sampling_params(request: _Request, lora: str | None, default_max_tokens: int,
                    choice: int = 0) -> SamplingParams:
    """The request's :class:`SamplingParams` (choice ``i`` of ``n`` gets seed ``seed + i``).

    Raises:
        APIError: a value SamplingParams refuses (400, naming the field).
    """
    max_tokens = getattr(request, "max_completion_tokens", None) or request.max_tokens
    if isinstance(request, ChatCompletionRequest):
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
    else:
        logprobs = request.logprobs
    stop = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
    try:
        return SamplingParams(
            temperature=request.temperature, top_p=request.top_p, top_k=request.top_k,
            min_p=request.min_p, seed=None if request.seed is None else request.seed + choice,
            presence_penalty=request.presence_penalty,
            frequency_penalty=request.frequency_penalty,
            repetition_penalty=request.repetition_penalty,
            max_tokens=max_tokens or default_max_tokens, stop=stop,
            ignore_eos=request.ignore_eos, logprobs=logprobs, lora=lora,
            logit_bias=request.logit_bias, allowed_token_ids=request.allowed_token_ids)
    except ValueError as err:
        message = str(err)
        field = message.split(" ", 1)[0].removeprefix("SamplingParams.").split("[", 1)[0]
        raise APIError(400, message, field) from None


# ---- runtime LoRA adapters (as vLLM's dynamic LoRA API) ------------------------------------------
class LoadLoraRequest(BaseModel):
    """``POST /v1/load_lora_adapter``: serve the PEFT adapter at ``lora_path`` as model
    ``lora_name``; ``load_inplace`` replaces an adapter of that name (else it is refused)."""

    model_config = ConfigDict(extra="ignore")

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    load_inplace: bool = False


class UnloadLoraRequest(BaseModel):
    """``POST /v1/unload_lora_adapter``: stop serving adapter ``lora_name``."""

    model_config = ConfigDict(extra="ignore")

    lora_name: str = Field(min_length=1)


class SingleLoraRequest(BaseModel):
    """``POST /v1/set_single_lora``: apply the adapter at ``lora_path`` to every request
    (``null``: none)."""

    model_config = ConfigDict(extra="ignore")

    lora_path: str | None = Field(min_length=1)
