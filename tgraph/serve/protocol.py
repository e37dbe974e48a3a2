"""The OpenAI request bodies tgraph serves, checked field by field, and their sampling parameters.

Unknown fields are ignored (clients send many); known fields of the wrong type or out of range
are refused with an OpenAI-style 400 naming the field (:class:`APIError`).
"""
from __future__ import annotations

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


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")

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
        """The message's text (text parts of a multi-part content joined)."""
        if isinstance(self.content, list):
            return "".join(p.get("text", "") for p in self.content if p.get("type") == "text")
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
