"""Quantized Hugging Face checkpoints that tgraph refuses, and how.

Every refusal is a :class:`WeightLoadError` raised while the checkpoint is opened, before any
weight is read (``no_weight_reads`` makes any read fail the test), naming the tensor, the scheme
and what is supported. Checkpoints are one-layer Llamas written by the writers of
``test_hf_quant`` and then broken one way each.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.io.test_hf_quant import awq_case, ct_case, fp8_case, gptq_case
from tgraph.errors import WeightLoadError
from tgraph.io import hf_quant
from tgraph.io.checkpoint import open_checkpoint
from tgraph.io.hf_quant.common import Checkpoint
from tgraph.io.weights import DictWeightLoader, SafetensorFileLoader
from tgraph.quant import QuantizedWeight
from tgraph.testing import random_hf_model

Q = "model.layers.0.self_attn.q_proj"
DOWN = "model.layers.0.mlp.down_proj"


def make(tmp_path: Path, case: Callable[[Any, Path], Any], **overrides: Any) -> Path:
    """A one-layer Llama quantized by ``case`` (hidden 64, intermediate 96)."""
    hf = random_hf_model("llama", seed=0, num_hidden_layers=1, **overrides)
    case(hf, tmp_path)
    return tmp_path


def edit_config(path: Path, **changes: Any) -> None:
    config = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config["quantization_config"].pop(key, None)
        else:
            config["quantization_config"][key] = value
    (path / "config.json").write_text(json.dumps(config))


def edit_tensors(path: Path, **changes: torch.Tensor | None) -> None:
    """Replace (or, with ``None``, drop) tensors; keys use ``__`` for ``.``."""
    tensors = load_file(path / "model.safetensors")
    for key, value in changes.items():
        name = key.replace("__", ".")
        if value is None:
            tensors.pop(name)
        else:
            tensors[name] = value
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def tensor(path: Path, name: str) -> torch.Tensor:
    return load_file(path / "model.safetensors")[name]


@pytest.fixture
def no_weight_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail on any weight read: refusals must come from names, shapes, dtypes and config."""
    def fail(*args: Any, **kwargs: Any) -> None:
        raise AssertionError(f"a weight was read while planning: {args[1:]}")
    monkeypatch.setattr(Checkpoint, "read", fail)
    monkeypatch.setattr(SafetensorFileLoader, "get_tensor", fail)


def refused(path: Path, *phrases: str) -> str:
    with pytest.raises(WeightLoadError) as info:
        open_checkpoint(path, device="cpu", dtype=torch.float32)
    message = str(info.value)
    for phrase in phrases:
        assert phrase in message, f"{phrase!r} not in: {message}"
    return message


GPTQ4 = gptq_case(4, 32, sym=True)


# ---- methods -----------------------------------------------------------------------------
def test_unknown_method(tmp_path: Path, no_weight_reads: None) -> None:
    path = make(tmp_path, GPTQ4)
    edit_config(path, quant_method="bitsandbytes")
    refused(path, "quantization method 'bitsandbytes'",
            "tgraph reads compressed-tensors, gptq, awq, fp8")


def test_declared_but_nothing_quantized(tmp_path: Path, no_weight_reads: None) -> None:
    path = make(tmp_path, fp8_case((128, 128)))
    edit_config(path, quant_method="gptq")
    refused(path, "declares gptq quantization", "no module has a qweight tensor")


# ---- GPTQ --------------------------------------------------------------------------------
@pytest.mark.parametrize("changes,phrases", [
    (dict(bits=3), ["GPTQ with bits=3", f"'{DOWN}.qweight'",
                    "tgraph reads 4- and 8-bit GPTQ"]),
    (dict(checkpoint_format="marlin"), ["GPTQ checkpoint_format 'marlin'", f"'{DOWN}.qweight'",
                                        "tgraph reads gptq and gptq_v2"]),
    (dict(group_size=40), [f"'{DOWN}.qweight' (GPTQ int4 g40 sym)",
                           "group_size 40 does not divide K=96"]),
])
def test_gptq_unsupported_config(tmp_path: Path, no_weight_reads: None, changes: dict[str, Any],
                                 phrases: list[str]) -> None:
    path = make(tmp_path, GPTQ4)
    edit_config(path, **changes)
    refused(path, *phrases)


def test_gptq_scales_of_the_wrong_shape(tmp_path: Path, no_weight_reads: None) -> None:
    path = make(tmp_path, GPTQ4)
    edit_tensors(path, **{f"{Q}__scales": torch.ones(3, 64, dtype=torch.float16)})
    refused(path, f"tensor '{Q}.scales' (GPTQ int4 g32 sym) has shape [3, 64], expected [2, 64]",
            "K / group_size = 64 / 32 groups by N = 64")


def test_gptq_packed_data_too_short(tmp_path: Path, no_weight_reads: None) -> None:
    path = make(tmp_path, GPTQ4)
    edit_tensors(path, **{f"{Q}__qweight": tensor(path, f"{Q}.qweight")[:4].clone()})
    # 4 words of 8 codes make K = 32, which the 2 groups of 32 scales contradict.
    refused(path, f"tensor '{Q}.scales'", "expected [1, 64]", "from qweight [4, 64]")


