"""The engine core: requests submitted from streams, threads and asyncio share one loop thread,
and every interleaving gives each request exactly the tokens it gets alone.

Runs the tiny random Llama in fp32 on CPU (eager graphs: the engine core does not depend on the
graph mode). Greedy and seeded sampling depend only on a request's own tokens, so "alone" is a
precise oracle: the same LLM generating one prompt at a time. Where an interleaving must be
pinned (an abort before the request finishes, a close while a step runs), a gate on the model
runner lets the loop take one step at a time.
"""
from __future__ import annotations

import asyncio
import threading
import weakref
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tgraph.errors import RequestTooLongError
from tgraph.runtime.engine_core import EngineClosedError
from tgraph.runtime.llm import LLM
from tgraph.runtime.sampling_params import SamplingParams
from tgraph.testing import make_tiny_hf_model

PROMPTS: list[list[int]] = [[1, 5, 9, 22, 7], [3, 4], [17, 150, 8, 8, 8, 8, 191, 0, 42], [121]]
MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, seed=5, max_tokens=MAX_TOKENS, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
WAIT_S = 60.0  # bound on every wait for another thread (a hang fails instead of blocking)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_hf_model("llama", tmp_path_factory.mktemp("engine-core"), seed=0)


def _llm(path: Path, **kwargs: Any) -> LLM:
    options = {"max_model_len": 64, "block_size": 4, "num_blocks": 64, **kwargs}
    return LLM(path, device="cpu", dtype="float32", graph="eager", **options)


@pytest.fixture(scope="module")
def llm(llama_dir: Path) -> Iterator[LLM]:
    llm = _llm(llama_dir)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def alone(llm: LLM) -> dict[tuple[int, str], list[int]]:
    """Tokens of each prompt generated alone, greedy, seeded and greedy for LONG tokens."""
    ref = {(i, name): llm.generate(p, params)[0].token_ids
           for i, p in enumerate(PROMPTS)
           for name, params in (("greedy", GREEDY), ("seeded", SEEDED), ("long", LONG))}
    # Distinct outputs, or a request reading another's cache could pass unnoticed.
    assert len({tuple(t[:MAX_TOKENS]) for t in ref.values()}) == 2 * len(PROMPTS)
    return ref


class Gate:
    """Holds the engine's loop before each model step until the test allows it."""

    def __init__(self, llm: LLM) -> None:
        self.runner = llm.engine.runner
        self.execute = self.runner.execute
        self.steps = threading.Semaphore(0)
        self.runner.execute = self

    def __call__(self, out: Any) -> Any:
        assert self.steps.acquire(timeout=WAIT_S), "the test never allowed this step"
        return self.execute(out)

    def allow(self, steps: int = 1) -> None:
        for _ in range(steps):
            self.steps.release()

    def remove(self) -> None:
        del self.runner.execute  # back to the class's method
        self.allow(1000)  # a step already waiting goes on


@pytest.fixture
def gate(llm: LLM) -> Iterator[Gate]:
    g = Gate(llm)
    yield g
    g.remove()


def _idle(llm: LLM) -> None:
    """Wait until the loop has applied everything queued so far, then check it holds nothing."""
    llm.engine.call(lambda: None, timeout=WAIT_S)  # runs after the aborts queued before it
    stats = llm.stats()
    assert (stats.running, stats.waiting, stats.kv_blocks_used) == (0, 0, 0), stats


def _tokens(events) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for e in events:
        out.setdefault(e.request_id, []).extend(e.token_ids)
    return out


# ------------------------------------------------------------------------------ interleavings
def test_suspended_stream_keeps_its_tokens_while_generate_runs(llm: LLM, alone) -> None:
    stream = llm.stream(PROMPTS[:2], GREEDY)
    first = next(stream)
    outputs = llm.generate(PROMPTS[2:], [GREEDY, SEEDED])
    assert outputs[0].token_ids == alone[2, "greedy"]
    assert outputs[1].token_ids == alone[3, "seeded"]
    events = [first, *stream]
    got = _tokens(events)
    assert list(got.values()) == [alone[0, "greedy"], alone[1, "greedy"]]
    assert sum(e.finished for e in events) == 2
    _idle(llm)


