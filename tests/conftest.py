"""Test set-up shared by the whole suite.

Without CUDA, Triton kernels run through Triton's interpreter on CPU tensors. The variable must be
set before any ``triton.jit`` decoration runs, so it is set here, before test modules import
kernels.
"""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

HAS_CUDA = torch.cuda.is_available()


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
