"""Quantized Hugging Face checkpoints (compressed-tensors, GPTQ, AWQ, FP8) against their oracles.

Checkpoints are made from tiny random models (``tgraph.testing.random_hf_model``):

- compressed-tensors ones with the compressed-tensors package itself (``apply_quantization_config``,
  its ``calculate_qparams``, ``ModelCompressor``), exactly as llm-compressor saves them;
- GPTQ, AWQ and FP8 ones by the writers below, which follow each format's documented layout
  (AutoGPTQ's / AutoAWQ's packing, transformers' FineGrainedFP8 block scales).

Oracles, per checkpoint:

- dequantized weights: compressed-tensors' own decompression of the saved files, or, for GPTQ,
  AWQ and FP8, a straightforward dequantization written here from the format's documentation
  (``*_reference``). tgraph's ``QuantizedWeight.dequantize`` must equal it bit for bit in fp32,
  except for compressed-tensors with zero points and fp32 scales: the library computes
  ``(q - z) * s`` (one rounding), tgraph ``s * q + b`` (three), so they may differ by a few ulps
  of the values' magnitude ``2**bits * s``: four roundings of at most ``2**(bits - 24) * s``
  bound the difference by ``2**(bits - 22) * max s``;
- the model: transformers loading the same directory (compressed-tensors without zero points,
  FP8 with whole 128x128 blocks), else transformers on the oracle's dequantized weights. Greedy
  tokens of ``LLM(dir)`` (static and eager graphs) must equal transformers', and prefill logits
  must agree within ``1e-4 * max|logit|``: both sides compute in fp32 on the same weights and
  differ only in summation order (the model tests measure ~1e-6).
"""
from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.helpers import EXACT_CPU_QUANT
from tgraph.io.checkpoint import open_checkpoint
from tgraph.quant import QuantizedWeight
from tgraph.runtime.llm import LLM
from tgraph.runtime.sampling_params import SamplingParams
from tgraph.testing import hf_greedy, hf_logits, random_hf_model, run_greedy
from tgraph.tuning import CpuTuning, Tuning

PROMPTS: list[list[int]] = [[1, 5, 9, 22, 7], [3, 4], [17, 150, 8, 8, 8, 8, 191, 0, 42], [121]]
MAX_TOKENS = 8
REL_TOL = 1e-4
PROJ = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
# Shapes with whole and partial 128x128 blocks: K = 256 or 384, N = 128 (k/v) to 384.
WIDE = dict(hidden_size=256, intermediate_size=384, head_dim=64)
# K = 192 (a partial 128 block) for q/k/v/gate/up, N = 192 (partial) for o/down; the packed
# q|k|v and gate|up keep whole row blocks (N = 256 + 128 + 128, 384 + 384).
RAGGED = dict(hidden_size=192, intermediate_size=384, head_dim=64)
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
FP8_MAX = 448.0


def linears(num_layers: int) -> list[str]:
    """The module names of every quantized projection of a tiny model."""
    return [f"model.layers.{i}.{p}" for i in range(num_layers) for p in PROJ]


