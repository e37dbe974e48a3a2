"""Weights a model cannot use are refused by the loader, and ``check-model`` finds every
non-finite tensor by scanning the checkpoint in bounded chunks."""
from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tgraph.cli import main
from tgraph.errors import WeightLoadError
from tgraph.io.weights import SafetensorFileLoader
from tgraph.models.loading import check_model, load_model
from tgraph.testing import make_tiny_hf_model

O_PROJ = "model.layers.0.self_attn.o_proj.weight"
Q_PROJ = "model.layers.0.self_attn.q_proj.weight"
UP_PROJ = "model.layers.1.mlp.up_proj.weight"


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_hf_model("llama", tmp_path_factory.mktemp("weights"), seed=0)


def _variant(src: Path, dst: Path, change: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    change(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize(("name", "dtype"), [(O_PROJ, torch.int32), (Q_PROJ, torch.bool)])
def test_integer_weight_is_a_load_error(llama_dir: Path, tmp_path: Path, name: str,
                                        dtype: torch.dtype) -> None:
    def to_dtype(t: dict[str, torch.Tensor]) -> None:
        t[name] = (t[name] * 100).to(dtype)

    path = _variant(llama_dir, tmp_path / "ckpt", to_dtype)
    kind = str(dtype).removeprefix("torch.")
    with pytest.raises(WeightLoadError, match=rf"tensor '{name}' is stored as {kind}; expected "
                                              r"a floating dtype"):
        load_model(path, dtype="float32", device="cpu", graph="eager")
    report = check_model(path)
    assert not report.ok
    assert any(f"'{name}' is stored as {kind}" in p for p in report.problems)


def test_float_storage_dtypes_still_load(llama_dir: Path, tmp_path: Path) -> None:
    def to_half(t: dict[str, torch.Tensor]) -> None:
        t[O_PROJ] = t[O_PROJ].half()
        t[Q_PROJ] = t[Q_PROJ].bfloat16()

    path = _variant(llama_dir, tmp_path / "ckpt", to_half)
    load_model(path, dtype="float32", device="cpu", graph="eager")
    assert check_model(path).ok


def test_check_model_reports_every_nonfinite_tensor(llama_dir: Path, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    def poison(t: dict[str, torch.Tensor]) -> None:
        t[O_PROJ][0, 0] = float("nan")
        t[O_PROJ][-1, -1] = float("nan")  # in the last chunk, not only the first
        t[UP_PROJ][3, 1] = float("inf")
        t[UP_PROJ][4, 1] = float("-inf")

    path = _variant(llama_dir, tmp_path / "ckpt", poison)
    assert check_model(llama_dir).ok
    # A chunk of 64 bytes is a row or two: the scan reads each tensor in many pieces.
    report = check_model(path, chunk_bytes=64)
    assert not report.ok
    assert sorted(report.problems) == [
        f"tensor '{O_PROJ}' holds 2 NaN and 0 Inf values; expected finite weights",
        f"tensor '{UP_PROJ}' holds 0 NaN and 2 Inf values; expected finite weights",
    ]
    rc = main(["check-model", str(path)])
    out = capsys.readouterr().out
    assert rc != 0
    assert f"ERROR: tensor '{O_PROJ}' holds 2 NaN" in out and "FAILED" in out


def test_scan_chunks_are_bounded(llama_dir: Path) -> None:
    loader = SafetensorFileLoader(llama_dir)
    name = "model.embed_tokens.weight"
    rows, cols = loader.shape(name)
    chunks = list(loader.iter_chunks(name, max_bytes=cols * 4 * 10))
    assert all(c.shape[0] <= 10 for c in chunks) and len(chunks) == -(-rows // 10)
    assert torch.equal(torch.cat(chunks), loader.get_tensor(name))
    loader.close()
