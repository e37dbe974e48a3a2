"""Single-LoRA and multi-LoRA stacked in one engine, against PEFT (fp32, CPU).

The oracle of a request is PEFT with the single adapter merged into the base model
(``merge_and_unload``) and the request's multi adapter applied on top (the base with the single
adapter merged alone for a request that names none). Tolerance as in ``test_lora.py``:
``max|tgraph - peft| <= 1e-4 * max|peft|`` per sequence (both fp32; merging only reorders the
sums, ~1e-6 measured). Both adapters move the logits by far more (checked: > 5e-2 relative to
the oracle without that adapter), so an engine that dropped either delta, or applied the single
adapter's scaling twice, would fail; greedy tokens are compared with PEFT's greedy generation too.
"""
from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers import build_with_triton_backend
from tests.models.conftest import load_tiny
from tests.models.test_lora import make_adapter, oracle_logits, rel_err, run_steps
from tgraph.errors import ConfigError, WeightLoadError
from tgraph.testing import make_tiny_text_model

REL_TOL = 1e-4
ADAPTER_EFFECT = 5e-2
PROMPTS = [[1, 5, 9, 22, 7, 3, 100], [3, 4], [17, 150, 8, 8, 191, 0, 42], [121, 7]]
# with a single adapter active: two requests name multi adapters, two name none
LORAS: list[str | None] = ["qv", None, "mlp", None]
DECODE_STEPS = 3
# the single adapter recorded in the engines (merge: false) unless a test merges it
FEATURES = {"single_lora": {"max_rank": 8, "merge": False},
            "multi_lora": {"max_rank": 8, "max_loras": 2}}
STACKED = ("multi_lora", "single_lora")
MULTI_ONLY = ("multi_lora",)
SHRINK_OPS = ("lora_shrink_concat", "rms_norm_lora_concat", "add_rms_norm_lora_concat")

# name -> (seed, LoraConfig kwargs). "dom" and "dom2" are single adapters (every module, one
# with rsLoRA); "qv" and "mlp" are per-request ones on overlapping and disjoint modules.
ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SINGLE = {"dom": (11, dict(r=8, lora_alpha=16, use_rslora=True, target_modules=ALL_MODULES)),
          "dom2": (12, dict(r=4, lora_alpha=8, target_modules=ALL_MODULES))}
MULTI = {"qv": (13, dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])),
         "mlp": (14, dict(r=2, lora_alpha=4, target_modules=["gate_proj", "down_proj",
                                                              "o_proj"]))}


class Oracles:
    """PEFT models of one base: ``of(single, multi)`` is the base with ``single`` merged in
    (``None``: not) and ``multi`` applied on top (``None``: none)."""

    def __init__(self, hf: Any, root: Path) -> None:
        self.hf, self.root = hf, root
        self._cache: dict[tuple[str | None, str | None], Any] = {}

    def of(self, single: str | None, multi: str | None) -> Any:
        from peft import PeftModel

        key = (single, multi)
        if key not in self._cache:
            if multi is None:
                model = self.hf
                if single is not None:
                    model = PeftModel.from_pretrained(copy.deepcopy(self.hf), self.root / single)
                    model = model.merge_and_unload()
            else:
                model = PeftModel.from_pretrained(copy.deepcopy(self.of(single, None)),
                                                  self.root / multi)
            self._cache[key] = model.eval()
        return self._cache[key]


def save_adapters(hf: Any, root: Path) -> None:
    for name, (seed, kwargs) in {**SINGLE, **MULTI}.items():
        make_adapter(hf, root / name, seed, **kwargs)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def stack_setup(request, tiny_model, tmp_path_factory):
    """A tiny model (Llama, or Qwen2 with q/k/v biases), the four adapters, the PEFT oracles."""
    tm = tiny_model(request.param)
    root = tmp_path_factory.mktemp(f"stack-{request.param}")
    save_adapters(tm.hf, root)
    return tm, root, Oracles(tm.hf, root)


