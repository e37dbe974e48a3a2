"""The demo tokenizer: exact UTF-8 round trip, special tokens, chat template, deterministic cache.
"""
from __future__ import annotations

import filecmp
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from tgraph.runtime.demo_tokenizer import (
    BOS_TOKEN,
    CHAT_TEMPLATE,
    EOS_TOKEN,
    VOCAB_SIZE,
    build_demo_tokenizer,
    train_demo_tokenizer,
)

MODULE_PATH = Path(__file__).resolve().parents[2] / "tgraph" / "runtime" / "demo_tokenizer.py"


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("demo_tokenizer")


@pytest.fixture(scope="module")
def tok(cache):
    return build_demo_tokenizer(cache)


def test_vocabulary_and_special_tokens(tok):
    assert 512 <= len(tok) <= 1024 and len(tok) == VOCAB_SIZE
    assert tok.bos_token == BOS_TOKEN and tok.eos_token == EOS_TOKEN
    assert tok.convert_tokens_to_ids(BOS_TOKEN) == tok.bos_token_id
    assert tok.convert_tokens_to_ids(EOS_TOKEN) == tok.eos_token_id
    assert tok.pad_token_id == tok.eos_token_id
    # Special tokens are atomic, not spelled out of byte pieces.
    assert tok.encode(f"{EOS_TOKEN}", add_special_tokens=False) == [tok.eos_token_id]
    assert tok.encode(f"a{BOS_TOKEN}b", add_special_tokens=False)[1:-1] == [tok.bos_token_id]
    # The training actually merged: common English words are single tokens.
    assert len(tok.tokenize(" the")) == 1 and len(tok.tokenize("The capital of France")) <= 6


def test_encode_prepends_bos_and_decode_skips_it(tok):
    ids = tok.encode("Hello world")
    assert ids[0] == tok.bos_token_id and tok.bos_token_id not in ids[1:]
    assert tok.decode(ids, skip_special_tokens=True) == "Hello world"
    assert tok.decode(ids) == f"{BOS_TOKEN}Hello world"


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=60))
@example(text="naïve café, Ærøskøbing, Ελληνικά, 日本語, 🎉👩‍👩‍👧 and \u0301")
@example(text="  leading and trailing spaces\t\n\r ")
@example(text="\x00\x7f\uffff\U0010ffff")
def test_round_trip_is_exact(tok, text):
    # Text that spells a special token encodes to that token (see
    # test_vocabulary_and_special_tokens), which skip_special_tokens then drops: the round trip
    # holds for all other text.
    assume(BOS_TOKEN not in text and EOS_TOKEN not in text)
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert tok.decode(tok.encode(text), skip_special_tokens=True) == text


def test_chat_template(tok):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What is the capital of France?"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (f"{BOS_TOKEN}### system\nBe brief.\n"
                    "### user\nWhat is the capital of France?\n### assistant\n")
    ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                  return_dict=False)
    # Exactly one BOS, from the template (tokenizing the template adds no second one).
    assert ids == tok.encode(text, add_special_tokens=False)
    assert ids.count(tok.bos_token_id) == 1 and ids[0] == tok.bos_token_id
    no_prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert not no_prompt.endswith("### assistant\n")
    assert tok.chat_template == CHAT_TEMPLATE


def test_cache_is_reused(cache, tok):
    tokenizer_json = cache / "tokenizer.json"
    before = tokenizer_json.stat().st_mtime_ns
    again = build_demo_tokenizer(cache)
    assert tokenizer_json.stat().st_mtime_ns == before, "a valid cache must not be rewritten"
    assert again.encode("reuse me") == tok.encode("reuse me")
    # The directory is an ordinary HF tokenizer directory.
    auto = AutoTokenizer.from_pretrained(str(cache))
    assert auto.encode("Hello 😀") == tok.encode("Hello 😀")


def test_stale_cache_is_rebuilt(tmp_path):
    build_demo_tokenizer(tmp_path)
    (tmp_path / "tgraph_demo_tokenizer.json").write_text('{"version": -1}')
    (tmp_path / "tokenizer.json").write_text("garbage")
    rebuilt = build_demo_tokenizer(tmp_path)
    assert len(rebuilt) == VOCAB_SIZE
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".build-")]


def test_build_is_deterministic(cache, tmp_path):
    # A second build writes byte-identical files ...
    build_demo_tokenizer(tmp_path)
    names = sorted(os.listdir(cache))
    assert names == sorted(os.listdir(tmp_path))
    match, mismatch, errors = filecmp.cmpfiles(cache, tmp_path, names, shallow=False)
    assert not mismatch and not errors, mismatch + errors


def test_training_is_deterministic_across_processes():
    # ... and so does another interpreter with another hash seed (the BPE trainer's tie-breaking
    # must not depend on hash order). Only the training runs there, and the module is loaded
    # from its file so the (slow) tgraph package import is skipped.
    env = dict(os.environ, PYTHONHASHSEED="12345")
    code = ("import importlib.util, sys; "
            f"spec = importlib.util.spec_from_file_location('demo_tok', {str(MODULE_PATH)!r}); "
            "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); "
            "sys.stdout.write(m.train_demo_tokenizer().to_str())")
    other = subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120,
                           capture_output=True, text=True).stdout
    assert other == train_demo_tokenizer().to_str()
