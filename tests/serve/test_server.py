"""``tgraph serve`` against the official ``openai`` client and raw HTTP, on a tiny CPU model.

The oracle is :meth:`LLM.generate` on the same model: greedy decoding in fp32 on CPU is exact (the
tiny model's top-two logit gaps are far above rounding, see tests/runtime/test_llm.py), so the
server must return exactly the same text, whether streamed or not, alone or among 64 clients.
Every test that talks HTTP runs twice: the engine in the server's process (an ``LLM``) and in a
child process (:class:`~tgraph.runtime.engine_process.EngineProcess`, what ``tgraph serve``
runs).
"""
from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from tgraph.runtime.engine_process import EngineProcess  # noqa: E402
from tgraph.runtime.llm import LLM  # noqa: E402
from tgraph.runtime.sampling_params import SamplingParams  # noqa: E402
from tgraph.serve import ServerConfig, ServerThread, build_app  # noqa: E402

MODEL = "tiny"
KEY = "sk-test"
MAX_TOKENS = 8
PROMPTS = ["The river began high in the mountains", "A computer does not", "Engineers measure"]
TIMEOUT = 120.0  # seconds any one request may take on a slow CI core


# 96 blocks of 4 tokens: 64 clients of ~20 tokens each do not all fit, so some wait.
OPTIONS = dict(device="cpu", dtype="float32", graph="eager", max_model_len=64, block_size=4,
               num_blocks=96)


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> Any:
    """The oracle (and the in-process server's model)."""
    llm = LLM(model_dir, **OPTIONS)
    yield llm
    llm.close()


@pytest.fixture(scope="module", params=["in-process", "engine-process"])
def served(request: pytest.FixtureRequest, llm: Any, model_dir: Path) -> Any:
    """(url, the served model): ``llm`` itself, or the same model in an engine process."""
    target = llm if request.param == "in-process" else EngineProcess(model_dir, **OPTIONS)
    try:
        with ServerThread(target, ServerConfig(served_model_name=MODEL, api_key=KEY)) as url:
            yield url, target
    finally:
        if target is not llm:
            target.close()


@pytest.fixture(scope="module")
def url(served: Any) -> str:
    return served[0]


@pytest.fixture()
def client(url: str) -> Any:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, timeout=TIMEOUT, max_retries=0)