def test_two_streams_advanced_alternately(llm: LLM, alone) -> None:
    a = llm.stream(PROMPTS[0], GREEDY)
    b = llm.stream(PROMPTS[1], SEEDED)
    got: dict[str, list[int]] = {"a": [], "b": []}
    live = {"a": a, "b": b}
    while live:
        for name in list(live):
            event = next(live[name], None)
            if event is None:
                del live[name]
            else:
                got[name] += event.token_ids
    assert got == {"a": alone[0, "greedy"], "b": alone[1, "seeded"]}
    _idle(llm)


def test_resuming_a_stream_whose_request_was_aborted(llm: LLM, alone, gate: Gate) -> None:
    """The issue's failure: another call ends a stream's request while the stream is
    suspended. Now the stream ends that request with "abort" and finishes the other one."""
    stream = llm.stream(PROMPTS[:2], LONG)
    gate.allow(1)  # the prefill of both
    first = next(stream)
    llm.abort(first.request_id)  # applied before the next step or the one after
    gate.allow(1000)
    events = [first, *stream]
    outputs = {e.request_id: e.output for e in events}
    assert sum(e.finished for e in events) == 2
    for out in outputs.values():
        ref = alone[PROMPTS.index(out.prompt_token_ids), "long"]
        if out.request_id == first.request_id:
            assert out.finish_reason == "abort"
            assert 1 <= len(out.token_ids) <= 2 and out.token_ids == ref[:len(out.token_ids)]
        else:
            assert out.finish_reason == "length" and out.token_ids == ref
    # Later calls work: nothing is left half-done in the scheduler.
    assert llm.generate(PROMPTS[0], GREEDY)[0].token_ids == alone[0, "greedy"]
    _idle(llm)


def test_generate_from_eight_threads(llm: LLM, alone) -> None:
    # Distinct prompts, equal prompts (greedy and seeded alike) and a multi-prompt call.
    jobs = [([PROMPTS[i % 4]], [GREEDY if i % 2 == 0 else SEEDED]) for i in range(6)]
    jobs += [([PROMPTS[0], PROMPTS[0]], [SEEDED, SEEDED]), (PROMPTS, [GREEDY] * 4)]
    start = threading.Barrier(len(jobs))

    def run(job: tuple[list[list[int]], list[SamplingParams]]) -> list[list[int]]:
        start.wait(WAIT_S)
        return [o.token_ids for o in llm.generate(*job)]

    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = [pool.submit(run, job) for job in jobs]
        results = [f.result(timeout=WAIT_S) for f in futures]
    for (prompts, params), got in zip(jobs, results):
        want = [alone[PROMPTS.index(p), "greedy" if sp is GREEDY else "seeded"]
                for p, sp in zip(prompts, params)]
        assert got == want
    _idle(llm)


def test_async_streams_and_request_streams(llm: LLM, alone) -> None:
    """The server's way in: ``engine.submit`` and ``async for`` from one asyncio loop."""
    engine = llm.engine

    async def read(i: int, params: SamplingParams) -> list[int]:
        stream = engine.submit(PROMPTS[i], params)
        tokens = [t async for e in stream for t in e.token_ids]
        assert stream.output.token_ids == tokens and stream.output.finish_reason == "length"
        return tokens

    async def main() -> list[list[int]]:
        return await asyncio.wait_for(asyncio.gather(
            read(0, GREEDY), read(1, SEEDED), read(2, GREEDY), read(0, GREEDY)), WAIT_S)

    got = asyncio.run(main())
    assert got == [alone[0, "greedy"], alone[1, "seeded"], alone[2, "greedy"],
                   alone[0, "greedy"]]
    # Blocking iteration of a RequestStream.
    stream = engine.submit(PROMPTS[3], SEEDED, request_id="mine")
    assert stream.request_id == "mine"
    assert [t for e in stream for t in e.token_ids] == alone[3, "seeded"]
    _idle(llm)


