"""L2Prefetch: an ``l2_prefetch`` of the following linears' weights before each decode attention.

Structure (where the nodes go, which weights they name, none in prefill), numbers (the hint
changes no result: exactly, since the op is a view and no kernel reads what it launches), the
byte selection, and on a GPU the launch itself inside a captured decode step.
"""
from __future__ import annotations

import pytest
import torch

from tests.helpers import build_with_triton_backend
from tgraph.bench.models import random_weights
from tgraph.io.model_config import ModelConfig
from tgraph.io.weights import DictWeightLoader
from tgraph.kernels.triton import prefetch
from tgraph.models.loading import build_model
from tgraph.testing import PagedBatcher
from tgraph.tuning import PrefetchTuning

HF = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=64,
          intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
          num_key_value_heads=2, vocab_size=128, max_position_embeddings=256, rms_norm_eps=1e-5,
          tie_word_embeddings=False)


def _run(disabled: tuple[str, ...], device: str = "cpu", dtype=torch.float32, batch: int = 2):
    """A prefill and two decode steps of ``batch`` sequences; the model and every step's logits."""
    torch.manual_seed(0)
    weights = random_weights(HF, dtype, device)
    model = build_model(ModelConfig.from_dict(HF),
                        DictWeightLoader(weights, device=device, dtype=dtype),
                        max_model_len=64, disabled_passes=disabled)
    model.allocate_kv_cache(32)
    b = PagedBatcher.for_model(model)
    seqs = [b.add([3 + i, 7, 11 + 2 * i]) for i in range(batch)]
    logits = []
    for _ in range(3):
        logits.append(model.run(b.step(seqs)).clone())
        for i, s in enumerate(seqs):
            b.append(s, int(logits[-1][i].argmax()))
    return model, logits


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_prefetch_changes_no_result(backend, monkeypatch):
    if backend == "triton":
        build_with_triton_backend(monkeypatch)
    model, with_pass = _run(())
    _, without = _run(("L2Prefetch",))
    for got, want in zip(with_pass, without):
        assert torch.equal(got, want)
    decode = model.engines[(False, ())]
    assert {p.name: p.matches for p in decode.stats.passes}["L2Prefetch"] == HF["num_hidden_layers"]


def test_prefetch_hints_are_counted_apart_from_the_step_kernels():
    with_pass, _ = _run(())
    without, _ = _run(("L2Prefetch",))
    hinted, plain = (m.engines[(False, ())] for m in (with_pass, without))
    assert hinted.stats.kernel_count == plain.stats.kernel_count
    assert hinted.stats.hint_count == HF["num_hidden_layers"] and plain.stats.hint_count == 0
    assert f"{hinted.stats.kernel_count} kernels (+3 prefetch hints)" in str(hinted)


def test_one_prefetch_before_each_decode_attention_naming_o_gate_up_and_down():
    model, _ = _run(())
    decode = model.engines[(False, ())].net
    nodes = list(decode.nodes)
    attention = [i for i, n in enumerate(nodes) if n.op == "rope_cache_attention"]
    assert len(attention) == HF["num_hidden_layers"]
    for i in attention:
        hint = nodes[i - 1]
        assert hint.op == "l2_prefetch"
        assert nodes[i].inputs[0] is hint.outputs[0]  # the attention reads q through the hint
        names = [v.name for v in hint.inputs[1:]]
        assert [n.split(".")[-2] for n in names] == ["o_proj", "gate_up_proj", "down_proj"], names
        assert hint.attrs["halves"] == (1, 2, 1)  # the packed gate|up weight has two halves
    # Prefill attention (packed queries) gets none.
    prefill = model.engines[(True, ())].net
    assert any("attention" in n.op for n in prefill.nodes)
    assert not [n for n in prefill.nodes if n.op == "l2_prefetch"]


def _w(rows: int, cols: int, device: str = "cpu") -> torch.Tensor:
    return torch.zeros(rows, cols, dtype=torch.bfloat16, device=device)


def test_select_ahead_takes_whole_weights_then_leading_rows_of_both_halves():
    x = torch.zeros(1, 4, dtype=torch.bfloat16)
    o, gate_up, down = _w(8, 64), _w(32, 64), _w(8, 64)  # 128 B per row
    row = 64 * 2
    # Room for o (8 rows) and 6 more rows: 3 from the gate half and 3 from the up half.
    parts = prefetch.select_ahead(x, (o, gate_up, down), (1, 2, 1), budget=14 * row)
    assert [p.data_ptr() for p in parts] == [o.data_ptr(), gate_up.data_ptr(),
                                             gate_up[16].data_ptr()]
    assert [p.shape[0] for p in parts] == [8, 3, 3]
    # Everything fits: all three whole, the gated one as its two halves (four tensors at most).
    parts = prefetch.select_ahead(x, (o, gate_up, down), (1, 2, 1), budget=10**6)
    assert [p.shape[0] for p in parts] == [8, 16, 16, 8]
    assert prefetch.select_ahead(x, (o,), (1,), budget=row - 1) == []
    # A weight on another device ends the selection.
    parts = prefetch.select_ahead(x, (o, _w(8, 64, "meta"), down), (1, 1, 1), budget=10**6)
    assert [p.shape[0] for p in parts] == [8]


def test_prefetch_is_a_no_op_without_a_gpu_that_supports_it():
    x = torch.zeros(1, 4)
    assert prefetch.prefetch_ahead(x, (_w(8, 64),), (1,), PrefetchTuning()) == 0
    assert prefetch.prefetch_l2(_w(8, 64)) == 0
    with pytest.raises(ValueError, match="at most 4 weights"):
        prefetch.prefetch_l2(*[_w(2, 8)] * 5)


@pytest.mark.gpu
def test_captured_decode_with_prefetch_is_bit_identical_gpu():
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("cp.async.bulk.prefetch needs Hopper or later")
    # Batch 1: the steps the kernel prefetches for (PrefetchTuning.max_rows).
    model, with_pass = _run((), "cuda", torch.bfloat16, batch=1)
    _, without = _run(("L2Prefetch",), "cuda", torch.bfloat16, batch=1)
    for got, want in zip(with_pass, without):
        assert torch.equal(got, want)
    w = next(t for t in model.engines[(False, ())].weights.values() if t.dim() == 2)
    x = torch.zeros(1, 8, device="cuda", dtype=torch.bfloat16)
    assert prefetch.prefetch_ahead(x, (w,), (1,), PrefetchTuning()) > 0
    # Two rows: above the default max_rows, nothing; a tuning that allows two prefetches.
    x2 = torch.zeros(2, 8, device="cuda", dtype=torch.bfloat16)
    assert prefetch.prefetch_ahead(x2, (w,), (1,), PrefetchTuning()) == 0
    assert prefetch.prefetch_ahead(x2, (w,), (1,), PrefetchTuning(max_rows=2)) > 0
    torch.cuda.synchronize()