# ---- int32 packing, written from the formats' documentation ---------------------------------
def to_int32(words: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit values (int64) as the int32 the checkpoints store (two's complement)."""
    return ((words + 2**31) % 2**32 - 2**31).to(torch.int32)


def pack_rows(values: torch.Tensor, bits: int, order: tuple[int, ...] | None = None
              ) -> torch.Tensor:
    """AutoGPTQ's packing along dim 0: word ``r`` holds rows ``per * r + i`` in bits
    ``bits * i`` (AWQ: row ``per * r + order[i]``)."""
    per = 32 // bits
    order = order or tuple(range(per))
    v = values.long().reshape(values.shape[0] // per, per, *values.shape[1:])
    words = sum(v[:, order[i]] << (bits * i) for i in range(per))
    return to_int32(words)


def unpack_rows(words: torch.Tensor, bits: int, order: tuple[int, ...] | None = None
                ) -> torch.Tensor:
    """The inverse of :func:`pack_rows`."""
    per = 32 // bits
    order = order or tuple(range(per))
    u = words.long() & 0xFFFFFFFF
    out = torch.empty(words.shape[0], per, *words.shape[1:], dtype=torch.int64)
    for i in range(per):
        out[:, order[i]] = (u >> (bits * i)) & (2**bits - 1)
    return out.reshape(words.shape[0] * per, *words.shape[1:])


# ---- GPTQ ----------------------------------------------------------------------------------
def quantize_gptq(w: torch.Tensor, bits: int, group: int, sym: bool
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """AutoGPTQ's round-to-nearest quantizer: codes ``[K, N]``, fp16 scales and int zero
    points ``[K / G, N]``."""
    n, k = w.shape
    g = k if group == -1 else group
    maxq = 2**bits - 1
    wg = w.reshape(n, k // g, g)
    if sym:
        xmax = wg.abs().amax(-1)
        scale = 2 * xmax / maxq
        zero = torch.full_like(scale, (maxq + 1) // 2)
    else:
        xmin, xmax = wg.amin(-1).clamp(max=0), wg.amax(-1).clamp(min=0)
        scale = (xmax - xmin) / maxq
        zero = torch.round(-xmin / scale)
    scale = scale.clamp(min=1e-6).half()
    q = torch.clamp(torch.round(wg / scale.float()[..., None]) + zero[..., None], 0, maxq)
    return q.reshape(n, k).t().long(), scale.t().contiguous(), zero.t().long()


def gptq_tensors(w: torch.Tensor, bits: int, group: int, sym: bool, v1: bool = True,
                 act_order: bool = False) -> dict[str, torch.Tensor]:
    """AutoGPTQ's tensors of ``w``; with ``act_order`` the features are quantized in a random
    order (as desc_act's Hessian order), group ``j // G`` holding the ``j``-th ``G`` of them,
    and stored back in their own order with ``g_idx`` naming each one's group."""
    k = w.shape[1]
    g = k if group == -1 else group
    order = torch.randperm(k) if act_order else torch.arange(k)
    codes, scales, zeros = quantize_gptq(w[:, order], bits, group, sym)
    logical = torch.empty_like(codes)
    logical[order] = codes  # codes rows follow `order`; put each back on its feature
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[order] = (torch.arange(k) // g).to(torch.int32)
    stored = (zeros - 1) & (2**bits - 1) if v1 else zeros  # v1 stores z - 1
    return {"qweight": pack_rows(logical, bits), "scales": scales,
            "qzeros": pack_rows(stored.t(), bits).t().contiguous(), "g_idx": g_idx}


def gptq_reference(t: dict[str, torch.Tensor], bits: int, group: int, v1: bool = True
                   ) -> torch.Tensor:
    """``w[n, k] = s[g, n] * (q[k, n] - z[g, n])`` with ``g = g_idx[k]``, in fp32."""
    q = unpack_rows(t["qweight"], bits)  # [K, N]
    z = unpack_rows(t["qzeros"].t(), bits).t()  # [groups, N]
    if v1:
        z = z + 1
    k = q.shape[0]
    g_idx = t["g_idx"].long() if "g_idx" in t else torch.arange(k) // (
        k if group == -1 else group)
    w = t["scales"].float()[g_idx] * (q - z[g_idx]).float()
    return w.t().contiguous()


# ---- AWQ -----------------------------------------------------------------------------------
def awq_tensors(w: torch.Tensor, group: int) -> dict[str, torch.Tensor]:
    """AutoAWQ's zero-point quantizer and GEMM packing (along N, order 0 2 4 6 1 3 5 7)."""
    n, k = w.shape
    wg = w.reshape(n, k // group, group)
    lo, hi = wg.amin(-1), wg.amax(-1)
    scale = ((hi - lo).clamp(min=1e-5) / 15).half()
    zero = (-torch.round(lo / scale.float())).clamp(0, 15)
    q = torch.clamp(torch.round(wg / scale.float()[..., None]) + zero[..., None], 0, 15)
    codes, zeros = q.reshape(n, k).t().long(), zero.t().long()  # [K, N], [K / G, N]
    return {"qweight": pack_rows(codes.t(), 4, AWQ_ORDER).t().contiguous(),
            "qzeros": pack_rows(zeros.t(), 4, AWQ_ORDER).t().contiguous(),
            "scales": scale.t().contiguous()}


def awq_reference(t: dict[str, torch.Tensor], group: int) -> torch.Tensor:
    """``w[n, k] = (q[k, n] - z[k // G, n]) * s[k // G, n]``, in fp32."""
    q = unpack_rows(t["qweight"].t(), 4, AWQ_ORDER).t()  # [K, N]
    z = unpack_rows(t["qzeros"].t(), 4, AWQ_ORDER).t()
    g = torch.arange(q.shape[0]) // group
    return ((q - z[g]).float() * t["scales"].float()[g]).t().contiguous()


# ---- FP8 -----------------------------------------------------------------------------------
def fp8_tensors(w: torch.Tensor, block: tuple[int, int] | None) -> dict[str, torch.Tensor]:
    """transformers' FineGrainedFP8 quantizer: per block, ``q = w * (448 / max|w|)`` in e4m3 and
    ``weight_scale_inv = max|w| / 448`` (fp32); ``block=None`` for one scale per tensor."""
    n, k = w.shape
    bh, bw = block or (n, k)
    rows, cols = math.ceil(n / bh), math.ceil(k / bw)
    padded = torch.nn.functional.pad(w, (0, cols * bw - k, 0, rows * bh - n))
    amax = padded.reshape(rows, bh, cols, bw).abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale = FP8_MAX / amax
    full = scale.repeat_interleave(bh, 0).repeat_interleave(bw, 1)[:n, :k]
    q = (w * full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    inv = (1.0 / scale).to(torch.float32)
    return {"weight": q, "weight_scale_inv": inv if block else inv.reshape(())}


def fp8_reference(t: dict[str, torch.Tensor], block: tuple[int, int] | None) -> torch.Tensor:
    """``w = q * s`` with ``s`` the scale of the weight's block, in fp32."""
    q = t["weight"].float()
    n, k = q.shape
    bh, bw = block or (n, k)
    s = t["weight_scale_inv"].float().reshape(math.ceil(n / bh), math.ceil(k / bw))
    return q * s.repeat_interleave(bh, 0).repeat_interleave(bw, 1)[:n, :k]


# ---- compressed-tensors, made by the package itself ----------------------------------------
def ct_quantize(hf: Any, weights: dict[str, Any], fmt: str, input_activations: Any = None
                ) -> Any:
    """Quantize ``hf`` in place with compressed-tensors (scales from each weight's min/max by
    the package's ``calculate_qparams``) and compress it; returns the ``ModelCompressor``."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams

    args = QuantizationArgs(**weights)
    scheme = QuantizationScheme(targets=["Linear"], weights=args,
                                input_activations=input_activations)
    apply_quantization_config(hf, QuantizationConfig(config_groups={"group_0": scheme},
                                                     ignore=["lm_head"]), show_progress=False)
    for _, m in hf.named_modules():
        if getattr(m, "quantization_scheme", None) is None:
            continue
        w = m.weight.detach()
        if args.strategy == "group":
            v = w.unflatten(-1, (w.shape[-1] // args.group_size, args.group_size))
            lo, hi = v.amin(-1), v.amax(-1)
        elif args.strategy == "channel":
            lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
        elif args.strategy == "tensor":
            lo, hi = w.amin().reshape(1), w.amax().reshape(1)
        else:  # block
            bh, bw = args.block_structure
            rows, cols = math.ceil(w.shape[0] / bh), math.ceil(w.shape[1] / bw)
            p = torch.nn.functional.pad(w, (0, cols * bw - w.shape[1], 0, rows * bh - w.shape[0]))
            v = p.reshape(rows, bh, cols, bw)
            lo, hi = v.amin(dim=(1, 3)), v.amax(dim=(1, 3))
        s, z = calculate_qparams(lo, hi, args)
        m.weight_scale.data.copy_(s.reshape(m.weight_scale.shape))
        if hasattr(m, "weight_zero_point"):
            m.weight_zero_point.data.copy_(z.reshape(m.weight_zero_point.shape))
    comp = ModelCompressor.from_pretrained_model(hf, quantization_format=fmt)
    comp.compress_model(hf)
    return comp


def ct_library_dense(path: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's dense state dict by compressed-tensors' own decompression of its files
    (every tensor fp32)."""
    from compressed_tensors.compressors import (
        FloatQuantizationCompressor,
        IntQuantizationCompressor,
        NaiveQuantizationCompressor,
        PackedQuantizationCompressor,
    )
    from compressed_tensors.quantization import QuantizationConfig

    compressors = {"pack-quantized": PackedQuantizationCompressor,
                   "float-quantized": FloatQuantizationCompressor,
                   "naive-quantized": NaiveQuantizationCompressor,
                   "int-quantized": IntQuantizationCompressor}
    qc = QuantizationConfig.model_validate(
        json.loads((path / "config.json").read_text())["quantization_config"])
    scheme = qc.config_groups["group_0"]
    tensors = load_file(path / "model.safetensors")
    prefixes = {n.rsplit(".", 1)[0] for n in tensors if n.endswith(".weight_scale")}
    out = {n: t.float() for n, t in tensors.items()
           if not (n.rsplit(".", 1)[0] in prefixes and n.rsplit(".", 1)[1].startswith("weight"))}
    for p in prefixes:
        local = {n[len(p) + 1:]: t for n, t in tensors.items()
                 if n.startswith(p + ".weight")}
        out[f"{p}.weight"] = compressors[scheme.format or qc.format].decompress(
            local, scheme)["weight"].float()
    return out


# ---- test checkpoints ----------------------------------------------------------------------
@dataclass
class Case:
    """A quantized test checkpoint: how to make it and which oracle judges it."""

    family: str
    make: Callable[[Any, Path], dict[str, torch.Tensor]]  # writes the dir, returns dense oracle
    overrides: dict[str, Any] = field(default_factory=dict)
    hf_loads_dir: bool = False  # transformers itself loads the directory
    exact: bool = True  # dequantized weights equal the oracle's bit for bit
    seed: int = 0


def write_checkpoint(hf: Any, path: Path, quant: dict[str, Any],
                     tensors: Callable[[str, torch.Tensor], dict[str, torch.Tensor]],
                     reference: Callable[[dict[str, torch.Tensor]], torch.Tensor],
                     dense_dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Save ``hf`` with every projection replaced by ``tensors(name, weight)`` (other tensors in
    ``dense_dtype``) and ``quant`` as its quantization_config; returns the dense oracle state
    (``reference`` of each projection's stored tensors, the rest as stored, fp32)."""
    hf.save_pretrained(path)
    state = {n: t.detach() for n, t in hf.state_dict().items()}
    out: dict[str, torch.Tensor] = {}
    oracle: dict[str, torch.Tensor] = {}
    quantized = set(linears(hf.config.num_hidden_layers))
    for name, t in state.items():
        module = name.rsplit(".", 1)[0]
        if module in quantized and name.endswith(".weight"):
            parts = tensors(module, t)
            out.update({f"{module}.{k}": v.contiguous() for k, v in parts.items()})
            oracle[name] = reference(parts)
        else:
            out[name] = t.to(dense_dtype).contiguous()
            oracle[name] = out[name].float()
    save_file(out, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = quant
    config["dtype"] = str(dense_dtype).replace("torch.", "")
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return oracle


def gptq_case(bits: int, group: int, sym: bool, v1: bool = True, desc_act: bool = False,
              static_groups: bool = False) -> Callable[[Any, Path], dict[str, torch.Tensor]]:
    """GPTQ with ``desc_act``: static groups keep ``g_idx = k // G``, else it is scattered."""
    def make(hf: Any, path: Path) -> dict[str, torch.Tensor]:
        quant = {"quant_method": "gptq", "bits": bits, "group_size": group, "sym": sym,
                 "desc_act": desc_act, "static_groups": static_groups, "true_sequential": True,
                 "damp_percent": 0.01, "checkpoint_format": "gptq" if v1 else "gptq_v2"}
        scattered = desc_act and not static_groups
        return write_checkpoint(hf, path, quant,
                                lambda _, w: gptq_tensors(w, bits, group, sym, v1, scattered),
                                lambda t: gptq_reference(t, bits, group, v1), torch.float16)
    return make


def awq_case(group: int) -> Callable[[Any, Path], dict[str, torch.Tensor]]:
    def make(hf: Any, path: Path) -> dict[str, torch.Tensor]:
        quant = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
                 "version": "gemm", "modules_to_not_convert": None}
        return write_checkpoint(hf, path, quant, lambda _, w: awq_tensors(w, group),
                                lambda t: awq_reference(t, group), torch.float16)
    return make


def fp8_case(block: tuple[int, int] | None) -> Callable[[Any, Path], dict[str, torch.Tensor]]:
    def make(hf: Any, path: Path) -> dict[str, torch.Tensor]:
        quant: dict[str, Any] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                 "fmt": "e4m3", "modules_to_not_convert": ["lm_head"]}
        if block:
            quant["weight_block_size"] = list(block)
        return write_checkpoint(hf, path, quant, lambda _, w: fp8_tensors(w, block),
                                lambda t: fp8_reference(t, block), torch.bfloat16)
    return make


def ct_case(weights: dict[str, Any], fmt: str, dynamic_inputs: str | None = None
            ) -> Callable[[Any, Path], dict[str, torch.Tensor]]:
    """A compressed-tensors checkpoint; ``dynamic_inputs`` ("int" / "float") adds per-token
    dynamic 8-bit input activations (W8A8), which tgraph leaves unquantized."""
    def make(hf: Any, path: Path) -> dict[str, torch.Tensor]:
        from compressed_tensors.quantization import QuantizationArgs

        inputs = None if dynamic_inputs is None else QuantizationArgs(
            num_bits=8, type=dynamic_inputs, strategy="token", dynamic=True, symmetric=True)
        comp = ct_quantize(hf, weights, fmt, inputs)
        hf.save_pretrained(path)
        comp.update_config(path)
        return ct_library_dense(path)
    return make


INT4_G32 = dict(num_bits=4, type="int", strategy="group", group_size=32)
CASES: dict[str, Case] = {
    "ct-w4-group-sym": Case("llama", ct_case({**INT4_G32, "symmetric": True},
                                             "pack-quantized"), hf_loads_dir=True),
    "ct-w4-group-asym": Case("qwen2", ct_case({**INT4_G32, "symmetric": False},
                                             "pack-quantized"), exact=False),
    "ct-w8-channel-sym": Case("qwen3", ct_case(dict(num_bits=8, type="int", strategy="channel",
                                                    symmetric=True), "pack-quantized"),
                              hf_loads_dir=True),
    "ct-w8-channel-asym": Case("mistral", ct_case(dict(num_bits=8, type="int",
                                                       strategy="channel", symmetric=False),
                                                  "pack-quantized"), exact=False),
    "ct-fp8-channel": Case("llama", ct_case(dict(num_bits=8, type="float", strategy="channel"),
                                            "float-quantized"), WIDE, hf_loads_dir=True),
    "ct-fp8-tensor": Case("qwen2", ct_case(dict(num_bits=8, type="float", strategy="tensor"),
                                           "float-quantized"), hf_loads_dir=True),
    "ct-fp8-block": Case("qwen3", ct_case(dict(num_bits=8, type="float", strategy="block",
                                               block_structure=[128, 128]),
                                          "float-quantized"), WIDE, hf_loads_dir=True),
    # W8A8 with dynamic activations: the oracle runs the dequantized weights on unquantized
    # activations, as tgraph does (transformers would quantize the activations).
    "ct-fp8-dynamic": Case("llama", ct_case(dict(num_bits=8, type="float", strategy="channel"),
                                            "float-quantized", "float"), seed=3),
    "ct-w8a8-int": Case("qwen2", ct_case(dict(num_bits=8, type="int", strategy="channel"),
                                         "int-quantized", "int")),
    "gptq-4bit-g32-sym": Case("llama", gptq_case(4, 32, sym=True)),
    "gptq-4bit-g32-asym": Case("qwen2", gptq_case(4, 32, sym=False)),
    "gptq-8bit-channel-sym-v2": Case("qwen3", gptq_case(8, -1, sym=True, v1=False)),
    "gptq-4bit-g16-asym-static-groups": Case("mistral", gptq_case(4, 16, sym=False,
                                                                  desc_act=True,
                                                                  static_groups=True)),
    "gptq-4bit-g32-sym-actorder": Case("llama", gptq_case(4, 32, sym=True, desc_act=True),
                                       seed=2),
    "gptq-8bit-g16-asym-actorder": Case("qwen2", gptq_case(8, 16, sym=False, desc_act=True)),
    "awq-g32": Case("llama", awq_case(32)),
    "awq-g16": Case("qwen2", awq_case(16), seed=1),
    "fp8-block": Case("qwen3", fp8_case((128, 128)), WIDE, hf_loads_dir=True),
    "fp8-block-ragged": Case("llama", fp8_case((128, 128)), RAGGED),
    "fp8-tensor": Case("mistral", fp8_case(None)),
}


@dataclass
class Made:
    path: Path
    case: Case
    oracle: dict[str, torch.Tensor]


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Made]:
    """``made(case)``: the case's checkpoint directory and dense oracle, built once."""
    cache: dict[str, Made] = {}

    def get(name: str) -> Made:
        if name not in cache:
            case = CASES[name]
            hf = random_hf_model(case.family, seed=case.seed, **case.overrides)
            path = tmp_path_factory.mktemp(name)
            cache[name] = Made(path, case, case.make(hf, path))
        return cache[name]

    return get


def hf_oracle(m: Made) -> Any:
    """transformers on the directory itself where it can load it, else on the oracle weights."""
    from transformers import AutoModelForCausalLM

    if m.case.hf_loads_dir:
        return AutoModelForCausalLM.from_pretrained(m.path, dtype=torch.float32).eval()
    hf = random_hf_model(m.case.family, seed=m.case.seed, **m.case.overrides)
    hf.load_state_dict(m.oracle)
    return hf.eval()


# ---- tests ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(CASES))
def test_dequantized_weights_match_oracle(made: Callable[[str], Made], name: str) -> None:
    m = made(name)
    config, loader = open_checkpoint(m.path, device="cpu", dtype=torch.float32)
    quantized = loader.quantized_names()
    assert quantized == sorted(f"{p}.weight" for p in linears(config.num_hidden_layers))
    for weight in quantized:
        qw = loader.get_tensor(weight)
        assert isinstance(qw, QuantizedWeight)
        got, ref = qw.dequantize(torch.float32), m.oracle[weight]
        assert got.shape == ref.shape, weight
        if m.case.exact:
            assert torch.equal(got, ref), (f"{weight} ({qw.scheme.describe(qw.shape)}): max "
                                           f"diff {(got - ref).abs().max()}")
        else:
            bound = 2 ** (qw.scheme.bits - 22) * float(qw.scale.abs().max())
            assert float((got - ref).abs().max()) <= bound, weight
    # Reading the quantized weights consumed every part (weight_shape and g_idx included).
    for name in set(loader.names()) - set(quantized):
        assert not isinstance(loader.get_tensor(name), QuantizedWeight)
    assert loader.unused_names() == []


@pytest.mark.parametrize("graph", ["static", "eager"])
@pytest.mark.parametrize("name", list(CASES))
def test_greedy_tokens_match_transformers(made: Callable[[str], Made], name: str,
                                          graph: str) -> None:
    m = made(name)
    ref = hf_greedy(hf_oracle(m), PROMPTS, MAX_TOKENS)
    assert len({tuple(r) for r in ref}) > 1, "every prompt generates the same tokens"
    llm = LLM(m.path, device="cpu", dtype="float32", graph=graph, max_model_len=64,
              block_size=4, num_blocks=64, **EXACT_CPU_QUANT)
    out = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                               ignore_eos=True))
    for i, (o, r) in enumerate(zip(out, ref)):
        assert o.token_ids == r, f"{name} prompt {i} ({graph}): tgraph {o.token_ids} vs HF {r}"


@pytest.mark.parametrize("name", list(["ct-w4-group-asym", "ct-fp8-block", "gptq-4bit-g32-asym",
                                        "gptq-4bit-g32-sym-actorder", "awq-g32",
                                        "fp8-block-ragged"]))
def test_prefill_logits_match_transformers(made: Callable[[str], Made], name: str) -> None:
    from tgraph.models import load_model

    m = made(name)
    hf = hf_oracle(m)
    model = load_model(m.path, device="cpu", dtype="float32", max_model_len=64, block_size=4,
                       tuning=Tuning(cpu=CpuTuning(bf16_quant_activations=False)))
    model.allocate_kv_cache(64)
    trace = run_greedy(model, PROMPTS, 0)
    for i, prompt in enumerate(PROMPTS):
        ref = hf_logits(hf, prompt)
        err = float((trace.prefill_logits[i].double() - ref.double()).abs().max()
                    / ref.double().abs().max())
        assert err <= REL_TOL, f"{name} prompt {i}: relative logit error {err}"


def expected_bytes(kind: str, n: int, k: int, group: int, offsets: bool) -> int:
    """Resident bytes of one quantized ``[N, K]`` weight: codes, fp32 scales (and offsets) per
    ``group`` columns (``kind == "fp8"``: per 128x128 block)."""
    if kind == "fp8":
        return n * k + math.ceil(n / 128) * math.ceil(k / 128) * 4
    code_bytes = n * k // 2 if kind == "int4" else n * k
    return code_bytes + (n * k // group) * 4 * (2 if offsets else 1)


@pytest.mark.parametrize("name,kind,group,offsets,scheme", [
    ("ct-w4-group-sym", "int4", 32, False, "int4 g32 sym"),
    ("gptq-4bit-g32-asym", "int4", 32, True, "int4 g32 offsets"),
    ("gptq-8bit-channel-sym-v2", "int8", None, False, "int8 channel sym"),
    ("awq-g16", "int4", 16, True, "int4 g16 offsets"),
    ("fp8-block", "fp8", None, False, "fp8 block 128x128"),
])
def test_check_model_reports_schemes_and_quantized_bytes(
        made: Callable[[str], Made], name: str, kind: str, group: int | None, offsets: bool,
        scheme: str, capsys: pytest.CaptureFixture[str]) -> None:
    from tgraph.cli import main

    m = made(name)
    assert main(["check-model", str(m.path)]) == 0
    out = capsys.readouterr().out
    assert "OK" in out.splitlines()[-1]
    layers = json.loads((m.path / "config.json").read_text())["num_hidden_layers"]
    for i in range(layers):
        for module in ("self_attn.o_proj", "mlp.down_proj"):
            assert f"quantized: model.layers.{i}.{module}.weight: {scheme}" in out
    resident = int(out.split("resident weight bytes: ")[1].split()[0])
    # Dense tensors count as fp32 (check-model reads in fp32); each projection at its packed size.
    quantized = {f"{p}.weight": tuple(m.oracle[f"{p}.weight"].shape) for p in linears(layers)}
    dense = sum(t.numel() * 4 for n, t in m.oracle.items() if n not in quantized)
    packed = sum(expected_bytes(kind, n, k, group or k, offsets) for n, k in quantized.values())
    assert resident == dense + packed
    assert packed < 0.35 * sum(n * k * 4 for n, k in quantized.values())
