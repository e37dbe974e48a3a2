"""``logit_bias`` (and the ``allowed_token_ids`` extension) through the OpenAI-compatible server,
on a tiny CPU model, with the engine in the server's process and in a child process.

The oracle is :meth:`LLM.generate` with the same :class:`SamplingParams`: greedy decoding in fp32
on CPU is exact (see test_server.py), so the server must return exactly its tokens; the biases
used change the tokens, so a server that dropped the field fails.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from tgraph.runtime.engine_process import EngineProcess  # noqa: E402
from tgraph.runtime.llm import LLM  # noqa: E402
from tgraph.runtime.sampling_params import SamplingParams  # noqa: E402
from tgraph.serve import ServerConfig, ServerThread  # noqa: E402

MODEL = "tiny"
MAX_TOKENS = 6
PROMPT = "The river began high in the mountains"
TIMEOUT = 120.0
OPTIONS = dict(device="cpu", dtype="float32", graph="eager", max_model_len=64, block_size=4,
               num_blocks=64)


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> Any:
    llm = LLM(model_dir, **OPTIONS)
    yield llm
    llm.close()


@pytest.fixture(scope="module", params=["in-process", "engine-process"])
def url(request: pytest.FixtureRequest, llm: Any, model_dir: Path) -> Any:
    target = llm if request.param == "in-process" else EngineProcess(model_dir, **OPTIONS)
    try:
        with ServerThread(target, ServerConfig(served_model_name=MODEL)) as url:
            yield url
    finally:
        if target is not llm:
            target.close()


def greedy(**kwargs: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, **kwargs)


def post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    body = {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True, **body}
    return httpx.post(f"{url}/v1/{path}", json=body, timeout=TIMEOUT)


def test_completions_and_chat_apply_logit_bias(llm: Any, url: str) -> None:
    plain = llm.generate(PROMPT, greedy())[0].token_ids
    # Ban the model's first two choices, favour a third token mildly, force nothing.
    bias = {str(plain[0]): -100, str(plain[1]): -100, "42": 2.5}
    expected = llm.generate(PROMPT, greedy(logit_bias=bias))[0]
    assert expected.token_ids != plain
    r = post(url, "completions", {"prompt": PROMPT, "logit_bias": bias})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == expected.token_ids
    assert r.json()["choices"][0]["text"] == expected.text

    chat = llm.generate(PROMPT, greedy(logit_bias={"42": 100}), chat=True)[0]
    assert set(chat.token_ids) == {42}
    r = post(url, "chat/completions", {"messages": [{"role": "user", "content": PROMPT}],
                                       "logit_bias": {"42": 100}})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == chat.token_ids
    assert r.json()["choices"][0]["message"]["content"] == chat.text


def test_openai_client_sends_logit_bias(llm: Any, url: str) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=TIMEOUT, max_retries=0)
    expected = llm.generate(PROMPT, greedy(logit_bias={7: 100}))[0].text
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                            temperature=0.0, logit_bias={"7": 100}, stream=True,
                                            extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected


def test_allowed_token_ids_extension(llm: Any, url: str) -> None:
    allowed = [5, 50, 500]
    expected = llm.generate(PROMPT, greedy(allowed_token_ids=allowed))[0].token_ids
    assert set(expected) <= set(allowed)
    r = post(url, "completions", {"prompt": PROMPT, "allowed_token_ids": allowed})
    assert r.json()["choices"][0]["token_ids"] == expected


@pytest.mark.parametrize("body, message", [
    ({"logit_bias": {"5": 101}}, r"logit_bias[5] is 101.0; expected a number in [-100, 100]"),
    ({"logit_bias": {"five": 1}}, "keys must be token ids"),
    ({"logit_bias": {"768": 1}}, "token id(s) [768]; expected ids below the vocabulary size 768"),
    ({"allowed_token_ids": []}, "allowed_token_ids is empty"),
])
def test_bad_logit_bias_is_400(url: str, body: dict[str, Any], message: str) -> None:
    r = post(url, "completions", {"prompt": PROMPT, **body})
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"]
