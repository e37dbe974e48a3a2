"""PEFT LoRA adapters whose modules have their own rank and alpha (``rank_pattern``,
``alpha_pattern``) and rsLoRA scaling, against PEFT on tiny random Llama and Qwen2 (fp32, CPU).

Tolerance: ``max|tgraph - peft| <= 1e-4 * max|peft|`` per sequence, as in ``test_lora.py`` (both
sides compute in fp32 and differ only in summation order, ~1e-6). Every adapter moves the logits
by more than 5e-2 relative, and the per-module ranks and scalings are compared exactly with the
ones PEFT chose, so a loader that ignored a pattern (or matched it by another rule) fails.
"""
from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch

from tests.models.conftest import load_tiny
from tests.models.test_lora import (
    ADAPTER_EFFECT,
    REL_TOL,
    copy_adapter,
    make_adapter,
    oracle_logits,
    rel_err,
    run_steps,
)
from tgraph.errors import ConfigError, WeightLoadError
from tgraph.layers.lora import LORA_TARGET_MODULES, load_peft_adapter
from tgraph.testing import hf_logits

ALL = list(LORA_TARGET_MODULES)
MAX_RANK = 8  # the largest rank of any module below
PROMPTS = [[1, 5, 9, 22, 7, 3, 100], [3, 4], [17, 150, 8, 8, 191, 0, 42], [121], [11, 12, 13]]

