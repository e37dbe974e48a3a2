"""Step programs on the CPU backend (:mod:`tgraph.engine.program`): a signature's steps bound once
at its second call and run as thunks from then on. A program computes exactly what the step-by-
step run computes (the same kernels on the same buffers), so results and KV caches are compared
with ``torch.equal`` against an engine built with ``CpuTuning.step_programs`` off, call by call,
while the inputs change values, a held input (the KV cache) is replaced and weights are swapped.
"""
from __future__ import annotations

import dataclasses

import torch

from tgraph.engine.engine import Engine
from tgraph.nn import functional as F
from tgraph.nn.module import Parameter
from tgraph.nn.network_manager import recording
from tgraph.nn.tensor import Tensor
from tgraph.tuning import Tuning

HIDDEN, HQ, HK, D, INTER = 64, 4, 2, 16, 96
KERNELS = ["cpu.norm_linear", "ref.split", "ref.reshape", "ref.reshape", "ref.reshape",
           "cpu.l2_prefetch", "cpu.rope_cache_attention", "ref.reshape", "cpu.linear_epilogue",
           "cpu.norm_linear", "cpu.linear_epilogue"]
BLOCK, NUM_BLOCKS, WIDTH = 4, 16, 6


def _weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = {"ln1": (HIDDEN,), "ln2": (HIDDEN,), "wqkv": ((HQ + 2 * HK) * D, HIDDEN),
              "wo": (HIDDEN, HQ * D), "wgu": (2 * INTER, HIDDEN), "wd": (HIDDEN, INTER)}
    return {name: torch.randn(*shape, generator=g) / (8 if len(shape) > 1 else 1)
            for name, shape in shapes.items()}


def _engine(weights: dict[str, torch.Tensor], programs: bool) -> Engine:
    """A decode step of a Llama-style block, fused as a model's is (the kernels listed in
    ``KERNELS``)."""
    with recording("block") as net:
        x = Tensor("x", torch.float32, ("batch", HIDDEN))
        cos = Tensor("cos", torch.float32, ("batch", D // 2))
        sin = Tensor("sin", torch.float32, ("batch", D // 2))
        k_cache = Tensor("k_cache", torch.float32, (NUM_BLOCKS, BLOCK, HK, D))
        v_cache = Tensor("v_cache", torch.float32, (NUM_BLOCKS, BLOCK, HK, D))
        slots = Tensor("slots", torch.int32, ("batch",))
        table = Tensor("block_table", torch.int32, ("batch", WIDTH))
        seq_len = Tensor("seq_len", torch.int32, ("batch",))
        w = {name: Parameter(t, name=name) for name, t in weights.items()}
        h = F.rms_norm(x, w["ln1"], eps=1e-6)
        q, k, v = F.split(F.linear(h, w["wqkv"]), [HQ * D, HK * D, HK * D], dim=-1)
        q, k = F.rope(q.reshape(-1, HQ, D), k.reshape(-1, HK, D), cos, sin)
        k_cache, v_cache = F.reshape_and_cache(k, v.reshape(-1, HK, D), k_cache, v_cache, slots)
        a = F.paged_attention(q, k_cache, v_cache, table, seq_len)
        r = F.linear(a.reshape(-1, HQ * D), w["wo"]) + x
        gu = F.linear(F.rms_norm(r, w["ln2"], eps=1e-6), w["wgu"])
        gate, up = F.split(gu, [INTER, INTER], dim=-1)
        out = F.linear(F.silu(gate) * up, w["wd"]) + r
        net.mark_output(out, "out")
    tuning = Tuning()
    tuning = dataclasses.replace(tuning, cpu=dataclasses.replace(tuning.cpu,
                                                                 step_programs=programs))
    return net.build_engine(backend="cpu", tuning=tuning)


def _step(i: int, batch: int, caches: tuple[torch.Tensor, torch.Tensor]
          ) -> dict[str, torch.Tensor]:
    """Call ``i``: new values (fresh tensors) for every input but the caches; sequence ``b``
    owns blocks ``3b + 1, 3b + 2`` and block 0 (its keys in two runs, so the kernels gather)."""
    g = torch.Generator().manual_seed(100 + i)
    pos = torch.tensor([5 + i + b for b in range(batch)])
    freqs = pos[:, None].float() / (10000 ** (torch.arange(0, D, 2).float() / D))[None, :]
    rows = [[3 * b + 1, 3 * b + 2, 0, 0, 0, 0] for b in range(batch)]
    slots = [rows[b][int(p) // BLOCK] * BLOCK + int(p) % BLOCK for b, p in enumerate(pos)]
    return {"x": torch.randn(batch, HIDDEN, generator=g), "cos": freqs.cos(), "sin": freqs.sin(),
            "k_cache": caches[0], "v_cache": caches[1],
            "slots": torch.tensor(slots, dtype=torch.int32),
            "block_table": torch.tensor(rows, dtype=torch.int32),
            "seq_len": (pos + 1).to(torch.int32)}


def _caches(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(NUM_BLOCKS, BLOCK, HK, D, generator=g),
            torch.randn(NUM_BLOCKS, BLOCK, HK, D, generator=g))


def test_programs_compute_what_the_steps_compute() -> None:
    weights = _weights(0)
    fast, slow = _engine(weights, True), _engine(weights, False)
    assert [s.kernel_name for s in fast.plan_for(None).steps] == KERNELS
    fast_caches, slow_caches = _caches(1), _caches(1)
    for i in range(6):
        batch = 2 if i < 5 else 1  # the last call: another signature, its first call
        if i == 3:  # a held input replaced: the program is built again around the new one
            fast_caches = tuple(c.clone() for c in fast_caches)
        got = fast.forward(_step(i, batch, fast_caches))["out"]
        want = slow.forward(_step(i, batch, slow_caches))["out"]
        assert torch.equal(got, want), f"call {i}"
        assert all(torch.equal(a, b) for a, b in zip(fast_caches, slow_caches)), f"call {i}"
    programs = [b.program for b in fast._bindings.values()]
    assert len(programs) == 2 and programs[0] is not None and programs[1] is None
    assert programs[0].held == {"k_cache", "v_cache"}
    assert all(b.program is None for b in slow._bindings.values())
    # Weights swapped: the programs are dropped and rebuilt on the new weights.
    new = _weights(7)
    fast.set_weights(new)
    slow.set_weights(new)
    for i in range(6, 9):
        got = fast.forward(_step(i, 2, fast_caches))["out"]
        want = slow.forward(_step(i, 2, slow_caches))["out"]
        assert torch.equal(got, want), f"call {i}"


def test_a_step_that_returns_a_new_tensor_keeps_its_binding_uncaptured() -> None:
    weights = _weights(0)
    engine, reference = _engine(weights, True), _engine(weights, False)
    step = next(s for s in engine.plan_for(None).steps if s.kernel_name == "cpu.linear_epilogue")
    kernel = step.kernel
    step.kernel = lambda outs, *args, **attrs: kernel(outs, *args, **attrs).clone()
    caches, ref_caches = _caches(2), _caches(2)
    for i in range(4):
        got = engine.forward(_step(i, 2, caches))["out"]
        assert torch.equal(got, reference.forward(_step(i, 2, ref_caches))["out"])
    binding = next(iter(engine._bindings.values()))
    assert binding.program is None and binding.unbindable
