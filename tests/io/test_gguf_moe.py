"""Tests of mixture-of-experts GGUF files (:mod:`tgraph.io.gguf_moe`).

Tiny random Qwen3-MoE, Qwen2-MoE, OLMoE and Mixtral models are written the way llama.cpp's
``convert_hf_to_gguf.py`` writes them: each sparse layer's experts stacked into one 3-D tensor
per projection (``ffn_gate_exps`` / ``ffn_up_exps`` / ``ffn_down_exps``), the router as
``ffn_gate_inp`` (kept F32, as llama-quantize keeps it), Qwen2-MoE's shared expert as
``ffn_*_shexp`` and its gate as the 1-D ``ffn_gate_inp_shexp``, Mixtral as architecture
``llama`` with ``llama.expert_count`` and permuted q/k rows; in F32 and quantized (the 3-D
tensors quantized per row, as gguf-py quantizes them; K-quants as valid random blocks).

Oracle: the transformers model each file was written from, its weights replaced by the values the
file holds (``gguf.quants.dequantize`` of every quantized tensor), decoded greedily in fp32 on
CPU, where a tiny model's logits agree with tgraph's to ~1e-6 relative: any token difference is a
bug, not rounding.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from tests.helpers import EXACT_CPU_QUANT
from tests.io.test_gguf import (
    VOCAB,
    add_model_metadata,
    add_tokenizer,
    demo_vocab,
    encode,
    gguf_name,
    llama_cpp_permute,
)
from tgraph.cli import main
from tgraph.errors import ConfigError, WeightLoadError
from tgraph.io.checkpoint import open_checkpoint
from tgraph.io.gguf import QUANTIZED_TYPES, gguf_model_config, read_gguf_header
from tgraph.quant import is_quantized
from tgraph.runtime.llm import LLM
from tgraph.runtime.sampling_params import SamplingParams
from tgraph.testing import hf_greedy, random_hf_model

PROMPTS: list[list[int]] = [[1, 5, 9, 22, 7, 300], [3, 4], [17, 150, 8, 8, 8, 191, 0, 42, 600]]
STEPS = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True)
ARCH = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "mixtral": "llama", "olmoe": "olmoe"}
EXPERTS = 4

# Sizes are multiples of 32 (Q4_0 / Q8_0 blocks); the K-quant model's of 256. llama.cpp's
# qwen3moe renormalises the top-k probabilities and qwen2moe does not (norm_topk_prob), so the
# transformers models do the same. Qwen3-MoE keeps layer 1 dense (a layer without a router).
QWEN3 = dict(num_experts=EXPERTS, num_experts_per_tok=2, moe_intermediate_size=64,
             norm_topk_prob=True, head_dim=32, mlp_only_layers=[1], tie_word_embeddings=True)
QWEN2 = dict(num_experts=EXPERTS, num_experts_per_tok=2, moe_intermediate_size=64,
             norm_topk_prob=False, shared_expert_intermediate_size=96,
             tie_word_embeddings=False)
MIXTRAL = dict(num_local_experts=EXPERTS, num_experts_per_tok=2, tie_word_embeddings=False)
# OLMoE: q/k normalised over all heads, clamped (clamp_kqv); llama.cpp does not renormalise.
OLMOE = dict(num_experts=EXPERTS, num_experts_per_tok=2, intermediate_size=64,
             norm_topk_prob=False, clip_qkv=2.5, tie_word_embeddings=False)
MIXTRAL_K = dict(MIXTRAL, hidden_size=256, intermediate_size=256, num_hidden_layers=2)


def _router_f32(qtype: Q) -> Callable[[str], Q]:
    """Every weight in ``qtype`` but the routers (llama-quantize leaves ffn_gate_inp alone)."""
    return lambda name: Q.F32 if "ffn_gate_inp" in name else qtype


def _qwen2_q4_0(name: str) -> Q:
    """Q4_0 experts and attention, a Q8_0 shared expert and embedding, an F16 head."""
    if "ffn_gate_inp" in name:
        return Q.F32
    if "shexp" in name or "token_embd" in name:
        return Q.Q8_0
    return Q.F16 if name == "output.weight" else Q.Q4_0


def _k_quants(name: str) -> Q:
    """As a Q4_K_M file mixes them: Q4_K gate/up experts, Q6_K down experts and embedding."""
    if "ffn_gate_inp" in name:
        return Q.F32
    if "down" in name or "token_embd" in name:
        return Q.Q6_K
    return Q.Q5_K if "attn_v" in name else Q.Q4_K


def _low_bits(name: str) -> Q:
    """As a Q2_K / Q3_K_S file mixes them: Q2_K gate/up experts, Q3_K down experts, IQ4_XS
    attention and embedding."""
    if "ffn_gate_inp" in name:
        return Q.F32
    if "exps" in name:
        return Q.Q3_K if "down" in name else Q.Q2_K
    return Q.IQ4_XS


# name -> (family, config overrides, GGUF type of each 2-D / 3-D weight by GGUF name)
VARIANTS: dict[str, tuple[str, dict[str, Any], Callable[[str], Q]]] = {
    "qwen3_moe_f32": ("qwen3_moe", QWEN3, lambda name: Q.F32),
    "qwen3_moe_q8_0": ("qwen3_moe", QWEN3, _router_f32(Q.Q8_0)),
    "qwen2_moe_f16": ("qwen2_moe", QWEN2, _router_f32(Q.F16)),
    "qwen2_moe_q4_0": ("qwen2_moe", QWEN2, _qwen2_q4_0),
    "mixtral_f32": ("mixtral", MIXTRAL, lambda name: Q.F32),
    "mixtral_k_quants": ("mixtral", MIXTRAL_K, _k_quants),
    "mixtral_low_bits": ("mixtral", MIXTRAL_K, _low_bits),
    "olmoe_q8_0": ("olmoe", OLMOE, _router_f32(Q.Q8_0)),
}


# ---------------------------------------------------------------------------------- the writer
def gguf_parts(name: str, data: np.ndarray, arch: str) -> list[tuple[str, np.ndarray]]:
    """An HF state-dict tensor as llama.cpp's tensors (transformers holds experts stacked:
    ``experts.gate_up_proj [E, 2I, H]``, each expert's gate rows then its up rows)."""
    m = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.(.+)", name)
    if m is None or m[2].split(".")[0] not in ("experts", "gate", "shared_expert",
                                               "shared_expert_gate"):
        return [(gguf_name(name, arch), data)]
    blk, rest = f"blk.{m[1]}", m[2]
    if rest == "experts.gate_up_proj":
        inter = data.shape[1] // 2
        return [(f"{blk}.ffn_gate_exps.weight", data[:, :inter]),
                (f"{blk}.ffn_up_exps.weight", data[:, inter:])]
    if rest == "experts.down_proj":
        return [(f"{blk}.ffn_down_exps.weight", data)]
    if rest == "gate.weight":
        return [(f"{blk}.ffn_gate_inp.weight", data)]
    if rest == "shared_expert_gate.weight":  # llama.cpp reads it as a 1-D [hidden] tensor
        return [(f"{blk}.ffn_gate_inp_shexp.weight", data[0])]
    proj = re.fullmatch(r"shared_expert\.(gate|up|down)_proj\.weight", rest)
    assert proj is not None, name
    return [(f"{blk}.ffn_{proj[1]}_shexp.weight", data)]


