"""The peer-memory all-reduce kernel (tgraph.kernels.triton.peer_allreduce) across processes.

On CPU each rank is a spawned process running the kernel under the Triton interpreter; its
"peer memory" is one shared-memory buffer per rank, mapped into every process (each process puts
its own addresses of the buffers in ``bases``, as peer mappings on GPUs do). The interpreter runs
a grid's programs in order, and every rank's program ``p`` waits only for the peers' program
``p``, so the ranks advance in lockstep through the same flags and data halves as on GPUs.

Checked: one-shot, two-shot and the polled one-shot, plain and with the fused residual add +
RMSNorm, several calls in a row (alternating data halves, counters; the polled buffers cycling
and cleared), more rows than programs; every rank's result is
bit-identical and equals the sum in rank order (fp32: exact; fp16: the sum rounded once, then
the norm exactly as the ``add_rms_norm`` kernel computes it). fp16, not bf16: the interpreter
rounds fp32 to bf16 unlike torch (and GPUs), fp16 like them.
"""
from __future__ import annotations

import os
import queue
import time

import pytest
import torch
import torch.multiprocessing as mp

from tgraph.kernels.triton.norms import add_rms_norm
from tgraph.kernels.triton.peer_allreduce import (
    PeerBuffers,
    fill_polled,
    fits,
    fits_polled,
    peer_all_reduce,
)

PROGRAMS = 3
MESSAGE_BYTES = 8 * 96 * 4
EPS = 1e-6
# (rows, cols, dtype, path, norm) per call, run in this order by every rank; the polled calls
# cycle through their three buffers more than once, with different rows (what each clears).
CALLS = [
    (1, 64, torch.float32, "one-shot", False),
    (5, 96, torch.float32, "two-shot", False),
    (4, 64, torch.float16, "polled", True),
    (4, 64, torch.float16, "one-shot", True),
    (7, 40, torch.float16, "two-shot", True),
    (2, 33, torch.float32, "two-shot", True),
    (7, 96, torch.float16, "polled", False),
    (1, 64, torch.float16, "polled", True),
    (5, 33, torch.float16, "polled", False),
    (3, 96, torch.float16, "polled", True),
]


def _inputs(call: int, rank: int, rows: int, cols: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(1000 * call + rank)
    x = torch.randn(rows, cols, generator=g).to(dtype)
    g = torch.Generator().manual_seed(1000 * call + 999)
    residual = torch.randn(rows, cols, generator=g).to(dtype)
    weight = (1 + 0.1 * torch.randn(cols, generator=g)).to(dtype)
    return x, residual, weight


def _rank(rank: int, world_size: int, buffers: list[torch.Tensor], results: mp.Queue) -> None:
    os.environ["TRITON_INTERPRET"] = "1"
    bases = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64)
    size = MESSAGE_BYTES * world_size
    data_offset, polled_offset, _ = PeerBuffers.layout(world_size, PROGRAMS, size, size)
    peer = PeerBuffers(bases, torch.zeros(PROGRAMS, dtype=torch.int32), rank, world_size,
                       PROGRAMS, data_offset, size, polled_offset, size, 2,
                       torch.zeros(2, PROGRAMS, dtype=torch.int32))
    if rank == 0:
        for buffer in buffers:
            fill_polled(buffer, peer)
    _wait_all_filled(buffers, peer)
    got = []
    for call, (rows, cols, dtype, path, norm) in enumerate(CALLS):
        mode = dict(two_shot=path == "two-shot", polled=path == "polled")
        x, residual, weight = _inputs(call, rank, rows, cols, dtype)
        out = torch.empty_like(x)
        if norm:
            res_out = torch.empty_like(x)
            peer_all_reduce(peer, x, out, residual=residual, weight=weight, eps=EPS,
                            residual_out=res_out, **mode)
            got.append((out.float().tolist(), res_out.float().tolist()))
        else:
            peer_all_reduce(peer, x, out, **mode)
            got.append((out.float().tolist(), None))
    results.put((rank, got, peer.counters.tolist(), peer.lamport_state.tolist()))


def _wait_all_filled(buffers: list[torch.Tensor], peer: PeerBuffers) -> None:
    """Until rank 0 has filled every polled buffer (a rank must not push into one before)."""
    end = peer.lamport_offset + 3 * peer.lamport_bytes
    while any(int(b[end - 1]) != 0x80 for b in buffers):
        time.sleep(0.01)


