"""LoRA features against PEFT on a tiny random Llama (fp32, CPU).

Tolerance: ``max|tgraph - peft| <= 1e-4 * max|peft|`` per sequence, as for the base families
(both sides compute in fp32; they differ only in summation order, measured ~1e-6). Every
adapter moves the logits by far more (checked: > 5e-2 relative), so a model that ignored an
adapter, used the wrong one, or got its scaling wrong would fail.
"""
from __future__ import annotations

import copy
import dataclasses
import gc
import json
import os
import shutil
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.models.conftest import load_tiny
from tgraph.errors import ConfigError, RecordError, WeightLoadError
from tgraph.ir.ops.lora import LORA_COUNTER_SLOTS, lora_shrink_concat_reference
from tgraph.kernels.triton.lora import lora_segments, new_lora_counters
from tgraph.layers.lora import lora_shrink_concat
from tgraph.models.base.batch import BatchMeta
from tgraph.nn import functional as F
from tgraph.nn.module import Parameter
from tgraph.nn.network_manager import new_network, recording
from tgraph.nn.tensor import Tensor
from tgraph.testing import PagedBatcher, hf_logits, random_hf_model

REL_TOL = 1e-4
ADAPTER_EFFECT = 5e-2
PROMPTS = [[1, 5, 9, 22, 7, 3, 100], [3, 4], [17, 150, 8, 8, 191, 0, 42], [121], [11, 12, 13]]
DECODE_STEPS = 3

# name -> (seed, LoraConfig kwargs): ranks, alphas, rsLoRA and target sets all differ.
ADAPTERS: dict[str, tuple[int, dict[str, Any]]] = {
    "qv": (1, dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])),
    "all": (2, dict(r=8, lora_alpha=16, use_rslora=True,
                    target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                    "up_proj", "down_proj"])),
    "mlp": (3, dict(r=2, lora_alpha=4, target_modules=["gate_proj", "down_proj", "o_proj"])),
}