# name -> (seed, LoraConfig kwargs). The tiny models have 3 layers. PEFT matches a key as a
# regular expression against the end of a module's name in the base model
# ("model.layers.1.self_attn.q_proj"), starting at a dot; the first matching key wins.
ADAPTERS: dict[str, tuple[int, dict[str, Any]]] = {
    "patterns": (11, dict(
        r=4, lora_alpha=8, target_modules=ALL,
        rank_pattern={
            r"layers\.1\.self_attn\.q_proj": 2,  # listed first: wins over "q_proj" in layer 1
            "q_proj": 8,
            "^model.layers.0.mlp.down_proj": 6,  # anchored full name
            r"layers\.[02]\.self_attn\.(k|v)_proj": 1,
            "lm_head": 16,  # matches no targeted module: ignored, as in PEFT
        },
        alpha_pattern={
            "o_proj": 3,  # an alpha without a rank entry (rank r)
            "layers.2.mlp.up_proj": 32.5,  # '.' matches any character; a float alpha
            "q_proj": 4,  # an alpha over ranks 2 and 8
        })),
    "rslora": (12, dict(r=6, lora_alpha=5, use_rslora=True,
                        target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"])),
    "both": (13, dict(
        r=2, lora_alpha=4, use_rslora=True, target_modules=ALL,
        rank_pattern={r"mlp\..*": 8, "v_proj": 3},
        alpha_pattern={"layers.0.self_attn.v_proj": 1, "down_proj": 12})),
}


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def pattern_setup(request, tiny_model, tmp_path_factory):
    """A tiny model, the adapters above saved by PEFT, and their PEFT models (the oracles)."""
    tm = tiny_model(request.param)
    root = tmp_path_factory.mktemp(f"lora-patterns-{request.param}")
    peft = {}
    for name, (seed, kwargs) in ADAPTERS.items():
        with warnings.catch_warnings():  # PEFT warns about the "lm_head" key matching nothing
            warnings.simplefilter("ignore", RuntimeWarning)
            peft[name] = make_adapter(tm.hf, root / name, seed, **kwargs)
    return tm, root, peft


def peft_modules(peft_model: Any) -> dict[tuple[int, str], tuple[int, float]]:
    """``(layer, module) -> (r, scaling)`` as PEFT set them up."""
    found = {}
    for name, module in peft_model.named_modules():
        if hasattr(module, "lora_A") and "default" in getattr(module, "r", {}):
            parts = name.split(".")
            layer = int(parts[parts.index("layers") + 1])
            found[(layer, parts[-1])] = (module.r["default"], module.scaling["default"])
    return found


def check_against_peft(results: list[tuple[list[int], torch.Tensor]], prompts: list[list[int]],
                       oracles: list[Any], base_hf: Any) -> None:
    """Logits within ``REL_TOL`` of the oracle's at every position, and each greedy token the
    oracle's argmax."""
    for i, ((tokens, got), prompt, oracle) in enumerate(zip(results, prompts, oracles)):
        ref = oracle_logits(oracle, tokens)
        err = rel_err(got, ref)
        assert err <= REL_TOL, f"sequence {i}: relative error {err} > {REL_TOL}"
        assert tokens[len(prompt):] == ref[len(prompt) - 1:-1].argmax(-1).tolist(), \
            f"sequence {i}: greedy tokens differ from the oracle's"
        if oracle is not base_hf:
            effect = rel_err(hf_logits(base_hf, tokens), ref)
            assert effect > ADAPTER_EFFECT, f"sequence {i}: adapter barely matters ({effect})"


# ---- which rank and scaling each module gets -----------------------------------------------------
def test_module_ranks_and_scalings_equal_peft(pattern_setup):
    _, root, peft = pattern_setup
    for name, (_, kwargs) in ADAPTERS.items():
        adapter = load_peft_adapter(root / name)
        want = peft_modules(peft[name])
        got = {key: (adapter.ranks[key], adapter.scalings[key]) for key in adapter.weights}
        assert got == want, name
        assert adapter.rank == max(r for r, _ in want.values())
        if kwargs.get("rank_pattern"):  # the patterns make a difference
            assert len({r for r, _ in want.values()}) > 1
            assert len({s for _, s in want.values()}) > 1
    patterns = load_peft_adapter(root / "patterns").ranks
    assert (patterns[(0, "q_proj")], patterns[(1, "q_proj")], patterns[(0, "down_proj")],
            patterns[(1, "down_proj")], patterns[(2, "k_proj")]) == (8, 2, 6, 4, 1)
    rslora = load_peft_adapter(root / "rslora")
    assert set(rslora.scalings.values()) == {5 / math.sqrt(6)}
    assert rslora.scaling == 5 / math.sqrt(6)


# ---- served through the LoRA features ------------------------------------------------------------
@pytest.mark.parametrize("graph", ["static", "eager"])
def test_multi_lora_matches_peft(pattern_setup, graph):
    """Every adapter, and a base-model request, in one batch: prefill and decode."""
    tm, root, peft = pattern_setup
    model = load_tiny(tm.path, graph, features={"multi_lora": {"max_rank": MAX_RANK,
                                                               "max_loras": 3}})
    multi = model.features["multi_lora"]
    for name in ADAPTERS:
        multi.load(name, root / name)
    loras = ["patterns", None, "rslora", "both", "patterns"]
    results = run_steps(model, PROMPTS, loras)
    check_against_peft(results, PROMPTS, [peft[n] if n else tm.hf for n in loras], tm.hf)
    assert set(model.engines) == {(True, ("multi_lora",)), (False, ("multi_lora",))}


@pytest.mark.parametrize("graph,merge", [("static", False), ("eager", False), ("static", True)])
def test_single_lora_matches_peft(pattern_setup, graph, merge):
    tm, root, peft = pattern_setup
    model = load_tiny(tm.path, graph, features={"single_lora": {"max_rank": MAX_RANK,
                                                                "merge": merge}})
    single = model.features["single_lora"]
    for name in ADAPTERS:
        single.load(name, root / name)
    for name in ADAPTERS:
        single.activate(name)
        results = run_steps(model, PROMPTS[:3], None)
        check_against_peft(results, PROMPTS[:3], [peft[name]] * 3, tm.hf)
    # switching adapters of different per-module ranks rebuilt nothing
    features = () if merge else ("single_lora",)
    assert set(model.engines) == {(True, features), (False, features)}


def test_max_rank_is_checked_against_the_largest_module_rank(pattern_setup):
    tm, root, _ = pattern_setup
    model = load_tiny(tm.path, features={"single_lora": {"max_rank": 6},
                                         "multi_lora": {"max_rank": 6}})
    single, multi = model.features["single_lora"], model.features["multi_lora"]
    single.load("rslora", root / "rslora")  # r = 6 everywhere: fits
    with pytest.raises(ConfigError, match=r"rank 8 exceeds max_rank 6 \(the largest module "
                                          r"rank: layer 0 q_proj\); raise the feature's "
                                          r"'max_rank'"):
        single.load("patterns", root / "patterns")
    # the config's r is 2, but its mlp modules have rank 8 (named: the first by layer, name)
    with pytest.raises(ConfigError, match=r"rank 8 exceeds max_rank 6 \(the largest module "
                                          r"rank: layer 0 down_proj\)"):
        multi.load("both", root / "both")
    assert set(single.adapters) == {"rslora"} and not multi.slots


# ---- malformed patterns --------------------------------------------------------------------------
MALFORMED: dict[str, tuple[dict[str, Any], str]] = {
    "rank_pattern not an object": (
        dict(rank_pattern=["q_proj", 8]),
        r"'rank_pattern' must be an object mapping module-name patterns \(regular expressions "
        r"such as 'q_proj' or 'layers\\\.0\\\.\.\*_proj'\) to ranks \(positive ints\), got list"),
    "fractional rank": (dict(rank_pattern={"q_proj": 8.5}),
                        r"rank_pattern\['q_proj'\] must be a positive int, got 8\.5"),
    "rank as a string": (dict(rank_pattern={"q_proj": "8"}),
                         r"rank_pattern\['q_proj'\] must be a positive int, got '8'"),
    "zero rank": (dict(rank_pattern={"v_proj": 0}),
                  r"rank_pattern\['v_proj'\] must be a positive int, got 0"),
    "boolean rank": (dict(rank_pattern={"v_proj": True}),
                     r"rank_pattern\['v_proj'\] must be a positive int, got True"),
    "alpha_pattern not an object": (
        dict(alpha_pattern="q_proj=16"),
        r"'alpha_pattern' must be an object mapping .* to alphas \(finite numbers\), got str"),
    "alpha as a string": (dict(alpha_pattern={"o_proj": "16"}),
                          r"alpha_pattern\['o_proj'\] must be a finite number, got '16'"),
    "null alpha": (dict(alpha_pattern={"o_proj": None}),
                   r"alpha_pattern\['o_proj'\] must be a finite number, got None"),
    "invalid regular expression": (
        dict(rank_pattern={"q_proj(": 4}),
        r"'rank_pattern' key 'q_proj\(' is not a valid regular expression"),
    "use_rslora not a bool": (dict(use_rslora="yes"),
                              r"'use_rslora' must be true or false, got 'yes'"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_patterns_give_clear_errors(pattern_setup, tmp_path, case):
    root = pattern_setup[1]
    changes, message = MALFORMED[case]
    bad = copy_adapter(root / "rslora", tmp_path / "bad", **changes)
    with pytest.raises(ConfigError, match=message):
        load_peft_adapter(bad)


def test_rank_pattern_that_contradicts_the_tensors(pattern_setup, tmp_path):
    root = pattern_setup[1]
    bad = copy_adapter(root / "rslora", tmp_path / "bad",
                       rank_pattern={r"layers\.1\.mlp\.down_proj": 5})
    with pytest.raises(WeightLoadError, match=r"with r=5 \(the rank of "
                                              r"'model\.layers\.1\.mlp\.down_proj'\)"):
        load_peft_adapter(bad)


def test_patterns_matching_no_module_change_nothing(pattern_setup, tmp_path):
    root = pattern_setup[1]
    plain = load_peft_adapter(root / "rslora")
    for i, changes in enumerate([
            dict(rank_pattern={"lm_head": 2, r"layers\.9\..*": 3, "k_proj": 1},
                 alpha_pattern={"embed_tokens": 1.0, "up_proj": 7}),
            dict(rank_pattern=None, alpha_pattern=None)]):
        other = load_peft_adapter(copy_adapter(root / "rslora", tmp_path / str(i), **changes))
        assert (other.ranks, other.scalings) == (plain.ranks, plain.scalings)