def stacked_model(tm: Any, root: Path, graph: str = "static", merge: bool = False) -> Any:
    """The tiny model with "dom" and "dom2" loaded as single adapters ("dom" active; merged into
    the weights with ``merge``) and "qv", "mlp" as multi adapters."""
    features = {**FEATURES, "single_lora": {**FEATURES["single_lora"], "merge": merge}}
    model = load_tiny(tm.path, graph, features=features)
    single, multi = model.features["single_lora"], model.features["multi_lora"]
    for name in SINGLE:
        single.load(name, root / name)
    for name in MULTI:
        multi.load(name, root / name)
    single.activate("dom")
    return model


@torch.no_grad()
def peft_greedy(model: Any, prompt: list[int], steps: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(steps):
        logits = model(torch.tensor([tokens]), use_cache=False).logits
        tokens.append(int(logits[0, -1].argmax()))
    return tokens[len(prompt):]


def check_against_peft(results, oracles: Oracles, single: str | None, loras, steps: int,
                       effect: bool = True) -> None:
    """Every sequence's logits within REL_TOL of its oracle, its greedy tokens PEFT's, and (with
    ``effect``) both adapters mattering."""
    for i, ((tokens, got), multi) in enumerate(zip(results, loras)):
        oracle = oracles.of(single, multi)
        ref = oracle_logits(oracle, tokens)
        err = rel_err(got, ref)
        assert err <= REL_TOL, f"sequence {i} ({single} + {multi}): relative error {err}"
        prompt = tokens[:len(tokens) - steps]
        assert tokens[len(prompt):] == peft_greedy(oracle, prompt, steps), f"sequence {i}"
        if not effect:
            continue
        without = [(None, multi)] + ([(single, None)] if multi is not None else [])
        for s, m in without:
            moved = rel_err(oracle_logits(oracles.of(s, m), tokens), ref)
            assert moved > ADAPTER_EFFECT, \
                f"sequence {i}: dropping {'single' if s is None else 'multi'} barely matters"


# ---- stacking, against PEFT --------------------------------------------------------------------
@pytest.mark.parametrize("graph", ["static", "eager"])
def test_merged_single_under_multi_matches_peft(stack_setup, graph):
    """The single adapter merged into the weights: the same mixed batch runs the multi-LoRA
    engines alone, on the merged weights, and every request equals PEFT."""
    tm, root, oracles = stack_setup
    model = stacked_model(tm, root, graph, merge=True)
    results = run_steps(model, PROMPTS, LORAS)
    check_against_peft(results, oracles, "dom", LORAS, DECODE_STEPS)
    assert set(model.engines) == {(True, MULTI_ONLY), (False, MULTI_ONLY)}


@pytest.mark.parametrize("graph", ["static", "eager"])
def test_single_and_multi_stacked_match_peft(stack_setup, graph):
    """One batch with the single adapter active, two requests naming multi adapters and two
    naming none: prefill and decode run the stacked engines, and every request equals PEFT."""
    tm, root, oracles = stack_setup
    model = stacked_model(tm, root, graph)
    results = run_steps(model, PROMPTS, LORAS)
    check_against_peft(results, oracles, "dom", LORAS, DECODE_STEPS)
    assert set(model.engines) == {(True, STACKED), (False, STACKED)}
    targets = len(model.features["single_lora"].targets)
    layers = model.llm_config.model.num_hidden_layers
    for engine in model.engines.values():
        lines = str(engine).splitlines()
        assert lines[1] == "  features: multi_lora, single_lora", lines[:3]
        # One shrink per adapted linear writes both features' columns; in the static graph the
        # RMSNorm before q/k/v and gate/up is folded into it (LoraPrologue).
        shrinks = [n for n in engine.net.nodes if n.op in SHRINK_OPS]
        assert len(shrinks) == targets, [n.op for n in shrinks]
        for n in shrinks:
            names = {v.name for v in n.inputs if v is not None}
            assert {"lora_token_slots", "single_lora_token_slots"} <= names, names
            assert n.attrs["second_width"] > 0
        fused = sum(n.op != "lora_shrink_concat" for n in shrinks)
        assert fused == (2 * layers if graph == "static" else 0)


def test_stacked_triton_backend_matches_peft(stack_setup, monkeypatch):
    """The stacked engines on the Triton backend (the interpreter on CPU): each adapted linear's
    one shrink, with the norm before it folded in where there is one, runs the Triton kernels
    (the per-token kernel: at most 64 tokens a step) and every request still equals PEFT, greedy
    tokens included. fp32, the tolerance above."""
    build_with_triton_backend(monkeypatch)
    tm, root, oracles = stack_setup
    model = stacked_model(tm, root)
    results = run_steps(model, PROMPTS, LORAS, steps=2)
    check_against_peft(results, oracles, "dom", LORAS, 2, effect=False)
    for engine in model.engines.values():
        text = str(engine)
        assert all(f"triton.{op}" in text for op in SHRINK_OPS), text


@pytest.mark.parametrize("merge", [False, True])
def test_switching_the_single_adapter_builds_no_engine(stack_setup, merge):
    """With every combination built once, switching the single adapter (to another, to none
    and back) builds nothing, and each batch follows the adapter active at its step."""
    tm, root, oracles = stack_setup
    model = stacked_model(tm, root, merge=merge)
    single = model.features["single_lora"]
    run_steps(model, PROMPTS[:2], LORAS[:2], steps=1)  # stacked
    run_steps(model, PROMPTS[:2], [None, None], steps=1)  # single alone
    single.activate(None)
    run_steps(model, PROMPTS[:2], LORAS[:2], steps=1)  # multi alone
    run_steps(model, PROMPTS[:2], [None, None], steps=1)  # base
    engines = dict(model.engines)
    # (prefill, decode) x (base, single, multi, stacked); merged: x (base, multi)
    assert len(engines) == (4 if merge else 8)
    assert str(engines[(False, ())]).splitlines()[1] == "  features: none"
    assert str(engines[(True, ("multi_lora",))]).splitlines()[1] == "  features: multi_lora"
    for active in ("dom2", None, "dom", "dom2"):
        single.activate(active)
        results = run_steps(model, PROMPTS, LORAS, steps=2)
        check_against_peft(results, oracles, active, LORAS, 2, effect=False)
        assert model.engines == engines, f"activating {active} built an engine"
        assert all(model.engines[k] is e for k, e in engines.items())


def test_batch_without_multi_adapters_runs_single_alone(stack_setup):
    """No request names a multi adapter: the single-LoRA engines, no stacked one."""
    tm, root, oracles = stack_setup
    model = stacked_model(tm, root)
    results = run_steps(model, PROMPTS[:2], None, steps=2)
    check_against_peft(results, oracles, "dom", [None, None], 2, effect=False)
    assert set(model.engines) == {(True, ("single_lora",)), (False, ("single_lora",))}
    assert "features: single_lora" in str(model.engines[(False, ("single_lora",))])


# ---- the LLM API and the command line ----------------------------------------------------------
LLM_OPTIONS = dict(device="cpu", max_model_len=64, num_blocks=48, block_size=4)


def _llm_generate(llm: Any, prompts: list[list[int]], picks: list[str | None],
                  steps: int) -> list[list[int]]:
    from tgraph.runtime.sampling_params import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True, lora=p)
              for p in picks]
    return [out.token_ids for out in llm.generate(prompts, params)]


