"""One rank of the LoRA-under-tensor-parallelism test; ``test_tp_lora.py`` launches it with
torchrun.

For every ``--model NAME=DIR`` and graph mode, each rank builds ``LLM(DIR, single_lora=dom,
loras={qv, mlp})`` (which joins the gloo group from torchrun's environment), generates greedily
for prompts that mix requests with and without a per-request adapter, switches the single
adapter to ``dom2`` and generates again, and records in ``OUT/rank<r>.json`` the tokens and the
engines built before and after the switch.
"""
from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torch.distributed.elastic.multiprocessing.errors import record

PROMPTS = [[1, 5, 9, 22, 7, 3, 100], [3, 4], [17, 150, 8, 8, 191, 0, 42], [121, 7]]
PICKS: list[str | None] = ["qv", None, "mlp", None]
MULTI = ("qv", "mlp")
MAX_TOKENS = 4
LLM_OPTIONS: dict[str, Any] = {"device": "cpu", "max_model_len": 64, "num_blocks": 48,
                               "block_size": 4}


def generate(llm: Any) -> list[list[int]]:
    from tgraph.runtime.sampling_params import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, lora=p)
              for p in PICKS]
    return [out.token_ids for out in llm.generate(PROMPTS, params)]


def run(model: str, adapters: Path, mode: str, timeout: float) -> dict[str, Any]:
    """Tokens with ``dom`` then ``dom2`` as the single adapter, and the engines built.

    ``mode``: the graph mode (``static`` / ``eager``), the single adapter recorded in the
    engines; with ``+merged`` it is merged into the weights instead (``llm.lora.merge_single``).
    """
    from tgraph.runtime.llm import LLM

    graph, _, merged = mode.partition("+")
    llm = LLM(model, graph=graph, dist_timeout=timeout, single_lora=adapters / "dom",
              loras={n: adapters / n for n in MULTI}, **LLM_OPTIONS,
              **{"llm.lora.merge_single": merged == "merged"})
    report: dict[str, Any] = {"rank": llm.rank, "world_size": llm.world_size,
                              "dom": generate(llm)}
    built = sorted(str(key) for key in llm.model.engines)
    llm.set_single_lora(adapters / "dom2")
    report["dom2"] = generate(llm)
    report["engines"] = [built, sorted(str(key) for key in llm.model.engines)]
    report["sliced_steps"] = llm.runner.vocab_parallel_steps
    llm.close()
    return report


@record
def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", action="append", required=True, metavar="NAME=DIR")
    parser.add_argument("--adapters", required=True, type=Path, metavar="DIR",
                        help="holds the PEFT adapters dom, dom2, qv and mlp of every model, "
                             "one sub-directory per model NAME")
    parser.add_argument("--modes", default="static,eager")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--timeout", type=float, default=60.0)
    args = parser.parse_args(argv)

    from tgraph.nn import distributed

    # One process group for every LLM of the run (each LLM then leaves it alone at close).
    rank = distributed.init_process_group("cpu", timeout=args.timeout).rank
    results: dict[str, Any] = {}
    for item in args.model:
        name, _, path = item.partition("=")
        for mode in args.modes.split(","):
            results[f"{name}/{mode}"] = run(path, args.adapters / name, mode, args.timeout)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{rank}.json").write_text(json.dumps(results))
    distributed.destroy_process_group()


if __name__ == "__main__":
    main()
