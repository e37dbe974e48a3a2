"""Test set-up shared by the whole suite.

Without CUDA, Triton kernels run through Triton's interpreter on CPU tensors. The variable must be
set before any ``triton.jit`` decoration runs, so it is set here, before test modules import
kernels.
"""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from hypothesis import settings

# Property tests are deterministic by default: a failure recurs on every run and prints its
# @reproduce_failure blob; `pytest --hypothesis-profile=explore` draws fresh examples.
settings.register_profile("ci", derandomize=True, print_blob=True, database=None)
settings.register_profile("explore", print_blob=True)
settings.load_profile("ci")

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

HAS_CUDA = torch.cuda.is_available()

# gguf is a dependency of tgraph, but a GPU machine without installs may lack it: the modules that
# read GGUF files are then left out, and the report header says so.
GGUF_MODULES = ["io/test_gguf.py", "io/test_gguf_tokenizer.py", "models/test_smollm2.py",
                "runtime/test_demo.py"]
HAS_GGUF = importlib.util.find_spec("gguf") is not None
collect_ignore = [] if HAS_GGUF else GGUF_MODULES


def pytest_report_header(config):
    if not HAS_GGUF:
        return f"gguf is not installed: not collected: {', '.join(GGUF_MODULES)}"
    return None


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if ("gpu" in item.keywords or "slow_gpu" in item.keywords) and not HAS_CUDA:
            item.add_marker(skip_gpu)


def pytest_runtest_logreport(report):
    # TGRAPH_TEST_LOG=FILE appends each test phase's duration as it ends (survives a killed run).
    path = os.environ.get("TGRAPH_TEST_LOG")
    if path and (report.when != "teardown" or report.outcome != "passed"):
        with open(path, "a", encoding="utf-8") as log:
            log.write(f"{report.duration:9.3f} {report.when:8s} {report.outcome:8s} "
                      f"{report.nodeid}\n")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True, scope="session")
def _gguf_tokenizers_cached_for_the_session(tmp_path_factory):
    """The tokenizers of the GGUF files tests write are cached in a temporary directory: those
    files' paths change every run, so their entries would pile up in the user's cache."""
    if not HAS_GGUF:
        yield
        return
    from tgraph.io import gguf_tokenizer

    root = tmp_path_factory.mktemp("gguf-tokenizers")
    original = gguf_tokenizer.cache_root
    gguf_tokenizer.cache_root = lambda: root
    yield
    gguf_tokenizer.cache_root = original
