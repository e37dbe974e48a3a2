"""``tgraph bench cpu``: tokens/s of tgraph on the CPU against transformers eager, one run.

The model is SmolLM2-135M-Instruct's Q4_1 GGUF (:func:`tgraph.demo.fetch_smollm2`) when it can
be had, else the ``smollm2-135m`` preset shape with random weights (fp32 only). Systems:

- ``tgraph fp32``: the GGUF dequantized by transformers and saved as an fp32 checkpoint (the very
  weights transformers runs), static graphs on the CPU backend;
- ``tgraph quantized``: the GGUF itself, its weights kept quantized (packed CPU kernels);
- ``transformers fp32``: ``AutoModelForCausalLM`` on the same GGUF (dequantized to fp32), eager.

Each runs the chat prompts greedily, ``max_tokens`` new tokens each (EOS ignored), at every batch
(prompts per ``generate`` call), measured by :mod:`tgraph.runtime.speed`. Every system stays
loaded and each round measures every system at every batch in turn, so that a machine whose load
drifts (other work sharing its cores) weighs on all of them alike; a row reports the median of
its rounds. A tgraph system's tokens are compared with transformers' one prompt at a time (no
padding).
"""
from __future__ import annotations

import functools
import gc
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from tgraph.demo import CHAT_PROMPTS, ModelFetchError, cache_root, fetch_smollm2
from tgraph.runtime.llm import cpu_threads
from tgraph.runtime.speed import Speed, tgraph_speed, transformers_speed

__all__ = ["run_cpu_bench"]

RANDOM_PRESET = "smollm2-135m"
_STAMP = "tgraph_cpu_bench.json"


def _fp32_checkpoint(gguf: Path, cache_dir: Path) -> tuple[Path, Any]:
    """transformers' fp32 model of ``gguf`` and its checkpoint directory (written once)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                 dtype=torch.float32).eval()
    out = cache_dir / "cpu-bench" / f"{gguf.stem}-fp32"
    stamp = out / _STAMP
    source = {"size": gguf.stat().st_size, "mtime": gguf.stat().st_mtime}
    if not (stamp.is_file() and json.loads(stamp.read_text()) == source):
        from safetensors.torch import save_file

        out.mkdir(parents=True, exist_ok=True)
        config = model.config.to_dict()
        config.pop("quantization_config", None)  # the dequantized weights are plain fp32
        (out / "config.json").write_text(json.dumps(config, indent=1))
        tied = config.get("tie_word_embeddings", False)
        state = {k: v.contiguous() for k, v in model.state_dict().items()
                 if not (tied and k == "lm_head.weight")}  # a tied table stored once
        save_file(state, str(out / "model.safetensors"))
        AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(out)
        stamp.write_text(json.dumps(source))
    return out, model


def _random_checkpoint(cache_dir: Path) -> tuple[Path, Any]:
    """The preset shape with random weights (seeded), saved once."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tgraph.models.presets import preset

    config = preset(RANDOM_PRESET)
    config.pop("architectures")
    config.pop("model_type")
    config["torch_dtype"] = "float32"
    out = cache_dir / "cpu-bench" / f"{RANDOM_PRESET}-random"
    if (out / _STAMP).is_file():
        return out, LlamaForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**config)).eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    (out / _STAMP).write_text(json.dumps({"preset": RANDOM_PRESET}))
    return out, model


