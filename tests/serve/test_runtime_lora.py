"""Runtime LoRA adapter management over HTTP (``--allow-runtime-lora``): load, unload, set and
clear the single adapter while the server runs, on a tiny CPU Llama and PEFT adapters.

The oracle is an :class:`LLM` built with the adapters from the start: greedy decoding in fp32 on
CPU is exact (see tests/runtime/test_llm.py), so a request to an adapter loaded at runtime must
get exactly its tokens. Every adapter changes the tokens (checked against the base model), so a
server that ignored a load, an unload or a switch fails. The HTTP tests run against the engine in
the server's process (an ``LLM``) and in a child process (``EngineProcess``, what ``tgraph serve``
runs); the engines built are checked in-process, where they are visible. The last test runs
``tgraph serve`` under torchrun (2 gloo ranks): every rank must apply a command at the same step.
"""
from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
pytest.importorskip("peft")

from fastapi.testclient import TestClient  # noqa: E402

from tests.models.test_lora import make_adapter  # noqa: E402
from tgraph.runtime.adapters import AdapterInUseError  # noqa: E402
from tgraph.runtime.engine_process import EngineProcess  # noqa: E402
from tgraph.runtime.llm import LLM  # noqa: E402
from tgraph.runtime.sampling_params import SamplingParams  # noqa: E402
from tgraph.serve import ServerConfig, ServerThread, build_app  # noqa: E402
from tgraph.testing import make_tiny_hf_model  # noqa: E402

MODEL = "tiny"
KEY = "sk-test"
MAX_TOKENS = 8
PROMPT = [1, 5, 9, 22, 7, 3, 100]
TIMEOUT = 120.0
OPTIONS = dict(device="cpu", dtype="float32", graph="eager", max_model_len=64, block_size=4,
               num_blocks=96)
ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> (seed, LoraConfig kwargs): "qv" and "mlp" per request, "dom" and "dom2" for everyone
ADAPTERS = {"qv": (13, dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])),
            "mlp": (14, dict(r=2, lora_alpha=4, target_modules=["gate_proj", "down_proj",
                                                                 "o_proj"])),
            "dom": (11, dict(r=8, lora_alpha=16, target_modules=ALL_MODULES)),
            "dom2": (12, dict(r=4, lora_alpha=8, target_modules=ALL_MODULES)),
            "wide": (15, dict(r=32, lora_alpha=32, target_modules=["q_proj"]))}  # > max_rank 16


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny Llama (token-id prompts) and its adapters, plus malformed adapter directories."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("runtime-lora")
    model_dir = make_tiny_hf_model("llama", root / "model", seed=4)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for name, (seed, kwargs) in ADAPTERS.items():
        make_adapter(hf, root / name, seed, **kwargs)
    bad_json = root / "bad-json"
    bad_json.mkdir()
    (bad_json / "adapter_config.json").write_text("{not json")
    bad_weights = root / "bad-weights"
    bad_weights.mkdir()
    (bad_weights / "adapter_config.json").write_text(
        (root / "qv" / "adapter_config.json").read_text())
    (bad_weights / "adapter_model.safetensors").write_bytes(b"garbage")
    return model_dir, root


def _greedy(llm: LLM, **kwargs: Any) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, **kwargs)
    return llm.generate(PROMPT, params)[0].token_ids


@pytest.fixture(scope="module")
def oracle(setup: tuple[Path, Path]) -> dict[tuple[str | None, str | None], list[int]]:
    """Greedy tokens of LLMs built with the adapters from the start, by (single, per-request)
    adapter."""
    model_dir, root = setup
    tokens: dict[tuple[str | None, str | None], list[int]] = {}
    for single in (None, "dom", "dom2"):
        llm = LLM(model_dir, loras={"qv": root / "qv", "mlp": root / "mlp"},
                  single_lora=None if single is None else root / single, **OPTIONS)
        try:
            for lora in (None, "qv", "mlp"):
                tokens[(single, lora)] = _greedy(llm, lora=lora)
        finally:
            llm.close()
    # every adapter changes the tokens, so each check below can fail
    assert len({tuple(t) for t in tokens.values()}) == len(tokens), tokens
    return tokens


@pytest.fixture(scope="module")
def llm(setup: tuple[Path, Path]) -> Any:
    """The in-process server's model: no adapter at start."""
    llm = LLM(setup[0], **OPTIONS)
    yield llm
    llm.close()


