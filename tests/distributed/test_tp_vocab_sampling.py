"""Vocabulary-parallel sampling (``tgraph.runtime.vocab_parallel``): tensor-parallel ranks sample
from their slices of the logits, without the LM head's all-gather, and get the tokens the
sampler gets on whole rows.

In-process: the ranks are threads exchanging through a barrier (the sampler's ``all_gather``
seam), compared with :class:`Sampler` on whole rows: greedy, seeded and unseeded temperature
sampling, top-k / top-p / min-p and penalties, at 2 and 4 ranks, with logits full of ties (the
cross-rank argmax rule, and top-k ties a rank could not send).

Under torchrun (this file is also the worker): a tiny Llama (untied head) and Qwen2 (tied) at 2
gloo ranks through the ``LLM`` API, fp32: a batch mixing greedy, seeded temperature and seeded
top-k (+ top-p, min-p, penalties) requests gives the tokens of world size 1 and of the same run
with the all-gather path, and its decode steps ran the engine without the all-gather; a batch
with a logprobs request falls back to gathering and still gives the same tokens.
"""
from __future__ import annotations

import argparse
import datetime
import json
import shutil
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from tgraph.runtime.sampler import PenaltyHistory, Sampler
from tgraph.runtime.sampling_params import SamplingParams
from tgraph.runtime.vocab_parallel import VocabParallelSampler, pick_over_ranks
from tgraph.tuning import VocabParallelTuning

LAUNCH_TIMEOUT_S = 240.0  # two models, 4 LLMs per rank on 2 shared cores; a hang fails here
GROUP_TIMEOUT_S = 60.0


# ---- ranks as threads ------------------------------------------------------------------------

class ThreadRanks:
    """An all-gather among ``world_size`` threads (one per rank), in rank order."""

    def __init__(self, world_size: int) -> None:
        self.slots: list[torch.Tensor | None] = [None] * world_size
        self.barrier = threading.Barrier(world_size, timeout=30)

    def all_gather(self, rank: int):
        def gather(t: torch.Tensor) -> torch.Tensor:
            self.slots[rank] = t.clone()
            self.barrier.wait()
            out = torch.stack([s for s in self.slots])
            self.barrier.wait()  # every rank has read before the next exchange writes
            return out
        return gather


def sample_as_ranks(logits: torch.Tensor, params: Sequence[SamplingParams], steps: list[int],
                    outputs: list[list[int]], prompts: list[list[int]], world_size: int,
                    settings: VocabParallelTuning | None = None,
                    samplers: list[Sampler] | None = None) -> list[Any]:
    """Each rank's :meth:`VocabParallelSampler.sample` on its slice (a thread per rank); a
    rank's exception is returned in its place."""
    vocab = logits.shape[1]
    width = vocab // world_size
    ranks = ThreadRanks(world_size)
    samplers = samplers or [Sampler(seed=0) for _ in range(world_size)]

    def run(r: int) -> Any:
        vp = VocabParallelSampler(samplers[r], r, world_size, vocab,
                                  settings or VocabParallelTuning(), ranks.all_gather(r))
        try:
            return vp.sample(logits[:, r * width:(r + 1) * width], params, steps, outputs,
                             prompts)
        except Exception as err:
            return err

    with ThreadPoolExecutor(world_size) as pool:
        return list(pool.map(run, range(world_size)))


def whole_rows(logits: torch.Tensor, params: Sequence[SamplingParams], steps: list[int],
               outputs: list[list[int]], prompts: list[list[int]]) -> list[int]:
    history = PenaltyHistory.from_lists(outputs, prompts) \
        if any(p.has_penalties for p in params) else None
    return Sampler(seed=0).sample(logits, params, steps, history).token_ids.tolist()


MIXED = (
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.4),
    SamplingParams(temperature=0.8, seed=11),
    SamplingParams(temperature=1.3),  # unseeded: the ranks' samplers share seed 0
    SamplingParams(temperature=0.9, top_k=1, seed=5),
    SamplingParams(temperature=1.1, top_k=7, seed=6),
    SamplingParams(temperature=1.0, top_k=40, seed=7),
    SamplingParams(temperature=0.7, top_k=12, top_p=0.83, seed=8),
    SamplingParams(temperature=1.2, top_k=30, min_p=0.07, seed=9),
    SamplingParams(temperature=1.0, top_k=9, top_p=0.71, min_p=0.02, presence_penalty=0.6,
                   repetition_penalty=0.8, seed=10),
)

