"""End-to-end tests of :class:`tgraph.runtime.llm.LLM`: load a tiny random Hugging Face checkpoint,
generate through the scheduler, runner and sampler, and compare with Hugging Face ``generate``.

Everything runs in fp32 on CPU, where greedy decoding must be token-exact with HF: the tiny model's
logits agree with HF to ~1e-6 relative (see tests/models), far below the gap between its top two
logits, so any token difference is a bug, not rounding.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tgraph.errors import RequestTooLongError
from tgraph.runtime.llm import LLM, RequestOutput
from tgraph.runtime.sampling_params import SamplingParams
from tgraph.testing import make_tiny_hf_model, make_tiny_text_model

# Prompts of different lengths (1 to 9 tokens) spanning several 4-token cache blocks.
PROMPTS: list[list[int]] = [
    [1, 5, 9, 22, 7],
    [3, 4],
    [17, 150, 8, 8, 8, 8, 191, 0, 42],
    [121],
]
MAX_TOKENS = 8
BLOCK_SIZE = 4
MAX_MODEL_LEN = 64
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

# The demo tokenizer has 768 tokens: the text model needs a vocabulary that covers it.
TEXT_PROMPTS = ["The river began high in the mountains", "A computer does not",
                "Engineers measure"]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama checkpoint without a tokenizer (prompts are token ids)."""
    return make_tiny_hf_model("llama", tmp_path_factory.mktemp("llm-llama"), seed=0)


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama checkpoint with the demo tokenizer saved next to it."""
    return make_tiny_text_model(tmp_path_factory.mktemp("llm-text"), seed=1)


def _llm(path: Path, graph: str = "static", **kwargs: Any) -> LLM:
    kwargs = {"max_model_len": MAX_MODEL_LEN, "block_size": BLOCK_SIZE, "num_blocks": 64,
              **kwargs}
    return LLM(path, device="cpu", dtype="float32", graph=graph, **kwargs)


@pytest.fixture(scope="module")
def text_llm(text_dir: Path) -> LLM:
    return _llm(text_dir, graph="eager")


@pytest.fixture(scope="module")
def hf_reference(llama_dir: Path) -> list[list[int]]:
    """HF ``generate`` greedy tokens of every prompt, one prompt at a time (no padding)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # generate exactly MAX_TOKENS, like ignore_eos
    out = []
    with torch.no_grad():
        for prompt in PROMPTS:
            x = torch.tensor([prompt])
            ids = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_TOKENS,
                              min_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0)
            out.append(ids[0, len(prompt):].tolist())
    return out


# ------------------------------------------------------------------------------ greedy parity
@pytest.mark.parametrize("graph", ["static", "eager"])
def test_greedy_generate_matches_hf(llama_dir: Path, hf_reference: list[list[int]],
                                    graph: str) -> None:
    llm = _llm(llama_dir, graph=graph)
    outputs = llm.generate(PROMPTS, GREEDY)
    assert [o.prompt_token_ids for o in outputs] == PROMPTS  # in prompt order
    for i, (out, ref) in enumerate(zip(outputs, hf_reference)):
        assert len(ref) == MAX_TOKENS
        assert out.token_ids == ref, f"prompt {i} ({graph}): tgraph {out.token_ids} vs HF {ref}"
        assert out.finish_reason == "length"
        assert out.text == ""  # no tokenizer in this directory
    # The four prompts must not all generate the same tokens, or a batching mix-up (every row
    # reading row 0's cache) could pass.
    assert len({tuple(r) for r in hf_reference}) == len(PROMPTS)


def test_llm_rejects_unknown_option(llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="unknown LLM option 'num_block'"):
        LLM(llama_dir, device="cpu", num_block=6)