@pytest.fixture(scope="module", params=["in-process", "engine-process"])
def served(request: pytest.FixtureRequest, llm: Any, setup: tuple[Path, Path]) -> Any:
    """(url, the served model) with runtime LoRA on, no adapter loaded at start."""
    target = llm if request.param == "in-process" else EngineProcess(setup[0], **OPTIONS)
    config = ServerConfig(served_model_name=MODEL, api_key=KEY, allow_runtime_lora=True)
    try:
        with ServerThread(target, config) as url:
            yield url, target
    finally:
        if target is not llm:
            target.close()


class Parked:
    """The in-process engine's loop parked in a call (no step, no command) until released."""

    def __init__(self, llm: Any) -> None:
        self.release, started = threading.Event(), threading.Event()

        def park() -> None:
            started.set()
            self.release.wait(TIMEOUT)

        self.thread = threading.Thread(target=llm.engine.call, args=(park,))
        self.thread.start()
        assert started.wait(TIMEOUT)

    def __enter__(self) -> Parked:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release.set()
        self.thread.join(TIMEOUT)


class Client:
    """Raw HTTP with the key."""

    def __init__(self, url: str) -> None:
        self.http = httpx.Client(base_url=url, timeout=TIMEOUT,
                                 headers={"Authorization": f"Bearer {KEY}"})

    def post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        return self.http.post(path, json=body)

    def ok(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        r = self.post(path, body)
        assert r.status_code == 200, r.text
        return r.json()

    def models(self) -> list[str]:
        r = self.http.get("/v1/models")
        assert r.status_code == 200, r.text
        return [m["id"] for m in r.json()["data"]]

    def tokens(self, model: str) -> list[int]:
        body = {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0.0,
                "ignore_eos": True, "return_token_ids": True}
        return self.ok("/v1/completions", body)["choices"][0]["token_ids"]

    def error(self, path: str, body: dict[str, Any], status: int) -> dict[str, Any]:
        r = self.post(path, body)
        assert r.status_code == status, r.text
        return r.json()["error"]


@pytest.fixture()
def client(served: Any) -> Any:
    c = Client(served[0])
    yield c
    # each test leaves the server as it found it: no adapter
    for name in c.models()[1:]:
        c.ok("/v1/unload_lora_adapter", {"lora_name": name})
    c.ok("/v1/set_single_lora", {"lora_path": None})
    c.http.close()


# ---- load, request, unload ----------------------------------------------------------------------
def test_a_loaded_adapter_serves_the_tokens_of_one_loaded_at_start(client: Client, setup,
                                                                  oracle) -> None:
    root = setup[1]
    assert client.models() == [MODEL]
    assert client.error("/v1/completions", {"model": "qv", "prompt": PROMPT}, 404)["code"] == \
        "model_not_found"
    out = client.ok("/v1/load_lora_adapter", {"lora_name": "qv", "lora_path": str(root / "qv")})
    assert out["status"] == "loaded" and out["loaded"] == ["qv"]
    listed = client.http.get("/v1/models").json()["data"]
    assert [(m["id"], m["root"], m["parent"]) for m in listed] == [
        (MODEL, MODEL, None), ("qv", str(root / "qv"), MODEL)]
    assert client.tokens("qv") == oracle[(None, "qv")]
    assert client.tokens(MODEL) == oracle[(None, None)]
    client.ok("/v1/load_lora_adapter", {"lora_name": "mlp", "lora_path": str(root / "mlp")})
    assert client.models() == [MODEL, "mlp", "qv"]
    assert client.tokens("mlp") == oracle[(None, "mlp")]
    assert client.tokens("qv") == oracle[(None, "qv")]

    out = client.ok("/v1/unload_lora_adapter", {"lora_name": "qv"})
    assert out["status"] == "unloaded" and out["loaded"] == ["mlp"]
    assert client.models() == [MODEL, "mlp"]
    assert client.error("/v1/completions", {"model": "qv", "prompt": PROMPT}, 404)["code"] == \
        "model_not_found"
    assert client.tokens("mlp") == oracle[(None, "mlp")]
    error = client.error("/v1/unload_lora_adapter", {"lora_name": "qv"}, 404)
    assert error["code"] == "lora_not_found" and "'qv' is not loaded" in error["message"]
    # loaded again under another name, into a freed slot
    client.ok("/v1/load_lora_adapter", {"lora_name": "qv2", "lora_path": str(root / "qv")})
    assert client.tokens("qv2") == oracle[(None, "qv")]


def test_replacing_needs_load_inplace(client: Client, setup, oracle) -> None:
    root = setup[1]
    client.ok("/v1/load_lora_adapter", {"lora_name": "a", "lora_path": str(root / "qv")})
    error = client.error("/v1/load_lora_adapter",
                         {"lora_name": "a", "lora_path": str(root / "mlp")}, 400)
    assert "already loaded" in error["message"] and error["param"] == "lora_name"
    assert client.tokens("a") == oracle[(None, "qv")]
    client.ok("/v1/load_lora_adapter",
              {"lora_name": "a", "lora_path": str(root / "mlp"), "load_inplace": True})
    assert client.tokens("a") == oracle[(None, "mlp")]


# ---- errors -------------------------------------------------------------------------------------
def test_bad_adapters_are_400_and_change_nothing(client: Client, setup, oracle) -> None:
    root = setup[1]
    client.ok("/v1/load_lora_adapter", {"lora_name": "qv", "lora_path": str(root / "qv")})
    cases = [({"lora_name": "x", "lora_path": str(root / "nowhere")}, "no such directory"),
             ({"lora_name": "x", "lora_path": str(root / "bad-json")}, "is not valid JSON"),
             ({"lora_name": "x", "lora_path": str(root / "bad-weights")}, "cannot be read"),
             ({"lora_name": "x", "lora_path": str(root / "wide")}, "exceeds max_rank 16"),
             ({"lora_name": MODEL, "lora_path": str(root / "mlp")}, "served model's name"),
             ({"lora_name": "x"}, "lora_path: Field required"),
             ({"lora_name": "", "lora_path": str(root / "mlp")}, "lora_name: String should")]
    for body, message in cases:
        error = client.error("/v1/load_lora_adapter", body, 400)
        assert message in error["message"], (body, error)
        assert error["type"] == "invalid_request_error"
    error = client.error("/v1/set_single_lora", {"lora_path": str(root / "nowhere")}, 400)
    assert "no such directory" in error["message"] and error["param"] == "lora_path"
    assert client.models() == [MODEL, "qv"]
    assert client.tokens("qv") == oracle[(None, "qv")]
    assert client.tokens(MODEL) == oracle[(None, None)]


def test_a_full_bank_is_refused(client: Client, setup, oracle) -> None:
    root = setup[1]
    for i in range(4):  # the multi-LoRA feature's default max_loras
        client.ok("/v1/load_lora_adapter", {"lora_name": f"a{i}", "lora_path": str(root / "qv")})
    error = client.error("/v1/load_lora_adapter",
                         {"lora_name": "a4", "lora_path": str(root / "mlp")}, 400)
    assert "max_loras=4" in error["message"], error
    assert client.models() == [MODEL, "a0", "a1", "a2", "a3"]
    assert client.tokens("a3") == oracle[(None, "qv")]


def test_runtime_lora_is_off_by_default_and_behind_the_key(llm: Any, setup) -> None:
    root = setup[1]
    calls = [("/v1/load_lora_adapter", {"lora_name": "qv", "lora_path": str(root / "qv")}),
             ("/v1/unload_lora_adapter", {"lora_name": "qv"}),
             ("/v1/set_single_lora", {"lora_path": str(root / "dom")})]
    key = {"Authorization": f"Bearer {KEY}"}
    off = TestClient(build_app(llm, ServerConfig(served_model_name=MODEL, api_key=KEY)))
    for path, body in calls:
        r = off.post(path, json=body, headers=key)
        assert r.status_code == 404, r.text
        assert r.json()["error"]["code"] == "runtime_lora_disabled"
        assert "--allow-runtime-lora" in r.json()["error"]["message"]
    on = TestClient(build_app(llm, ServerConfig(served_model_name=MODEL, api_key=KEY,
                                                allow_runtime_lora=True)))
    for path, body in calls:
        r = on.post(path, json=body)
        assert r.status_code == 401, r.text
        assert r.json()["error"]["code"] == "invalid_api_key"
    assert llm.adapters == [] and llm.single_lora is None


# ---- the single adapter -------------------------------------------------------------------------
def test_the_single_adapter_is_set_switched_and_cleared(client: Client, setup, oracle) -> None:
    root = setup[1]
    client.ok("/v1/load_lora_adapter", {"lora_name": "qv", "lora_path": str(root / "qv")})
    out = client.ok("/v1/set_single_lora", {"lora_path": str(root / "dom")})
    assert out["status"] == "set" and out["lora_path"] == str(root / "dom")
    assert client.tokens(MODEL) == oracle[("dom", None)]
    assert client.tokens("qv") == oracle[("dom", "qv")]  # stacked
    client.ok("/v1/set_single_lora", {"lora_path": str(root / "dom2")})
    assert client.tokens(MODEL) == oracle[("dom2", None)]
    client.ok("/v1/set_single_lora", {"lora_path": str(root / "dom2")})  # the same one again
    assert client.tokens(MODEL) == oracle[("dom2", None)]
    error = client.error("/v1/set_single_lora", {"lora_path": str(root / "bad-json")}, 400)
    assert "is not valid JSON" in error["message"]
    assert client.tokens(MODEL) == oracle[("dom2", None)]  # the previous one stays
    out = client.ok("/v1/set_single_lora", {"lora_path": None})
    assert out["status"] == "cleared"
    assert client.tokens(MODEL) == oracle[(None, None)]
    assert client.tokens("qv") == oracle[(None, "qv")]
    assert client.error("/v1/set_single_lora", {}, 400)["param"] == "lora_path"


# ---- in flight, and the engines ------------------------------------------------------------------
def test_unloading_an_adapter_in_use_is_409(client: Client, served: Any, setup) -> None:
    """The unload is queued while the loop is parked with the adapter's request in flight (in
    the child process the pipe's order does the same: tests/runtime/test_engine_process.py)."""
    url, target = served
    if not isinstance(target, LLM):
        pytest.skip("parks the in-process engine's loop")
    root = setup[1]
    client.ok("/v1/load_lora_adapter", {"lora_name": "qv", "lora_path": str(root / "qv")})
    body = {"model": "qv", "prompt": PROMPT, "max_tokens": 40, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "return_token_ids": True}
    tokens: list[int] = []
    answer: list[httpx.Response] = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=TIMEOUT,
                      headers={"Authorization": f"Bearer {KEY}"}) as response:
        with Parked(target):
            pass  # a step boundary: the request was handed to the loop...
        with Parked(target):
            # ...and runs 40 steps, so the unload queued now finds it in flight
            unload = threading.Thread(target=lambda: answer.append(
                client.post("/v1/unload_lora_adapter", {"lora_name": "qv"})))
            unload.start()
            time.sleep(0.5)
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                tokens += json.loads(line[6:])["choices"][0]["token_ids"]
        unload.join(TIMEOUT)
    assert answer[0].status_code == 409, answer[0].text
    error = answer[0].json()["error"]
    assert error["code"] == "lora_in_use" and "1 request(s) in flight" in error["message"]
    assert len(tokens) == 40
    client.ok("/v1/unload_lora_adapter", {"lora_name": "qv"})  # finished: now it unloads