# Logits of 3 values: greedy rows tie across ranks, and the top-k rows' k-th value ties with
# tokens a rank kept back (each rank holds ~16 of the top value's ~32 copies, sends 5).
TIED = (
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.0, presence_penalty=0.5),
    SamplingParams(temperature=1.0, seed=3),
    SamplingParams(temperature=0.6, top_k=5, seed=4),
    SamplingParams(temperature=1.4, top_k=2, top_p=0.77, seed=5),
    SamplingParams(temperature=1.0, top_k=4, min_p=0.3),
)


def _histories(rows: int, vocab: int, gen: torch.Generator) -> tuple[list[list[int]], ...]:
    outputs = [torch.randint(0, vocab, (int(n),), generator=gen).tolist()
               for n in torch.randint(0, 12, (rows,), generator=gen)]
    prompts = [torch.randint(0, vocab, (5,), generator=gen).tolist() for _ in range(rows)]
    return outputs, prompts


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("ties", [False, True], ids=["continuous", "ties"])
def test_tokens_equal_the_whole_row_sampler(world_size: int, ties: bool) -> None:
    """Every rank returns the whole-row sampler's tokens, trial after trial (a fresh sampler per
    trial: the unseeded rows' draws are then the same on every rank and in the reference). With
    ``ties`` (:data:`TIED`) top-k rows tie with tokens kept back and resolve on gathered whole
    rows."""
    vocab, trials = 96, 12
    gen = torch.Generator().manual_seed(1 + world_size + 10 * ties)
    params = TIED if ties else MIXED
    rows = len(params)
    tie_rows = 0
    for trial in range(trials):
        if ties:
            logits = torch.randint(0, 3, (rows, vocab), generator=gen).float() * 0.75
        else:
            logits = torch.randn(rows, vocab, generator=gen) * 3
        outputs, prompts = _histories(rows, vocab, gen)
        steps = [trial + i for i in range(rows)]
        expected = whole_rows(logits, params, steps, outputs, prompts)
        results = sample_as_ranks(logits, params, steps, outputs, prompts, world_size)
        for r, res in enumerate(results):
            assert not isinstance(res, Exception), f"rank {r}: {res!r}"
            assert res.failed_ranks == []
            assert res.token_ids == expected, f"trial {trial}, rank {r}"
        assert len({tuple(res.tie_rows) for res in results}) == 1  # the ranks agree
        tie_rows += len(results[0].tie_rows)
    # The tie rule is exercised (and kept out of the continuous case).
    assert (tie_rows > 0) == ties


def test_argmax_ties_across_ranks_pick_the_lowest_index() -> None:
    """Greedy rows whose maximum appears in several slices take its first occurrence, as
    ``torch.argmax`` does on the whole row."""
    vocab, ws = 16, 4
    logits = torch.zeros(5, vocab)
    logits[0, [3, 9, 14]] = 2.0  # ranks 0, 2, 3 hold it
    logits[1, [13, 6]] = 1.0  # ranks 3 and 1
    logits[2, [15]] = 0.5  # the last rank only
    logits[3] = float("-inf")  # nothing but -inf: index 0
    logits[4, [8, 12, 11]] = 3.0  # ranks 2 and 2: within a slice, then across
    params = [SamplingParams(temperature=0.0)] * 5
    expected = logits.argmax(dim=-1).tolist()
    assert expected == [3, 6, 15, 0, 8]
    for res in sample_as_ranks(logits, params, [0] * 5, [[]] * 5, [[]] * 5, ws):
        assert res.token_ids == expected
    # The reduction itself: equal values go to the lowest rank.
    values = torch.tensor([[1.0, 2.0, 5.0], [1.0, 3.0, 5.0], [0.5, 3.0, 5.0]])
    ids = torch.tensor([[0, 1, 2], [10, 11, 12], [20, 21, 22]])
    assert pick_over_ranks(values, ids).tolist() == [0, 11, 2]


def test_which_batches_are_supported() -> None:
    """Only what needs tokens alone: no logprobs or logit bias, and top-p / min-p only on top
    of a top-k within the cap."""
    vp = VocabParallelSampler(Sampler(), 0, 2, 100, VocabParallelTuning(max_top_k=8,
                                                                        max_batch=3))
    ok = [SamplingParams(temperature=0.0, top_p=0.5), SamplingParams(top_k=8, top_p=0.9),
          SamplingParams(temperature=0.5, top_k=100, repetition_penalty=1.2)]
    assert vp.supports(ok)
    assert not vp.supports(ok + [SamplingParams()])  # more than max_batch rows
    for refused in (SamplingParams(temperature=0.0, logprobs=0), SamplingParams(top_p=0.9),
                    SamplingParams(min_p=0.1), SamplingParams(top_k=9),
                    SamplingParams(top_k=99, top_p=0.9), SamplingParams(logit_bias={3: 1.0}),
                    SamplingParams(temperature=0.0, allowed_token_ids=[1, 2])):
        assert not vp.supports([SamplingParams(), refused]), refused


