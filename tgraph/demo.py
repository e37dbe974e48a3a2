"""``tgraph demo``: the whole pipeline on a machine with no model and no GPU.

It builds (once, in a cache directory) a small Llama-architecture model with random weights and a
locally trained byte-level tokenizer, runs the same prompts through Hugging Face transformers and
through tgraph with greedy decoding, and prints whether the tokens agree and the speed of each.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from tgraph import envs

DEMO_PROMPTS = [
    "The river began high in the mountains",
    "Graph capture makes inference",
    "Once upon a time, a small robot",
    "tgraph records every op into a network and",
]
_DEMO_VERSION = 1


def cache_root() -> Path:
    """The directory the demo caches its model in (``TGRAPH_CACHE_DIR``, see tgraph.envs)."""
    return envs.get("TGRAPH_CACHE_DIR")


def build_demo_model(directory: Path) -> Path:
    """Write the demo checkpoint and tokenizer to ``directory`` (reused when already there)."""
    stamp = directory / "tgraph_demo.json"
    if stamp.exists() and json.loads(stamp.read_text()).get("version") == _DEMO_VERSION:
        return directory
    from transformers import LlamaConfig, LlamaForCausalLM

    from tgraph.runtime.demo_tokenizer import build_demo_tokenizer

    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = build_demo_tokenizer(directory)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=256, intermediate_size=688, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(1234)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(directory, safe_serialization=True)
    stamp.write_text(json.dumps({"version": _DEMO_VERSION}))
    return directory


def _hf_greedy(model_dir: Path, prompts: list[list[int]], max_tokens: int
               ) -> tuple[list[list[int]], float]:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # ignore EOS, as the tgraph run does
    outputs, start = [], time.perf_counter()
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids])
            out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens,
                                 min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
            outputs.append(out[0, len(ids):].tolist())
    return outputs, time.perf_counter() - start


def run_demo(max_tokens: int = 24, graph: str = "static", device: str = "cpu",
             cache_dir: str | None = None) -> int:
    """Run the demo; returns 0 when tgraph's tokens equal Hugging Face's for every prompt."""
    from tgraph.runtime.llm import LLM
    from tgraph.runtime.sampling_params import SamplingParams

    directory = build_demo_model(Path(cache_dir) if cache_dir else cache_root() / "demo-llama")
    print(f"demo model: {directory} (Llama architecture, random weights, byte-level BPE)")
    start = time.perf_counter()
    llm = LLM(directory, graph=graph, device=device, max_model_len=256)
    setup = time.perf_counter() - start
    prompts = [llm.encode(p) for p in DEMO_PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    # Warm-up: first calls compile kernels (GPU) and build the engines; keep that out of tokens/s.
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))

    start = time.perf_counter()
    results = llm.generate(prompts, params)
    ours_s = time.perf_counter() - start
    theirs, hf_s = _hf_greedy(directory, prompts, max_tokens)

    agree = 0
    for text, result, ref in zip(DEMO_PROMPTS, results, theirs):
        same = result.token_ids == ref
        agree += same
        mark = "agree" if same else f"DIFFER at token {_first_diff(result.token_ids, ref)}"
        print(f"  [{mark}] {text!r} -> {result.text!r}")
    total = sum(len(r.token_ids) for r in results)
    engines = llm.model.engines
    decode = engines.get((False, ()))
    device = llm.model.llm_config.device
    print(f"tokens agree for {agree}/{len(prompts)} prompts (greedy, fp32, {device})")
    print(f"tgraph ({graph}): {total / ours_s:.1f} tokens/s, batched, continuous batching "
          f"(load + build {setup:.1f} s)")
    print(f"HF transformers eager: {total / hf_s:.1f} tokens/s, one prompt at a time")
    if decode is not None:
        s = decode.stats
        print(f"decode engine: {s.kernel_count} kernels ({s.node_count} nodes); passes: "
              + ", ".join(f"{r.name} {r.matches}" for r in s.passes if r.matches))
    return 0 if agree == len(prompts) else 1


def _first_diff(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))
