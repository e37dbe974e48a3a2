"""The OpenAI-compatible HTTP API over an :class:`~tgraph.runtime.llm.LLM`'s engine.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (server-sent events when
``stream``), ``GET /v1/models``, ``GET /health``, ``GET /metrics``. Handlers only submit requests
to the engine core and read their own streams; the engine's loop thread runs the model. A client
that disconnects has its requests aborted, which frees their KV blocks at the next step.

With ``ServerConfig.allow_runtime_lora`` (``--allow-runtime-lora``), as vLLM's dynamic LoRA API:
``POST /v1/load_lora_adapter {"lora_name", "lora_path"}`` serves an adapter as a model,
``POST /v1/unload_lora_adapter {"lora_name"}`` stops serving it (409 while requests in flight use
it), ``POST /v1/set_single_lora {"lora_path": str | null}`` sets or clears the adapter applied to
every request. The engine applies each between two steps without building an engine. Off, they
answer 404; they need the API key when one is set.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from tgraph.errors import ConfigError, InvalidRequestError, RequestTooLongError, WeightLoadError
from tgraph.runtime.adapters import AdapterInUseError, AdapterNotFoundError
from tgraph.runtime.engine_core import EngineClosedError
from tgraph.runtime.outputs import merge_events
from tgraph.serve.metrics import ServerMetrics
from tgraph.serve.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    LoadLoraRequest,
    SingleLoraRequest,
    UnloadLoraRequest,
    sampling_params,
)

__all__ = ["ServerConfig", "build_app"]

DISCONNECT_POLL_S = 1.0  # how often a request checks that its client is still there


@dataclass(frozen=True)
class ServerConfig:
    """What the server answers with and what it admits.

    Attributes:
        served_model_name: the model name clients use (LoRA adapters are models too).
        api_key: required as ``Authorization: Bearer <key>`` when set.
        max_waiting: refuse new requests (429) while this many wait for the engine (None: no
            limit).
        default_max_tokens: ``max_tokens`` of a request that gives none.
        gil_switch_interval_s: :func:`sys.setswitchinterval` while :func:`~tgraph.serve.serve`
            runs: how long the HTTP thread may keep the interpreter once the engine thread,
            back from waiting on the GPU, wants it (None: Python's 5 ms).
        allow_runtime_lora: serve the endpoints that load and unload LoRA adapters and set
            the single one (off: they answer 404).
    """

    served_model_name: str
    api_key: str | None = None
    max_waiting: int | None = None
    default_max_tokens: int = 256
    gil_switch_interval_s: float | None = None
    allow_runtime_lora: bool = False

    def __post_init__(self) -> None:
        if self.gil_switch_interval_s is not None and not self.gil_switch_interval_s > 0:
            raise ValueError("ServerConfig.gil_switch_interval_s must be > 0 seconds, got "
                             f"{self.gil_switch_interval_s!r}")


@dataclass
class _Choice:
    """One choice of a request: its engine stream and what it produced so far."""

    index: int
    stream: Any
    prompt_ids: list[int]
    group: int = 0  # the prompt it answers (a completion request may send several)
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[Any] = field(default_factory=list)


def build_app(llm: Any, config: ServerConfig) -> FastAPI:
    """The FastAPI application serving ``llm`` (an :class:`~tgraph.runtime.llm.LLM`)."""
    app = FastAPI(title="tgraph", docs_url=None, redoc_url=None)
    engine = llm.engine
    metrics = ServerMetrics(engine.stats)
    app.state.llm, app.state.metrics = llm, metrics

    @app.exception_handler(APIError)
    async def _api_error(_: Request, err: APIError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, err: RequestValidationError) -> JSONResponse:
        first = err.errors()[0] if err.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = ".".join(loc) or None
        message = f"{param}: {first.get('msg', 'invalid value')}" if param else str(err)
        return JSONResponse(APIError(400, message, param).body(), status_code=400)

    def authorize(request: Request) -> None:
        if config.api_key is None:
            return
        header = request.headers.get("authorization", "")
        if header != f"Bearer {config.api_key}":
            raise APIError(401, "missing or wrong API key (Authorization: Bearer <key>)",
                           kind="authentication_error", code="invalid_api_key")

    def adapter_of(model: str) -> str | None:
        if model == config.served_model_name:
            return None
        if model in _adapters(llm):
            return model
        raise APIError(404, f"model {model!r} does not exist; served: "
                            f"{[config.served_model_name, *_adapters(llm)]}", "model",
                       code="model_not_found")

    def admit() -> None:
        if config.max_waiting is not None and engine.stats().waiting >= config.max_waiting:
            raise APIError(429, f"{config.max_waiting} requests are already waiting; retry "
                                "later", kind="rate_limit_error",
                           headers={"Retry-After": "1"})

    def submit(prompt_ids: list[int], request: Any, lora: str | None, prefix: str,
               where: str, group: int = 0) -> list[_Choice]:
        choices = []
        try:
            for i in range(request.n):
                params = sampling_params(request, lora, config.default_max_tokens, i)
                stream = engine.submit(prompt_ids, params, request_id=f"{prefix}-{i}")
                choices.append(_Choice(i, stream, prompt_ids, group))
        except RequestTooLongError as err:
            _cancel(choices)
            raise APIError(400, str(err), where, code="context_length_exceeded") from None
        except (ValueError, ConfigError) as err:
            _cancel(choices)
            raise APIError(400, str(err), where) from None
        return choices

    @app.get("/health")
    async def health() -> JSONResponse:
        if engine.closed:  # closed, its loop failed, or its process died: take us out of rotation
            return JSONResponse({"status": "engine closed"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        authorize(request)
        now = int(time.time())
        base = config.served_model_name
        paths = engine.adapter_state.loras
        return {"object": "list", "data": [
            {"id": base, "object": "model", "created": now, "owned_by": "tgraph",
             "root": base, "parent": None},
            *({"id": n, "object": "model", "created": now, "owned_by": "tgraph",
               "root": paths.get(n) or base, "parent": base} for n in _adapters(llm))]}

    # ---- runtime LoRA adapters -----------------------------------------------------------------
    def runtime_lora(request: Request) -> None:
        authorize(request)
        if not config.allow_runtime_lora:
            raise APIError(404, "runtime LoRA adapter updates are off; start the server with "
                                "--allow-runtime-lora", code="runtime_lora_disabled")

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> dict[str, Any]:
        runtime_lora(request)
        body = _parse(LoadLoraRequest, await request.body())
        if body.lora_name == config.served_model_name:
            raise APIError(400, f"lora_name {body.lora_name!r} is the served model's name; "
                                "pick another", "lora_name")
        await _adapter_call(llm.load_lora, body.lora_name, body.lora_path,
                            replace=body.load_inplace)
        return {"object": "lora_adapter", "lora_name": body.lora_name,
                "lora_path": body.lora_path, "status": "loaded", "loaded": _adapters(llm)}

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> dict[str, Any]:
        runtime_lora(request)
        body = _parse(UnloadLoraRequest, await request.body())
        await _adapter_call(llm.unload_lora, body.lora_name)
        return {"object": "lora_adapter", "lora_name": body.lora_name, "status": "unloaded",
                "loaded": _adapters(llm)}

    @app.post("/v1/set_single_lora")
    async def set_single_lora(request: Request) -> dict[str, Any]:
        runtime_lora(request)
        body = _parse(SingleLoraRequest, await request.body())
        await _adapter_call(llm.set_single_lora, body.lora_path)
        return {"object": "single_lora", "lora_path": body.lora_path,
                "status": "cleared" if body.lora_path is None else "set"}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        authorize(request)
        body.check_supported()
        lora = adapter_of(body.model)
        admit()
        prompts = body.prompts()
        if len(prompts) > 1 and body.stream:
            raise APIError(400, "streaming takes one prompt per request", "prompt")
        rid = f"cmpl-{uuid.uuid4().hex}"
        groups = []
        try:
            for p, prompt in enumerate(prompts):
                ids = _encode(llm, prompt, "prompt")
                groups.append(submit(ids, body, lora, f"{rid}-{p}", "prompt", p))
        except APIError:
            for group in groups:
                _cancel(group)
            raise
        choices = [c for group in groups for c in group]
        for i, c in enumerate(choices):
            c.index = i
        arrival = time.perf_counter()
        if body.stream:
            return _sse(_completion_chunks(llm, body, rid, choices, metrics, arrival, request))
        await _drain(choices, metrics, arrival, request)
        return {"id": rid, "object": "text_completion", "created": int(time.time()),
                "model": body.model, "choices": [
                    {"index": c.index, "text": c.text, "finish_reason": c.finish_reason,
                     "logprobs": _completion_logprobs(llm, c.logprobs)
                     if body.logprobs is not None else None,
                     **_token_ids(body, c.token_ids, c.prompt_ids)} for c in choices],
                "usage": _usage(choices)}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Any:
        authorize(request)
        body.check_supported()
        lora = adapter_of(body.model)
        admit()
        ids = _chat_ids(llm, body)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        choices = submit(ids, body, lora, rid, "messages")
        arrival = time.perf_counter()
        if body.stream:
            return _sse(_chat_chunks(llm, body, rid, choices, metrics, arrival, request))
        await _drain(choices, metrics, arrival, request)
        return {"id": rid, "object": "chat.completion", "created": int(time.time()),
                "model": body.model, "choices": [
                    {"index": c.index, "message": {"role": "assistant", "content": c.text},
                     "finish_reason": c.finish_reason,
                     "logprobs": _chat_logprobs(llm, c.logprobs) if body.logprobs else None,
                     **_token_ids(body, c.token_ids, c.prompt_ids)}
                    for c in choices],
                "usage": _usage(choices)}

    return app


# ---- requests -----------------------------------------------------------------------------------
def _adapters(llm: Any) -> list[str]:
    """The LoRA adapters loaded for per-request use (each is a model name)."""
    return list(llm.adapters)


def _parse(model: type[BaseModel], raw: bytes) -> Any:
    """A JSON body checked by ``model`` (read after the key and the flag are checked)."""
    try:
        return model.model_validate_json(raw or b"{}")
    except ValidationError as err:
        first = err.errors()[0]
        param = ".".join(str(p) for p in first.get("loc", ())) or None
        message = first.get("msg", "invalid value")
        raise APIError(400, f"{param}: {message}" if param else message, param) from None


async def _adapter_call(fn: Any, *args: Any, **kwargs: Any) -> None:
    """Run an adapter call of the model off the event loop (it waits for the engine's next
    step boundary), its errors answered in OpenAI's shape."""
    try:
        await asyncio.to_thread(fn, *args, **kwargs)
    except AdapterNotFoundError as err:
        raise APIError(404, str(err), "lora_name", code="lora_not_found") from None
    except AdapterInUseError as err:
        raise APIError(409, str(err), "lora_name", code="lora_in_use") from None
    except EngineClosedError as err:
        raise APIError(503, str(err), kind="server_error", code="engine_closed") from None
    except WeightLoadError as err:  # no such directory, a missing or malformed file
        raise APIError(400, str(err), "lora_path") from None
    except InvalidRequestError as err:  # e.g. the name is taken
        raise APIError(400, str(err), "lora_name") from None
    except (ValueError, TypeError) as err:  # the bank is full, a rank above max_rank...
        raise APIError(400, str(err)) from None
    except Exception as err:
        raise APIError(500, f"the adapter call failed: {type(err).__name__}: {err}",
                       kind="server_error") from None


def _encode(llm: Any, prompt: str | list[int], where: str) -> list[int]:
    try:
        return llm.encode(prompt)
    except (ValueError, ConfigError) as err:
        raise APIError(400, str(err), where) from None


def _chat_ids(llm: Any, body: ChatCompletionRequest) -> list[int]:
    tokenizer = llm.tokenizer
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise APIError(400, "this model has no chat template; use /v1/completions", "messages")
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                            return_dict=False)
    except Exception as err:  # a template that refuses these messages (roles, order)
        raise APIError(400, f"the chat template refused the messages: {err}",
                       "messages") from None
    return list(ids)