def test_gptq_qweight_of_the_wrong_dtype(tmp_path: Path, no_weight_reads: None) -> None:
    path = make(tmp_path, GPTQ4)
    edit_tensors(path, **{f"{Q}__qweight": tensor(path, f"{Q}.qweight").long()})
    refused(path, f"tensor '{Q}.qweight' (GPTQ int4 g32 sym) is stored as int64",
            "gptq stores it as int32")


def test_gptq_uneven_act_order_groups(tmp_path: Path, no_weight_reads: None) -> None:
    path = make(tmp_path, gptq_case(4, 32, sym=True, desc_act=True))
    edit_tensors(path, **{f"{Q}__g_idx": torch.zeros(64, dtype=torch.int32)})
    refused(path, f"tensor '{Q}.g_idx' (GPTQ int4 g32 sym)",
            "every one of the 2 groups must hold exactly 32 input features")


def test_gptq_missing_qzeros(tmp_path: Path, no_weight_reads: None) -> None:
    path = make(tmp_path, GPTQ4)
    edit_tensors(path, **{f"{Q}__qzeros": None})
    refused(path, f"tensor '{Q}.qzeros' (GPTQ int4 g32 sym) is missing")


def test_gptq_sym_config_with_other_zero_points_fails_on_read(tmp_path: Path) -> None:
    """Zero points are data: a sym=true checkpoint whose zeros are not 8 fails when read."""
    path = make(tmp_path, gptq_case(4, 32, sym=False))
    edit_config(path, sym=True)
    _, loader = open_checkpoint(path, device="cpu", dtype=torch.float32)
    with pytest.raises(WeightLoadError, match=r"config.json says sym=true, but the zero points "
                                              r"\(stored code \+ 1\) are \["):
        loader.get_tensor(f"{Q}.weight")


# ---- AWQ ---------------------------------------------------------------------------------
@pytest.mark.parametrize("changes,phrases", [
    (dict(version="gemv"), ["AWQ version 'gemv'", f"'{DOWN}.qweight'", "GEMM layout"]),
    (dict(version="exllama"), ["AWQ version 'exllama'", "GEMM layout"]),
    (dict(bits=8), ["AWQ with bits=8", "tgraph reads 4-bit AWQ"]),
    (dict(zero_point=False), ["AWQ with zero_point=false", "zero_point: true"]),
    (dict(group_size=40), [f"'{DOWN}.qweight' (AWQ gemm int4 g40)",
                           "group_size 40 does not divide K=96"]),
])
def test_awq_unsupported_config(tmp_path: Path, no_weight_reads: None, changes: dict[str, Any],
                                phrases: list[str]) -> None:
    path = make(tmp_path, awq_case(32))
    edit_config(path, **changes)
    refused(path, *phrases)


def test_awq_qzeros_of_the_wrong_shape(tmp_path: Path, no_weight_reads: None) -> None:
    path = make(tmp_path, awq_case(32))
    edit_tensors(path, **{f"{Q}__qzeros": torch.zeros(2, 4, dtype=torch.int32)})
    refused(path, f"tensor '{Q}.qzeros' (AWQ gemm int4 g32) has shape [2, 4], expected [2, 8]")


# ---- FP8 ---------------------------------------------------------------------------------
@pytest.mark.parametrize("changes,phrases", [
    (dict(activation_scheme="static"), ["FP8 activation_scheme 'static'", f"'{DOWN}.weight'",
                                        "activation_scheme 'dynamic'"]),
    (dict(fmt="e5m2"), ["FP8 fmt 'e5m2'", "float8 e4m3"]),
    (dict(weight_block_size=[128]), ["FP8 weight_block_size [128]", "two positive ints"]),
    (dict(modules_to_not_convert=["model.layers.0.mlp"]),
     [f"'{DOWN}.weight_scale_inv' (FP8 block 128x128)", "modules_to_not_convert lists"]),
    (dict(weight_block_size=None), [f"'{DOWN}.weight_scale_inv' (FP8 tensor) has shape [1, 2]",
                                    "per-block scales need weight_block_size"]),
])
def test_fp8_unsupported_config(tmp_path: Path, no_weight_reads: None, changes: dict[str, Any],
                                phrases: list[str]) -> None:
    path = make(tmp_path, fp8_case((128, 128)), intermediate_size=160)
    edit_config(path, **changes)
    refused(path, *phrases)


def test_fp8_scales_of_the_wrong_shape(tmp_path: Path, no_weight_reads: None) -> None:
    path = make(tmp_path, fp8_case((32, 32)))
    edit_tensors(path, **{f"{Q}__weight_scale_inv": torch.ones(2, 1)})
    refused(path, f"tensor '{Q}.weight_scale_inv' (FP8 block 32x32) has shape [2, 1], expected "
                  "[2, 2]", "ceil(N / 32) by ceil(K / 32) blocks for a [64, 64] weight")


