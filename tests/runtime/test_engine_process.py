"""The engine in a child process: the same tokens as ``LLM.generate``, bad input refused in the
parent by the engine's own errors, a load error raised as itself, streams that end when the
engine closes or its process dies, and LoRA adapters loaded, unloaded and switched while it runs
(tiny Llama, fp32 on CPU)."""
from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from tgraph.errors import ConfigError, RequestTooLongError, WeightLoadError
from tgraph.runtime.adapters import AdapterInUseError, AdapterNotFoundError
from tgraph.runtime.engine_core import EngineClosedError
from tgraph.runtime.engine_process import EngineProcess
from tgraph.runtime.llm import LLM
from tgraph.runtime.sampling_params import SamplingParams
from tgraph.testing import make_tiny_hf_model

OPTIONS = dict(device="cpu", dtype="float32", graph="eager", max_model_len=64, block_size=4,
               num_blocks=32)
PROMPTS = [[1, 5, 9, 22, 7], [3, 4], [17, 150, 8, 8, 191, 0, 42]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
WAIT_S = 60.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_hf_model("llama", tmp_path_factory.mktemp("engine-process"), seed=2)


@pytest.fixture(scope="module")
def alone(model_dir: Path) -> list[list[int]]:
    llm = LLM(model_dir, **OPTIONS)
    try:
        return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    finally:
        llm.close()


async def _collect(stream: Any) -> list[int]:
    tokens: list[int] = []
    async for event in stream:
        tokens += event.token_ids
    return tokens


def test_requests_get_the_tokens_of_llm_generate(model_dir: Path, alone) -> None:
    engine = EngineProcess(model_dir, **OPTIONS)
    try:
        async def main() -> list[list[int]]:
            streams = [engine.engine.submit(p, GREEDY, request_id=f"r{i}")
                       for i, p in enumerate(PROMPTS)]
            return await asyncio.wait_for(asyncio.gather(*map(_collect, streams)), WAIT_S)

        assert asyncio.run(main()) == alone
        stats = engine.engine.stats()
        assert stats.kv_blocks_used == 0 and stats.finished.get("length") == len(PROMPTS)
        assert engine.encode([3, 4]) == [3, 4]
    finally:
        engine.close()


def test_bad_requests_are_refused_in_the_parent(model_dir: Path) -> None:
    engine = EngineProcess(model_dir, **OPTIONS)
    try:
        async def main() -> None:
            submit = engine.engine.submit
            with pytest.raises(RequestTooLongError, match="max_model_len 64"):
                submit(list(range(1, 60)), GREEDY, request_id="long")
            with pytest.raises(ValueError, match="LoRA adapter 'nope' is not loaded"):
                submit([1, 2], SamplingParams(lora="nope"), request_id="lora")
            with pytest.raises(ValueError, match="explicit request ids"):
                submit([1, 2], GREEDY)
            stream = submit([1, 2], GREEDY, request_id="same")
            with pytest.raises(ValueError, match="already in use"):
                submit([1, 2], GREEDY, request_id="same")
            assert len(await asyncio.wait_for(_collect(stream), WAIT_S)) == 10

        asyncio.run(main())
    finally:
        engine.close()


def test_a_load_error_is_raised_as_itself(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "nope"}')
    with pytest.raises(ConfigError, match="nope"):
        EngineProcess(tmp_path, **OPTIONS)


def test_streams_end_when_the_engine_closes_or_its_process_dies(model_dir: Path) -> None:
    long = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    for how in ("close", "kill"):
        engine = EngineProcess(model_dir, **OPTIONS)

        async def main() -> None:
            stream = engine.engine.submit(PROMPTS[0], long, request_id="r")
            events = aiter(stream)
            assert (await asyncio.wait_for(anext(events), WAIT_S)).token_ids
            if how == "close":
                engine.close()
            else:
                os.kill(engine._process.pid, signal.SIGKILL)
            with pytest.raises(EngineClosedError):
                await asyncio.wait_for(_collect(events), WAIT_S)
            assert engine.engine.closed  # what the server's /health reports (503)
            with pytest.raises(EngineClosedError):
                engine.engine.submit(PROMPTS[1], GREEDY, request_id="after")

        try:
            asyncio.run(main())
        finally:
            engine.close()


# ---- LoRA adapters at run time -----------------------------------------------------------------
@pytest.fixture(scope="module")
def adapters(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two PEFT adapters of the tiny Llama: "qv" (per request) and "dom" (for every request)."""
    pytest.importorskip("peft")
    import torch
    from transformers import AutoModelForCausalLM

    from tests.models.test_lora import make_adapter

    root = tmp_path_factory.mktemp("engine-process-adapters")
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    make_adapter(hf, root / "qv", 13, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    make_adapter(hf, root / "dom", 11, r=8, lora_alpha=16,
                 target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                 "up_proj", "down_proj"])
    return root


def test_adapters_change_in_the_child_as_in_an_llm(model_dir: Path, adapters: Path) -> None:
    """Loaded, unloaded (refused while a request uses it), set and cleared in the child: the
    tokens of an LLM built with the adapters from the start."""
    llm = LLM(model_dir, loras={"qv": adapters / "qv"}, single_lora=adapters / "dom", **OPTIONS)
    try:
        stacked = llm.generate(PROMPTS[0], GREEDY, lora="qv")[0].token_ids
        llm.set_single_lora(None)
        tuned = llm.generate(PROMPTS[0], GREEDY, lora="qv")[0].token_ids
        base = llm.generate(PROMPTS[0], GREEDY)[0].token_ids
    finally:
        llm.close()
    assert len({tuple(stacked), tuple(tuned), tuple(base)}) == 3  # each adapter matters
    engine = EngineProcess(model_dir, **OPTIONS)
    try:
        engine.load_lora("qv", adapters / "qv")  # no event loop yet: it reads the pipe itself
        assert engine.adapters == ["qv"]

        async def main() -> None:
            qv = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, lora="qv")
            assert await asyncio.wait_for(_collect(engine.engine.submit(
                PROMPTS[0], qv, request_id="a")), WAIT_S) == tuned
            stream = engine.engine.submit(PROMPTS[0], qv, request_id="b")
            # sent after the submission on the same pipe: the request is in flight
            with pytest.raises(AdapterInUseError, match="1 request"):
                await asyncio.to_thread(engine.unload_lora, "qv")
            assert engine.adapters == ["qv"]
            assert await asyncio.wait_for(_collect(stream), WAIT_S) == tuned
            with pytest.raises(ConfigError, match="off the event loop"):
                engine.set_single_lora(adapters / "dom")
            await asyncio.to_thread(engine.set_single_lora, adapters / "dom")
            assert await asyncio.wait_for(_collect(engine.engine.submit(
                PROMPTS[0], qv, request_id="c")), WAIT_S) == stacked

        asyncio.run(main())
        assert engine.single_lora == str(adapters / "dom")
        # the event loop that read the pipe is closed: the calls read it themselves again
        with pytest.raises(WeightLoadError, match="no such directory"):
            engine.set_single_lora(adapters / "nowhere")
        assert engine.single_lora == str(adapters / "dom")
        engine.set_single_lora(None)
        engine.unload_lora("qv")
        assert engine.adapters == [] and engine.single_lora is None
        with pytest.raises(AdapterNotFoundError, match="'qv' is not loaded"):
            engine.unload_lora("qv")

        async def after() -> None:
            with pytest.raises(ValueError, match="LoRA adapter 'qv' is not loaded"):
                engine.engine.submit(PROMPTS[0], SamplingParams(lora="qv"), request_id="d")
            assert await asyncio.wait_for(_collect(engine.engine.submit(
                PROMPTS[0], GREEDY, request_id="e")), WAIT_S) == base

        asyncio.run(after())
    finally:
        engine.close()
    with pytest.raises(EngineClosedError):
        engine.load_lora("qv", adapters / "qv")
