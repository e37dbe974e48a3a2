"""LoRA features against PEFT on a tiny random Llama (fp32, CPU).

Tolerance: ``max|tgraph - peft| <= 1e-4 * max|peft|`` per sequence, as for the base families
(both sides compute in fp32; they differ only in summation order, measured ~1e-6). Every
adapter moves the logits by far more (checked: > 5e-2 relative), so a model that ignored an
adapter, used the wrong one, or got its scaling wrong would fail.
"""
from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.models.conftest import load_tiny
from tgraph.errors import ConfigError, RecordError, WeightLoadError
from tgraph.ir.ops.lora import lora_delta_reference
from tgraph.kernels.fast_lora import lora_delta_into
from tgraph.layers.lora import lora_delta
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
@pytest.mark.parametrize("graph", ["static", "eager"])
def test_single_adapter_matches_peft(lora_setup, graph):
    tm, root, peft = lora_setup
    model = load_tiny(tm.path, graph, features={"single_lora": {"max_rank": 8}})
    single = model.features["single_lora"]
    single.load("all", root / "all")
    single.activate("all")
    results = run_steps(model, PROMPTS[:3], None)
    assert_matches(results, [peft["all"]] * 3, tm.hf)
    assert set(model.engines) == {(True, ("single_lora",)), (False, ("single_lora",))}


def test_single_switching_adapters_never_rebuilds(lora_setup):
    tm, root, peft = lora_setup
    model = load_tiny(tm.path, features={"single_lora": {"max_rank": 8}})
    single = model.features["single_lora"]
    for name in ("qv", "mlp"):
        single.load(name, root / name)
    for name in ("qv", "mlp", None, "qv"):
        single.activate(name)
        results = run_steps(model, PROMPTS[:2], None, steps=1)
        assert_matches(results, [peft[name] if name else tm.hf] * 2, tm.hf)
    # two kinds of batch (prefill, decode) x two feature combinations ((), single_lora)
    assert set(model.engines) == {(True, ()), (False, ()), (True, ("single_lora",)),
                                  (False, ("single_lora",))}


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


def test_multi_load_unload_at_run_time(lora_setup):
    tm, root, peft = lora_setup
    model = load_tiny(tm.path, features={"multi_lora": {"max_rank": 8, "max_loras": 2}})
    multi = model.features["multi_lora"]
    multi.load("qv", root / "qv")
    multi.load("mlp", root / "mlp")
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


def test_engines_built_per_feature_combination(lora_setup):
    tm, root, peft = lora_setup
    model = load_tiny(tm.path, features={"single_lora": {"max_rank": 8},
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


def test_single_and_multi_in_one_batch_refused(lora_setup):
    tm, root, _ = lora_setup
    model = load_tiny(tm.path, features={"single_lora": {"max_rank": 8},
                                         "multi_lora": {"max_rank": 8}})
    model.features["single_lora"].load("qv", root / "qv")
    model.features["single_lora"].activate("qv")
    model.features["multi_lora"].load("mlp", root / "mlp")
    with pytest.raises(ConfigError,
                       match="'single_lora' and 'multi_lora' cannot be used in one batch"):
        run_steps(model, PROMPTS[:2], [None, "mlp"], steps=0)
    assert not model.engines


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


# ---- the lora_delta op ---------------------------------------------------------------------------
def _delta_case(tokens: int = 40, k: int = 48, n: int = 72, r: int = 16, slots: int = 4,
                dtype: torch.dtype = torch.float32, device: str = "cpu"):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, k, generator=g).to(device, dtype)
    a = torch.randn(slots, r, k, generator=g).to(device, dtype) / k ** 0.5
    b = torch.randn(slots, n, r, generator=g).to(device, dtype)
    scaling = torch.rand(slots, generator=g).add(0.5).to(device)
    token_slots = torch.randint(0, slots, (tokens,), generator=g, dtype=torch.int32).to(device)
    return x, a, b, scaling, token_slots


def _loop_delta(x, a, b, scaling, token_slots) -> torch.Tensor:
    """Token by token, in fp64: the plain definition."""
    out = torch.zeros(x.shape[0], b.shape[1], dtype=torch.float64)
    for t, s in enumerate(token_slots.tolist()):
        if s:
            out[t] = scaling[s].double() * (b[s].double() @ (a[s].double() @ x[t].double()))
    return out


def _symbolic(x_dtype=torch.float32, rank_b: int = 16, slot_dtype=torch.int32):
    """Symbolic inputs of the ``_delta_case`` shapes (``t`` tokens, K 48, N 72, R 16, L 4)."""
    return (Tensor("x", x_dtype, ("t", 48)), Tensor("a", x_dtype, (4, 16, 48)),
            Tensor("b", x_dtype, (4, 72, rank_b)), Tensor("s", torch.float32, (4,)),
            Tensor("slots", slot_dtype, ("t",)))


def test_lora_delta_reference_and_triton_kernel():
    """The reference against the per-token definition, and the Triton wrapper (interpreter on
    CPU) through a built engine against it. fp32 throughout: tolerance 1e-5 relative."""
    x, a, b, scaling, token_slots = _delta_case()
    want = _loop_delta(x, a, b, scaling, token_slots)
    got_ref = lora_delta_reference(x, a, b, scaling, token_slots)
    assert rel_err(got_ref, want) <= 1e-5
    assert (got_ref[token_slots == 0] == 0).all()
    assert (token_slots == 0).any() and (token_slots != 0).any()

    with recording(new_network("lora_delta")) as net:
        out = lora_delta(*_symbolic())
        net.mark_output(out, "out")
    engine = net.build_engine(backend="triton")
    result = torch.full((40, 72), float("nan"))
    engine.forward({"x": x, "a": a, "b": b, "s": scaling, "slots": token_slots}, {"out": result})
    assert "triton.lora_delta" in str(engine)
    assert rel_err(result, want) <= 1e-5


def test_lora_delta_shape_errors():
    with recording(new_network("bad")):
        with pytest.raises(RecordError, match="a_stack rank vs b_stack rank differ"):
            lora_delta(*_symbolic(rank_b=8))
        with pytest.raises(RecordError, match="token_slots must be int32 or int64"):
            lora_delta(*_symbolic(slot_dtype=torch.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_lora_delta_kernel_gpu(dtype):
    """Decode- and prefill-sized token counts at Llama-8B q/k/v widths (K 4096, N 6144, rank 3x16).
    bf16/fp16 inputs, fp32 accumulation: tolerance 2e-2 (bf16) / 5e-3 (fp16) relative."""
    for tokens in (7, 1024):
        x, a, b, scaling, token_slots = _delta_case(tokens, 4096, 6144, 48, 9, dtype, "cuda")
        want = lora_delta_reference(x.float(), a.float(), b.float(), scaling, token_slots)
        out = torch.full((tokens, 6144), float("nan"), dtype=dtype, device="cuda")
        lora_delta_into([out], x, a, b, scaling, token_slots)
        assert rel_err(out.float(), want) <= (2e-2 if dtype == torch.bfloat16 else 5e-3)


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
    """The same mixed batch with the Triton backend (interpreter on CPU): lora_delta runs the
    shrink/expand kernels. fp32: tolerance as above."""
    from tgraph.ir.network import Network

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
    assert "triton.lora_delta" in str(engine)
    assert_matches(results, [peft[n] if n else tm.hf for n in loras], tm.hf)


def _peft_greedy(model: Any, prompt: list[int], steps: int) -> list[int]:
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            tokens.append(int(model(torch.tensor([tokens]), use_cache=False).logits[0, -1].argmax()))
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