def _greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _wait_idle(llm: Any, timeout: float = 30.0) -> Any:
    """The engine's stats once nothing runs or waits (aborts are applied at the next step)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = llm.engine.stats()
        if stats.running == 0 and stats.waiting == 0 and stats.kv_blocks_used == 0:
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"the engine did not go idle: {stats}")
        time.sleep(0.02)


# ---- completions and chat equal LLM.generate -----------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_completions_equal_generate(llm: Any, client: Any, stream: bool) -> None:
    expected = llm.generate(PROMPTS[0], _greedy())[0]
    kwargs = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0.0,
                  extra_body={"ignore_eos": True})
    if stream:
        chunks = list(client.completions.create(stream=True,
                                                stream_options={"include_usage": True},
                                                **kwargs))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        usage = chunks[-1].usage
    else:
        out = client.completions.create(**kwargs)
        text, finish, usage = out.choices[0].text, out.choices[0].finish_reason, out.usage
    assert text == expected.text
    assert finish == "length"
    assert usage.completion_tokens == len(expected.token_ids) == MAX_TOKENS
    assert usage.prompt_tokens == len(llm.encode(PROMPTS[0]))


def test_completions_token_prompts_and_several_prompts(llm: Any, client: Any) -> None:
    ids = llm.encode(PROMPTS[1])
    expected = llm.generate([ids, PROMPTS[2]], _greedy())
    out = client.completions.create(model=MODEL, prompt=[PROMPTS[1], PROMPTS[2]],
                                    max_tokens=MAX_TOKENS, temperature=0.0,
                                    extra_body={"ignore_eos": True})
    assert [c.text for c in sorted(out.choices, key=lambda c: c.index)] == [
        e.text for e in expected]
    one = client.completions.create(model=MODEL, prompt=ids, max_tokens=MAX_TOKENS,
                                    temperature=0.0, extra_body={"ignore_eos": True})
    assert one.choices[0].text == expected[0].text


@pytest.mark.parametrize("stream", [False, True])
def test_chat_equals_generate_with_the_chat_template(llm: Any, client: Any,
                                                     stream: bool) -> None:
    expected = llm.generate(PROMPTS[2], _greedy(), chat=True)[0]
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": PROMPTS[2]}],
                  max_tokens=MAX_TOKENS, temperature=0.0, extra_body={"ignore_eos": True})
    if stream:
        chunks = list(client.chat.completions.create(
            stream=True, stream_options={"include_usage": True}, **kwargs))
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        usage = chunks[-1].usage
        assert chunks[-1].choices == []
    else:
        out = client.chat.completions.create(**kwargs)
        assert out.choices[0].message.role == "assistant"
        text, usage = out.choices[0].message.content, out.usage
    assert text == expected.text
    assert usage.completion_tokens == MAX_TOKENS
    assert usage.prompt_tokens == len(llm.encode(PROMPTS[2], chat=True))


def test_n_choices_and_seeded_sampling(llm: Any, client: Any) -> None:
    kwargs = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=1.0,
                  seed=7, n=2, extra_body={"ignore_eos": True})
    first = client.completions.create(**kwargs)
    again = client.completions.create(**kwargs)
    texts = [c.text for c in sorted(first.choices, key=lambda c: c.index)]
    assert texts == [c.text for c in sorted(again.choices, key=lambda c: c.index)]
    # choice i samples with seed + i, exactly as LLM.generate does with that seed
    for i, text in enumerate(texts):
        params = SamplingParams(temperature=1.0, seed=7 + i, max_tokens=MAX_TOKENS,
                                ignore_eos=True)
        assert text == llm.generate(PROMPTS[0], params)[0].text
    assert first.usage.completion_tokens == 2 * MAX_TOKENS


def test_logprobs(client: Any) -> None:
    out = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=4,
                                    temperature=0.0, logprobs=2,
                                    extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == out.choices[0].text
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert chosen <= 0.0 and len(top) == 2
        assert chosen == pytest.approx(max(top.values()), abs=1e-5)  # greedy picks the top
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPTS[1]}], max_tokens=3,
        temperature=0.0, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 3 for t in content)


def test_stop_strings_end_the_text(llm: Any, client: Any) -> None:
    full = llm.generate(PROMPTS[0], _greedy(16))[0].text
    stop = full[len(full) // 2:len(full) // 2 + 2]
    if not stop.strip():
        pytest.skip("the tiny model's text has no usable stop string here")
    out = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=16,
                                    temperature=0.0, stop=[stop],
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == full[:full.index(stop)]


# ---- many clients --------------------------------------------------------------------------------
def test_64_streaming_clients_some_disconnecting(llm: Any, served: Any) -> None:
    """Every client that stays gets exactly its tokens alone; those that leave free their blocks."""
    url, target = served
    prompts = [f"{PROMPTS[i % 3]} {i}" for i in range(64)]
    expected = [o.text for o in llm.generate(prompts, _greedy())]
    leaving = set(range(0, 64, 4))

    async def client(i: int, http: Any) -> str | None:
        body = {"model": MODEL, "prompt": prompts[i], "max_tokens": MAX_TOKENS,
                "temperature": 0.0, "ignore_eos": True, "stream": True}
        text, chunks = "", 0
        async with http.stream("POST", f"{url}/v1/completions", json=body,
                               headers={"Authorization": f"Bearer {KEY}"}) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                text += chunk["choices"][0]["text"]
                chunks += 1
                if i in leaving and chunks == 2:
                    return None  # leaves the block: the connection closes midway
        return text

    async def main() -> list[str | None]:
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(timeout=TIMEOUT, limits=limits) as http:
            return await asyncio.gather(*(client(i, http) for i in range(64)))

    got = asyncio.run(main())
    for i, text in enumerate(got):
        if i not in leaving:
            assert text == expected[i], f"client {i}"
    stats = _wait_idle(target)
    assert stats.kv_blocks_used == 0
    assert stats.finished.get("abort", 0) + stats.finished.get("aborted", 0) >= 1


# ---- errors --------------------------------------------------------------------------------------
def test_invalid_fields_are_400_naming_the_field(client: Any) -> None:
    for kwargs, field in ((dict(temperature=-1.0), "temperature"), (dict(n=0), "n"),
                          (dict(max_tokens=0), "max_tokens"), (dict(top_p=1.5), "top_p")):
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model=MODEL, prompt="hi", **kwargs)
        assert err.value.body["param"] == field, err.value.body
        assert field in err.value.body["message"]


def test_what_the_server_does_not_do_is_400_naming_the_field(client: Any) -> None:
    """Tools, structured output, guided decoding, suffixes, best_of and image parts are refused,
    not answered as if the request had not asked; their empty values are accepted."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    hi = [{"role": "user", "content": "hi"}]
    image = [{"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                          {"type": "image_url",
                                           "image_url": {"url": "data:image/png;base64,AA=="}}]}]
    refused = [
        (dict(messages=hi, tools=[tool]), "tools", "tool calls"),
        (dict(messages=hi, tool_choice="required"), "tool_choice", "tool calls"),
        (dict(messages=hi, response_format={"type": "json_object"}), "response_format",
         "structured output"),
        (dict(messages=hi, extra_body={"guided_json": {"type": "object"}}), "guided_json",
         "guided decoding"),
        (dict(messages=image), "messages", "'image_url'"),
    ]
    for kwargs, field, what in refused:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=MODEL, max_tokens=2, **kwargs)
        assert err.value.body["param"] == field, err.value.body
        assert what in err.value.body["message"], err.value.body
    for kwargs, field in ((dict(suffix=" end"), "suffix"), (dict(best_of=3), "best_of")):
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model=MODEL, prompt="hi", max_tokens=2, **kwargs)
        assert err.value.body["param"] == field, err.value.body
    out = client.chat.completions.create(model=MODEL, messages=hi, max_tokens=2, tools=[],
                                         tool_choice="none", response_format={"type": "text"})
    assert out.choices[0].message.content is not None
    out = client.completions.create(model=MODEL, prompt="hi", max_tokens=2, best_of=1, suffix="")
    assert out.choices[0].text is not None


