"""Shared fixtures of the server tests."""
from __future__ import annotations

from pathlib import Path

import pytest

from tgraph.testing import make_tiny_hf_model

DEMO_VOCAB = 768  # the demo tokenizer's vocabulary


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama with the demo tokenizer (its vocabulary), saved as HF saves it."""
    from tgraph.runtime.demo_tokenizer import build_demo_tokenizer

    path = tmp_path_factory.mktemp("serve-model")
    tok = build_demo_tokenizer(path / "tok")
    tok.save_pretrained(path)
    make_tiny_hf_model("llama", path, seed=1, vocab_size=DEMO_VOCAB,
                       bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    return path