# ------------------------------------------------------------------------------ submission checks
def test_submit_refuses_before_queueing(llm: LLM, gate: Gate) -> None:
    engine = llm.engine
    held = engine.submit(PROMPTS[0], GREEDY, request_id="dup")  # kept waiting by the gate
    with pytest.raises(ValueError, match=r"request id\(s\) \['dup'\] are already in use"):
        engine.submit(PROMPTS[1], GREEDY, request_id="dup")
    with pytest.raises(ValueError, match="'nope' is not loaded"):
        engine.submit(PROMPTS[1], SamplingParams(max_tokens=2, lora="nope"))
    with pytest.raises(RequestTooLongError, match="max_model_len 64"):
        engine.submit(list(range(1, 60)), GREEDY)
    with pytest.raises(RequestTooLongError):  # one refused prompt refuses the whole batch
        llm.generate([PROMPTS[1], list(range(1, 60))], GREEDY)
    assert llm.stats().waiting == 1  # only the held request
    gate.allow(1000)
    assert [t for e in held for t in e.token_ids] and held.output.finish_reason == "length"
    _idle(llm)


# ------------------------------------------------------------------------------ dropped streams
def test_dropped_streams_abort_their_requests(llm: LLM, gate: Gate) -> None:
    before = llm.stats().finished.get("abort", 0)
    stream = llm.stream(PROMPTS[:2], LONG)
    gate.allow(1)
    next(stream)
    del stream  # the generator is closed: both requests are aborted
    request_stream = llm.engine.submit(PROMPTS[2], LONG)
    del request_stream  # garbage-collected unread
    gate.allow(1000)
    _idle(llm)
    assert llm.stats().finished["abort"] == before + 3


# ------------------------------------------------------------------------------ failures
def test_a_failing_step_fails_only_its_requests(llama_dir: Path) -> None:
    """One request runs at a time (``max_num_seqs=1``): a step that fails ends the running
    request with the error; the waiting one, and every later call, get their exact tokens."""
    llm = _llm(llama_dir, max_num_seqs=1)
    ref = [o.token_ids for o in llm.generate(PROMPTS[:2], GREEDY)]
    execute = llm.engine.runner.execute
    calls = []

    def failing(out: Any) -> Any:
        calls.append(out)
        if len(calls) == 3:
            raise RuntimeError("injected step failure")
        return execute(out)

    llm.engine.runner.execute = failing
    first = llm.engine.submit(PROMPTS[0], GREEDY)
    second = llm.engine.submit(PROMPTS[1], GREEDY)
    with pytest.raises(RuntimeError, match="injected step failure"):
        list(first)
    assert first.output.finish_reason == "abort" and len(first.output.token_ids) == 2
    assert [t for e in second for t in e.token_ids] == ref[1]
    assert [o.token_ids for o in llm.generate(PROMPTS[:2], GREEDY)] == ref
    assert llm.engine.thread.is_alive()
    _idle(llm)
    llm.close()


# ------------------------------------------------------------------------------ releasing memory
def test_close_fails_pending_streams_and_drops_the_kv_cache(llama_dir: Path, no_gc) -> None:
    llm = _llm(llama_dir)
    gate = Gate(llm)
    caches = [weakref.ref(t) for pair in llm.model.kv_caches for t in pair]
    assert caches
    stream = llm.engine.submit(PROMPTS[0], LONG)
    gate.allow(1)
    events = iter(stream)
    assert next(events).token_ids
    assert llm.engine.close(timeout=0) is False  # the loop waits in a step: it ends after it
    gate.allow(1000)
    with pytest.raises(EngineClosedError, match="closed before the request finished"):
        list(events)
    llm.close()
    assert not llm.engine.thread.is_alive()
    assert [r for r in caches if r() is not None] == []
    with pytest.raises(EngineClosedError):
        llm.generate(PROMPTS[0], GREEDY)
    llm.close()  # idempotent


def test_dropping_the_llm_stops_its_thread_and_frees_the_cache(llama_dir: Path, no_gc) -> None:
    llm = _llm(llama_dir)
    assert llm.generate(PROMPTS[0], GREEDY)[0].token_ids
    thread = llm.engine.thread
    assert thread is not None and thread.is_alive()
    caches = [weakref.ref(t) for pair in llm.model.kv_caches for t in pair]
    alive = weakref.ref(llm)
    del llm
    assert alive() is None  # no reference cycle holds the LLM
    assert not thread.is_alive()
    assert [r for r in caches if r() is not None] == []
