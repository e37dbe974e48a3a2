"""Bad inputs to the Python API are refused by name, before any work starts: each raises a
:mod:`tgraph.errors` class (which is also the builtin a caller would catch) whose message names
the field, the value and what is expected."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from tgraph.errors import (
    ConfigError,
    InvalidRequestError,
    InvalidRequestTypeError,
    TGraphError,
)
from tgraph.runtime.llm import LLM
from tgraph.runtime.request import InvalidRequestError as ReExported
from tgraph.runtime.sampling_params import SamplingParams
from tgraph.testing import make_tiny_hf_model

OPTIONS: dict[str, Any] = dict(device="cpu", dtype="float32", graph="eager", max_model_len=64,
                               block_size=4, num_blocks=64)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_hf_model("llama", tmp_path_factory.mktemp("bad-inputs"), seed=0)


@pytest.fixture(scope="module")
def llm(llama_dir: Path):
    model = LLM(llama_dir, **OPTIONS)
    yield model
    model.close()


@pytest.fixture
def no_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if LLM gets as far as reading weights."""
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("weights were loaded before the bad input was refused")

    monkeypatch.setattr("tgraph.runtime.llm.load_model", refuse)


# ---- SamplingParams --------------------------------------------------------------------------
@pytest.mark.parametrize(("kwargs", "builtin", "words"), [
    ({"stop": 5}, TypeError, ["SamplingParams.stop", "5", "list of strings"]),
    ({"stop_token_ids": 5}, TypeError, ["SamplingParams.stop_token_ids", "5", "token ids"]),
    ({"stop": {"a": 1}}, TypeError, ["SamplingParams.stop", "dict"]),
    ({"max_tokens": 0}, ValueError, ["SamplingParams.max_tokens", "0", ">= 1"]),
    ({"temperature": float("nan")}, ValueError, ["SamplingParams.temperature", "nan", "finite"]),
    ({"top_p": 0}, ValueError, ["SamplingParams.top_p", "0", "(0, 1]"]),
    ({"seed": 2**64}, ValueError, ["SamplingParams.seed", str(2**64), "[0, 2**64)"]),
    ({"seed": -1}, ValueError, ["SamplingParams.seed", "-1", "[0, 2**64)"]),
])
def test_sampling_params_refusals(kwargs: dict[str, Any], builtin: type[Exception],
                                  words: list[str]) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)
    assert isinstance(info.value, builtin) and isinstance(info.value, TGraphError)
    for word in words:
        assert word in str(info.value)


def test_sampling_params_boundaries_still_accepted() -> None:
    SamplingParams(top_p=1.0, min_p=0.0, seed=2**64 - 1, stop="x", stop_token_ids=(1, 2))
    SamplingParams(top_p=1e-9, min_p=1.0, seed=0, temperature=0)
    assert ReExported is InvalidRequestError  # the runtime's old import path keeps working


# ---- prompts and params --------------------------------------------------------------------
@pytest.mark.parametrize(("prompts", "params", "words"), [
    (torch.tensor([1, 2, 3]), None, ["prompts must be", "Tensor", ".tolist()"]),
    (None, None, ["prompts must be", "NoneType"]),
    (5, None, ["prompts must be", "int 5"]),
    ([[1, 2], [3, "x"]], None, ["must hold ints", "str 'x'"]),
    ("hi", {"temperature": 0}, ["params must be SamplingParams", "dict", "temperature"]),
    ([1, 2], {"temperature": 0}, ["params must be SamplingParams", "dict"]),
    ([[1, 2], [3]], [SamplingParams(), "greedy"], ["must hold SamplingParams", "greedy"]),
])
def test_generate_refuses_bad_types(llm: LLM, prompts: Any, params: Any,
                                    words: list[str]) -> None:
    with pytest.raises(InvalidRequestTypeError) as info:
        llm.generate(prompts, params)
    assert isinstance(info.value, TypeError)
    for word in words:
        assert word in str(info.value)


@pytest.mark.parametrize("bad", [192, 10**6, 2**31, 2**40])
def test_prompt_token_ids_beyond_vocab(llm: LLM, bad: int) -> None:
    vocab = llm.model.config.vocab_size
    assert vocab == 192
    with pytest.raises(InvalidRequestError,
                       match=rf"prompt_token_ids holds token id\(s\) \[{bad}\]; expected ids "
                             rf"below the vocabulary size {vocab}"):
        llm.generate([[1, 2], [1, bad]], SamplingParams(max_tokens=2))
    # Nothing was queued: the next request runs normally.
    out = llm.generate([1, vocab - 1], SamplingParams(max_tokens=2, temperature=0))
    assert len(out[0].token_ids) == 2


def test_unknown_lora_refused_at_submission(llm: LLM) -> None:
    with pytest.raises(InvalidRequestError, match=r"SamplingParams.lora: LoRA adapter 'nope' "
                                                  r"is not loaded; expected one of \[\]"):
        llm.generate([1, 2], SamplingParams(lora="nope"))
    with pytest.raises(InvalidRequestError, match="'nope' is not loaded"):
        llm.generate([1, 2], lora="nope")


def test_stop_strings_need_a_tokenizer(llm: LLM) -> None:
    assert llm.tokenizer is None
    with pytest.raises(InvalidRequestError,
                       match=r"SamplingParams.stop=\['x'\] needs a tokenizer"):
        llm.generate([1, 2], SamplingParams(stop=["x"]))


# ---- LLM options, paths and tokenizers -------------------------------------------------------
@pytest.mark.parametrize("value", [0, -3, True, 2.5, "64"])
def test_max_model_len_refused(llama_dir: Path, no_weights: None, value: Any) -> None:
    with pytest.raises(ConfigError, match=rf"max_model_len must be None .* or an int >= 1, "
                                          rf"got {value!r}"):
        LLM(llama_dir, **{**OPTIONS, "max_model_len": value})


def test_unknown_disabled_pass_refused(llama_dir: Path, no_weights: None) -> None:
    with pytest.raises(ConfigError, match=r"llm.engine.disabled_passes names unknown pass\(es\) "
                                          r"\['Nope'\]; expected names from the pipeline: .*"
                                          r"SwiGLU"):
        LLM(llama_dir, **OPTIONS, disabled_passes=["SwiGLU", "Nope"])


@pytest.mark.parametrize("name", ["model.safetensors", "config.json", "missing"])
def test_model_path_must_be_a_directory(llama_dir: Path, no_weights: None, name: str) -> None:
    with pytest.raises(ConfigError, match=rf"model path '.*{name}' .*expected a model "
                                          r"directory \(config.json \+ safetensors\) or a "
                                          r"\.gguf file"):
        LLM(llama_dir / name, **OPTIONS)


def test_remote_code_tokenizer_refused_before_weights(llama_dir: Path, tmp_path: Path,
                                                      no_weights: None) -> None:
    from tgraph.runtime.demo_tokenizer import build_demo_tokenizer

    path = tmp_path / "remote"
    shutil.copytree(llama_dir, path)
    build_demo_tokenizer(tmp_path / "tok").save_pretrained(path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["auto_map"] = {"AutoTokenizer": ["tokenization_custom.CustomTokenizer", None]}
    config["tokenizer_class"] = "CustomTokenizer"
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"cannot load the tokenizer of .*remote.*custom code"):
        LLM(path, **OPTIONS)