def _expected(call: int, world_size: int):
    rows, cols, dtype, _, norm = CALLS[call]
    xs = [_inputs(call, r, rows, cols, dtype)[0] for r in range(world_size)]
    acc = torch.zeros(rows, cols)
    for x in xs:  # rank order, fp32, as the kernel sums
        acc += x.float()
    reduced = acc.to(dtype)
    if not norm:
        return reduced.float(), None
    _, residual, weight = _inputs(call, 0, rows, cols, dtype)
    # What NCCL + the add_rms_norm kernel give (the path the fused kernel replaces).
    out, res_out = torch.empty_like(reduced), torch.empty_like(reduced)
    add_rms_norm(reduced, residual, weight, EPS, out, res_out)
    return out.float(), res_out.float()


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_peer_all_reduce_matches_the_rank_order_sum(world_size):
    size = MESSAGE_BYTES * world_size
    total = PeerBuffers.layout(world_size, PROGRAMS, size, size)[2]
    buffers = [torch.zeros(total, dtype=torch.uint8).share_memory_() for _ in range(world_size)]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, world_size, buffers, results))
             for r in range(world_size)]
    for p in procs:
        p.start()
    try:
        got = {}
        for _ in procs:
            rank, outputs, counters, polled_state = results.get(timeout=240)
            got[rank] = (outputs, counters, polled_state)
    except queue.Empty:
        pytest.fail("a rank did not finish (a barrier never completed?)")
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    for rank in range(world_size):
        outputs, counters, polled_state = got[rank]
        # A call runs min(rows, PROGRAMS) programs; each counts only its own calls.
        flagged = [c for c in CALLS if c[3] != "polled"]
        polled = [c for c in CALLS if c[3] == "polled"]
        assert counters == [sum(rows > p for rows, *_ in flagged) for p in range(PROGRAMS)]
        # Each program's last polled buffer (they cycle 1, 2, 0, ...) and the elements it used.
        assert polled_state[0] == [sum(rows > p for rows, *_ in polled) % 3
                                   for p in range(PROGRAMS)]
        assert polled_state[1][0] == -(-polled[-1][0] // PROGRAMS) * polled[-1][1]
        for call in range(len(CALLS)):
            out, res_out = _expected(call, world_size)
            # Exact: the same fp32 sum in the same order, rounded once, then the same norm.
            assert torch.equal(torch.tensor(outputs[call][0]), out), (rank, call)
            if res_out is not None:
                assert torch.equal(torch.tensor(outputs[call][1]), res_out), (rank, call)


def test_fits_refuses_what_the_buffer_cannot_hold():
    peer = PeerBuffers(torch.zeros(2, dtype=torch.int64), torch.zeros(4, dtype=torch.int32), 0,
                       2, 4, 256, 2048, 4352, 1024, 2)
    assert peer.slot_bytes == 256  # 2048 bytes / (4 programs x 2 source ranks)
    assert fits_polled(peer, torch.empty(4, 64, dtype=torch.bfloat16))  # 128 bytes per slot
    assert not fits_polled(peer, torch.empty(4, 64))  # 4-byte elements: other negative zeros
    assert not fits_polled(peer, torch.empty(5, 64, dtype=torch.bfloat16))
    assert fits(peer, torch.empty(4, 64))  # one 256-byte row per program
    assert not fits(peer, torch.empty(5, 64))
    assert not fits(peer, torch.empty(64, 4).t())  # last dim strided
    with pytest.raises(ValueError, match="does not fit"):
        peer_all_reduce(peer, torch.empty(5, 64), torch.empty(5, 64))


def test_path_by_message_size():
    from tgraph.kernels.triton_backend.peer_memory import path_for, peer_buffers
    from tgraph.tuning import AllReduceTuning

    t = AllReduceTuning(polled_max_bytes=100, one_shot_max_bytes=1000, two_shot_max_bytes=5000)
    assert [path_for(n, t) for n in (1, 100, 101, 1000, 1001, 5000, 5001)] == [
        "polled", "polled", "one-shot", "one-shot", "two-shot", "two-shot", "nccl"]
    # The defaults: no two-shot window (it lost to one-shot at every size on 2 GPUs).
    d = AllReduceTuning()
    assert path_for(d.one_shot_max_bytes + 1, d) == "nccl"
    # CPU tensors (gloo) and the setting off keep NCCL/gloo.
    assert peer_buffers(torch.empty(4), d) is None
    assert peer_buffers(torch.empty(4), AllReduceTuning(peer=False)) is None
