"""Tests of the GGUF reader (:mod:`tgraph.io.gguf`).

Tiny GGUF files are written here from tiny random Hugging Face models with ``gguf.GGUFWriter``
the way llama.cpp's ``convert_hf_to_gguf.py`` writes them: llama.cpp's tensor names and metadata
keys, its q/k row permutation for the Llama architecture, and a byte-level BPE vocabulary (the
demo tokenizer's) so that transformers can build the tokenizer with ``gguf_file=``. Weights are
quantized with ``gguf.quants.quantize`` where it can (F16, BF16, Q4_0, Q4_1, Q8_0); the K-quants
(which gguf-py only dequantizes) get valid random blocks.

Oracles: ``gguf.quants.dequantize`` for every repacked type (bit-exact), ``gguf.GGUFReader`` for
the header, and transformers' own loading of the same file for the greedy tokens. Everything runs
in fp32 on CPU, where a tiny model's logits agree with transformers to ~1e-6 relative, far below
the gap between its top two logits: any token difference is a bug, not rounding.
"""
from __future__ import annotations

import functools
import json
import math
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
from tgraph.cli import main
from tgraph.errors import ConfigError, WeightLoadError
from tgraph.io.checkpoint import open_checkpoint
from tgraph.io.gguf import (
    QUANTIZED_TYPES,
    GGUFLoader,
    gguf_model_config,
    read_gguf_header,
    read_gguf_model,
    repack_blocks,
)
from tgraph.runtime.llm import LLM
from tgraph.runtime.sampling_params import SamplingParams
from tgraph.testing import hf_greedy, random_hf_model

# The demo tokenizer's vocabulary (768 tokens) is the tiny models' vocabulary.
VOCAB = 768
PROMPTS: list[list[int]] = [[1, 5, 9, 22, 7, 300], [3, 4], [17, 150, 8, 8, 8, 191, 0, 42, 600],
                            [121]]
STEPS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True)
# K-quant super-blocks hold 256 values: rows of those tensors must be multiples of 256.
K_SHAPES = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                num_key_value_heads=2, num_hidden_layers=2)

@functools.cache
def _name_map(arch: str) -> Any:
    """gguf-py's map of HF names to llama.cpp's for ``arch``, as convert_hf_to_gguf uses it."""
    (which,) = [a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == arch]
    return gguf.get_tensor_name_map(which, 128)


def gguf_name(hf: str, arch: str = "llama") -> str:
    base, _, kind = hf.rpartition(".")
    # Qwen3-MoE's dense layers (mlp_only_layers) are named as Llama's: gguf-py lists none.
    name = _name_map(arch).get_name(base) or _name_map("llama").get_name(base)
    assert name is not None, f"gguf-py maps no {arch} tensor to {hf}"
    return f"{name}.{kind}"


