"""``Engine.forward`` with preallocated outputs never aliases silently: output buffers that share
memory with each other, with themselves, or with an input that is still read (or written in
place) after they are written are refused, naming both buffers; legal buffers give exact values."""
from __future__ import annotations

import pytest
import torch

from tests.helpers import assert_close, poison_like
from tgraph.engine.engine import Engine
from tgraph.errors import EngineInputError
from tgraph.nn import functional as F
from tgraph.nn.network_manager import recording
from tgraph.nn.tensor import Tensor

f32 = torch.float32


def _sum_and_view(sum_first: bool = True) -> Engine:
    """``sum = a + b`` and ``flat_a = a.reshape(-1)`` (a view of input ``a``)."""
    with recording("sum_and_view") as net:
        a, b = Tensor("a", f32, (3, 4)), Tensor("b", f32, (3, 4))
        marks = [(a + b, "sum"), (a.reshape(-1), "flat_a")]
        for value, name in marks if sum_first else marks[::-1]:
            net.mark_output(value, name)
    return net.build_engine()


@pytest.fixture
def ab() -> dict[str, torch.Tensor]:
    return {"a": torch.randn(3, 4), "b": torch.randn(3, 4)}


def test_an_output_into_an_input_that_a_later_output_views_is_refused(ab) -> None:
    engine = _sum_and_view()
    before = ab["a"].clone()
    # Before: "sum" was copied into a first, so flat_a read a + b instead of a.
    with pytest.raises(EngineInputError, match="output 'sum' shares memory with input 'a', which "
                       "output 'flat_a' is a view of, copied after 'sum' is written"):
        engine.forward(ab, {"sum": ab["a"], "flat_a": torch.empty(12)})
    assert torch.equal(ab["a"], before)  # refused before anything ran


def test_an_output_that_views_the_input_it_is_written_into_is_refused(ab) -> None:
    engine = _sum_and_view()
    with pytest.raises(EngineInputError, match="output 'flat_a' shares memory with input 'a', "
                       "which output 'flat_a' is a view of"):
        engine.forward(ab, {"sum": torch.empty(3, 4), "flat_a": ab["a"].reshape(-1)})


def test_an_output_into_an_input_read_before_it_is_written_is_allowed(ab) -> None:
    """flat_a is copied out of a before sum is written into a: in place, and exact."""
    engine = _sum_and_view(sum_first=False)
    a, b = ab["a"].clone(), ab["b"].clone()
    flat = poison_like(torch.empty(12))
    engine.forward(ab, {"flat_a": flat, "sum": ab["a"]})
    assert torch.equal(flat, a.reshape(-1))
    assert_close(ab["a"], a.double() + b.double())


def test_an_output_into_an_input_no_output_views_is_allowed() -> None:
    with recording("in_place") as net:
        a, b = Tensor("a", f32, (3, 4)), Tensor("b", f32, (3, 4))
        net.mark_output(F.exp(a) + b, "y")
    engine = net.build_engine()
    a, b = torch.randn(3, 4), torch.randn(3, 4)
    want = a.double().exp() + b.double()
    engine.forward({"a": a, "b": b}, {"y": a})
    assert_close(a, want)


@pytest.mark.parametrize("overlap", ["same", "sliced"])
def test_outputs_that_share_memory_are_refused(ab, overlap: str) -> None:
    engine = _sum_and_view()
    if overlap == "same":  # before: accepted, and one result was lost
        shared = torch.empty(12)
        outputs = {"sum": shared.view(3, 4), "flat_a": shared}
    else:
        shared = torch.empty(20)
        outputs = {"sum": shared[:12].view(3, 4), "flat_a": shared[8:]}
    with pytest.raises(EngineInputError, match="outputs 'sum' and 'flat_a' share memory; each "
                       "output needs a buffer of its own"):
        engine.forward(ab, outputs)


@pytest.mark.parametrize("make", [
    lambda: torch.empty(4).expand(3, 4),
    lambda: torch.empty(3, 1).expand(3, 4),
    lambda: torch.empty(6).as_strided((3, 4), (1, 1)),
], ids=["expand_rows", "expand_cols", "strides_step_into_each_other"])
def test_a_self_overlapping_output_is_refused(ab, make) -> None:
    engine = _sum_and_view()
    # Before: torch's copy_ raised a raw RuntimeError (or, for the as_strided case, wrote garbage).
    with pytest.raises(EngineInputError, match=r"output 'sum' \(float32\[3, 4\], strides .*\) "
                       r"has elements that share memory"):
        engine.forward(ab, {"sum": make(), "flat_a": torch.empty(12)})


def test_an_output_over_an_input_written_in_place_is_refused() -> None:
    with recording("cache_out") as net:
        k = Tensor("k", f32, ("num_tokens", 2, 4))
        kc = Tensor("k_cache", f32, (3, 4, 2, 4))
        vc = Tensor("v_cache", f32, (3, 4, 2, 4))
        slots = Tensor("slots", torch.int32, ("num_tokens",))
        kc2, _ = F.reshape_and_cache(k, k, kc, vc, slots)
        net.mark_output(F.sum(kc2, -1), "k_sum")
    engine = net.build_engine()
    kcache = torch.zeros(3, 4, 2, 4)
    inputs = {"k": torch.randn(3, 2, 4), "k_cache": kcache, "v_cache": torch.zeros(3, 4, 2, 4),
              "slots": torch.tensor([5, -1, 0], dtype=torch.int32)}
    with pytest.raises(EngineInputError, match="output 'k_sum' shares memory with input "
                       "'k_cache', which the network writes in place"):
        engine.forward(inputs, {"k_sum": kcache.view(-1)[:24].view(3, 4, 2)})


def test_distinct_outputs_give_exact_values(ab) -> None:
    engine = _sum_and_view()
    a, b = ab["a"].clone(), ab["b"].clone()
    whole = torch.full((40,), float("nan"))
    # Two outputs in one storage, side by side: legal.
    outputs = {"sum": whole[:12].view(3, 4), "flat_a": whole[12:24]}
    result = engine.forward(ab, outputs)
    assert result["sum"] is outputs["sum"] and result["flat_a"] is outputs["flat_a"]
    assert_close(outputs["sum"], a.double() + b.double())
    assert torch.equal(outputs["flat_a"], a.reshape(-1))
    assert torch.isnan(whole[24:]).all()  # nothing written past the given buffers
    assert torch.equal(ab["a"], a) and torch.equal(ab["b"], b)


def test_outputs_without_buffers_still_work(ab) -> None:
    engine = _sum_and_view()
    out = engine.forward(ab)
    assert_close(out["sum"], ab["a"].double() + ab["b"].double())
    assert torch.equal(out["flat_a"], ab["a"].reshape(-1))


def test_a_same_dtype_cast_is_a_copy_not_its_input(ab) -> None:
    """Without passes, ``cast`` to the tensor's own dtype ran ``x.to(dtype)``, which returns ``x``
    itself: an output buffer over ``a`` then changed the cast's result after the fact."""
    with recording("sum_and_cast") as net:
        a, b = Tensor("a", f32, (3, 4)), Tensor("b", f32, (3, 4))
        net.mark_output(a + b, "sum")
        net.mark_output(F.cast(a, f32), "cast_a")
    engine = net.build_engine(passes=False)
    a0, b0 = ab["a"].clone(), ab["b"].clone()
    out = poison_like(torch.empty(3, 4))
    engine.forward(ab, {"sum": ab["a"], "cast_a": out})
    assert torch.equal(out, a0)
    assert_close(ab["a"], a0.double() + b0.double())