def test_fp8_weight_not_stored_in_fp8(tmp_path: Path, no_weight_reads: None) -> None:
    path = make(tmp_path, fp8_case((128, 128)))
    edit_tensors(path, **{f"{Q}__weight": torch.zeros(64, 64, dtype=torch.bfloat16)})
    refused(path, f"tensor '{Q}.weight' (FP8 block 128x128) is stored as bfloat16",
            "stores it as float8_e4m3fn")


# ---- compressed-tensors ------------------------------------------------------------------
W4 = ct_case(dict(num_bits=4, type="int", strategy="group", group_size=32, symmetric=True),
             "pack-quantized")


def edit_group(path: Path, **changes: Any) -> None:
    config = json.loads((path / "config.json").read_text())
    qc = config["quantization_config"]
    group = qc["config_groups"]["group_0"]
    for key, value in changes.items():
        if key in ("ignore", "kv_cache_scheme", "format"):
            qc[key] = value
            if key == "format":
                group["format"] = value
        elif key == "weights":
            group["weights"].update(value)
        else:
            group[key] = value
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("changes,phrases", [
    (dict(format="nvfp4-pack-quantized"), [f"'{DOWN}.weight_packed'",
                                           "format 'nvfp4-pack-quantized'",
                                           "supported: pack-quantized int4/int8"]),
    (dict(weights=dict(num_bits=2)), ["int2 group 32 sym", "2-bit int weights"]),
    (dict(weights=dict(group_size=40)), ["int4 group 40 sym",
                                         "group_size 40 does not divide K=96"]),
    (dict(input_activations=dict(num_bits=8, type="float", strategy="tensor", dynamic=False)),
     ["static input activation scales are not supported"]),
    (dict(kv_cache_scheme=dict(num_bits=8, type="float")),
     ["compressed-tensors kv_cache_scheme (KV-cache quantization)"]),
    (dict(ignore=["lm_head", "re:.*down_proj"]),
     [f"tensor '{DOWN}.weight_packed' is quantized, but the compressed-tensors ignore list"]),
    (dict(targets=["re:.*self_attn.*"]),
     [f"tensor '{DOWN}.weight_packed' is quantized, but no compressed-tensors config group "
      f"targets {DOWN}"]),
])
def test_compressed_tensors_unsupported_config(tmp_path: Path, no_weight_reads: None,
                                               changes: dict[str, Any],
                                               phrases: list[str]) -> None:
    path = make(tmp_path, W4)
    edit_group(path, **changes)
    refused(path, *phrases)


def test_compressed_tensors_packed_data_too_short(tmp_path: Path,
                                                  no_weight_reads: None) -> None:
    path = make(tmp_path, W4)
    edit_tensors(path, **{f"{Q}__weight_packed": tensor(path, f"{Q}.weight_packed")[:, :7]
                          .clone()})
    refused(path, f"tensor '{Q}.weight_packed' (compressed-tensors pack-quantized int4 group 32 "
                  "sym, group 'group_0') has shape [64, 7], expected [64, 8]",
            "weight_shape [64, 64] packs into ceil(64 / 8) int32 words per row")


def test_compressed_tensors_scales_of_the_wrong_shape(tmp_path: Path,
                                                      no_weight_reads: None) -> None:
    path = make(tmp_path, W4)
    edit_tensors(path, **{f"{Q}__weight_scale": torch.ones(64, 3)})
    refused(path, f"tensor '{Q}.weight_scale'", "has shape [64, 3], expected [64, 2]",
            "group scales of a [64, 64] weight")


# ---- loaders without safetensors files -------------------------------------------------------
def test_in_memory_gptq_is_read(tmp_path: Path) -> None:
    """Without file headers dtypes are unknown, but a format whose parts have their own names
    reads through the loader."""
    path = make(tmp_path, GPTQ4)
    config = json.loads((path / "config.json").read_text())
    tensors = load_file(path / "model.safetensors")
    from_files = open_checkpoint(path, device="cpu", dtype=torch.float32)[1]
    loader = DictWeightLoader(tensors, dtype=torch.float32)
    names = hf_quant.register_hf_quantized(loader, None, config["quantization_config"])
    assert f"{Q}.weight" in names and len(names) == 7
    got, ref = loader.get_tensor(f"{Q}.weight"), from_files.get_tensor(f"{Q}.weight")
    assert isinstance(got, QuantizedWeight)
    assert torch.equal(got.dequantize(), ref.dequantize())


def test_in_memory_fp8_is_refused(tmp_path: Path) -> None:
    """An fp8 part named like its weight can only be read raw from safetensors files."""
    path = make(tmp_path, fp8_case((128, 128)))
    config = json.loads((path / "config.json").read_text())
    loader = DictWeightLoader(load_file(path / "model.safetensors"))
    with pytest.raises(WeightLoadError, match=rf"tensor '{DOWN}.weight' is both the quantized data "
                                              r"and the weight's name.*DictWeightLoader"):
        hf_quant.register_hf_quantized(loader, None, config["quantization_config"])