def llama_cpp_permute(w: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, verbatim."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


# Every type the loader reads, as its refusals list them.
ALL_TYPES = ("F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, "
             "IQ4_XS")
RANDOM_BLOCK_TYPES = (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_NL, Q.IQ4_XS)


def random_blocks(qtype: Q, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Valid random blocks of a K-quant or IQ4 type (every byte pattern is a valid code or scale;
    the fp16 super-block scales are finite, of both signs, some zero)."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    n = rows * cols // block
    data = rng.integers(0, 256, (n, size), dtype=np.uint8)

    def halves(scale: float) -> np.ndarray:
        h = (rng.standard_normal(n) * scale).astype(np.float16)
        h[::7] = 0  # zero scales (and mins) happen in real files
        return h.view(np.uint8).reshape(n, 2)

    if qtype in (Q.Q4_K, Q.Q5_K):  # d, dmin, 12 bytes of 6-bit scales/mins, codes
        data[:, 0:2], data[:, 2:4] = halves(2e-4), halves(2e-4)
    elif qtype == Q.Q6_K:  # codes, 16 int8 scales, d last
        data[:, 208:210] = halves(2e-4)
    elif qtype == Q.Q2_K:  # 16 scale/min bytes, codes, d, dmin
        data[:, 80:82], data[:, 82:84] = halves(5e-3), halves(5e-3)
    elif qtype == Q.Q3_K:  # high-bit mask, codes, 12 bytes of 6-bit scales, d
        data[:, 108:110] = halves(2e-4)
    elif qtype in (Q.IQ4_NL, Q.IQ4_XS):  # d first (IQ4_XS: then 6-bit scales, codes)
        data[:, 0:2] = halves(1e-4)
    else:
        raise ValueError(qtype)
    return data.reshape(rows, cols // block * size)


def encode(w: np.ndarray, qtype: Q, rng: np.random.Generator) -> np.ndarray:
    """A weight in a GGUF type: quantized by gguf-py, or random valid blocks of the types it
    cannot quantize (the K-quants and IQ4)."""
    if qtype in RANDOM_BLOCK_TYPES:
        return random_blocks(qtype, *w.shape, rng)
    return gguf.quants.quantize(w.astype(np.float32), qtype)


def demo_vocab(cache: Path) -> dict[str, Any]:
    """The demo tokenizer as convert_hf_to_gguf's gpt2 vocabulary: tokens by id, token types,
    merges, special ids and chat template."""
    from tgraph.runtime.demo_tokenizer import CHAT_TEMPLATE, build_demo_tokenizer

    tok = build_demo_tokenizer(cache)
    spec = json.loads(tok.backend_tokenizer.to_str())
    vocab = dict(spec["model"]["vocab"])
    special = {t["content"]: t["id"] for t in spec["added_tokens"]}
    vocab.update(special)
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    assert len(tokens) == VOCAB
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    types = [3 if t in special else 1 for t in tokens]  # 3: control, 1: normal
    return dict(tokens=tokens, types=types, merges=merges, bos=tok.bos_token_id,
                eos=tok.eos_token_id, template=CHAT_TEMPLATE)


def add_model_metadata(w: Any, c: Any, arch: str, name: str) -> None:
    """The shape metadata llama.cpp writes for HF config ``c`` under architecture ``arch``."""
    w.add_name(name)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    rope = c.rope_parameters
    rope = rope.get("full_attention", rope)  # per layer type (Gemma 3): the global base
    w.add_rope_freq_base(float(getattr(c, "rope_theta", None) or rope["rope_theta"]))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    if arch == "llama":
        w.add_rope_dimension_count(head_dim)
    if arch == "phi3":  # llama.cpp writes the rotated dims (a fraction of them in Phi-4-mini)
        rope = c.rope_parameters
        w.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
    if head_dim != c.hidden_size // c.num_attention_heads:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if arch == "gemma3":
        w.add_sliding_window(c.sliding_window)


def add_tokenizer(w: Any, vocab: dict[str, Any]) -> None:
    """The demo tokenizer (:func:`demo_vocab`) as GGUF tokenizer metadata."""
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(vocab["tokens"])
    w.add_token_types(vocab["types"])
    w.add_token_merges(vocab["merges"])
    w.add_bos_token_id(vocab["bos"])
    w.add_eos_token_id(vocab["eos"])
    w.add_chat_template(vocab["template"])


def write_gguf(path: Path, hf: Any, vocab: dict[str, Any], types: Callable[[str, tuple], Q],
               arch: str | None = None, name: str = "tiny", extra: dict[str, Any] | None = None,
               extra_tensors: dict[str, np.ndarray] | None = None,
               split_max_tensors: int = 0) -> Path:
    """Write ``hf`` as llama.cpp would (names, metadata, q/k permutation, tokenizer).

    Args:
        types: HF tensor name and shape -> the GGUF type of a 2-D weight (1-D tensors are F32).
        arch: general.architecture (default: the family's).
        extra: metadata to add ({key: value}, e.g. a rope scaling type).
        extra_tensors: F32 tensors to add by GGUF name (e.g. ``rope_freqs.weight``).
        split_max_tensors: split the model into parts of this many tensors, as llama.cpp's
            gguf-split does (``path`` then names no file: the parts are
            ``STEM-00001-of-0000N.gguf`` beside it).
    """
    c = hf.config
    arch = arch or {"mistral": "llama", "gemma3_text": "gemma3"}.get(c.model_type, c.model_type)
    w = gguf.GGUFWriter(str(path), arch, split_max_tensors=split_max_tensors)
    add_model_metadata(w, c, arch, name)
    for key, value in (extra or {}).items():
        if isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, int):
            w.add_uint16(key, value)
        else:
            w.add_float32(key, value)
    add_tokenizer(w, vocab)
    if c.pad_token_id is not None and c.pad_token_id < c.vocab_size:
        w.add_pad_token_id(c.pad_token_id)  # transformers' Phi3Config would default to 32000
    rng = np.random.default_rng(7)
    for hf_name, t in hf.state_dict().items():
        if hf_name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        data = t.detach().float().numpy()
        if arch == "llama" and re.search(r"\.(q|k)_proj\.", hf_name):
            kv = c.num_attention_heads if ".q_proj." in hf_name else c.num_key_value_heads
            data = llama_cpp_permute(data, c.num_attention_heads, kv)
        if arch == "gemma3" and hf_name.endswith("norm.weight"):
            data = data + 1  # llama.cpp's converter stores Gemma's norm scales with the one
        if data.ndim == 1:
            w.add_tensor(gguf_name(hf_name, arch), data.astype(np.float32))
            continue
        qtype = types(hf_name, data.shape)
        if qtype == Q.F32:
            w.add_tensor(gguf_name(hf_name, arch), data)
        elif qtype == Q.F16:
            w.add_tensor(gguf_name(hf_name, arch), data.astype(np.float16))
        else:
            w.add_tensor(gguf_name(hf_name, arch), encode(data, qtype, rng), raw_dtype=qtype)
    for gguf_key, data in (extra_tensors or {}).items():
        w.add_tensor(gguf_key, data.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# name -> (family, config overrides, GGUF type of each 2-D weight, general.name)
def _mixed(name: str, shape: tuple) -> Q:
    """Different types in one model: Q8_0 embedding, Q4_0 attention, Q4_1 MLP, F16 head."""
    if "embed" in name:
        return Q.Q8_0
    if "lm_head" in name:
        return Q.F16
    return Q.Q4_0 if "self_attn" in name else Q.Q4_1


def _k_quants(name: str, shape: tuple) -> Q:
    """Q4_K / Q5_K / Q6_K as a Q4_K_M file mixes them (Q6_K embedding)."""
    if "embed" in name or "down_proj" in name:
        return Q.Q6_K
    return Q.Q5_K if "v_proj" in name or "up_proj" in name else Q.Q4_K


def _fallbacks(name: str, shape: tuple) -> Q:
    """The types llama.cpp writes into a K-quant file for rows that are not whole 256-value
    super-blocks (a Q4_K_M of a model of hidden 896): Q5_0, Q5_1 and IQ4_NL."""
    if "embed" in name or "lm_head" in name:
        return Q.Q8_0
    if "gate_proj" in name:
        return Q.IQ4_NL
    return Q.Q5_1 if "up_proj" in name or "o_proj" in name else Q.Q5_0


def _low_bits(name: str, shape: tuple) -> Q:
    """Q2_K / Q3_K / IQ4_XS, as Q2_K, Q3_K_M and IQ4_XS files mix them."""
    if "embed" in name or "lm_head" in name:
        return Q.IQ4_XS
    if "q_proj" in name or "k_proj" in name or "up_proj" in name:
        return Q.Q2_K
    return Q.Q3_K if "down_proj" in name or "o_proj" in name else Q.IQ4_XS


VARIANTS: dict[str, tuple[str, dict[str, Any], Callable[[str, tuple], Q], str]] = {
    "llama": ("llama", {"tie_word_embeddings": False}, _mixed, "tiny"),
    "llama_tied_q4_1": ("llama", {"tie_word_embeddings": True},
                        lambda n, s: Q.Q8_0 if "embed" in n else Q.Q4_1, "tiny"),
    "llama_k_quants": ("llama", {"tie_word_embeddings": False, **K_SHAPES}, _k_quants, "tiny"),
    "qwen2": ("qwen2", {"tie_word_embeddings": False}, _mixed, "tiny"),
    "qwen2_fallbacks": ("qwen2", {"tie_word_embeddings": False}, _fallbacks, "tiny"),
    "llama_low_bits": ("llama", {"tie_word_embeddings": False, **K_SHAPES}, _low_bits, "tiny"),
    # transformers reads no head_dim from a qwen3 GGUF (it keeps Qwen3Config's 128): use 128,
    # which is not hidden / heads, so tgraph must read attention.key_length.
    "qwen3": ("qwen3", {"tie_word_embeddings": True, "head_dim": 128},
              lambda n, s: Q.Q8_0, "tiny"),
    # llama.cpp writes Mistral as "llama" (tgraph tells it by its name). transformers loads it
    # as Llama: its own "mistral" GGUF path needs an architecture gguf-py does not have.
    "mistral": ("mistral", {"tie_word_embeddings": False},
                lambda n, s: Q.F16 if "embed" in n else Q.Q4_0, "Mistral 7B Instruct v0.3"),
    # Gemma 3: norms stored with the one added, four a layer; five sliding layers (window 4) to
    # one full. head_dim 256 = query_pre_attn_scalar, as in the 1B-12B models (transformers
    # reads neither from a GGUF and keeps those defaults; tgraph derives them as llama.cpp does).
    # Phi-3: q|k|v and gate|up fused (attn_qkv, ffn_up), read as their parts.
    "phi3": ("phi3", {"tie_word_embeddings": False, "pad_token_id": 0}, _mixed, "tiny"),
    "gemma3": ("gemma3_text", {"tie_word_embeddings": True, "head_dim": 256,
                               "query_pre_attn_scalar": 256, "num_hidden_layers": 6,
                               "sliding_window": 4}, _mixed, "tiny"),
}


@pytest.fixture(scope="session")
def vocab(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return demo_vocab(tmp_path_factory.mktemp("gguf-vocab"))


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory, vocab: dict[str, Any]
              ) -> Callable[[str], tuple[Path, Any]]:
    """``tiny_gguf(variant) -> (file, transformers model loaded from it)``, once per session."""
    cache: dict[str, tuple[Path, Any]] = {}

    def get(variant: str) -> tuple[Path, Any]:
        if variant not in cache:
            from transformers import AutoModelForCausalLM

            family, overrides, types, name = VARIANTS[variant]
            hf = random_hf_model(family, seed=3, vocab_size=VOCAB, bos_token_id=vocab["bos"],
                                 eos_token_id=vocab["eos"], **overrides)
            path = write_gguf(tmp_path_factory.mktemp(variant) / f"{variant}.gguf", hf, vocab,
                              types, name=name)
            ref = AutoModelForCausalLM.from_pretrained(
                str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
            cache[variant] = (path, ref)
        return cache[variant]

    return get


# ------------------------------------------------------------------------------ bit-exact repack
@pytest.mark.parametrize("qtype", list(QUANTIZED_TYPES), ids=lambda t: t.name)
def test_repack_is_bit_identical_to_gguf_dequantize(qtype: Q) -> None:
    rng = np.random.default_rng(0)
    rows, cols = 24, 512
    w = rng.standard_normal((rows, cols)).astype(np.float32) * rng.uniform(0.01, 3, (rows, 1))
    w[:, :64] = 0  # whole zero blocks: a zero scale (and the sign of zero) must survive
    data = encode(w, qtype, rng)
    ref = torch.from_numpy(gguf.quants.dequantize(data, qtype))
    weight = repack_blocks(data, qtype, (rows, cols), name="w")
    assert weight.scheme == QUANTIZED_TYPES[qtype]
    got = weight.dequantize(torch.float32)
    # Bit-identical, signed zeros included: compare the fp32 bit patterns.
    assert torch.equal(got.view(torch.int32), ref.view(torch.int32))
    # The packed layout is tgraph's: e.g. int4 codes two to a byte, fp32 group scales.
    assert weight.scale.dtype == torch.float32 and weight.qdata.dtype == weight.scheme.storage_dtype


@pytest.mark.parametrize("qtype", list(QUANTIZED_TYPES), ids=lambda t: t.name)
def test_repack_split_over_threads_is_the_same(qtype: Q) -> None:
    """Rows repacked in pieces by several threads (uneven pieces: 3 over 13 rows) give the
    same bits as gguf-py."""
    rng = np.random.default_rng(2)
    data = encode(rng.standard_normal((13, 512)).astype(np.float32), qtype, rng)
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        got = repack_blocks(data, qtype, (13, 512), piece_bytes=64).dequantize(torch.float32)
    finally:
        torch.set_num_threads(threads)
    ref = torch.from_numpy(gguf.quants.dequantize(data, qtype))
    assert torch.equal(got.view(torch.int32), ref.view(torch.int32))


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q6_K], ids=lambda t: t.name)
def test_repack_reorders_whole_rows(qtype: Q) -> None:
    rng = np.random.default_rng(1)
    w = rng.standard_normal((16, 256)).astype(np.float32)
    data = encode(w, qtype, rng)
    order = rng.permutation(16)
    got = repack_blocks(data, qtype, (16, 256), rows=order).dequantize(torch.float32)
    ref = torch.from_numpy(gguf.quants.dequantize(data, qtype))[torch.from_numpy(order)]
    assert torch.equal(got.view(torch.int32), ref.view(torch.int32))


def test_repack_refuses_wrong_sizes_and_types() -> None:
    data = np.zeros((4, 18 * 3), np.uint8)
    with pytest.raises(WeightLoadError, match=r"'w' \(Q4_0 \[4, 64\]\) has 216 bytes, "
                                              r"expected 144"):
        repack_blocks(data, Q.Q4_0, (4, 64), name="w")
    with pytest.raises(WeightLoadError, match=rf"'w' is TQ2_0; supported types: {ALL_TYPES}$"):
        repack_blocks(data, Q.TQ2_0, (4, 256), name="w")


# ----------------------------------------------------------------------------- header and config
def test_header_matches_gguf_reader(tiny_gguf: Callable) -> None:
    path, _ = tiny_gguf("llama")
    header = read_gguf_header(path)
    reader = gguf.GGUFReader(path)
    assert list(header.tensors) == [t.name for t in reader.tensors]
    for t in reader.tensors:
        info = header.tensors[t.name]
        assert info.shape == tuple(int(d) for d in reversed(t.shape.tolist()))
        assert info.ggml_type == t.tensor_type and info.nbytes == t.n_bytes
        assert info.offset == t.data_offset
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        value = header.metadata[key]
        if field.types[0] == gguf.GGUFValueType.ARRAY:
            assert len(value) == len(field.data), key
            if field.types[-1] != gguf.GGUFValueType.STRING:
                assert list(value) == field.contents(), key
        else:
            assert value == field.contents(), key


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_config_matches_transformers(variant: str, tiny_gguf: Callable) -> None:
    path, ref = tiny_gguf(variant)
    config = gguf_model_config(path)
    hf = ref.config
    assert config.model_type == VARIANTS[variant][0]
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
                  "tie_word_embeddings", "bos_token_id"):
        assert getattr(config, field) == getattr(hf, field), field
    assert config.head_dim == (getattr(hf, "head_dim", None)
                               or hf.hidden_size // hf.num_attention_heads)
    assert config.rms_norm_eps == pytest.approx(hf.rms_norm_eps, rel=1e-6)  # stored as fp32
    assert config.eos_token_ids == (hf.eos_token_id,)


def test_config_reads_rope_scaling_and_head_dim(tmp_path: Path, vocab: dict[str, Any]) -> None:
    hf = random_hf_model("llama", vocab_size=VOCAB)
    linear = write_gguf(tmp_path / "linear.gguf", hf, vocab, lambda n, s: Q.F32,
                        extra={"llama.rope.scaling.type": "linear",
                               "llama.rope.scaling.factor": 4.0})
    assert gguf_model_config(linear).rope_scaling == {"rope_type": "linear", "factor": 4.0}
    bad = write_gguf(tmp_path / "bad.gguf", hf, vocab, lambda n, s: Q.F32,
                     extra={"llama.rope.scaling.type": "wavy"})
    with pytest.raises(ConfigError, match="rope scaling type 'wavy' is not supported"):
        gguf_model_config(bad)


def test_llama3_rope_factors_become_llama3_scaling(tmp_path: Path,
                                                   vocab: dict[str, Any]) -> None:
    """llama.cpp stores Llama 3.1's rope scaling as per-frequency factors (rope_freqs.weight);
    they are turned back into the HF parameters, and the model matches HF's with them."""
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    hf = random_hf_model("llama", vocab_size=VOCAB, head_dim=32, num_attention_heads=2,
                         num_key_value_heads=1, rope_theta=500000.0, rope_scaling=dict(scaling),
                         max_position_embeddings=131072)
    # convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors, in numpy.
    dim, base = 32, 500000.0
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factors = []
    for f in freqs:
        wavelen = 2 * np.pi / f
        if wavelen < 8192 / 4.0:
            factors.append(1.0)
        elif wavelen > 8192 / 1.0:
            factors.append(8.0)
        else:
            smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
            factors.append(1 / ((1 - smooth) / 8.0 + smooth))
    assert 1.0 < min(f for f in factors if f > 1.0) < 8.0  # the file has all three bands
    with_freqs = write_gguf(tmp_path / "llama3.gguf", hf, vocab, lambda n, s: Q.F32,
                            extra_tensors={"rope_freqs.weight": np.array(factors, np.float32)})
    config = gguf_model_config(with_freqs)
    assert config.rope_scaling == scaling
    model_cfg, loader = open_checkpoint(with_freqs, config)
    assert "rope_freqs.weight" not in loader.names()  # consumed by the config, not a weight
    llm = LLM(with_freqs, device="cpu", dtype="float32", max_model_len=64, num_blocks=32,
              block_size=4, **EXACT_CPU_QUANT)
    prompt = list(range(1, 40))
    got = llm.generate([prompt], GREEDY)[0].token_ids
    assert got == hf_greedy(hf, [prompt], STEPS)[0]


# ------------------------------------------------------------------------ models vs transformers
@pytest.mark.parametrize("graph", ["static", "eager"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_tokens_match_transformers(variant: str, graph: str, tiny_gguf: Callable) -> None:
    path, ref = tiny_gguf(variant)
    llm = LLM(path, device="cpu", dtype="float32", graph=graph, max_model_len=64, num_blocks=64,
              block_size=4, **EXACT_CPU_QUANT)
    # Quantized weights stay quantized in the built model.
    quantized = [n for n, p in llm.model.named_parameters() if hasattr(p.data, "scheme")]
    assert quantized, "no weight was kept quantized"
    got = [r.token_ids for r in llm.generate(PROMPTS, GREEDY)]
    assert got == hf_greedy(ref, PROMPTS, STEPS)


def test_q_and_k_rows_are_unpermuted(tiny_gguf: Callable) -> None:
    """The q/k weights read back in Hugging Face's row order: equal to transformers' weights
    dequantized from the same Q4_0 blocks."""
    path, ref = tiny_gguf("mistral")
    config = gguf_model_config(path)
    _, loader = open_checkpoint(path, config, dtype=torch.float32)
    for proj in ("q_proj", "k_proj"):
        name = f"model.layers.1.self_attn.{proj}.weight"
        got = loader.get_tensor(name).dequantize(torch.float32)
        want = ref.state_dict()[name]
        assert torch.equal(got, want), proj  # transformers dequantized the same blocks
    embed = loader.get_tensor("model.embed_tokens.weight")
    assert embed.dtype == torch.float32 and not hasattr(embed, "scheme")  # F16 read as is


def test_chat_template_from_metadata(tiny_gguf: Callable) -> None:
    path, _ = tiny_gguf("llama")
    llm = LLM(path, device="cpu", dtype="float32", max_model_len=64, num_blocks=32, block_size=4,
              **EXACT_CPU_QUANT)
    ids = llm.encode("hi", chat=True)
    text = llm.tokenizer.decode(ids)
    assert text.startswith("<|begin_of_text|>### user\nhi\n### assistant\n"), text


# ------------------------------------------------------------------------------------- CLI
def test_check_model_reports_schemes_and_bytes(tiny_gguf: Callable,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    path, _ = tiny_gguf("llama")
    assert main(["check-model", str(path)]) == 0
    out = capsys.readouterr().out
    resident = int(re.search(r"resident weight bytes: (\d+)", out)[1])
    assert "quantized: model.embed_tokens.weight: int8 g32 sym" in out
    assert re.search(r"quantized: model\.layers\.0\.self_attn\.\w+\.weight: int4 g32 sym", out)
    assert re.search(r"quantized: model\.layers\.0\.mlp\.\w+\.weight: int4 g32 offsets", out)
    assert out.rstrip().endswith("OK")
    # Resident bytes per GGUF tensor: codes (int4: half a byte) + fp32 scales (and offsets) per
    # group; F16/F32 tensors in fp32. Q8_0 keeps 34 bytes per 32 values as 36, Q4_0 18 as 20,
    # Q4_1 20 as 24.
    per_value = {Q.Q8_0: 1 + 4 / 32, Q.Q4_0: 0.5 + 4 / 32, Q.Q4_1: 0.5 + 8 / 32, Q.F16: 4,
                 Q.F32: 4}
    header = read_gguf_header(path)
    want = sum(math.prod(t.shape) * per_value[t.ggml_type] for t in header.tensors.values())
    assert resident == want
    assert f"checkpoint files: {path.stat().st_size} bytes" in out


def test_generate_command_takes_a_gguf_file(tiny_gguf: Callable,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    path, _ = tiny_gguf("qwen2")
    assert main(["generate", "--model", str(path), "--prompt", "The river", "--max-tokens", "4",
                 "--ignore-eos"]) == 0
    err = capsys.readouterr().err
    assert "[4 tokens" in err


# --------------------------------------------------------------------------------- refusals
def test_unsupported_type_is_refused_before_any_weight_is_read(
        tmp_path: Path, vocab: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    hf = random_hf_model("llama", vocab_size=VOCAB, **K_SHAPES)
    path = write_gguf(tmp_path / "tq2_0.gguf", hf, vocab,
                      lambda n, s: Q.TQ2_0 if "down_proj" in n else Q.Q8_0)
    import tgraph.io.gguf as gguf_io

    def no_reads(*args: Any) -> None:
        raise AssertionError("a tensor was read before the refusal")

    monkeypatch.setattr(gguf_io, "_read_bytes", no_reads)
    with pytest.raises(WeightLoadError) as err:
        GGUFLoader(path, gguf_model_config(path))
    message = str(err.value)
    assert "'blk.0.ffn_down.weight' (TQ2_0 [256, 512])" in message
    assert f"supported types: {ALL_TYPES}" in message
    monkeypatch.undo()
    assert main(["check-model", str(path)]) == 1


def test_truncated_file_is_refused_by_tensor(tmp_path: Path, tiny_gguf: Callable) -> None:
    path, _ = tiny_gguf("qwen2")
    header = read_gguf_header(path)
    last = max(header.tensors.values(), key=lambda t: t.offset)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:last.offset + last.nbytes - 5])
    with pytest.raises(WeightLoadError, match=rf"tensor '{re.escape(last.name)}' .* the file is "
                                              "truncated"):
        gguf_model_config(cut)
    stub = tmp_path / "stub.gguf"
    stub.write_bytes(path.read_bytes()[:4000])  # cut inside the metadata
    with pytest.raises(WeightLoadError, match="header is truncated or corrupt"):
        read_gguf_header(stub)
    not_gguf = tmp_path / "model.gguf"
    not_gguf.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(WeightLoadError, match="is not a GGUF file"):
        read_gguf_header(not_gguf)


def test_unknown_architecture_is_refused(tmp_path: Path, vocab: dict[str, Any],
                                         capsys: pytest.CaptureFixture[str]) -> None:
    hf = random_hf_model("llama", vocab_size=VOCAB)
    path = write_gguf(tmp_path / "gpt2.gguf", hf, vocab, lambda n, s: Q.F32, arch="gpt2")
    with pytest.raises(ConfigError, match=r"GGUF architecture 'gpt2' is not supported; "
                                          r"supported: llama, mistral, qwen2, qwen3"):
        gguf_model_config(path)
    assert main(["check-model", str(path)]) == 1
    assert "'gpt2' is not supported" in capsys.readouterr().out


def test_a_split_model_reads_whole_from_any_part(tmp_path: Path, tiny_gguf: Callable,
                                                 vocab: dict[str, Any]) -> None:
    """llama.cpp's gguf-split parts: metadata in the first, tensors spread over all; any part
    names the model, which decodes as the whole file does."""
    whole, ref = tiny_gguf("llama")
    family, overrides, types, name = VARIANTS["llama"]
    hf = random_hf_model(family, seed=3, vocab_size=VOCAB, bos_token_id=vocab["bos"],
                         eos_token_id=vocab["eos"], **overrides)
    write_gguf(tmp_path / "tiny.gguf", hf, vocab, types, name=name, split_max_tensors=8)
    parts = sorted(tmp_path.glob("tiny-*-of-*.gguf"))
    assert len(parts) >= 3 and not (tmp_path / "tiny.gguf").exists()
    header = read_gguf_model(parts[1])
    assert header.parts == tuple(parts) and header.path == parts[0]
    assert set(header.tensors) == set(read_gguf_header(whole).tensors)
    assert {t.file for t in header.tensors.values()} == set(parts)
    assert gguf_model_config(parts[-1]).hf_config == gguf_model_config(whole).hf_config
    want = hf_greedy(ref, PROMPTS, STEPS)
    for part in (parts[0], parts[-1]):
        llm = LLM(part, device="cpu", dtype="float32", max_model_len=64, num_blocks=64,
                  block_size=4, **EXACT_CPU_QUANT)
        assert [r.token_ids for r in llm.generate(PROMPTS, GREEDY)] == want
    assert main(["check-model", str(parts[1])]) == 0


def test_a_split_model_with_a_part_missing_or_misnamed_is_refused(
        tmp_path: Path, vocab: dict[str, Any]) -> None:
    hf = random_hf_model("llama", vocab_size=VOCAB)
    write_gguf(tmp_path / "m.gguf", hf, vocab, lambda n, s: Q.F32, split_max_tensors=10)
    parts = sorted(tmp_path.glob("m-*-of-*.gguf"))
    count = len(parts)
    parts[1].rename(tmp_path / "other.gguf")
    with pytest.raises(WeightLoadError, match=rf"split in {count} files; missing beside it: "
                                              rf"m-00002-of-0000{count}\.gguf"):
        gguf_model_config(parts[0])
    with pytest.raises(WeightLoadError, match=r"'.*other\.gguf' is one part of a GGUF model split "
                                              r"in \d files, but its name does not follow"):
        gguf_model_config(tmp_path / "other.gguf")
    (tmp_path / "other.gguf").rename(parts[2].with_name("m-00002-of-00002.gguf"))
    with pytest.raises(WeightLoadError, match="does not follow"):  # the count disagrees
        gguf_model_config(parts[2].with_name("m-00002-of-00002.gguf"))


def test_gemma3_config_is_completed_as_llama_cpp_does(tmp_path: Path, tiny_gguf: Callable,
                                                     vocab: dict[str, Any]) -> None:
    """What a Gemma 3 GGUF does not store, llama.cpp fixes: five sliding layers to one full with
    RoPE base 10000, the window from the metadata, and the attention scale from head_dim except
    for the 27B model (62 layers), whose scale is hidden / heads."""
    from tgraph.io.model_config import gemma3_text_config

    config = gguf_model_config(tiny_gguf("gemma3")[0])
    assert config.layer_types == ("sliding_attention",) * 5 + ("full_attention",)
    assert (config.layer_config(0).sliding_window, config.layer_config(0).rope_theta) == (4, 1e4)
    assert (config.layer_config(5).sliding_window, config.layer_config(5).rope_theta) == (None, 1e6)
    assert gemma3_text_config(config.hf_config)["query_pre_attn_scalar"] == 256
    hf = random_hf_model("gemma3_text", vocab_size=VOCAB, num_hidden_layers=62, head_dim=32)
    deep = write_gguf(tmp_path / "deep.gguf", hf, vocab, lambda n, s: Q.F32)
    assert gemma3_text_config(gguf_model_config(deep).hf_config)["query_pre_attn_scalar"] == 16


def test_an_olmo2_file_decodes_with_a_tokenizer_given(tmp_path: Path, vocab: dict[str, Any],
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """OLMo 2 files (post norms under llama.cpp's names, q/k norms over all heads) read as the
    model they were written from. transformers builds no tokenizer for this architecture, so
    the refusal names the way out and the tokenizer given (a directory) is used."""
    from tgraph.runtime.demo_tokenizer import build_demo_tokenizer

    hf = random_hf_model("olmo2", seed=3, vocab_size=VOCAB, bos_token_id=vocab["bos"],
                         eos_token_id=vocab["eos"], tie_word_embeddings=False)
    path = write_gguf(tmp_path / "olmo2.gguf", hf, vocab, lambda n, s: Q.F32)
    assert gguf_model_config(path).model_type == "olmo2"
    with pytest.raises(WeightLoadError, match=r"pass the model's Hugging Face tokenizer "
                                              r"instead \(LLM\(\.\.\., tokenizer=DIR\)"):
        LLM(path, device="cpu", dtype="float32")
    tokenizer_dir = tmp_path / "tokenizer"
    build_demo_tokenizer(tmp_path / "cache").save_pretrained(str(tokenizer_dir))
    for graph in ("static", "eager"):
        llm = LLM(path, device="cpu", dtype="float32", graph=graph, max_model_len=64,
                  num_blocks=64, block_size=4, tokenizer=tokenizer_dir)
        got = [r.token_ids for r in llm.generate(PROMPTS, GREEDY)]
        assert got == hf_greedy(hf, PROMPTS, STEPS), graph
    assert main(["generate", "--model", str(path), "--tokenizer", str(tokenizer_dir),
                 "--prompt", "The river", "--max-tokens", "4", "--ignore-eos"]) == 0
    assert "[4 tokens" in capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"tokenizer: '.*missing' not found"):
        LLM(path, device="cpu", dtype="float32", tokenizer=tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="has no tokenizer files"):
        LLM(path, device="cpu", dtype="float32", tokenizer=tmp_path / "empty")


def test_phi3_longrope_and_partial_rotary_from_the_file(tmp_path: Path,
                                                        vocab: dict[str, Any]) -> None:
    """Phi-3-128k / Phi-4-mini files: LongRoPE's factors stored as the rope_factors_long /
    rope_factors_short tensors with the original context and attention factor in the metadata,
    and the rotated dims in rope.dimension_count (transformers reads neither from a GGUF, so
    the oracle is the model the file was written from)."""
    rope = {"rope_type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.6],
            "long_factor": [1.2, 2.0, 3.5, 6.0]}
    hf = random_hf_model("phi3", seed=3, vocab_size=VOCAB, bos_token_id=vocab["bos"],
                         eos_token_id=vocab["eos"], pad_token_id=0, partial_rotary_factor=0.5,
                         original_max_position_embeddings=64, rope_scaling=rope)
    attention = math.sqrt(1 + math.log(256 / 64) / math.log(64))
    path = write_gguf(tmp_path / "phi3.gguf", hf, vocab, lambda n, s: Q.F32, extra={
        "phi3.rope.scaling.original_context_length": 64,
        "phi3.rope.scaling.attn_factor": attention},
        extra_tensors={"rope_factors_long.weight": np.array(rope["long_factor"]),
                       "rope_factors_short.weight": np.array(rope["short_factor"])})
    config = gguf_model_config(path)
    assert config.partial_rotary_factor == 0.5 and config.rope_type == "longrope"
    assert config.rope_scaling["long_factor"] == pytest.approx(rope["long_factor"])
    assert config.rope_scaling["original_max_position_embeddings"] == 64
    llm = LLM(path, device="cpu", dtype="float32", max_model_len=64, num_blocks=64,
              block_size=4)
    got = [r.token_ids for r in llm.generate(PROMPTS, GREEDY)]
    assert got == hf_greedy(hf, PROMPTS, STEPS)