@pytest.fixture(scope="module")
def llama_setup(tiny_model, tmp_path_factory):
    """The tiny Llama alone (the API is family-independent), its adapters and oracles."""
    tm = tiny_model("llama")
    root = tmp_path_factory.mktemp("stack-api")
    save_adapters(tm.hf, root)
    return tm, root, Oracles(tm.hf, root)


def test_llm_single_lora_with_per_request_adapters(llama_setup):
    from tgraph.runtime.llm import LLM

    tm, root, oracles = llama_setup
    steps = 3
    llm = LLM(tm.path, single_lora=root / "dom", loras={n: root / n for n in MULTI},
              **LLM_OPTIONS)
    assert llm.single_lora == str(root / "dom")
    prompts, picks = PROMPTS[:3], ["qv", None, "mlp"]

    def expect(single: str | None) -> list[list[int]]:
        return [peft_greedy(oracles.of(single, m), p, steps) for p, m in zip(prompts, picks)]

    assert _llm_generate(llm, prompts, picks, steps) == expect("dom")
    built = set(llm.model.engines)
    llm.set_single_lora(root / "dom2")
    assert _llm_generate(llm, prompts, picks, steps) == expect("dom2")
    assert set(llm.model.engines) == built, "switching the single adapter built an engine"
    assert list(llm.model.features["single_lora"].adapters) == [str(root / "dom2")]
    # an adapter that cannot load leaves the active one in place
    with pytest.raises(WeightLoadError, match="no such directory"):
        llm.set_single_lora(root / "nowhere")
    assert llm.single_lora == str(root / "dom2")
    assert _llm_generate(llm, prompts, picks, steps) == expect("dom2")
    llm.set_single_lora(None)
    assert llm.single_lora is None and not llm.model.features["single_lora"].adapters
    assert _llm_generate(llm, prompts, picks, steps) == expect(None)
    llm.close()