def test_a_rank_that_fails_is_reported_by_the_others() -> None:
    """A rank whose own part raises still joins the exchange: it raises its error, the others
    learn which rank failed instead of waiting for it."""
    samplers = [Sampler(seed=0), Sampler(seed=0)]

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("injected")

    samplers[1].scale_logits = broken
    params = [SamplingParams(temperature=0.0), SamplingParams(top_k=3, seed=1)]
    rank0, rank1 = sample_as_ranks(torch.randn(2, 8), params, [0, 0], [[], []], [[], []], 2,
                                   samplers=samplers)
    assert isinstance(rank1, RuntimeError) and str(rank1) == "injected"
    assert rank0.failed_ranks == [1] and rank0.token_ids == []


# ---- under torchrun: models through the LLM API -------------------------------------------------

PROMPTS = ((1, 5, 9, 22, 7), (3, 4), (8,) * 10 + (9,), (2, 30, 31))
MAX_TOKENS = 8
LLM_OPTIONS: dict[str, Any] = {"device": "cpu", "max_model_len": 64, "num_blocks": 48,
                               "block_size": 4}
SLICED = "llm.engine.tuning.vocab_parallel.enabled"


def request_params(logprobs: bool) -> list[SamplingParams]:
    """Greedy, seeded temperature and seeded top-k (+ top-p, min-p, penalties) requests; with
    ``logprobs`` the greedy one asks for logprobs (the batch must gather)."""
    common = {"max_tokens": MAX_TOKENS, "ignore_eos": True}
    return [
        SamplingParams(temperature=0.0, logprobs=2 if logprobs else None, **common),
        SamplingParams(temperature=0.9, seed=21, **common),
        SamplingParams(temperature=1.0, top_k=5, seed=22, **common),
        SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, seed=23,
                       repetition_penalty=1.2, **common),
    ]


def _generate(llm: Any, logprobs: bool) -> list[list[int]]:
    return [o.token_ids for o in llm.generate([list(p) for p in PROMPTS],
                                              request_params(logprobs))]


def _gathers(engine: Any) -> int:
    return sum(n.op == "all_gather" for n in engine.net.nodes)


def worker(argv: Sequence[str] | None = None) -> None:
    """One rank: per model, an ``LLM`` sampling from slices and one gathering, each generating
    the mixed batch without and with a logprobs request."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--model", action="append", default=[], help="NAME=DIR")
    parser.add_argument("--device", default="cpu", help="cpu (gloo) or cuda (NCCL)")
    args = parser.parse_args(argv)

    from tgraph.nn import distributed
    from tgraph.runtime.llm import LLM

    # Joined here, so that no LLM owns (and closes) the group.
    info = distributed.init_process_group(args.device,
                                          timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    options = dict(LLM_OPTIONS, device=info.device.type)  # each rank: its LOCAL_RANK GPU
    report: dict[str, Any] = {"rank": info.rank, "world_size": info.world_size}
    for spec in args.model:
        name, model_dir = spec.split("=", 1)
        for label, sliced in (("sliced", True), ("gathered", False)):
            llm = LLM(model_dir, **options, **{SLICED: sliced})
            runner = llm.runner
            entry: dict[str, Any] = {"tokens": _generate(llm, logprobs=False)}
            entry["sliced_steps"] = runner.vocab_parallel_steps
            entry["logprobs_tokens"] = _generate(llm, logprobs=True)
            entry["sliced_steps_after_logprobs"] = runner.vocab_parallel_steps
            entry["engines"] = {f"{'prefill' if p else 'decode'}+{'+'.join(f) or 'base'}":
                                _gathers(e) for (p, f), e in llm.model.engines.items()}
            entry["captured"] = {f"decode+{'+'.join(f) or 'base'}": e.captured_signatures
                                 for (p, f), e in llm.model.engines.items() if not p}
            report[f"{name}_{label}"] = entry
            llm.close()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{info.rank}.json").write_text(json.dumps(report))
    distributed.destroy_process_group()


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Token-id checkpoints (no tokenizer: the ranks skip importing transformers): a Llama
    with an untied head and a Qwen2 with a tied one, vocabulary 192 (96 per rank)."""
    from tgraph.testing import make_tiny_hf_model

    root = tmp_path_factory.mktemp("tp_vocab")
    dirs = {"llama": make_tiny_hf_model("llama", root / "llama", seed=3,
                                        tie_word_embeddings=False),
            "qwen2": make_tiny_hf_model("qwen2", root / "qwen2", seed=4,
                                        tie_word_embeddings=True)}
    for path in dirs.values():
        for f in path.iterdir():
            if f.name != "config.json" and f.suffix != ".safetensors":
                f.unlink() if f.is_file() else shutil.rmtree(f)
    return dirs


