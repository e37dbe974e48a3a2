"""The tokenizer of a GGUF file: built by transformers from the file's metadata once, then read
back from a cache.

transformers rebuilds a GGUF's tokenizer by parsing the whole metadata through gguf-py, twice
(the config, then the vocabulary): ~6.6 s for SmolLM2's 49k tokens, most of a small model's
start-up. The tokenizer it builds is saved with ``save_pretrained`` (``tokenizer.json``, its
config and chat template: ~3.5 MB for SmolLM2) under
``$TGRAPH_CACHE_DIR/gguf-tokenizers/<key>``, the key a hash of the file's resolved path, size and
modification time and of the transformers version, and later loads read that (~0.3 s), which
encodes, decodes and renders chat templates as the tokenizer it was saved from
(tests/io/test_gguf_tokenizer.py). An entry is written whole (a temporary directory renamed into
place) or not at all; where the cache cannot be written the tokenizer is still returned.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from tgraph import envs
from tgraph.errors import WeightLoadError

__all__ = ["cache_root", "load_gguf_tokenizer", "tokenizer_cache_entry"]


def tokenizer_cache_entry(path: str | Path) -> Path:
    """Where the tokenizer of the GGUF file ``path`` is cached (whether or not it is yet)."""
    import transformers

    p = Path(path).resolve()
    stat = p.stat()
    key = f"{p}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}"
    return cache_root() / hashlib.sha256(key.encode()).hexdigest()[:32]


def cache_root() -> Path:
    """The directory of the cached tokenizers, ``$TGRAPH_CACHE_DIR/gguf-tokenizers``."""
    return envs.TGRAPH_CACHE_DIR / "gguf-tokenizers"


def load_gguf_tokenizer(path: str | Path) -> Any:
    """The transformers tokenizer of the GGUF file ``path`` (of a split model: its first part,
    which holds the vocabulary), from the cache when an entry exists.

    Raises:
        WeightLoadError: transformers cannot build a tokenizer from the file's metadata.
    """
    from transformers import AutoTokenizer

    p = Path(path)
    entry = tokenizer_cache_entry(p)
    if (entry / "tokenizer.json").is_file():
        try:
            return AutoTokenizer.from_pretrained(str(entry), trust_remote_code=False)
        except Exception:  # a damaged entry: rebuilt below
            shutil.rmtree(entry, ignore_errors=True)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name,
                                                  trust_remote_code=False)
    except Exception as err:  # a GGUF whose vocabulary transformers cannot rebuild
        raise WeightLoadError(f"cannot build the tokenizer of {p} from its GGUF metadata: "
                              f"{err}; pass the model's Hugging Face tokenizer instead "
                              "(LLM(..., tokenizer=DIR), or --tokenizer DIR)") from err
    _store(tokenizer, entry)
    return tokenizer


def _store(tokenizer: Any, entry: Path) -> None:
    """Save ``tokenizer`` as the cache ``entry``, whole or not at all."""
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=entry.parent, prefix=".build-") as tmp:
            draft = Path(tmp) / "tokenizer"
            tokenizer.save_pretrained(str(draft))
            os.replace(draft, entry)
    except OSError:  # a read-only or full cache, or another process's entry won the race
        pass