def test_no_engine_is_built_by_a_command(client: Client, served: Any, setup, oracle) -> None:
    """Once every combination of features ran, loading, unloading, switching and clearing
    adapters (and serving them) builds no engine."""
    _, target = served
    if not isinstance(target, LLM):
        pytest.skip("the engines are visible in-process")
    root = setup[1]
    client.ok("/v1/load_lora_adapter", {"lora_name": "qv", "lora_path": str(root / "qv")})
    client.ok("/v1/set_single_lora", {"lora_path": str(root / "dom")})
    client.tokens("qv")
    client.tokens(MODEL)
    client.ok("/v1/set_single_lora", {"lora_path": None})
    client.tokens("qv")
    client.tokens(MODEL)
    built = set(target.model.engines)
    # prefill and decode x (base, multi): the single adapter is merged into the weights
    assert len(built) == 4, built
    client.ok("/v1/load_lora_adapter", {"lora_name": "mlp", "lora_path": str(root / "mlp")})
    client.ok("/v1/unload_lora_adapter", {"lora_name": "qv"})
    client.ok("/v1/set_single_lora", {"lora_path": str(root / "dom2")})
    assert client.tokens("mlp") == oracle[("dom2", "mlp")]
    assert client.tokens(MODEL) == oracle[("dom2", None)]
    client.ok("/v1/set_single_lora", {"lora_path": None})
    assert client.tokens("mlp") == oracle[(None, "mlp")]
    assert set(target.model.engines) == built


