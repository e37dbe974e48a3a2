"""LoRA under tensor parallelism: single + multi adapters stacked, at world size 2 (gloo, CPU,
``lora_worker.py`` under torchrun, bounded by a timeout that kills the whole job), against world
size 1 in this process and against PEFT.

Adapters are split as their base linears are (A whole and B's rows for q/k/v and gate/up, by
heads for q/k/v; A's columns and B whole for o and down, whose one all-reduce sums the base and
the delta). Checkpoints: a tiny Llama with its 2 KV heads split over the ranks, the same with one
KV head replicated on both (its k/v B whole on each rank), and a Qwen2 (q/k/v biases).

Greedy tokens must be equal: world size 2 only reorders fp32 sums (~1e-7 on logits of order 1,
see test_tp_gloo.py), far below the top-1 gaps of these random models; and the world size 1
tokens equal PEFT's (the single adapter merged into the base, the request's adapter on top).
"""
from __future__ import annotations

import copy
import json
import os
import signal
from pathlib import Path

import pytest
import torch

from tests.distributed.launch import finish, start_torchrun
from tests.distributed.lora_worker import MAX_TOKENS, MULTI, PICKS, PROMPTS
from tests.models.test_lora import make_adapter
from tgraph.testing import make_tiny_hf_model

WORKER = Path(__file__).resolve().with_name("lora_worker.py")
LAUNCH_TIMEOUT_S = 300.0  # ~60 s on 2 shared CPU cores; a hang fails here instead
ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> (seed, LoraConfig kwargs), as in tests/models/test_lora_stacking.py
ADAPTERS = {"dom": (11, dict(r=8, lora_alpha=16, use_rslora=True, target_modules=ALL_MODULES)),
            "dom2": (12, dict(r=4, lora_alpha=8, target_modules=ALL_MODULES)),
            "qv": (13, dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])),
            "mlp": (14, dict(r=2, lora_alpha=4, target_modules=["gate_proj", "down_proj",
                                                                 "o_proj"]))}
# name -> (family, config overrides)
CHECKPOINTS = {"split": ("llama", {}), "replicated": ("llama", {"num_key_value_heads": 1}),
               "qwen2": ("qwen2", {})}
# graph modes with the single adapter recorded in the engines, and merged into the weights
MODES = ("static", "eager", "static+merged")


@pytest.fixture(scope="module")
def tp_lora(tmp_path_factory: pytest.TempPathFactory):
    """Checkpoints and adapters written here, the torchrun job, and meanwhile the world size 1
    references. Returns ``(each rank's reports, references, PEFT tokens)``."""
    from transformers import AutoModelForCausalLM

    from tests.distributed.lora_worker import run

    root = tmp_path_factory.mktemp("tp_lora")
    models, hfs = {}, {}
    for name, (family, overrides) in CHECKPOINTS.items():
        models[name] = make_tiny_hf_model(family, root / "models" / name, seed=5, **overrides)
        hfs[name] = AutoModelForCausalLM.from_pretrained(models[name],
                                                         dtype=torch.float32).eval()
        for adapter, (seed, kwargs) in ADAPTERS.items():
            make_adapter(hfs[name], root / "adapters" / name / adapter, seed, **kwargs)
    out = root / "out"
    job = start_torchrun([str(WORKER), "--adapters", str(root / "adapters"), "--out", str(out),
                          "--modes", ",".join(MODES),
                          *[a for n, p in models.items() for a in ("--model", f"{n}={p}")]])
    try:
        # The world size 1 references and PEFT's tokens, while the ranks run.
        references = {(n, m): run(str(models[n]), root / "adapters" / n, m, 60.0)
                      for n in CHECKPOINTS for m in MODES}
        peft = {n: {single: _peft_tokens(hfs[n], root / "adapters" / n, single)
                    for single in ("dom", "dom2")} for n in CHECKPOINTS}
    except BaseException:
        os.killpg(job.proc.pid, signal.SIGKILL)
        job.proc.wait()
        raise
    launch = finish(job, LAUNCH_TIMEOUT_S)
    assert launch.rc == 0, f"the launch failed:\n{launch.output[-6000:]}"
    reports = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    return reports, references, peft


@torch.no_grad()
def _peft_tokens(hf, adapters: Path, single: str) -> list[list[int]]:
    """PEFT's greedy tokens: ``single`` merged into the base, each request's adapter on top."""
    from peft import PeftModel

    merged = PeftModel.from_pretrained(copy.deepcopy(hf), adapters / single).merge_and_unload()
    oracles = {None: merged.eval()}
    for name in MULTI:
        oracles[name] = PeftModel.from_pretrained(copy.deepcopy(merged), adapters / name).eval()
    tokens = []
    for prompt, pick in zip(PROMPTS, PICKS):
        seq = list(prompt)
        for _ in range(MAX_TOKENS):
            seq.append(int(oracles[pick](torch.tensor([seq]), use_cache=False).logits[0, -1]
                           .argmax()))
        tokens.append(seq[len(prompt):])
    return tokens


CASES = [(n, m) for n in CHECKPOINTS for m in MODES]


@pytest.mark.parametrize("name,mode", CASES, ids=[f"{n}-{m}" for n, m in CASES])
def test_tp2_single_and_multi_lora_match_tp1_and_peft(tp_lora, name: str, mode: str) -> None:
    reports, references, peft = tp_lora
    ref = references[(name, mode)]
    for single in ("dom", "dom2"):
        assert ref[single] == peft[name][single], f"world size 1 {name}/{mode} {single} vs PEFT"
    for r, report in enumerate(reports):
        got = report[f"{name}/{mode}"]
        assert (got["rank"], got["world_size"]) == (r, 2)
        for single in ("dom", "dom2"):
            assert got[single] == ref[single], f"rank {r} {name}/{mode} {single}"
        before, after = got["engines"]
        assert before == after, f"rank {r}: switching the single adapter built an engine"
        # Greedy LoRA decode steps sample from the vocabulary slices (the features stack).
        assert got["sliced_steps"] > 0, f"rank {r}: no LoRA step took the vocab-parallel path"
        if mode.endswith("+merged"):  # the base and multi-LoRA engines serve the merged weights
            assert not any("single_lora" in key for key in before), before
            assert any("'multi_lora'" in key for key in before), before
            continue
        assert any("multi_lora', 'single_lora'" in key for key in before), before
        assert any("'single_lora', 'vocab_parallel'" in key for key in after), after