def test_too_long_prompt_is_400(client: Any) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt=list(range(1, 200)), max_tokens=4)
    assert err.value.body["code"] == "context_length_exceeded"


def test_unknown_model_is_404(client: Any) -> None:
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="gpt-5", prompt="hi", max_tokens=1)
    assert MODEL in err.value.body["message"]


def test_missing_or_wrong_key_is_401(url: str) -> None:
    for key in ("wrong", None):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "hi"},
                       headers=headers, timeout=TIMEOUT)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{url}/health", timeout=TIMEOUT).status_code == 200  # no key needed


def test_full_queue_is_429_with_retry_after(llm: Any) -> None:
    from fastapi.testclient import TestClient

    # max_waiting=0: the queue is always full, so every request is turned away before it runs
    app = build_app(llm, ServerConfig(served_model_name=MODEL, max_waiting=0))
    with TestClient(app) as http:
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi"})
    assert r.status_code == 429
    assert r.headers["Retry-After"] == "1"
    assert r.json()["error"]["type"] == "rate_limit_error"


# ---- models, health, metrics ---------------------------------------------------------------------
def test_health_is_503_once_the_engine_is_closed(model_dir: Path, url: str) -> None:
    from fastapi.testclient import TestClient

    assert httpx.get(f"{url}/health", timeout=TIMEOUT).json() == {"status": "ok"}
    closed = LLM(model_dir, **OPTIONS)
    closed.close()
    with TestClient(build_app(closed, ServerConfig(served_model_name=MODEL))) as http:
        r = http.get("/health")
    assert r.status_code == 503 and r.json() == {"status": "engine closed"}


def test_models_lists_the_served_name(client: Any) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_metrics_are_prometheus_text(client: Any, url: str) -> None:
    client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=2, temperature=0.0,
                              stream=True).close()
    client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=2, temperature=0.0,
                              extra_body={"ignore_eos": True})
    text = httpx.get(f"{url}/metrics", timeout=TIMEOUT).text
    for name in ('tgraph_requests_total{finish_reason="length"}',
                 "tgraph_time_to_first_token_seconds_bucket",
                 "tgraph_inter_token_latency_seconds_bucket",
                 "tgraph_request_latency_seconds_count", "tgraph_requests_running ",
                 "tgraph_requests_waiting ", "tgraph_kv_cache_usage_ratio ",
                 "tgraph_prefix_cache_queries_total ", "tgraph_prefix_cache_hits_total ",
                 "tgraph_preemptions_total "):
        assert name in text, name
