"""Checkpoints shared by the runtime tensor-parallel tests (built once per session)."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tgraph.testing import make_tiny_text_model


@pytest.fixture(scope="session")
def tp_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama with the demo tokenizer (heads, KV heads, MLP and vocab split 2 ways)."""
    return make_tiny_text_model(tmp_path_factory.mktemp("tp-llama"), seed=3)


@pytest.fixture(scope="session")
def tp_ids_model_dir(tp_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same checkpoint without tokenizer files: prompts are token ids, and the ranks skip
    importing transformers (most of a launch's time on 2 cores)."""
    path = tmp_path_factory.mktemp("tp-llama-ids")
    for f in tp_model_dir.iterdir():
        if f.name == "config.json" or f.suffix == ".safetensors":
            shutil.copy(f, path / f.name)
    return path