def test_llm_lora_settings_reach_the_features(llama_setup):
    """``llm.lora``: the single adapter recorded in engines instead of merged, and the slots
    and rank the features take."""
    from tgraph.runtime.llm import LLM

    tm, root, oracles = llama_setup
    llm = LLM(tm.path, single_lora=root / "dom", loras={"qv": root / "qv"}, **LLM_OPTIONS,
              **{"llm.lora.merge_single": False, "llm.lora.max_loras": 1,
                 "llm.lora.max_rank": 8})
    single, multi = llm.model.features["single_lora"], llm.model.features["multi_lora"]
    assert not single.merged and multi.max_loras == 1 and single.max_rank == multi.max_rank == 8
    picks = ["qv", None]
    assert _llm_generate(llm, PROMPTS[:2], picks, 2) == \
        [peft_greedy(oracles.of("dom", m), p, 2) for p, m in zip(PROMPTS[:2], picks)]
    assert (False, STACKED) in llm.model.engines
    with pytest.raises(ConfigError, match="max_loras=1"):
        llm.load_lora("mlp", root / "mlp")
    llm.close()
    with pytest.raises(ConfigError, match="llm.lora.max_rank"):
        LLM(tm.path, **LLM_OPTIONS, **{"llm.lora.max_rank": 0})


@pytest.fixture(scope="module")
def cli_setup(tmp_path_factory):
    """A tiny Llama with the demo tokenizer (text prompts), a single and a multi adapter."""
    from transformers import AutoModelForCausalLM

    path = make_tiny_text_model(tmp_path_factory.mktemp("cli-stack"), seed=2)
    hf = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    root = tmp_path_factory.mktemp("cli-stack-adapters")
    for name, spec in (("dom", SINGLE["dom"]), ("qv", MULTI["qv"])):
        make_adapter(hf, root / name, spec[0], **spec[1])
    return path, root, Oracles(hf, root)


def test_cli_generate_single_lora(cli_setup, capsys):
    """``tgraph generate --single-lora DIR`` (with and without ``--lora``/``--use-lora``) prints
    PEFT's greedy text."""
    from transformers import AutoTokenizer

    from tgraph.cli import main
    from tgraph.runtime.llm import encode_prompt

    path, root, oracles = cli_setup
    tok = AutoTokenizer.from_pretrained(path)
    prompt, steps = "The river began", 4
    ids = encode_prompt(tok, prompt)
    common = ["generate", "--model", str(path), "--prompt", prompt, "--max-tokens", str(steps),
              "--no-chat", "--ignore-eos", "--max-model-len", "64",
              "--set", "llm.cache.num_blocks=32", "--set", "llm.cache.block_size=4",
              "--single-lora", str(root / "dom")]
    for multi in (None, "qv"):
        extra = [] if multi is None else ["--lora", f"qv={root / 'qv'}", "--use-lora", "qv"]
        assert main(common + extra) == 0
        out = capsys.readouterr()
        want = tok.decode(peft_greedy(oracles.of("dom", multi), ids, steps))
        assert out.out == want, (multi, out.err[-2000:])
        assert f"[{steps} tokens" in out.err


