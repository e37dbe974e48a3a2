"""Shared fixtures of the server tests."""
from __future__ import annotations

from pathlib import Path

import pytest

from tgraph.testing import make_tiny_text_model


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama with the demo tokenizer (its vocabulary), saved as HF saves it."""
    return make_tiny_text_model(tmp_path_factory.mktemp("serve-model"), seed=1)