def test_generate_rejects_bad_prompts(llama_dir: Path) -> None:
    llm = _llm(llama_dir, graph="eager")
    with pytest.raises(ValueError, match="token ids"):
        llm.generate([[]], GREEDY)
    with pytest.raises(ValueError, match="2 SamplingParams for 1 prompts"):
        llm.generate([PROMPTS[0]], [GREEDY, GREEDY])
    # A text prompt needs a tokenizer, which this directory lacks.
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate("hello", GREEDY)


# ------------------------------------------------------------------------------ scheduling
def test_preemption_keeps_outputs(llama_dir: Path) -> None:
    """A 6-block cache (24 tokens) cannot hold the four requests at once (they need 3 blocks
    each by the end), so requests are preempted and recomputed; each output must equal the
    output of that prompt run alone, greedy and seeded sampling alike."""
    params = [GREEDY, SamplingParams(temperature=0.8, seed=7, max_tokens=MAX_TOKENS,
                                     ignore_eos=True), GREEDY,
              SamplingParams(temperature=0.8, seed=11, max_tokens=MAX_TOKENS, ignore_eos=True)]
    alone_llm = _llm(llama_dir, graph="eager")
    alone = [alone_llm.generate([p], sp)[0].token_ids for p, sp in zip(PROMPTS, params)]

    llm = _llm(llama_dir, graph="eager", num_blocks=6)
    assert llm.capacity_tokens == 24
    outputs = llm.generate(PROMPTS, params)
    stats = llm.stats()
    assert stats.preemptions > 0
    for i, (out, ref) in enumerate(zip(outputs, alone)):
        assert out.token_ids == ref, f"prompt {i}: batched {out.token_ids} vs alone {ref}"
        assert out.finish_reason == "length"
    # Nothing left, every block returned (the stats count a request's last event).
    assert (stats.running, stats.waiting, stats.kv_blocks_used) == (0, 0, 0)
    assert stats.finished == {"length": len(PROMPTS)}


def test_request_too_long(llama_dir: Path) -> None:
    llm = _llm(llama_dir, graph="eager", num_blocks=6, max_model_len=32)
    # 20 + 8 = 28 <= max_model_len 32, but 27 KV tokens > the 24-token cache.
    too_big_for_cache = list(range(1, 21))
    # 30 + 8 = 38 > max_model_len 32.
    too_long = list(range(1, 31))
    with pytest.raises(RequestTooLongError, match="cache holds 24 tokens"):
        llm.generate([PROMPTS[0], too_big_for_cache], GREEDY)
    with pytest.raises(RequestTooLongError, match="max_model_len 32"):
        llm.generate([too_long, PROMPTS[1]], GREEDY)
    # Nothing of the refused calls was queued; the next call works.
    assert (llm.stats().waiting, llm.stats().finished) == (0, {})
    ref = _llm(llama_dir, graph="eager").generate(PROMPTS[:2], GREEDY)
    outputs = llm.generate(PROMPTS[:2], GREEDY)
    assert [o.token_ids for o in outputs] == [r.token_ids for r in ref]


# ------------------------------------------------------------------------------ text, stream
def _full(llm: LLM, max_tokens: int = 12) -> list[RequestOutput]:
    return llm.generate(TEXT_PROMPTS, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                     ignore_eos=True))


def test_stream_concatenates_to_generate(text_llm: LLM) -> None:
    full = _full(text_llm)
    events = list(text_llm.stream(TEXT_PROMPTS, SamplingParams(temperature=0.0, max_tokens=12,
                                                               ignore_eos=True)))
    by_id: dict[str, list] = {}
    for e in events:
        by_id.setdefault(e.request_id, []).append(e)
    assert len(by_id) == len(TEXT_PROMPTS)
    for evs, ref in zip(sorted(by_id.values(), key=lambda v: int(v[0].request_id.split("-")[1])),
                        full):
        # one event per generated token, finished only on the last one
        assert len(evs) == 12
        assert [e.finished for e in evs] == [False] * 11 + [True]
        assert [t for e in evs for t in e.token_ids] == ref.token_ids
        assert "".join(e.text for e in evs) == ref.text
        assert ref.text and ref.text == text_llm.tokenizer.decode(ref.token_ids,
                                                                  skip_special_tokens=True)
    # Continuous batching: the requests' events interleave instead of running one after another.
    order = [e.request_id for e in events]
    first_done = min(len(order) - 1 - order[::-1].index(r) for r in by_id)
    assert len(set(order[:first_done + 1])) == len(TEXT_PROMPTS)