def test_cli_single_lora_bad_dir(cli_setup, tmp_path, capsys):
    from tgraph.cli import main

    path, root, _ = cli_setup
    bad = tmp_path / "bad"
    shutil.copytree(root / "dom", bad)
    config = json.loads((bad / "adapter_config.json").read_text())
    config["use_dora"] = True
    (bad / "adapter_config.json").write_text(json.dumps(config))
    rc = main(["generate", "--model", str(path), "--prompt", "hi", "--max-tokens", "2",
               "--max-model-len", "64", "--set", "llm.cache.num_blocks=32",
               "--single-lora", str(bad)])
    assert rc == 2
    assert "use_dora not supported" in capsys.readouterr().err


# ---- prefill from CUDA graphs ------------------------------------------------------------------
def test_padded_prefill_signature_equals_the_unpadded_prefill(stack_setup):
    """The stacked engine run on the staging a captured prefill uses (its arrays padded to the
    token and sequence buckets, the features' slots and groupings included: pad tokens in
    multi's slot 0) gives the real rows' logits of the unpadded prefill. CPU, fp32: the linears
    see 64 rows instead of 20 (another blocking of the sums), 1e-5."""
    from tgraph.testing import PagedBatcher

    tm, root, _ = stack_setup
    model = stacked_model(tm, root)
    batcher = PagedBatcher.for_model(model)
    batch = batcher.step([batcher.add(p) for p in PROMPTS])
    batch.loras = LORAS
    ref = model.run(batch).clone()
    state = model._graph_state()
    key = (True, STACKED)
    staging = state.step_inputs.prefill_staged((key, ("prefill", 64, 8)), batch, 64, 8, STACKED)
    staging.upload()
    slots = staging.inputs["lora_token_slots"]
    assert slots.shape == (64,) and not slots[batch.num_tokens:].any()
    assert staging.inputs["lora_seg_start"][1] == 64 - sum(
        len(p) for p, n in zip(PROMPTS, LORAS) if n)  # slot 0: no-adapter and pad tokens
    got = state.engines[key].forward(staging.inputs)["model_out"][:len(ref)]
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)



def test_gpu_tests_prefill_shrinks_alike_padded_and_unpadded():
    """``test_lora_gpu``'s bit-exact mix (bucket4) prefills 119 tokens, padded to the 128-token
    bucket when captured: each adapted linear's shrink must launch alike at both counts (the
    slot-tile kernel, the same K splits, so the same fp32 sums), stacked as multi-only. Its
    decode (4 tokens, a bucket) is not padded."""
    from tests.models import test_lora_gpu as gpu
    from tgraph.kernels.triton.lora import lora_concat_splits
    from tgraph.models.base.batch import prefill_token_bucket
    from tgraph.models.base.llm_config import LlmConfig
    from tgraph.tuning import LoraTuning

    cfg, rank = gpu.CONFIG, gpu.MAX_RANK
    hidden = cfg["hidden_size"]
    # target -> (K, packed rank): both features adapt every module (q/k/v, gate/up packed)
    shapes = {"qkv_proj": (hidden, 3 * rank), "o_proj": (hidden, rank),
              "gate_up_proj": (hidden, 2 * rank), "down_proj": (cfg["intermediate_size"], rank)}
    real = sum(gpu.PROMPT_LENGTHS[:len(gpu.MIXES["bucket4"])])
    padded = prefill_token_bucket(real, LlmConfig.prefill_graph_tokens)
    assert (real, padded) == (119, 128)
    rows_max = LoraTuning().rows_max_tokens
    assert (real <= rows_max) == (padded <= rows_max)
    for target, (k, r) in shapes.items():
        for second in ({}, dict(second_rank=r, second_slots=2)):
            got = [lora_concat_splits(t, k, r, gpu.MAX_LORAS + 1, "cpu", **second)
                   for t in (real, padded)]
            assert got[0] == got[1], (target, second, got)

