"""``tgraph serve`` as users start it: a process, a LoRA adapter served as a model, SIGTERM drains.

One server process runs the whole file (starting one costs the imports and the model load). The
oracle for the adapter is :meth:`LLM.generate` with ``lora=`` in this process (fp32 on CPU:
greedy tokens are exact, see tests/runtime/test_llm.py).
"""
from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
pytest.importorskip("peft")

from tgraph.runtime.llm import LLM  # noqa: E402
from tgraph.runtime.sampling_params import SamplingParams  # noqa: E402
from tgraph.testing import make_tiny_hf_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny"
ADAPTER = "qv"
START_TIMEOUT = 180.0  # imports + model load on a slow CI core
SETTINGS = ["--graph", "eager", "--set", "llm.model.device=cpu", "--set", "llm.model.dtype=float32",
            "--set", "llm.cache.block_size=4", "--set", "llm.cache.num_blocks=64",
            "--max-model-len", "64"]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny Llama and a random PEFT adapter of it (B non-zero, so it changes the tokens)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("serve-process")
    model_dir = make_tiny_hf_model("llama", root / "model", seed=0)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(1)
    config = LoraConfig(init_lora_weights=False, r=4, lora_alpha=8,
                        target_modules=["q_proj", "v_proj"])
    get_peft_model(hf, config).save_pretrained(root / ADAPTER)
    return model_dir, root / ADAPTER


@pytest.fixture(scope="module")
def server(model: tuple[Path, Path]) -> Iterator[tuple[subprocess.Popen, str]]:
    model_dir, adapter = model
    cmd = [sys.executable, "-m", "tgraph", "serve", "--model", str(model_dir), "--port", "0",
           "--served-model-name", MODEL, "--lora", f"{ADAPTER}={adapter}", "--drain-seconds",
           "60", "--log-level", "warning", *SETTINGS]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, cwd=ROOT)
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    seen = []
    while True:
        try:
            line = lines.get(timeout=START_TIMEOUT)
        except queue.Empty:
            proc.kill()
            raise AssertionError(f"the server did not start: {''.join(seen)}") from None
        if line is None:
            raise AssertionError(f"the server exited ({proc.wait()}): {''.join(seen)}")
        seen.append(line)
        if line.startswith("tgraph: serving on "):
            break
    yield proc, line.split()[-1]
    if proc.poll() is None:
        proc.kill()
        proc.wait(30)


def test_models_list_the_adapter(server: tuple[subprocess.Popen, str]) -> None:
    _, url = server
    ids = [m["id"] for m in httpx.get(f"{url}/v1/models", timeout=60).json()["data"]]
    assert ids == [MODEL, ADAPTER]


def test_adapter_as_model_equals_generate_with_lora(model: tuple[Path, Path],
                                                    server: tuple[subprocess.Popen, str]) -> None:
    model_dir, adapter = model
    _, url = server
    prompt = [1, 5, 9, 22, 7]
    llm = LLM(model_dir, device="cpu", dtype="float32", graph="eager", max_model_len=64,
              block_size=4, num_blocks=64, loras={ADAPTER: adapter})
    try:
        greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        base = llm.generate(prompt, greedy)[0].token_ids
        tuned = llm.generate(prompt, greedy, lora=ADAPTER)[0].token_ids
    finally:
        llm.close()
    assert base != tuned  # the adapter changes the tokens, so the check below can fail

    def served(name: str) -> list[int]:
        body = {"model": name, "prompt": prompt, "max_tokens": 8, "temperature": 0.0,
                "ignore_eos": True, "logprobs": 0}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return [int(t) for t in r.json()["choices"][0]["logprobs"]["tokens"]]

    assert served(MODEL) == base
    assert served(ADAPTER) == tuned


def test_sigterm_drains_the_requests_in_flight(server: tuple[subprocess.Popen, str]) -> None:
    """Run last in this file: it stops the server."""
    proc, url = server
    body = {"model": MODEL, "prompt": [3, 4], "max_tokens": 40, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "logprobs": 0}
    events: list[dict[str, Any]] = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            events.append(json.loads(line[len("data: "):]))
            if len(events) == 1:
                proc.send_signal(signal.SIGTERM)  # mid-request: it must still finish
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert sum(len(e["choices"][0]["logprobs"]["tokens"]) for e in events) == 40
    assert proc.wait(120) == 0
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/health", timeout=10)