def _cancel(choices: Sequence[_Choice]) -> None:
    for c in choices:
        c.stream.cancel()


async def _events(choices: Sequence[_Choice], request: Request) -> AsyncIterator[tuple[_Choice,
                                                                                      Any]]:
    """Every choice's events as they come, merged (a choice's events already queued come as
    one, so a server that falls behind the engine sends fewer, larger chunks); a client that
    goes away aborts them all."""
    watcher = asyncio.create_task(_watch_disconnect(request, choices))
    try:
        if len(choices) == 1:
            c = choices[0]
            events = aiter(c.stream)
            while True:
                try:
                    first = await anext(events)
                    event = merge_events([first, *c.stream.ready()])
                except StopAsyncIteration:
                    return
                except Exception as err:  # the request failed (a step, or the engine closing)
                    raise _failed(c, err) from err
                yield c, event
        else:
            async for item in _merged(choices):
                yield item
    finally:
        watcher.cancel()
        _cancel([c for c in choices if c.finish_reason is None])


async def _merged(choices: Sequence[_Choice]) -> AsyncIterator[tuple[_Choice, Any]]:
    """The events of several choices, each choice read by its own task."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(c: _Choice) -> None:
        try:
            async for first in c.stream:
                await queue.put((c, merge_events([first, *c.stream.ready()])))
        except Exception as err:  # this request failed: it ends with the error, others go on
            await queue.put((c, err))
        await queue.put((c, None))

    tasks = [asyncio.create_task(pump(c)) for c in choices]
    open_streams = len(choices)
    try:
        while open_streams:
            c, event = await queue.get()
            if event is None:
                open_streams -= 1
            elif isinstance(event, Exception):
                raise _failed(c, event) from event
            else:
                yield c, event
    finally:
        for task in tasks:
            task.cancel()


def _failed(c: _Choice, err: Exception) -> APIError:
    return APIError(500, f"request {c.stream.request_id} failed: {err}", kind="server_error")


async def _watch_disconnect(request: Request, choices: Sequence[_Choice]) -> None:
    """Abort the choices once the client is gone (checked every second)."""
    while not await request.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)
    _cancel(choices)


def _record(c: _Choice, event: Any, metrics: ServerMetrics, arrival: float,
            last: dict[int, float]) -> None:
    """Fold one event into its choice and observe its latencies (the tokens of a merged event
    share its gap evenly)."""
    now = time.perf_counter()
    tokens = list(event.token_ids)
    if tokens:
        if not c.token_ids:
            metrics.time_to_first_token.observe(now - arrival)
            tokens_after_gap = tokens[1:]
            gap = 0.0
        else:
            tokens_after_gap = tokens
            gap = now - last[c.index]
        for _ in tokens_after_gap:
            metrics.inter_token_latency.observe(gap / len(tokens_after_gap))
        last[c.index] = now
    c.text += event.text
    c.token_ids += tokens
    out = event.output
    if out.logprobs:
        c.logprobs = list(out.logprobs)
    if event.finished:
        c.finish_reason = out.finish_reason or "stop"
        metrics.requests.labels(c.finish_reason).inc()
        metrics.request_latency.observe(now - arrival)


async def _drain(choices: Sequence[_Choice], metrics: ServerMetrics, arrival: float,
                 request: Request) -> None:
    last: dict[int, float] = {}
    async for c, event in _events(choices, request):
        _record(c, event, metrics, arrival, last)


def _usage(choices: Sequence[_Choice]) -> dict[str, int]:
    prompt = sum({c.group: len(c.prompt_ids) for c in choices}.values())  # each prompt once
    completion = sum(len(c.token_ids) for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


# ---- streaming ----------------------------------------------------------------------------------
def _sse(chunks: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
    async def body() -> AsyncIterator[bytes]:
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk)}\n\n".encode()
        except APIError as err:
            yield f"data: {json.dumps(err.body())}\n\n".encode()
        yield b"data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


async def _completion_chunks(llm: Any, body: CompletionRequest, rid: str,
                             choices: Sequence[_Choice], metrics: ServerMetrics, arrival: float,
                             request: Request) -> AsyncIterator[dict[str, Any]]:
    created, last = int(time.time()), {}
    async for c, event in _events(choices, request):
        seen = len(c.logprobs)
        _record(c, event, metrics, arrival, last)
        yield {"id": rid, "object": "text_completion", "created": created, "model": body.model,
               "choices": [{"index": c.index, "text": event.text, "finish_reason":
                            c.finish_reason if event.finished else None,
                            "logprobs": _completion_logprobs(llm, c.logprobs[seen:])
                            if body.logprobs is not None else None,
                            **_token_ids(body, event.token_ids)}]}
    if body.include_usage:
        yield {"id": rid, "object": "text_completion", "created": created, "model": body.model,
               "choices": [], "usage": _usage(choices)}


async def _chat_chunks(llm: Any, body: ChatCompletionRequest, rid: str,
                       choices: Sequence[_Choice], metrics: ServerMetrics, arrival: float,
                       request: Request) -> AsyncIterator[dict[str, Any]]:
    created, last = int(time.time()), {}

    def chunk(index: int, delta: dict[str, Any], finish: str | None = None,
              logprobs: Any = None, token_ids: Sequence[int] = ()) -> dict[str, Any]:
        return {"id": rid, "object": "chat.completion.chunk", "created": created,
                "model": body.model, "choices": [{"index": index, "delta": delta,
                                                  "logprobs": logprobs,
                                                  "finish_reason": finish,
                                                  **_token_ids(body, token_ids)}]}

    for c in choices:
        yield chunk(c.index, {"role": "assistant", "content": ""})
    async for c, event in _events(choices, request):
        seen = len(c.logprobs)
        _record(c, event, metrics, arrival, last)
        yield chunk(c.index, {"content": event.text} if event.text else {},
                    c.finish_reason if event.finished else None,
                    _chat_logprobs(llm, c.logprobs[seen:]) if body.logprobs else None,
                    event.token_ids)
    if body.include_usage:
        yield {"id": rid, "object": "chat.completion.chunk", "created": created,
               "model": body.model, "choices": [], "usage": _usage(choices)}


def _token_ids(body: Any, token_ids: Sequence[int], prompt_ids: Sequence[int] | None = None
               ) -> dict[str, list[int]]:
    """The ``return_token_ids`` extension: a choice's (or a chunk's) token ids, and in a whole
    response the prompt's too."""
    if not body.return_token_ids:
        return {}
    ids = {"token_ids": list(token_ids)}
    if prompt_ids is not None:
        ids["prompt_token_ids"] = list(prompt_ids)
    return ids


# ---- logprobs -----------------------------------------------------------------------------------
def _token_text(llm: Any, token_id: int) -> str:
    tokenizer = llm.tokenizer
    return str(token_id) if tokenizer is None else tokenizer.decode([token_id])


def _completion_logprobs(llm: Any, logprobs: Sequence[Any]) -> dict[str, Any]:
    return {"tokens": [_token_text(llm, lp.token_id) for lp in logprobs],
            "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [{_token_text(llm, t): v for t, v in zip(lp.top_token_ids,
                                                                       lp.top_logprobs)}
                             for lp in logprobs],
            "text_offset": []}


def _chat_logprobs(llm: Any, logprobs: Sequence[Any]) -> dict[str, Any]:
    content = []
    for lp in logprobs:
        token = _token_text(llm, lp.token_id)
        content.append({"token": token, "logprob": lp.logprob,
                        "bytes": list(token.encode()),
                        "top_logprobs": [{"token": _token_text(llm, t), "logprob": v,
                                          "bytes": list(_token_text(llm, t).encode())}
                                         for t, v in zip(lp.top_token_ids, lp.top_logprobs)]})
    return {"content": content}