def test_stream_single_text_prompt_is_incremental(text_llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    ref = text_llm.generate(TEXT_PROMPTS[0], params)[0]
    stream = text_llm.stream(TEXT_PROMPTS[0], params)
    first = next(stream)  # the first token arrives before the rest are generated
    assert not first.finished and len(first.output.token_ids) == 1
    rest = list(stream)
    assert rest[-1].finished
    assert first.text + "".join(e.text for e in rest) == ref.text


def test_stop_string_truncates_text(text_llm: LLM) -> None:
    full = _full(text_llm)[0]
    text = full.text
    # A stop string taken from the middle of the greedy output: the text must end before its
    # first occurrence.
    start = next(i for i in range(3, len(text) - 3) if text[i:i + 3].strip() == text[i:i + 3])
    stop = text[start:start + 3]
    cut = text.index(stop)
    out = text_llm.generate(TEXT_PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=12,
                                                            ignore_eos=True, stop=[stop]))[0]
    assert out.text == text[:cut]
    assert out.finish_reason == "stop"
    assert out.token_ids == full.token_ids[:len(out.token_ids)]
    assert len(out.token_ids) < len(full.token_ids)


def test_max_tokens_finish_reason(text_llm: LLM) -> None:
    outputs = text_llm.generate(TEXT_PROMPTS, SamplingParams(temperature=0.0, max_tokens=3,
                                                             ignore_eos=True))
    for out in outputs:
        assert out.finish_reason == "length"
        assert len(out.token_ids) == 3


def test_seeded_sampling_is_reproducible(text_llm: LLM) -> None:
    def sample(seed: int) -> list[list[int]]:
        params = SamplingParams(temperature=0.8, seed=seed, max_tokens=10, ignore_eos=True)
        return [o.token_ids for o in text_llm.generate(TEXT_PROMPTS, params)]

    first, second = sample(1234), sample(1234)
    assert first == second
    # The draws are random: another seed, or greedy, gives other tokens.
    assert sample(99) != first
    assert [o.token_ids for o in _full(text_llm, 10)] != first


def test_text_prompt_chat_template(text_llm: LLM) -> None:
    ids = text_llm.encode("hello", chat=True)
    plain = text_llm.encode("hello")
    assert len(ids) > len(plain)
    assert text_llm.tokenizer.decode(ids).endswith("### assistant\n")


def test_progress_bar_counts_generated_tokens(llama_dir, capsys):
    llm = _llm(llama_dir)
    outputs = llm.generate([[1, 2, 3], [4, 5]], SamplingParams(temperature=0.0, max_tokens=5,
                                                               ignore_eos=True), progress=True)
    err = capsys.readouterr().err
    assert "generating" in err and "10/10" in err
    assert [len(o.token_ids) for o in outputs] == [5, 5]


def test_tuning_settings_reach_every_engine(llama_dir: Path) -> None:
    from tgraph.config import load_settings

    base = load_settings(overrides=[
        'llm.engine.tuning.decode_attention.override={"block_n": 32, "num_warps": 4, '
        '"num_stages": 2}'])
    llm = _llm(llama_dir, config=base, **{"llm.engine.tuning.gemv.tma_weights": False})
    tuning = llm.model.llm_config.tuning
    # Both the base Settings (an object-valued leaf) and the dotted override arrive.
    assert tuning.gemv.tma_weights is False
    assert tuning.decode_attention.override.block_n == 32
    llm.generate([PROMPTS[0]], GREEDY)
    assert llm.model.engines and all(e.tuning is tuning for e in llm.model.engines.values())