def head_dim_of(c: Any) -> int:
    return getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads


def qk_rows(hf: Any, name: str) -> np.ndarray | None:
    """The rows llama.cpp's permutation puts at each place of a Llama q/k weight, else None."""
    c = hf.config
    if ARCH[c.model_type] != "llama" or not re.search(r"\.(q|k)_proj\.", name):
        return None
    kv = c.num_attention_heads if ".q_proj." in name else c.num_key_value_heads
    rows = (c.num_attention_heads if ".q_proj." in name else kv) * head_dim_of(c)
    return llama_cpp_permute(np.arange(rows)[:, None], c.num_attention_heads, kv)[:, 0]


def write_moe_gguf(path: Path, hf: Any, vocab: dict[str, Any], types: Callable[[str], Q],
                   drop: tuple[str, ...] = (), expert_count: int | None = None,
                   per_expert: bool = False) -> tuple[Path, dict[str, np.ndarray]]:
    """Write ``hf`` as llama.cpp would.

    Args:
        types: GGUF name -> the GGUF type of a 2-D or 3-D weight (1-D tensors are F32).
        drop: GGUF tensors to leave out.
        expert_count: the ``expert_count`` metadata (default: the model's).
        per_expert: one tensor per expert (``blk.N.ffn_gate.E.weight``, as written), as
            llama.cpp wrote Mixtral before it stacked experts.

    Returns:
        The file and the values it holds (dequantized, in GGUF row order) by GGUF name.
    """
    c = hf.config
    arch = ARCH[c.model_type]
    w = gguf.GGUFWriter(str(path), arch)
    add_model_metadata(w, c, arch, "tiny moe")
    experts = getattr(c, "num_experts", None) or c.num_local_experts
    w.add_expert_count(expert_count or experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    if arch in ("qwen2moe", "qwen3moe"):
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
    if getattr(c, "clip_qkv", None) is not None:
        w.add_clamp_kqv(c.clip_qkv)
    if arch == "qwen2moe":
        w.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    add_tokenizer(w, vocab)
    rng = np.random.default_rng(5)
    held: dict[str, np.ndarray] = {}
    for hf_name, t in hf.state_dict().items():
        if hf_name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        data = t.detach().float().numpy()
        rows = qk_rows(hf, hf_name)
        if rows is not None:
            data = data[rows]
        for name, part in gguf_parts(hf_name, data, arch):
            if name in drop:
                continue
            if per_expert and name.endswith("_exps.weight"):
                for e, one in enumerate(part):
                    w.add_tensor(name.replace("_exps", f".{e}"), one)
                held[name] = part
                continue
            qtype = Q.F32 if part.ndim == 1 else types(name)
            if qtype in (Q.F32, Q.F16):
                stored = part.astype(np.float32 if qtype == Q.F32 else np.float16)
                w.add_tensor(name, stored)
                held[name] = stored.astype(np.float32)
                continue
            flat = encode(np.ascontiguousarray(part).reshape(-1, part.shape[-1]), qtype, rng)
            blocks = flat.reshape(*part.shape[:-1], flat.shape[-1])  # experts slice by slice
            w.add_tensor(name, blocks, raw_dtype=qtype)
            held[name] = gguf.quants.dequantize(blocks, qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, held


def reference(hf: Any, held: dict[str, np.ndarray]) -> Any:
    """``hf`` with the weights the file holds (q/k rows back in HF's order)."""
    state = {}
    for hf_name, t in hf.state_dict().items():
        source = "model.embed_tokens.weight" if hf_name == "lm_head.weight" and \
            hf.config.tie_word_embeddings else hf_name  # a tied head: the file's embedding
        parts = [held[n] for n, _ in gguf_parts(source, t.detach().numpy(),
                                                ARCH[hf.config.model_type])]
        value = np.concatenate(parts, axis=1) if len(parts) > 1 else parts[0]
        rows = qk_rows(hf, hf_name)
        if rows is not None:
            value = value[np.argsort(rows)]
        state[hf_name] = torch.from_numpy(np.ascontiguousarray(value)).reshape(t.shape)
    hf.load_state_dict(state)
    return hf


@pytest.fixture(scope="session")
def vocab(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return demo_vocab(tmp_path_factory.mktemp("gguf-moe-vocab"))


@pytest.fixture(scope="session")
def moe_gguf(tmp_path_factory: pytest.TempPathFactory, vocab: dict[str, Any]
             ) -> Callable[[str], tuple[Path, Any, dict[str, np.ndarray]]]:
    """``moe_gguf(variant) -> (file, transformers model of its values, values by GGUF name)``,
    once per session."""
    cache: dict[str, tuple[Path, Any, dict[str, np.ndarray]]] = {}

    def get(variant: str) -> tuple[Path, Any, dict[str, np.ndarray]]:
        if variant not in cache:
            family, overrides, types = VARIANTS[variant]
            hf = random_hf_model(family, seed=3, vocab_size=VOCAB, bos_token_id=vocab["bos"],
                                 eos_token_id=vocab["eos"], **overrides)
            path, held = write_moe_gguf(tmp_path_factory.mktemp(variant) / f"{variant}.gguf",
                                        hf, vocab, types)
            cache[variant] = (path, reference(hf, held), held)
        return cache[variant]

    return get


def _llm(path: Path, graph: str = "static", tokenizer: Any = None) -> LLM:
    return LLM(path, device="cpu", dtype="float32", graph=graph, max_model_len=64,
               num_blocks=64, block_size=4, tokenizer=tokenizer, **EXACT_CPU_QUANT)


# ---------------------------------------------------------------------------------- config
@pytest.mark.parametrize("variant", ["qwen3_moe_f32", "qwen2_moe_f16", "mixtral_f32"])
def test_config_has_the_moe_keys(variant: str, moe_gguf: Callable) -> None:
    path, hf, _ = moe_gguf(variant)
    config = gguf_model_config(path)
    d, want = config.hf_config, hf.config
    assert config.model_type == want.model_type
    assert d["num_experts_per_tok"] == want.num_experts_per_tok
    if want.model_type == "mixtral":
        assert d["num_local_experts"] == want.num_local_experts
        assert config.intermediate_size == want.intermediate_size
        return
    assert d["num_experts"] == want.num_experts
    assert d["moe_intermediate_size"] == want.moe_intermediate_size
    assert d["norm_topk_prob"] == want.norm_topk_prob  # llama.cpp's choice per architecture
    assert d["mlp_only_layers"] == list(want.mlp_only_layers)  # layers without a router
    if want.model_type == "qwen2_moe":
        assert d["shared_expert_intermediate_size"] == want.shared_expert_intermediate_size
        assert d["qkv_bias"] is True


def test_olmoe_config_keeps_its_clamp_and_routing(moe_gguf: Callable) -> None:
    config = gguf_model_config(moe_gguf("olmoe_q8_0")[0])
    d = config.hf_config
    assert config.model_type == "olmoe" and d["clip_qkv"] == 2.5
    assert (d["num_experts"], d["num_experts_per_tok"]) == (EXPERTS, 2)
    assert d["norm_topk_prob"] is False and config.intermediate_size == 64


# ------------------------------------------------------------------------ models vs transformers
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_tokens_match_transformers(variant: str, moe_gguf: Callable,
                                          tmp_path: Path) -> None:
    path, ref, _ = moe_gguf(variant)
    tokenizer = None
    if ARCH[ref.config.model_type] == "olmoe":  # transformers tokenizes no olmoe file: given
        from tgraph.runtime.demo_tokenizer import build_demo_tokenizer

        tokenizer = build_demo_tokenizer(tmp_path)
    llm = _llm(path, tokenizer=tokenizer)
    got = [r.token_ids for r in llm.generate(PROMPTS, GREEDY)]
    assert got == hf_greedy(ref, PROMPTS, STEPS)
    # Quantized experts stay packed: flat [E * 2I, H] and [E * H, I] weights of the file's type.
    experts = llm.model.model.layers[0].mlp.experts
    w13, w2 = experts.w13.data, experts.w2.data
    _, overrides, types = VARIANTS[variant]
    hidden = overrides.get("hidden_size", 64)
    inter = overrides.get("moe_intermediate_size", overrides.get("intermediate_size", 96))
    gate_type, down_type = types("blk.0.ffn_gate_exps.weight"), types("blk.0.ffn_down_exps.weight")
    if gate_type in QUANTIZED_TYPES:
        assert is_quantized(w13) and w13.scheme == QUANTIZED_TYPES[gate_type]
        assert is_quantized(w2) and w2.scheme == QUANTIZED_TYPES[down_type]
        assert tuple(w13.shape) == (EXPERTS * 2 * inter, hidden)
        assert tuple(w2.shape) == (EXPERTS * hidden, inter)
    else:
        assert not is_quantized(w13) and tuple(w13.shape) == (EXPERTS, 2 * inter, hidden)


def test_eager_graph_matches_too(moe_gguf: Callable) -> None:
    path, ref, _ = moe_gguf("qwen2_moe_q4_0")
    got = [r.token_ids for r in _llm(path, "eager").generate(PROMPTS, GREEDY)]
    assert got == hf_greedy(ref, PROMPTS, STEPS)


@pytest.mark.parametrize("variant", ["qwen3_moe_q8_0", "mixtral_k_quants", "mixtral_low_bits"])
def test_each_expert_reads_as_its_slice_bit_for_bit(variant: str, moe_gguf: Callable) -> None:
    """Expert e of a stacked tensor is the file's e-th slice: repacked, it dequantizes to exactly
    what gguf-py dequantizes."""
    path, _, held = moe_gguf(variant)
    block, names = ("block_sparse_moe", ("w1", "w3", "w2")) if variant.startswith("mixtral") \
        else ("mlp", ("gate_proj", "up_proj", "down_proj"))
    _, loader = open_checkpoint(path, gguf_model_config(path), dtype=torch.float32)
    for proj, name in zip(("gate", "up", "down"), names):
        want = torch.from_numpy(held[f"blk.0.ffn_{proj}_exps.weight"])
        for e in range(EXPERTS):
            got = loader.get_tensor(f"model.layers.0.{block}.experts.{e}.{name}.weight")
            assert is_quantized(got)
            assert torch.equal(got.dequantize(torch.float32).view(torch.int32),
                               want[e].view(torch.int32)), (proj, e)


def test_mixtral_with_one_tensor_per_expert(tmp_path: Path, vocab: dict[str, Any]) -> None:
    """Older llama.cpp files hold Mixtral's experts one tensor each."""
    hf = random_hf_model("mixtral", seed=4, vocab_size=VOCAB, **MIXTRAL)
    path, held = write_moe_gguf(tmp_path / "per-expert.gguf", hf, vocab, lambda name: Q.F32,
                                per_expert=True)
    assert "blk.1.ffn_down.3.weight" in read_gguf_header(path).tensors
    got = [r.token_ids for r in _llm(path).generate(PROMPTS, GREEDY)]
    assert got == hf_greedy(reference(hf, held), PROMPTS, STEPS)


@pytest.mark.parametrize("variant, scheme", [("qwen3_moe_q8_0", "int8 g32 sym"),
                                             ("mixtral_f32", None)])
def test_check_model_reads_every_expert(variant: str, scheme: str | None, moe_gguf: Callable,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    """Every expert slice is used (none reported unused) and scanned; packed experts listed."""
    path, _, _ = moe_gguf(variant)
    assert main(["check-model", str(path)]) == 0
    out = capsys.readouterr().out
    if scheme is not None:
        assert f"quantized: model.layers.0.mlp.experts.w13: {scheme}" in out
    else:
        assert "quantized:" not in out
    assert "UNUSED" not in out and out.rstrip().endswith("OK")


def test_check_model_names_the_expert_holding_a_nan(tmp_path: Path, moe_gguf: Callable,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    path, _, _ = moe_gguf("mixtral_f32")
    info = read_gguf_header(path).tensors["blk.1.ffn_up_exps.weight"]
    data = bytearray(path.read_bytes())
    at = info.offset + 3 * info.nbytes // EXPERTS + 4 * 100  # expert 3, value 100
    data[at:at + 4] = np.array([np.nan], np.float32).tobytes()
    bad = tmp_path / "nan.gguf"
    bad.write_bytes(bytes(data))
    assert main(["check-model", str(bad)]) == 1
    out = capsys.readouterr().out
    assert "tensor 'model.layers.1.block_sparse_moe.experts.3.w3.weight' holds 1 NaN" in out


# --------------------------------------------------------------------------------- refusals
def test_a_missing_expert_tensor_is_named(tmp_path: Path, vocab: dict[str, Any]) -> None:
    hf = random_hf_model("qwen3_moe", vocab_size=VOCAB, **QWEN3)
    path, _ = write_moe_gguf(tmp_path / "missing.gguf", hf, vocab, _router_f32(Q.Q8_0),
                             drop=("blk.2.ffn_down_exps.weight",))
    with pytest.raises(WeightLoadError) as err:
        _llm(path)
    message = str(err.value)
    assert "tensor 'model.layers.2.mlp.experts.0.down_proj.weight' not found" in message
    assert ("it is read from expert 0 of the stacked GGUF tensor 'blk.2.ffn_down_exps.weight', "
            "which the file does not have") in message


def test_an_expert_count_the_tensors_do_not_hold_is_refused(tmp_path: Path,
                                                            vocab: dict[str, Any]) -> None:
    hf = random_hf_model("mixtral", vocab_size=VOCAB, **MIXTRAL)
    path, _ = write_moe_gguf(tmp_path / "five.gguf", hf, vocab, _router_f32(Q.Q8_0),
                             expert_count=5)
    with pytest.raises(ConfigError, match=re.escape(
            "stacked expert tensor 'blk.0.ffn_gate_exps.weight' (Q8_0 [4, 96, 64]) does not "
            "match the metadata (llama.expert_count 5, hidden 64, expert width 96): expected "
            "[5, 96, 64]")):
        gguf_model_config(path)


def test_a_truncated_expert_tensor_is_named(tmp_path: Path, moe_gguf: Callable) -> None:
    path, _, _ = moe_gguf("qwen2_moe_q4_0")
    header = read_gguf_header(path)
    last = max((t for t in header.tensors.values() if t.name.endswith("_exps.weight")),
               key=lambda t: t.offset)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:last.offset + last.nbytes // 2])
    with pytest.raises(WeightLoadError, match=rf"tensor '{re.escape(last.name)}' \(Q4_0 "
                                              r"\[4, \d+, \d+\]\) needs bytes .* the file is "
                                              "truncated"):
        gguf_model_config(cut)
