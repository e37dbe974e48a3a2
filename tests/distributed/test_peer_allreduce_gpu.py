"""The peer-memory all-reduce on 2 GPUs (peer_allreduce_worker.py under torchrun): one-shot,
two-shot and the polled one-shot, plain and with the fused add + RMSNorm, eager and from CUDA
graph replays with new inputs, against NCCL (+ the add_rms_norm kernel).

Bounds: with 2 ranks NCCL's bf16/fp16 sum is one rounded addition, which is what the kernel
computes (an fp32 sum rounded once), so results must be bit-identical (max diff 0), and every
rank must hold the same bits (the residual streams of TP ranks must never drift apart).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.distributed.launch import run_torchrun

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]

WORKER = Path(__file__).resolve().with_name("peer_allreduce_worker.py")


def test_peer_all_reduce_equals_nccl_on_two_gpus(tmp_path):
    out = tmp_path / "found.json"
    job = run_torchrun([str(WORKER), str(out)], timeout=600, nproc=2,
                       TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NCCL_NVLS_ENABLE="0")
    assert job.rc == 0, job.output[-6000:]
    found = json.loads(out.read_text())
    assert found["peer"], "peer memory was not set up between the 2 GPUs"
    # 5 shapes x (one-shot, two-shot) x (plain, norm), and polled where the rows fit its slots.
    assert len(found["cases"]) >= 24, found["cases"]
    assert any(case["path"] == "polled" for case in found["cases"])
    for case in found["cases"]:
        assert case["identical"], case
        assert case["max_diff"] == 0.0, case