def _launch(model_dirs: dict[str, Path], out: Path, device: str) -> list[dict]:
    from tests.distributed.launch import run_torchrun

    models = [a for name, path in model_dirs.items() for a in ("--model", f"{name}={path}")]
    launch = run_torchrun([__file__, "--out", str(out), "--device", device, *models],
                          LAUNCH_TIMEOUT_S)
    assert launch.rc == 0, f"the launch failed:\n{launch.output[-6000:]}"
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.fixture(scope="module")
def reports(model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return _launch(model_dirs, tmp_path_factory.mktemp("tp_vocab_out"), "cpu")


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_tp2_tokens_equal_world_size_1_and_the_gathered_path(
        name: str, model_dirs: dict[str, Path], reports: list[dict]) -> None:
    """Greedy and seeded tokens: world size 2 sampling from slices == world size 2 gathering ==
    world size 1, on both ranks; with a logprobs request in the batch too. fp32: the ranks'
    logits differ from world size 1's by ~1e-7 (test_tp_gloo.py), far below the score gaps
    that decide these tokens."""
    from tgraph.runtime.llm import LLM

    llm = LLM(model_dirs[name], **LLM_OPTIONS)
    expected, expected_lp = _generate(llm, logprobs=False), _generate(llm, logprobs=True)
    llm.close()
    assert expected_lp[1:] == expected[1:]  # the seeded requests do not depend on the batch
    for r, report in enumerate(reports):
        assert (report["rank"], report["world_size"]) == (r, 2)
        for label in ("sliced", "gathered"):
            entry = report[f"{name}_{label}"]
            assert entry["tokens"] == expected, f"rank {r}, {label}"
            assert entry["logprobs_tokens"] == expected_lp, f"rank {r}, {label}"


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_decode_steps_skip_the_logits_all_gather(name: str, reports: list[dict]) -> None:
    """The mixed batch's decode steps ran the engine without the all-gather (and sampled from
    the slices), the logprobs batch the gathering engine; with the setting off nothing did."""
    for report in reports:
        sliced, gathered = report[f"{name}_sliced"], report[f"{name}_gathered"]
        # Every decode step of the first batch (the first step is its prefill).
        assert sliced["sliced_steps"] == MAX_TOKENS - 1
        assert sliced["sliced_steps_after_logprobs"] == MAX_TOKENS - 1
        assert sliced["engines"] == {"prefill+base": 1, "decode+base": 1,
                                     "decode+vocab_parallel": 0}
        assert gathered["sliced_steps_after_logprobs"] == 0
        assert gathered["engines"] == {"prefill+base": 1, "decode+base": 1}


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_tp2_on_nccl_samples_from_captured_slices(model_dirs: dict[str, Path],
                                                  tmp_path: Path) -> None:
    """The same on 2 GPUs over NCCL, fp32, CUDA graphs: the engine without the all-gather is
    captured ahead of time with the base one (every bucket), its steps sample from the slices,
    and the tokens equal one GPU's (fp32: the ranks' logits differ by rounding far below the
    score gaps that decide these tokens)."""
    from tgraph.runtime.llm import LLM

    reports_gpu = _launch(model_dirs, tmp_path, "cuda")
    for name in model_dirs:
        llm = LLM(model_dirs[name], **dict(LLM_OPTIONS, device="cuda"))
        expected = _generate(llm, logprobs=False)
        llm.close()
        for r, report in enumerate(reports_gpu):
            sliced = report[f"{name}_sliced"]
            assert sliced["tokens"] == expected, f"rank {r} {name}"
            assert sliced["sliced_steps"] == MAX_TOKENS - 1
            captured = sliced["captured"]
            assert captured["decode+vocab_parallel"] == captured["decode+base"] > 0, captured


if __name__ == "__main__":
    from torch.distributed.elastic.multiprocessing.errors import record

    record(worker)()