def make_adapter(hf: Any, path: Path, seed: int, **lora_kwargs: Any) -> Any:
    """Save a random PEFT adapter of ``hf`` (B is non-zero: ``init_lora_weights=False``) and
    return the PEFT model, the oracle."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(init_lora_weights=False, **lora_kwargs)
    peft_model = get_peft_model(copy.deepcopy(hf), config).eval()
    peft_model.save_pretrained(path)
    return peft_model


@pytest.fixture(scope="module")
def lora_setup(tiny_model, tmp_path_factory):
    """The tiny Llama, three saved adapters and their PEFT models."""
    tm = tiny_model("llama")
    root = tmp_path_factory.mktemp("lora")
    peft = {name: make_adapter(tm.hf, root / name, seed, **kw)
            for name, (seed, kw) in ADAPTERS.items()}
    return tm, root, peft


@torch.no_grad()
def oracle_logits(model: Any, tokens: list[int]) -> torch.Tensor:
    return model(torch.tensor([tokens]), use_cache=False).logits[0].float()


def run_steps(model: Any, prompts: list[list[int]], loras: list[str | None] | None,
              steps: int = DECODE_STEPS) -> list[tuple[list[int], torch.Tensor]]:
    """Prefill ``prompts`` in one packed batch (logits of every token), then ``steps`` greedy
    decode steps; returns ``(tokens, logits [len(tokens), vocab])`` per sequence."""
    b = PagedBatcher.for_model(model)
    ids = [b.add(p) for p in prompts]
    batch = b.step(ids, all_logits=True)
    batch.loras = loras
    rows = list(torch.split(model.run(batch).clone(), [len(p) for p in prompts]))
    for _ in range(steps):
        for i, s in enumerate(ids):
            b.append(s, int(torch.argmax(rows[i][-1])))
        batch = b.step(ids)
        batch.loras = loras
        last = model.run(batch).clone()
        rows = [torch.cat([r, last[i:i + 1]]) for i, r in enumerate(rows)]
    return [(b.tokens(s), rows[i]) for i, s in enumerate(ids)]


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.double() - ref.double()).abs().max() / ref.double().abs().max())


def assert_matches(results, oracles, base_hf) -> None:
    for i, ((tokens, got), oracle) in enumerate(zip(results, oracles)):
        ref = oracle_logits(oracle, tokens)
        err = rel_err(got, ref)
        assert err <= REL_TOL, f"sequence {i}: relative error {err} > {REL_TOL}"
        if oracle is not base_hf:
            effect = rel_err(hf_logits(base_hf, tokens), ref)
            assert effect > ADAPTER_EFFECT, f"sequence {i}: adapter barely matters ({effect})"


# ---- single adapter ------------------------------------------------------------------------------
@pytest.mark.parametrize("graph,merge", [("static", True), ("static", False),
                                         ("eager", True), ("eager", False)])
def test_single_adapter_matches_peft(lora_setup, graph, merge):
    """Merged into the weights (the base engines serve it) or recorded (engines of its own)."""
    tm, root, peft = lora_setup
    model = load_tiny(tm.path, graph, features={"single_lora": {"max_rank": 8, "merge": merge}})
    single = model.features["single_lora"]
    single.load("all", root / "all")
    single.activate("all")
    assert single.merged is merge
    results = run_steps(model, PROMPTS[:3], None)
    assert_matches(results, [peft["all"]] * 3, tm.hf)
    features = () if merge else ("single_lora",)
    assert set(model.engines) == {(True, features), (False, features)}


@pytest.mark.parametrize("merge", [True, False])
def test_single_switching_adapters_never_rebuilds(lora_setup, merge):
    tm, root, peft = lora_setup
    model = load_tiny(tm.path, features={"single_lora": {"max_rank": 8, "merge": merge}})
    single = model.features["single_lora"]
    targets = {t.key: t.linear for t in single.targets}
    originals = {key: linear.weight.data.clone() for key, linear in targets.items()}
    for name in ("qv", "mlp"):
        single.load(name, root / name)
    for name in ("qv", "mlp", None, "qv"):
        single.activate(name)
        results = run_steps(model, PROMPTS[:2], None, steps=1)
        assert_matches(results, [peft[name] if name else tm.hf] * 2, tm.hf)
    # two kinds of batch (prefill, decode) x the feature combinations ((), single_lora)
    recorded = set() if merge else {(True, ("single_lora",)), (False, ("single_lora",))}
    assert set(model.engines) == {(True, ()), (False, ())} | recorded
    # clearing the adapter gives the base weights back bit for bit (merged: from the host copy)
    single.activate(None)
    for key, linear in targets.items():
        assert torch.equal(linear.weight.data, originals[key]), key
    assert single.host_bytes == 0


def test_merged_single_adapter_reloaded_and_unloaded_in_place(lora_setup, tmp_path):
    """Replacing the active adapter's files re-merges from the base weights (the old delta is not
    left behind); unloading the active adapter restores the base."""
    tm, root, peft = lora_setup
    model = load_tiny(tm.path, features={"single_lora": {"max_rank": 8}})
    single = model.features["single_lora"]
    linear = single.targets[0].linear
    original = linear.weight.data.clone()
    single.load("x", root / "qv")
    single.activate("x")
    assert not torch.equal(linear.weight.data, original)
    assert single.host_bytes == sum(t.linear.weight.data.numel() * 4 for t in single.targets)
    single.load("x", root / "mlp")  # the active adapter's weights replaced: mlp alone applies
    assert_matches(run_steps(model, PROMPTS[:2], None, steps=1), [peft["mlp"]] * 2, tm.hf)
    single.unload("x")
    assert single.active is None and torch.equal(linear.weight.data, original)
    assert_matches(run_steps(model, PROMPTS[:2], None, steps=1), [tm.hf] * 2, tm.hf)


def test_single_lora_merge_setting_is_checked(lora_setup):
    tm, _, _ = lora_setup
    with pytest.raises(ConfigError, match="merge must be true or false"):
        load_tiny(tm.path, features={"single_lora": {"merge": "yes"}})
    with pytest.raises(ConfigError, match="unknown settings \\['max_loras'\\]"):
        load_tiny(tm.path, features={"single_lora": {"max_loras": 2}})


# ---- multi adapter -------------------------------------------------------------------------------
@pytest.mark.parametrize("graph", ["static", "eager"])
def test_mixed_batch_matches_peft(lora_setup, graph):
    """Three adapters and base-model requests in one batch, prefill and decode."""
    tm, root, peft = lora_setup
    model = load_tiny(tm.path, graph, features={"multi_lora": {"max_rank": 8, "max_loras": 3}})
    multi = model.features["multi_lora"]
    for name in ADAPTERS:
        multi.load(name, root / name)
    loras = ["all", None, "qv", "mlp", "all"]
    results = run_steps(model, PROMPTS, loras)
    assert_matches(results, [peft[n] if n else tm.hf for n in loras], tm.hf)
    assert set(model.engines) == {(True, ("multi_lora",)), (False, ("multi_lora",))}


def _multi_with_two_adapters(lora_setup) -> tuple[Any, Any]:
    """The tiny model with two multi-LoRA slots, holding "qv" and "mlp"."""
    tm, root, _ = lora_setup
    model = load_tiny(tm.path, features={"multi_lora": {"max_rank": 8, "max_loras": 2}})
    multi = model.features["multi_lora"]
    multi.load("qv", root / "qv")
    multi.load("mlp", root / "mlp")
    return model, multi


def test_multi_load_unload_at_run_time(lora_setup):
    tm, root, peft = lora_setup
    model, multi = _multi_with_two_adapters(lora_setup)
    with pytest.raises(ConfigError, match="max_loras=2"):
        multi.load("all", root / "all")
    assert_matches(run_steps(model, PROMPTS[:2], ["qv", "mlp"], steps=1),
                   [peft["qv"], peft["mlp"]], tm.hf)
    multi.unload("qv")
    with pytest.raises(ValueError, match=r"\['qv'\] are not loaded"):
        run_steps(model, PROMPTS[:1], ["qv"], steps=0)
    assert multi.load("all", root / "all") == 1  # the freed slot is reused
    assert_matches(run_steps(model, PROMPTS[:2], ["all", "mlp"], steps=1),
                   [peft["all"], peft["mlp"]], tm.hf)
    # a batch without adapter names runs the base engines
    assert_matches(run_steps(model, PROMPTS[:1], None, steps=1), [tm.hf], tm.hf)
    assert set(model.engines) == {(True, ()), (False, ()), (True, ("multi_lora",)),
                                  (False, ("multi_lora",))}


def test_multi_batch_arrays_follow_adapter_and_batch_changes(lora_setup):
    # The arrays of the last batch are reused while nothing they depend on changes.
    root = lora_setup[1]
    _, multi = _multi_with_two_adapters(lora_setup)
    decode = BatchMeta([1, 2, 3], [5, 5, 5], [-1, -1, -1], [1, 1, 1], [6, 6, 6], [[0]] * 3,
                       is_prefill=False, loras=["mlp", None, "qv"])
    first = multi.batch_arrays(decode)
    assert first["lora_token_slots"].tolist() == [2, 0, 1]
    assert multi.batch_arrays(dataclasses.replace(decode, input_ids=[4, 5, 6])) is first
    with pytest.raises(ValueError, match="read-only"):
        first["lora_token_slots"][0] = 1
    # Another adapter mix, other query lengths, or a slot that changed hands: recomputed.
    swapped = multi.batch_arrays(dataclasses.replace(decode, loras=["qv", None, "mlp"]))
    assert swapped["lora_token_slots"].tolist() == [1, 0, 2]
    prefill = dataclasses.replace(decode, query_lens=[2, 1, 1], input_ids=[1, 2, 3, 4],
                                  position_ids=[4, 5, 5, 5], slots_mapping=[-1] * 4,
                                  is_prefill=True)
    assert multi.batch_arrays(prefill)["lora_token_slots"].tolist() == [2, 2, 0, 1]
    multi.unload("qv")
    multi.unload("mlp")
    multi.load("mlp", root / "mlp")
    multi.load("qv", root / "qv")
    assert multi.batch_arrays(decode)["lora_token_slots"].tolist() == [1, 0, 2]
    multi.unload("qv")
    with pytest.raises(ValueError, match=r"\['qv'\] are not loaded"):
        multi.batch_arrays(decode)


def test_engines_built_per_feature_combination(lora_setup):
    tm, root, peft = lora_setup
    model = load_tiny(tm.path, features={"single_lora": {"max_rank": 8, "merge": False},
                                         "multi_lora": {"max_rank": 8}})
    single, multi = model.features["single_lora"], model.features["multi_lora"]
    single.load("qv", root / "qv")
    multi.load("mlp", root / "mlp")
    run_steps(model, PROMPTS[:1], None, steps=1)  # base
    run_steps(model, PROMPTS[:1], ["mlp"], steps=0)  # multi, prefill only
    single.activate("qv")
    run_steps(model, PROMPTS[:1], None, steps=1)  # single
    assert set(model.engines) == {(True, ()), (False, ()), (True, ("multi_lora",)),
                                  (True, ("single_lora",)), (False, ("single_lora",))}


# Single and multi in one batch (stacked): tests/models/test_lora_stacking.py.


# ---- bad adapters --------------------------------------------------------------------------------
def copy_adapter(src: Path, dst: Path, **config_changes: Any) -> Path:
    shutil.copytree(src, dst)
    if config_changes:
        config = json.loads((dst / "adapter_config.json").read_text())
        config.update(config_changes)
        (dst / "adapter_config.json").write_text(json.dumps(config))
    return dst


def test_bad_adapters_give_clear_errors(lora_setup, tmp_path):
    tm, root, _ = lora_setup
    model = load_tiny(tm.path, features={"single_lora": {"max_rank": 4}})
    single = model.features["single_lora"]

    with pytest.raises(WeightLoadError, match="no such directory"):
        single.load("x", tmp_path / "nowhere")
    no_config = copy_adapter(root / "qv", tmp_path / "no_config")
    (no_config / "adapter_config.json").unlink()
    with pytest.raises(WeightLoadError, match="missing adapter_config.json"):
        single.load("x", no_config)
    no_weights = copy_adapter(root / "qv", tmp_path / "no_weights")
    (no_weights / "adapter_model.safetensors").unlink()
    with pytest.raises(WeightLoadError, match="missing adapter_model.safetensors"):
        single.load("x", no_weights)
    unknown = copy_adapter(root / "qv", tmp_path / "unknown", target_modules=["q_proj", "lm_head"])
    with pytest.raises(ConfigError, match=r"unknown target module\(s\) \['lm_head'\]"):
        single.load("x", unknown)
    with pytest.raises(ConfigError, match="rank 8 exceeds max_rank 4"):
        single.load("x", root / "all")
    dora = copy_adapter(root / "qv", tmp_path / "dora", use_dora=True)
    with pytest.raises(ConfigError, match="use_dora not supported"):
        single.load("x", dora)

    # an adapter trained for another base model (hidden size 32)
    other = random_hf_model("llama", seed=0, hidden_size=32, intermediate_size=48)
    make_adapter(other, tmp_path / "other", 1, **ADAPTERS["qv"][1])
    with pytest.raises(WeightLoadError, match=r"q_proj has A \[4, 32\].*needs A \[4, 64\]"):
        single.load("x", tmp_path / "other")

    # a module the feature was configured not to adapt
    narrow = load_tiny(tm.path, features={"single_lora": {"target_modules": ["q_proj"]}})
    with pytest.raises(ConfigError, match="adapts 'v_proj', which this model's LoRA feature"):
        narrow.features["single_lora"].load("x", root / "qv")
    assert not single.adapters and not narrow.features["single_lora"].adapters


def test_bad_settings_and_names(lora_setup):
    tm, root, _ = lora_setup
    with pytest.raises(ConfigError, match=r"unknown settings \['rank'\]"):
        load_tiny(tm.path, features={"multi_lora": {"rank": 8}})
    model = load_tiny(tm.path, features={"multi_lora": {"max_rank": 8}})
    with pytest.raises(KeyError, match="'nope' is not loaded"):
        model.features["single_lora"].activate("nope")
    model.features["multi_lora"].load("qv", root / "qv")
    with pytest.raises(ValueError, match="2 entries for 1 sequences"):
        run_steps(model, PROMPTS[:1], ["qv", None], steps=0)


# ---- the lora_shrink_concat op + the GEMM ------------------------------------------------------
def _concat_case(tokens: int = 40, k: int = 48, n: int = 72, r: int = 16, slots: int = 4):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, k, generator=g)
    w = torch.randn(n, k, generator=g) / k ** 0.5
    a = torch.randn(slots, r, k, generator=g) / k ** 0.5
    b = torch.randn(slots, n, r, generator=g)
    scaling = torch.rand(slots, generator=g).add(0.5)
    token_slots = torch.randint(0, slots, (tokens,), generator=g, dtype=torch.int32)
    return x, w, a, b, scaling, token_slots


def _loop_linear(x, w, a, b, scaling, token_slots) -> torch.Tensor:
    """Token by token, in fp64: the plain definition of a multi-LoRA linear."""
    out = x.double() @ w.double().t()
    for t, s in enumerate(token_slots.tolist()):
        if s:
            out[t] += scaling[s].double() * (b[s].double() @ (a[s].double() @ x[t].double()))
    return out


def _record_lora_linear(lead: int = 0):
    """``F.linear([x | xa], [W | B blocks])`` on the ``_concat_case`` shapes, ``lead`` zero
    columns before the blocks; returns the network and the concatenated weight."""
    x, w, a, b, scaling, slots = _concat_case()
    w_cat = torch.cat([w, torch.zeros(72, lead), *[b[s] for s in range(1, 4)]], dim=1)
    with recording(new_network("lora_linear")) as net:
        xcat = lora_shrink_concat(
            Tensor("x", torch.float32, ("t", 48)), Tensor("a", torch.float32, (4, 16, 48)),
            Tensor("s", torch.float32, (4,)), Tensor("slots", torch.int32, ("t",)),
            Tensor("order", torch.int32, ("t",)), Tensor("seg", torch.int32, (5,)),
            Tensor("counters", torch.int32, (LORA_COUNTER_SLOTS,)), lead=lead, width=lead + 48)
        net.mark_output(F.linear(xcat, Parameter(w_cat, name="w_cat")), "out")
    order, seg = lora_segments(slots, 4)
    inputs = {"x": x, "a": a, "s": scaling, "slots": slots, "order": order.to(torch.int32),
              "seg": seg, "counters": new_lora_counters("cpu")}
    return net, inputs, _loop_linear(x, w, a, b, scaling, slots)


def test_lora_shrink_concat_reference():
    """x copied, each token's scaled shrink in its slot's block, zeros elsewhere (fp32: 1e-5)."""
    x, _, a, _, scaling, slots = _concat_case()
    order, seg = lora_segments(slots, 4)
    got = lora_shrink_concat_reference(x, a, scaling, slots, order, seg, None, lead=3, width=55)
    assert got.shape == (40, 48 + 55)
    assert torch.equal(got[:, :48], x)
    for t, s in enumerate(slots.tolist()):
        block = torch.zeros(55, dtype=torch.float64)
        if s:
            shrink = a[s].double() @ x[t].double()
            block[3 + (s - 1) * 16:3 + s * 16] = scaling[s].double() * shrink
        assert rel_err(got[t, 48:], block) <= 1e-5 if s else torch.equal(got[t, 48:], block.float())
    assert (slots == 0).any() and (slots != 0).any()
    with pytest.raises(ValueError, match=r"token_slots must lie in \[0, 4\)"):
        lora_shrink_concat_reference(x, a, scaling, slots + 1, order, seg, None, lead=0, width=48)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_lora_linear_is_one_gemm(backend):
    """The shrink op then one linear on [W | B blocks] equals the per-token definition, on the
    reference backend and with the Triton kernel (interpreter on CPU). fp32: 1e-5 relative."""
    net, inputs, want = _record_lora_linear(lead=8)
    engine = net.build_engine(backend=backend)
    result = torch.full((40, 72), float("nan"))
    engine.forward(inputs, {"out": result})
    assert rel_err(result, want) <= 1e-5
    if backend == "triton":
        assert "triton.lora_shrink_concat" in str(engine)
        assert not inputs["counters"].any(), "the kernel must leave its counters zeroed"


def test_lora_shrink_concat_shape_errors():
    def record(a_shape=(4, 16, 48), slot_dtype=torch.int32, lead=0, width=48):
        return lora_shrink_concat(
            Tensor("x", torch.float32, ("t", 48)), Tensor("a", torch.float32, a_shape),
            Tensor("s", torch.float32, (4,)), Tensor("slots", slot_dtype, ("t",)),
            Tensor("order", torch.int32, ("t",)), Tensor("seg", torch.int32, (5,)),
            Tensor("counters", torch.int32, (LORA_COUNTER_SLOTS,)), lead=lead, width=width)

    with recording(new_network("bad")):
        with pytest.raises(RecordError, match="x in_features vs a_stack dim 2 differ"):
            record(a_shape=(4, 16, 40))
        with pytest.raises(RecordError, match="token_slots must be int32 or int64"):
            record(slot_dtype=torch.float32)
        with pytest.raises(RecordError, match=r"width 50 cannot hold lead 4 \+ 3 slot blocks of "
                                              r"rank 16 \(expected width >= 52\)"):
            record(lead=4, width=50)
        with pytest.raises(RecordError, match=r"a_stack slots vs scaling differ \(3 vs 4\)"):
            record(a_shape=(3, 16, 48), width=48)


# ---- the shared weight storage -------------------------------------------------------------------
def _base_logits(model: Any, steps: int = 1) -> list[torch.Tensor]:
    return [logits for _, logits in run_steps(model, PROMPTS[:2], None, steps=steps)]


def test_weights_are_held_once_and_the_base_engine_is_unchanged(lora_setup):
    """Loading an adapter re-lays every target weight out into [W | multi | single] storage: the
    base weight becomes a view of it (no second copy), base engines built before are rebound to
    that view and compute the same logits, bit for bit (the same fp32 values, read with another
    row stride)."""
    tm, root, _ = lora_setup
    model = load_tiny(tm.path, features={"single_lora": {"max_rank": 8, "merge": False},
                                         "multi_lora": {"max_rank": 8, "max_loras": 3}})
    before = _base_logits(model)
    engines = dict(model.engines)
    targets = model.features["multi_lora"].targets
    originals = {t.key: t.linear.weight.data.clone() for t in targets}
    old = [weakref.ref(t.linear.weight.data) for t in targets]
    model.features["multi_lora"].load("qv", root / "qv")
    gc.collect()
    assert all(ref() is None for ref in old), "an old weight tensor is still held (a second copy)"

    multi, single = model.features["multi_lora"], model.features["single_lora"]
    for t in multi.targets:
        bank = multi.banks[t.key]
        assert bank is single.banks[t.key]  # one storage shared by both features
        weight = t.linear.weight.data
        assert bank.shares_storage(weight) and weight.data_ptr() == bank.storage.data_ptr()
        assert torch.equal(weight, originals[t.key])
        assert bank.storage.shape == (t.out_features, t.in_features + multi.region_width(t)
                                      + single.region_width(t))
        assert multi.region_width(t) == 3 * 8 * len(t.enabled)
        for engine in engines.values():  # built before: rebound, not holding the old tensor
            held = {v.name: d for v, d in engine.weights.items()}
            assert bank.shares_storage(held[t.linear.weight.name])
    after = _base_logits(model)
    assert model.engines == engines  # rebound, not rebuilt
    for a, b in zip(before, after):
        assert torch.equal(a, b)
    # and the LoRA engine's GEMM weights are views of the same storage
    run_steps(model, PROMPTS[:1], ["qv"], steps=0)
    lora_engine = model.engines[(True, ("multi_lora",))]
    cats = [d for v, d in lora_engine.weights.items() if v.name.endswith("weight_cat")]
    assert len(cats) == len(multi.targets)
    assert all(any(multi.banks[t.key].shares_storage(d) for t in multi.targets) for d in cats)


def test_narrow_target_modules_match_peft(lora_setup):
    """Only q/v targeted: the packed qkv delta has two rank blocks (no k block), o/mlp none."""
    tm, root, peft = lora_setup
    model = load_tiny(tm.path, features={"single_lora": {"max_rank": 4,
                                                         "target_modules": ["q_proj", "v_proj"]}})
    single = model.features["single_lora"]
    assert {t.module for t in single.targets} == {"qkv_proj"}
    single.load("qv", root / "qv")
    single.activate("qv")
    assert single.adapters["qv"]["lora_a_0_qkv_proj"].shape == (8, 64)
    assert_matches(run_steps(model, PROMPTS[:2], None, steps=1), [peft["qv"]] * 2, tm.hf)


def test_mixed_batch_triton_backend(lora_setup, monkeypatch):
    """The same mixed batch with the Triton backend (interpreter on CPU): lora_shrink_concat runs
    the shrink kernel, and every adapted linear is one GEMM. fp32: tolerance as above."""
    from tgraph.ir.network import Network

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton backend on CPU tensors needs the interpreter (set without CUDA)")

    build = Network.build_engine

    def build_triton(self, *args, **kwargs):
        return build(self, *args, **{**kwargs, "backend": "triton"})

    monkeypatch.setattr(Network, "build_engine", build_triton)
    tm, root, peft = lora_setup
    model = load_tiny(tm.path, features={"multi_lora": {"max_rank": 8, "max_loras": 3}})
    multi = model.features["multi_lora"]
    for name in ADAPTERS:
        multi.load(name, root / name)
    loras = ["all", None, "qv", "mlp"]
    results = run_steps(model, PROMPTS[:4], loras, steps=1)
    engine = model.engines[(True, ("multi_lora",))]
    assert "triton.lora_shrink_concat" in str(engine)
    assert_matches(results, [peft[n] if n else tm.hf for n in loras], tm.hf)


def _peft_greedy(model: Any, prompt: list[int], steps: int) -> list[int]:
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([tokens]), use_cache=False).logits
            tokens.append(int(logits[0, -1].argmax()))
    return tokens[len(prompt):]


def test_llm_generate_with_adapters_per_request(lora_setup):
    from tgraph.runtime.llm import LLM
    from tgraph.runtime.sampling_params import SamplingParams

    tm, root, peft = lora_setup
    names = list(ADAPTERS)[:2]
    llm = LLM(tm.path, device="cpu", max_model_len=64, num_blocks=32, block_size=4,
              loras={n: root / n for n in names})
    prompts = [[1, 5, 9, 22, 7], [3, 4, 8], [11, 12, 13, 14]]
    picks = [names[0], None, names[1]]
    params = [SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, lora=p)
              for p in picks]
    outputs = llm.generate(prompts, params)
    for prompt, pick, out in zip(prompts, picks, outputs):
        oracle = peft[pick] if pick else tm.hf
        assert out.token_ids == _peft_greedy(oracle, prompt, 4), pick
