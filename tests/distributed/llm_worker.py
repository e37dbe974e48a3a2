"""One rank of the ``LLM``-under-torchrun test; ``test_tp_runtime.py`` launches it with torchrun.

Each rank builds ``LLM(model_dir)`` (which joins the gloo group from torchrun's environment) and
records, in ``OUT/rank<r>.json``: greedy and randomly sampled generations, whether logprobs came
back, what each rank raised when rank 0 alone was given a prompt that cannot fit, when the ranks
were given different prompts or different settings, and when rank 0's sampler failed in the
middle of a generation, and a greedy generation after those errors (the ranks must still be in
step). Last, rank 0 leads and rank 1 follows its engine (the server's way): rank 0 submits
requests, aborts one, and closes, which ends rank 1's ``follow()``.
"""
from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from torch.distributed.elastic.multiprocessing.errors import record

# Token ids: the test's checkpoint has no tokenizer (loading one imports transformers).
PROMPTS = ((1, 5, 9, 22, 7), (3, 4), (8,) * 10 + (9,))
PROMPT_LISTS = [list(p) for p in PROMPTS]
MAX_TOKENS = 6
SAMPLED_TOKENS = 12
SAMPLER_FAILURE = "injected sampler failure on rank 0"
ABORTED_TOKENS = 50
LLM_OPTIONS: dict[str, Any] = {"device": "cpu", "max_model_len": 64, "num_blocks": 32,
                               "block_size": 4}


def _error(fn: Callable[[], Any]) -> list[str] | None:
    """``[type name, message]`` of what ``fn`` raised, or ``None``."""
    try:
        fn()
    except Exception as err:
        return [type(err).__name__, str(err)]
    return None


@record
def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--graph", default="static")
    parser.add_argument("--timeout", type=float, default=60.0)
    args = parser.parse_args(argv)

    from tgraph.runtime.llm import LLM
    from tgraph.runtime.sampling_params import SamplingParams

    llm = LLM(args.model, graph=args.graph, dist_timeout=args.timeout, **LLM_OPTIONS)
    rank = llm.rank
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    report: dict[str, Any] = {"rank": rank, "world_size": llm.world_size,
                              "backend": llm.dist_info.backend if llm.dist_info else ""}
    outs = llm.generate(PROMPT_LISTS, greedy)
    report["greedy"] = [o.token_ids for o in outs]
    report["logprobs"] = [o.logprobs is not None for o in outs]
    # No seed: rank 1 would draw its own tokens if it sampled instead of receiving rank 0's.
    sampled = llm.generate(PROMPT_LISTS, SamplingParams(
        temperature=1.5, max_tokens=SAMPLED_TOKENS, ignore_eos=True))
    report["sampled"] = [o.token_ids for o in sampled]
    # 70 tokens cannot fit max_model_len 64: rejected on rank 0 only.
    bad = [1] * 70 if rank == 0 else [1, 2, 3]
    report["bad_prompt_error"] = _error(lambda: llm.generate([bad], greedy))
    report["different_prompts_error"] = _error(
        lambda: llm.generate([[1, 2, 3 + rank]], greedy))
    report["different_settings_error"] = _error(
        lambda: LLM(args.model, graph="eager", **{**LLM_OPTIONS, "num_blocks": 32 + rank}))
    # Rank 0's sampler fails in the middle of a generation: every rank must raise, not wait.
    sample = llm.runner.sampler.sample
    calls = []

    def failing_sample(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError(SAMPLER_FAILURE)
        return sample(*args, **kwargs)

    if rank == 0:
        llm.runner.sampler.sample = failing_sample
    report["sampler_error"] = _error(lambda: llm.generate(PROMPT_LISTS, greedy))
    llm.runner.sampler.sample = sample
    report["greedy_after_errors"] = [o.token_ids for o in llm.generate(PROMPT_LISTS, greedy)]
    # The server's way: rank 0 leads (takes the requests), rank 1 follows until rank 0 closes.
    if rank == 0:
        llm.engine.lead()
        streams = [llm.engine.submit(p, greedy) for p in PROMPT_LISTS]
        victim = llm.engine.submit(PROMPT_LISTS[0], SamplingParams(
            temperature=0.0, max_tokens=ABORTED_TOKENS, ignore_eos=True))
        llm.abort(victim.request_id)
        report["lead_greedy"] = [[t for e in s for t in e.token_ids] for s in streams]
        list(victim)
        report["lead_aborted"] = [victim.output.finish_reason, len(victim.output.token_ids)]
        llm.engine.call(lambda: None)  # the last step's stats are published
    else:
        llm.engine.follow()
    stats = llm.stats()
    report["lead_stats"] = [stats.finished, stats.running, stats.waiting, stats.kv_blocks_used]
    llm.close()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
