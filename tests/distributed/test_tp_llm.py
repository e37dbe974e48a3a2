"""Tensor parallelism through the ``LLM`` API under torchrun (``llm_worker.py``, 2 gloo ranks on
CPU, bounded by a timeout that kills the whole job), compared with a single process here.

Greedy tokens equal world size 1's on both ranks; only rank 0 samples (random draws agree on
both ranks) and returns logprobs; a prompt rejected on rank 0 alone, different prompts or
different settings raise on every rank, so does a sampling failure on rank 0 mid-generation,
after which the ranks still generate in step; rank 1 follows rank 0's engine (the server's way).

Greedy parity holds although world size 2 sums the row-parallel halves in another order: fp32
logits differ by ~1e-7 (see test_tp_gloo.py), far below the top-1 gaps of these random models.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.distributed.launch import run_torchrun
from tests.distributed.llm_worker import (
    ABORTED_TOKENS,
    LLM_OPTIONS,
    MAX_TOKENS,
    PROMPT_LISTS,
    PROMPTS,
    SAMPLED_TOKENS,
    SAMPLER_FAILURE,
)

WORKER = Path(__file__).resolve().with_name("llm_worker.py")
LAUNCH_TIMEOUT_S = 120.0  # a launch takes 10-20 s on 2 CPU cores; a hang fails here instead


def _single_process(model_dir: Path, prompts, max_tokens: int, **options):
    from tgraph.runtime.llm import LLM
    from tgraph.runtime.sampling_params import SamplingParams

    llm = LLM(model_dir, **{**LLM_OPTIONS, **options})
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return llm.generate(list(prompts), params)


@pytest.fixture(scope="module")
def llm_reports(tp_ids_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("tp_llm")
    launch = run_torchrun([str(WORKER), "--model", str(tp_ids_model_dir), "--out", str(out)],
                          LAUNCH_TIMEOUT_S)
    assert launch.rc == 0, f"the LLM launch failed:\n{launch.output[-6000:]}"
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_llm_greedy_matches_world_size_1(tp_ids_model_dir: Path, llm_reports: list[dict]) -> None:
    ref = _single_process(tp_ids_model_dir, PROMPT_LISTS, MAX_TOKENS, graph="static")
    for r, report in enumerate(llm_reports):
        assert (report["rank"], report["world_size"], report["backend"]) == (r, 2, "gloo")
        assert report["greedy"] == [o.token_ids for o in ref], f"rank {r}"
        assert all(len(t) == MAX_TOKENS for t in report["greedy"])


def test_llm_only_rank0_samples(llm_reports: list[dict]) -> None:
    rank0, rank1 = llm_reports
    # Unseeded draws at temperature 1.5 over 768 tokens: rank 1 drawing its own tokens would
    # agree with rank 0's for all 36 by chance with negligible probability.
    assert rank0["sampled"] == rank1["sampled"]
    assert [len(t) for t in rank0["sampled"]] == [SAMPLED_TOKENS] * len(PROMPTS)
    assert rank0["sampled"] != rank0["greedy"]
    # Logprobs are computed where the sampling happens.
    assert rank0["logprobs"] == [True] * len(PROMPTS)
    assert rank1["logprobs"] == [False] * len(PROMPTS)


def test_llm_request_rejected_on_one_rank_raises_on_every_rank(llm_reports: list[dict]) -> None:
    rank0, rank1 = (r["bad_prompt_error"] for r in llm_reports)
    assert rank0[0] == rank1[0] == "RequestTooLongError"
    assert "max_model_len" in rank0[1]
    assert rank1[1].startswith("rank 0 rejected the request(s) with RequestTooLongError: ")
    assert rank0[1] in rank1[1]


def test_llm_different_prompts_refused(llm_reports: list[dict]) -> None:
    for report in llm_reports:
        kind, message = report["different_prompts_error"]
        assert kind == "ConfigError"
        assert "ranks [1] submitted other prompts or sampling parameters than rank 0" in message


def test_llm_different_settings_refused(llm_reports: list[dict]) -> None:
    for report in llm_reports:
        kind, message = report["different_settings_error"]
        assert kind == "ConfigError"
        assert "the configuration differs between ranks" in message
        assert "llm.cache.num_blocks (rank 0: 32, rank 1: 33)" in message


def test_llm_sampling_failure_on_rank0_raises_on_every_rank(llm_reports: list[dict]) -> None:
    rank0, rank1 = (r["sampler_error"] for r in llm_reports)
    assert rank0 == ["RuntimeError", SAMPLER_FAILURE]
    assert rank1[0] == "RankFailedError" and "rank 0 failed while sampling" in rank1[1]


def test_llm_ranks_stay_in_step_after_errors(llm_reports: list[dict]) -> None:
    for report in llm_reports:
        assert report["greedy_after_errors"] == report["greedy"]


def test_rank1_follows_rank0s_engine(llm_reports: list[dict]) -> None:
    """Rank 0 leads (submits, aborts one request, closes); rank 1 ran the same steps: the
    greedy tokens are world size 1's, and both ranks end with the same finished requests and
    every block free, rank 1 once rank 0's close ended its ``follow()``."""
    rank0, rank1 = llm_reports
    assert rank0["lead_greedy"] == rank0["greedy"]
    reason, tokens = rank0["lead_aborted"]
    assert reason == "abort" and tokens < ABORTED_TOKENS
    finished, running, waiting, used = rank0["lead_stats"]
    assert (running, waiting, used) == (0, 0, 0)
    assert finished["abort"] >= 1 and finished["length"] >= len(PROMPTS)
    assert rank1["lead_stats"] == rank0["lead_stats"]




def test_llm_joins_with_its_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """The device, timeout and ``llm.engine.capture_collectives`` reach the process group."""
    from tgraph.config import load_settings
    from tgraph.nn import distributed
    from tgraph.runtime import llm as llm_module

    calls = []
    monkeypatch.setattr(distributed, "init_process_group",
                        lambda device, **kw: calls.append((device, kw)) or "info")
    settings = load_settings(overrides=["llm.engine.capture_collectives=false",
                                        "llm.model.device=cpu"])
    monkeypatch.setattr(distributed, "launched_world_size", lambda: 1)
    assert llm_module._join_tensor_parallel(settings, 7.0) == (None, False) and not calls
    monkeypatch.setattr(distributed, "launched_world_size", lambda: 2)
    assert llm_module._join_tensor_parallel(settings, 7.0) == ("info", True)
    assert calls == [("cpu", {"timeout": 7.0, "capture_collectives": False})]
    llm_module._join_tensor_parallel(load_settings(), None)
    assert calls[-1] == ("auto", {"timeout": distributed.DEFAULT_TIMEOUT,
                                  "capture_collectives": True})
