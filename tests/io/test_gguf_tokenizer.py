"""A GGUF file's tokenizer from the cache (tgraph/io/gguf_tokenizer.py) against the one
transformers builds from the file: the same ids for text with and without special tokens, the same
decoded text, chat template and special tokens."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from gguf import GGMLQuantizationType as Q

from tests.io.test_gguf import VOCAB, demo_vocab, write_gguf
from tgraph.io import gguf_tokenizer
from tgraph.io.checkpoint import load_tokenizer
from tgraph.io.gguf_tokenizer import tokenizer_cache_entry
from tgraph.testing import random_hf_model

TEXTS = ["Hello world!", "  leading spaces\n\nand blank lines\t tabs", "émojis 🤖 and 中文",
         "### user\nhi\n### assistant\n", ""]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
DEFAULT_ROOT = gguf_tokenizer.cache_root  # taken at collection, before the conftest moves it


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    vocab = demo_vocab(tmp_path_factory.mktemp("vocab"))
    hf = random_hf_model("qwen2", vocab_size=VOCAB, bos_token_id=vocab["bos"],
                         eos_token_id=vocab["eos"])
    return write_gguf(tmp_path_factory.mktemp("model") / "tiny.gguf", hf, vocab,
                      lambda n, s: Q.F32)


@pytest.fixture()
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The cache's default place (below ``$TGRAPH_CACHE_DIR``), which the suite's conftest moves
    to a session directory, in a directory of this test's."""
    monkeypatch.setenv("TGRAPH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(gguf_tokenizer, "cache_root", DEFAULT_ROOT)
    return tmp_path / "cache"


def _same(a: Any, b: Any) -> None:
    for text in TEXTS:
        for special in (True, False):
            ids = a(text, add_special_tokens=special)["input_ids"]
            assert ids == b(text, add_special_tokens=special)["input_ids"], (text, special)
            assert a.decode(ids) == b.decode(ids)
    chat = dict(add_generation_prompt=True, tokenize=False)
    assert a.apply_chat_template(MESSAGES, **chat) == b.apply_chat_template(MESSAGES, **chat)
    assert (a.bos_token_id, a.eos_token_id, a.all_special_ids) == \
        (b.bos_token_id, b.eos_token_id, b.all_special_ids)


def test_the_cached_tokenizer_is_the_one_transformers_built(gguf_file: Path, cache: Path,
                                                            monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    from transformers import AutoTokenizer

    built = load_tokenizer(gguf_file)
    entry = tokenizer_cache_entry(gguf_file)
    assert entry.parent.parent == cache and (entry / "tokenizer.json").is_file()
    assert not [p for p in entry.parent.iterdir() if p.name.startswith(".build-")]
    calls = []
    original = AutoTokenizer.from_pretrained

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs.get("gguf_file"))
        return original(*args, **kwargs)

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", spy)
    cached = load_tokenizer(gguf_file)
    assert calls == [None]  # read from the entry, the GGUF not parsed again
    _same(built, cached)


def test_a_damaged_entry_is_rebuilt_and_a_changed_file_gets_a_new_one(
        gguf_file: Path, cache: Path) -> None:
    built = load_tokenizer(gguf_file)
    entry = tokenizer_cache_entry(gguf_file)
    (entry / "tokenizer.json").write_text("{not json")
    _same(built, load_tokenizer(gguf_file))
    assert (entry / "tokenizer.json").read_text().startswith("{")
    assert (entry / "tokenizer.json").stat().st_size > 1000
    stat = gguf_file.stat()
    os.utime(gguf_file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert tokenizer_cache_entry(gguf_file) != entry


def test_an_unwritable_cache_still_gives_the_tokenizer(gguf_file: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setattr(gguf_tokenizer, "cache_root", lambda: blocker / "x")  # mkdir fails
    tokenizer = load_tokenizer(gguf_file)
    assert tokenizer("hi")["input_ids"]
    assert blocker.is_file()