def _median(speeds: list[Speed]) -> Speed:
    return sorted(speeds, key=lambda sp: sp.seconds)[len(speeds) // 2]


def _row(system: str, speeds: list[Speed], reference: Speed | None) -> dict[str, Any]:
    """One system at one batch over its rounds: the median round's numbers."""
    speed = _median(speeds)
    row: dict[str, Any] = {"system": system, "batch": speed.batch, "tokens": speed.tokens,
                           "seconds": round(speed.seconds, 3),
                           "tokens_per_s": round(speed.tokens_per_second, 2)}
    if len(speeds) > 1:
        row["tokens_per_s_rounds"] = [round(sp.tokens_per_second, 2) for sp in speeds]
    if reference is not None:
        same = sum(a == b for a, b in zip(speed.token_ids, reference.token_ids))
        row["tokens_equal_transformers"] = f"{same}/{len(reference.token_ids)}"
    return row


def run_cpu_bench(gguf: str | os.PathLike[str] | None = None, batches: Sequence[int] = (1, 4),
                  max_tokens: int = 64, json_path: str | None = None,
                  cache_dir: str | os.PathLike[str] | None = None, random_model: bool = False,
                  threads: int | None = None, verbose: bool = True,
                  rounds: int = 3) -> dict[str, Any]:
    """Measure tgraph (fp32 and quantized) and transformers eager on the CPU.

    Args:
        gguf: a GGUF file (default: SmolLM2-135M-Instruct Q4_1, fetched once).
        batches: prompts per ``generate`` call, each measured.
        max_tokens: new tokens per prompt.
        json_path: where to write the results (also returned).
        cache_dir: the cache root (default: ``TGRAPH_CACHE_DIR``).
        random_model: use the preset shape with random weights, no GGUF.
        threads: torch threads (default: every core this process may use).
        verbose: print each result as it comes.
        rounds: measurements of every system at every batch, interleaved; rows report the
            median.
    Returns:
        ``{"model", "threads", "max_tokens", "rounds", "results": [...], "ratios": {...}}``.
    """
    from tgraph.runtime.llm import LLM

    root = Path(cache_dir) if cache_dir is not None else cache_root()
    torch.set_num_threads(cpu_threads(threads))
    path = Path(gguf) if gguf is not None else None
    if path is None and not random_model:
        try:
            path = fetch_smollm2(root)
        except ModelFetchError as err:
            print(f"the GGUF is not available ({err}); random weights of {RANDOM_PRESET}")
    if path is not None:
        fp32_dir, hf = _fp32_checkpoint(path, root)
        model_name = path.name
    else:
        fp32_dir, hf = _random_checkpoint(root)
        model_name = f"{RANDOM_PRESET} (random weights)"
    sources: list[tuple[str, Path]] = [("tgraph fp32", fp32_dir)]
    if path is not None:
        sources.append(("tgraph quantized", path))
    report: dict[str, Any] = {"model": model_name, "threads": torch.get_num_threads(),
                              "max_tokens": max_tokens, "batches": list(batches),
                              "rounds": rounds, "results": []}

    def add(row: dict[str, Any]) -> None:
        report["results"].append(row)
        if verbose:
            print(json.dumps(row), flush=True)

    llms = {system: LLM(where, device="cpu", dtype="float32", max_model_len=512,
                        cpu_threads=torch.get_num_threads()) for system, where in sources}
    first = next(iter(llms.values()))
    prompts = [first.encode(p, chat=True) for p in CHAT_PROMPTS] if path is not None \
        else [[(7 * i + 13 * j) % 4000 + 100 for j in range(24)] for i in range(4)]
    measures: dict[str, Any] = {
        system: functools.partial(tgraph_speed, llm) for system, llm in llms.items()}
    measures["transformers fp32"] = functools.partial(transformers_speed, hf)
    speeds: dict[tuple[str, int], list[Speed]] = {}
    try:
        for _ in range(rounds):
            for system, measure in measures.items():
                for b in batches:
                    speeds.setdefault((system, b), []).append(measure(prompts, b, max_tokens))
    finally:
        for llm in llms.values():
            llm.close()
        llms.clear()
        gc.collect()
    reference = speeds[("transformers fp32", 1)][0] if 1 in batches else None
    median = {key: _median(runs).tokens_per_second for key, runs in speeds.items()}
    for system in measures:
        for b in batches:
            add(_row(system, speeds[system, b],
                     None if system.startswith("transformers") else reference))
    ratios = {}
    for system, _ in sources:
        for b in batches:
            for ref_b in sorted({1, b}):
                ref = median.get(("transformers fp32", ref_b))
                if ref is not None and ref > 0:
                    ratios[f"{system} b{b} / transformers b{ref_b}"] = round(
                        median[system, b] / ref, 2)
    report["ratios"] = ratios
    if verbose:
        print(json.dumps({"ratios": ratios}, indent=1))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(report, f, indent=1)
    return report