GPU_CONFIG: dict[str, Any] = dict(
    model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=512, hidden_size=256,
    intermediate_size=512, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
    head_dim=32, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=512,
    tie_word_embeddings=False)
# name -> write_random_adapter kwargs (PEFT is not needed on the GPU machine)
GPU_ADAPTERS: dict[str, dict[str, Any]] = {
    "dom": dict(seed=1, rank=8, alpha=16),
    "qv": dict(seed=2, rank=4, alpha=8, target_modules=["q_proj", "v_proj"]),
    "mlp": dict(seed=3, rank=2, alpha=4, target_modules=["gate_proj", "down_proj", "o_proj"]),
}


@pytest.mark.gpu
@pytest.mark.parametrize("features", [STACKED, ("multi_lora",), ("single_lora",)],
                         ids=["stacked", "multi", "single"])
def test_captured_lora_prefill_and_decode_match_uncaptured(tmp_path, features):
    """LoRA prefills (a mixed batch, then a larger one in another token bucket) run from CUDA
    graphs, then decode from captured graphs: the same greedy tokens and, within fp32
    tolerance (padded GEMMs may sum in another order: 1e-4), the same logits as the same model
    with no CUDA graphs at all."""
    from tgraph.bench.lora import write_random_adapter
    from tgraph.bench.models import random_weights
    from tgraph.io.model_config import ModelConfig
    from tgraph.io.weights import DictWeightLoader
    from tgraph.models.loading import build_model
    from tgraph.testing import PagedBatcher

    config = ModelConfig.from_dict(GPU_CONFIG)
    for name, kwargs in GPU_ADAPTERS.items():
        write_random_adapter(tmp_path / name, config, b_std=0.05, **kwargs)
    picks = LORAS if "multi_lora" in features else [None] * len(LORAS)
    rounds = [[list(range(3, 40)), [5, 6, 7], [9, 9, 9, 2], [100]],     # 45 tokens: bucket 128
              [list(range(1, 200)), list(range(9, 20)), [4], [8, 8]]]  # 213 tokens: bucket 256
    results = []
    for graphs in (True, False):
        loader = DictWeightLoader(random_weights(GPU_CONFIG, torch.float32, "cuda"),
                                  device="cuda", dtype=torch.float32)
        model = build_model(config, loader, max_model_len=512, cuda_graph=graphs,
                            prefill_graph_tokens=256, features=FEATURES)
        model.allocate_kv_cache(128)
        for name in MULTI:
            model.features["multi_lora"].load(name, tmp_path / name)
        if "single_lora" in features:
            model.features["single_lora"].load("dom", tmp_path / "dom")
            model.features["single_lora"].activate("dom")
        batcher = PagedBatcher.for_model(model)
        logits, tokens = [], []
        for prompts in rounds:
            ids = [batcher.add(p) for p in prompts]
            batch = batcher.step(ids)
            batch.loras = picks
            last = model.run(batch).clone()
            logits.append(last)
            for _ in range(3):
                nxt = [int(t) for t in last.argmax(-1)]
                tokens.append(nxt)
                for s, t in zip(ids, nxt):
                    batcher.append(s, t)
                batch = batcher.step(ids)
                batch.loras = picks
                last = model.run(batch).clone()
                logits.append(last)
        results.append((logits, tokens))
        captured = {sig for key, sig in model._graph_state().captured if key[1] == features}
        want = {("prefill", 128, 4), ("prefill", 256, 4), 4} if graphs else set()
        assert captured == want
        assert set(model.engines) == {(True, features), (False, features)}
    (got, got_tokens), (ref, ref_tokens) = results
    assert got_tokens == ref_tokens
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