# ---- in-process API -----------------------------------------------------------------------------
def test_llm_refuses_to_unload_an_adapter_in_flight(llm: Any, setup, oracle) -> None:
    root = setup[1]
    llm.load_lora("qv", root / "qv")
    try:
        stream = llm.engine.submit(PROMPT, SamplingParams(temperature=0.0, max_tokens=30,
                                                          ignore_eos=True, lora="qv"))
        with pytest.raises(AdapterInUseError, match="1 request"):
            llm.unload_lora("qv")  # queued behind the submission: it is in flight
        assert len(list(stream)) == 30 and llm.adapters == ["qv"]
    finally:
        llm.unload_lora("qv")
    assert llm.adapters == []


def test_a_request_queued_behind_its_adapters_unload_fails_alone(llm: Any, setup,
                                                                  oracle) -> None:
    """A request checked while its adapter was loaded but started after the unload fails with
    a clear error; a request of the same step is unaffected."""
    root = setup[1]
    llm.load_lora("qv", root / "qv")
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with Parked(llm):
        unload = threading.Thread(target=llm.unload_lora, args=("qv",))
        unload.start()
        time.sleep(0.5)  # the unload is queued first
        doomed = llm.engine.submit(PROMPT, SamplingParams(temperature=0.0, ignore_eos=True,
                                                          max_tokens=MAX_TOKENS, lora="qv"))
        base = llm.engine.submit(PROMPT, greedy)
    unload.join(TIMEOUT)
    with pytest.raises(ValueError, match="LoRA adapter 'qv' was unloaded before the request"):
        list(doomed)
    list(base)
    assert base.output.token_ids == oracle[(None, None)]
    assert llm.adapters == []


