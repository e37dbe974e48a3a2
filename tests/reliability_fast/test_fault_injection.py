"""Fault injection: an exception inside a kernel or the sampler, in the middle of a batch.

The failed step must end every request of its batch with the error (their tokens so far are
exact), free their KV blocks, and leave the :class:`LLM` serving exact tokens afterwards. Greedy
and seeded sampling depend only on a request's own tokens, seed and step, so the first call of
the same LLM (before any fault) is an exact oracle for every later call.

The fault is injected where the engine gets its kernels, before the LLM builds its engines: the
torch references that eager plans launch (the plan binds ``get_op(op).reference`` when it is
lowered), the CPU backend's kernels that static plans launch (``select_kernel``, also bound at
lowering), and :meth:`Sampler.process_logits`.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tgraph.engine import engine as engine_module
from tgraph.engine import plan
from tgraph.ir.ops import get_op
from tgraph.kernels.backends import select_kernel
from tgraph.runtime.llm import LLM
from tgraph.runtime.sampler import Sampler
from tgraph.runtime.sampling_params import SamplingParams
from tgraph.testing import make_tiny_hf_model

PROMPTS: list[list[int]] = [[1, 5, 9, 22, 7], [3, 4], [17, 150, 8, 8, 8, 8, 191, 0, 42], [121]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, seed=5, max_tokens=8, ignore_eos=True)
PARAMS = [GREEDY, SEEDED, GREEDY, SEEDED]
WAIT_S = 60.0


class InjectedFault(RuntimeError):
    """The error a faulty kernel raises."""


class Fault:
    """Counts the calls of the functions it wraps and raises on call number ``at`` (if set)."""

    def __init__(self) -> None:
        self.calls = 0
        self.at: int | None = None

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        name = getattr(fn, "__name__", None) or getattr(fn, "func", fn).__name__  # a partial

        def count() -> None:
            self.calls += 1
            if self.calls == self.at:
                raise InjectedFault(f"injected fault in {name} at call {self.at}")

        @functools.wraps(fn)
        def faulty(*args: Any, **kwargs: Any) -> Any:
            count()
            return fn(*args, **kwargs)

        bind = getattr(fn, "bind", None)
        if bind is not None:
            # The CPU engine's step programs bind a kernel once and call its thunk per step.
            def faulty_bind(*args: Any, **kwargs: Any) -> Callable[[], Any]:
                thunk = bind(*args, **kwargs)

                def run() -> Any:
                    count()
                    return thunk()

                return run

            faulty.bind = faulty_bind
        return faulty


def _inject(monkeypatch: pytest.MonkeyPatch, where: str, fault: Fault) -> None:
    if where == "sampler":
        monkeypatch.setattr(Sampler, "process_logits", fault.wrap(Sampler.process_logits))
        return

    # Every op whose name says it is a linear (or an attention), fused or not: the static graph
    # runs fused ops (norm_linear, rope_cache_attention, ...), the eager graph the plain ones.
    def faulty_get_op(name: str) -> Any:
        op = get_op(name)
        if where in name:
            return dataclasses.replace(op, reference=fault.wrap(op.reference))
        return op

    monkeypatch.setattr(plan, "get_op", faulty_get_op)

    def faulty_select(node: Any, *args: Any, **kwargs: Any) -> Any:
        kernel, name = select_kernel(node, *args, **kwargs)
        return (fault.wrap(kernel) if where in node.op else kernel), name

    monkeypatch.setattr(engine_module, "select_kernel", faulty_select)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_hf_model("llama", tmp_path_factory.mktemp("faults"), seed=0)


def _idle(llm: LLM) -> None:
    llm.engine.call(lambda: None, timeout=WAIT_S)  # runs after what the loop had queued
    stats = llm.stats()
    assert (stats.running, stats.waiting, stats.kv_blocks_used) == (0, 0, 0), stats


@pytest.mark.parametrize("graph", ["static", "eager"])
@pytest.mark.parametrize("where", ["linear", "attention", "sampler"])
def test_a_fault_mid_batch_fails_the_batch_and_the_next_call_is_exact(
        llama_dir: Path, monkeypatch: pytest.MonkeyPatch, where: str, graph: str) -> None:
    fault = Fault()
    _inject(monkeypatch, where, fault)
    llm = LLM(llama_dir, device="cpu", dtype="float32", graph=graph, max_model_len=64,
              block_size=4, num_blocks=64)
    try:
        fault.calls = 0  # count the calls of one generate (construction may warm up)
        ref = [o.token_ids for o in llm.generate(PROMPTS, PARAMS)]
        assert fault.calls > 0, f"no {where} call went through the patched function"
        assert all(len(r) == GREEDY.max_tokens for r in ref)
        # Halfway through the same work: every request is running, in decode.
        fault.at, fault.calls = fault.calls // 2, 0
        streams = [llm.engine.submit(p, s) for p, s in zip(PROMPTS, PARAMS)]
        for i, stream in enumerate(streams):
            with pytest.raises(InjectedFault, match="injected fault"):
                list(stream)
            out = stream.output
            assert out.finish_reason == "abort", f"request {i}: {out.finish_reason}"
            # Tokens before the fault are exact, and the fault came mid-generation.
            assert 0 < len(out.token_ids) < len(ref[i]), f"request {i}: {out.token_ids}"
            assert out.token_ids == ref[i][: len(out.token_ids)], f"request {i}"
        assert fault.calls == fault.at, "the fault fired once, and nothing ran after it"
        _idle(llm)
        assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS)] == ref
        assert llm.engine.thread.is_alive()
        _idle(llm)
    finally:
        llm.close()