# ---- tensor parallel -----------------------------------------------------------------------------
@pytest.mark.slow
def test_runtime_lora_under_tensor_parallelism(setup, oracle) -> None:
    """``tgraph serve --allow-runtime-lora`` under torchrun: rank 0 takes the commands and rank 1
    applies them at the same step; the tokens equal one process's, a failed load leaves both
    ranks serving, and SIGTERM still ends every process with 0."""
    from tests.distributed.launch import finish, server_url, start_torchrun
    from tests.distributed.test_tp_serve import _rank0_pid

    model_dir, root = setup
    settings = ["--graph", "eager", "--set", "llm.model.device=cpu",
                "--set", "llm.model.dtype=float32", "--set", "llm.cache.block_size=4",
                "--set", "llm.cache.num_blocks=96", "--max-model-len", "64"]
    job = start_torchrun(["-m", "tgraph", "serve", "--model", str(model_dir), "--port", "0",
                          "--served-model-name", MODEL, "--api-key", KEY, "--log-level",
                          "warning", "--allow-runtime-lora", *settings])
    url = server_url(job, 180.0)
    client = Client(url)
    try:
        client.ok("/v1/load_lora_adapter", {"lora_name": "qv", "lora_path": str(root / "qv")})
        assert client.tokens("qv") == oracle[(None, "qv")]
        client.error("/v1/load_lora_adapter",
                     {"lora_name": "x", "lora_path": str(root / "bad-weights")}, 400)
        client.ok("/v1/set_single_lora", {"lora_path": str(root / "dom")})
        assert client.tokens("qv") == oracle[("dom", "qv")]
        assert client.tokens(MODEL) == oracle[("dom", None)]
        client.ok("/v1/unload_lora_adapter", {"lora_name": "qv"})
        client.ok("/v1/set_single_lora", {"lora_path": None})
        assert client.models() == [MODEL]
        assert client.tokens(MODEL) == oracle[(None, None)]
    finally:
        client.http.close()
        os.kill(_rank0_pid(job.proc.pid), signal.SIGTERM)
        job.proc.stdout = None  # the reader thread owns it
        launch = finish(job, 120.0)
    assert launch.rc == 0, launch.stderr[-4000:]
