"""Tests of the safetensors / in-memory weight loaders.

Every comparison is exact (``torch.equal``): loading copies bytes and, where asked, converts dtype
with the same ``Tensor.to`` the reference uses, so any difference is a bug, not rounding.
"""
from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tgraph.errors import WeightLoadError
from tgraph.io import weights as wl
from tgraph.io.weights import (
    DictWeightLoader,
    SafetensorFileLoader,
    WeightLoader,
    load_weights,
)

Q = "model.layers.0.self_attn.q_proj.weight"
K = "model.layers.0.self_attn.k_proj.weight"
V = "model.layers.0.self_attn.v_proj.weight"
QB = "model.layers.0.self_attn.q_proj.bias"
EMBED = "model.embed_tokens.weight"
NORM = "model.norm.weight"
STEP = "model.step"  # an integer tensor: never dtype-converted implicitly


def make_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {
        Q: torch.randn(8, 12, generator=g),
        K: torch.randn(4, 12, generator=g),
        V: torch.randn(4, 12, generator=g),
        QB: torch.randn(8, generator=g),
        EMBED: torch.randn(10, 12, generator=g).to(torch.bfloat16),
        NORM: torch.randn(12, generator=g),
        STEP: torch.arange(6, dtype=torch.int64),
    }


def save_single(root: Path, tensors: dict[str, torch.Tensor]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(root / "model.safetensors"))
    return root


def save_sharded(
    root: Path, tensors: dict[str, torch.Tensor], n: int, index: bool = True
) -> Path:
    """Split tensors round-robin over n files, the way HF shards, with an index unless told not."""
    root.mkdir(parents=True, exist_ok=True)
    names = sorted(tensors)
    weight_map = {}
    for i in range(n):
        file = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        part = {name: tensors[name] for name in names[i::n]}
        save_file(part, str(root / file))
        weight_map.update({name: file for name in part})
    if index:
        (root / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map})
        )
    return root


LAYOUTS = ["single", "sharded2", "sharded3", "no_index", "dict"]


def make_loader(layout: str, root: Path, tensors: dict[str, torch.Tensor], **kw) -> WeightLoader:
    if layout == "dict":
        return DictWeightLoader(tensors.items(), **kw)
    if layout == "single":
        return SafetensorFileLoader(save_single(root, tensors), **kw)
    if layout == "no_index":
        return SafetensorFileLoader(save_sharded(root, tensors, 2, index=False), **kw)
    return SafetensorFileLoader(save_sharded(root, tensors, int(layout[-1])), **kw)


@pytest.fixture
def tensors() -> dict[str, torch.Tensor]:
    return make_tensors()


# --------------------------------------------------------------------------------- whole reads
@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_reads_identical_tensors(layout, tmp_path, tensors):
    loader = make_loader(layout, tmp_path / "ckpt", tensors)
    assert loader.names() == sorted(tensors)
    for name, ref in tensors.items():
        assert loader.has(name)
        assert loader.shape(name) == tuple(ref.shape)
        out = loader.get_tensor(name)
        assert out.dtype == ref.dtype and out.is_contiguous()
        assert torch.equal(out, ref), name


@pytest.mark.parametrize("n", [2, 3])
def test_sharded_checkpoint_spreads_over_files(n, tmp_path, tensors):
    # Guards the fixture itself: a "sharded" layout that wrote one file would test nothing.
    loader = make_loader(f"sharded{n}", tmp_path / "ckpt", tensors)
    assert isinstance(loader, SafetensorFileLoader) and len(loader.files) == n


def test_single_file_path_is_accepted(tmp_path, tensors):
    root = save_single(tmp_path / "ckpt", tensors)
    loader = SafetensorFileLoader(root / "model.safetensors")
    assert torch.equal(loader.get_tensor(Q), tensors[Q])


def test_index_wins_over_stray_files(tmp_path, tensors):
    # The index decides which file holds a tensor; a stale extra file is never consulted.
    root = save_sharded(tmp_path / "ckpt", tensors, 2)
    save_file({Q: torch.zeros(8, 12)}, str(root / "stale.safetensors"))
    loader = SafetensorFileLoader(root)
    assert torch.equal(loader.get_tensor(Q), tensors[Q])


def test_duplicate_tensor_without_index_is_an_error(tmp_path, tensors):
    root = tmp_path / "ckpt"
    root.mkdir()
    save_file({Q: tensors[Q]}, str(root / "a.safetensors"))
    save_file({Q: tensors[Q]}, str(root / "b.safetensors"))
    with pytest.raises(WeightLoadError, match="stored twice"):
        SafetensorFileLoader(root).names()


# ------------------------------------------------------------------------------ dtype / device
@pytest.mark.parametrize("layout", ["single", "dict"])
def test_loader_dtype_converts_float_tensors_only(layout, tmp_path, tensors):
    loader = make_loader(layout, tmp_path / "ckpt", tensors, dtype=torch.float16)
    for name in (Q, EMBED):
        out = loader.get_tensor(name)
        assert out.dtype == torch.float16
        assert torch.equal(out, tensors[name].to(torch.float16))
    assert loader.get_tensor(STEP).dtype == torch.int64  # ints keep their dtype
    # A per-call dtype wins over the loader's, and applies to any tensor.
    assert loader.get_tensor(Q, dtype=torch.float64).dtype == torch.float64
    assert loader.get_tensor(STEP, dtype=torch.int32).dtype == torch.int32
    shard = loader.get_sharded(Q, 0, rank=1, world_size=2)
    assert shard.dtype == torch.float16 and torch.equal(shard, tensors[Q][4:].half())


def test_bad_constructor_arguments(tmp_path, tensors):
    root = save_single(tmp_path / "ckpt", tensors)
    with pytest.raises(ValueError, match="rank must be in"):
        SafetensorFileLoader(root, rank=2, world_size=2)
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        SafetensorFileLoader(root, world_size=0)
    with pytest.raises(TypeError, match="dtype must be a torch.dtype"):
        SafetensorFileLoader(root, dtype="bfloat16")
    with pytest.raises(TypeError, match=r"\(str, torch.Tensor\)"):
        DictWeightLoader([("a", [1.0, 2.0])])
    with pytest.raises(WeightLoadError, match="given twice"):
        DictWeightLoader([("a", torch.zeros(1)), ("a", torch.ones(1))])


# ---------------------------------------------------------------------------- tensor parallel
@pytest.mark.parametrize("layout", ["single", "sharded3", "dict"])
@pytest.mark.parametrize("dim", [0, 1, -1])
@pytest.mark.parametrize("world_size", [2, 4])
def test_shards_concatenate_to_full_tensor(layout, dim, world_size, tmp_path, tensors):
    loader = make_loader(layout, tmp_path / "ckpt", tensors)
    full = tensors[Q]  # [8, 12]: divisible by 2 and 4 on both dims
    shards = [loader.get_sharded(Q, dim, rank=r, world_size=world_size) for r in range(world_size)]
    for shard in shards:
        expected = list(full.shape)
        expected[dim] //= world_size
        assert list(shard.shape) == expected and shard.is_contiguous()
    assert torch.equal(torch.cat(shards, dim=dim), full)


def test_sharded_defaults_to_loader_rank(tmp_path, tensors):
    root = save_single(tmp_path / "ckpt", tensors)
    for rank in range(2):
        loader = SafetensorFileLoader(root, rank=rank, world_size=2)
        assert torch.equal(loader.get_sharded(QB, 0), tensors[QB].chunk(2)[rank])
        assert torch.equal(loader.get_sharded(Q, 1), tensors[Q].chunk(2, dim=1)[rank])


def test_file_loader_reads_shards_through_slices(tmp_path, tensors):
    """A rank must read only its shard: get_sharded goes through get_slice, never get_tensor."""
    loader = SafetensorFileLoader(save_single(tmp_path / "ckpt", tensors))
    loader.names()  # opens the file
    (file, handle), = loader._handles.items()
    calls = []

    class Spy:
        def get_slice(self, name):
            calls.append(("slice", name))
            return handle.get_slice(name)

        def get_tensor(self, name):
            raise AssertionError(f"whole tensor {name} read for a shard")

        def keys(self):
            return handle.keys()

    loader._handles[file] = Spy()
    out = loader.get_sharded(Q, 0, rank=1, world_size=2)
    assert torch.equal(out, tensors[Q][4:])
    assert ("slice", Q) in calls


@pytest.mark.parametrize("layout", ["single", "dict"])
def test_indivisible_shard_names_tensor_dim_and_world(layout, tmp_path, tensors):
    loader = make_loader(layout, tmp_path / "ckpt", tensors, rank=0, world_size=3)
    with pytest.raises(WeightLoadError) as info:
        loader.get_sharded(Q, 0)  # 8 rows over 3 ranks
    msg = str(info.value)
    assert Q in msg and "size 8" in msg and "world_size 3" in msg
    with pytest.raises(WeightLoadError, match="no such dim"):
        loader.get_sharded(QB, 1)


@pytest.mark.parametrize("layout", ["sharded2", "dict"])
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_merged_qkv_is_concat_of_each_rank_shard(layout, world_size, tmp_path, tensors):
    parts = [tensors[Q], tensors[K], tensors[V]]
    for rank in range(world_size):
        loader = make_loader(
            layout, tmp_path / f"ckpt{rank}", tensors, rank=rank, world_size=world_size
        )
        packed = loader.get_merged([Q, K, V], dim=0, shard_dim=0)
        expected = torch.cat([p.chunk(world_size, dim=0)[rank] for p in parts], dim=0)
        assert packed.shape == (16 // world_size, 12)
        assert torch.equal(packed, expected)
    # Without shard_dim the parts are read whole.
    assert torch.equal(loader.get_merged([Q, K, V]), torch.cat(parts))


def test_merged_input_dim_sharding_and_errors(tmp_path, tensors):
    loader = make_loader("single", tmp_path / "ckpt", tensors, rank=1, world_size=2)
    packed = loader.get_merged([K, V], dim=0, shard_dim=1)
    assert torch.equal(packed, torch.cat([tensors[K][:, 6:], tensors[V][:, 6:]]))
    with pytest.raises(WeightLoadError, match="cannot concatenate"):
        loader.get_merged([Q, QB])  # [8, 12] and [8]
    with pytest.raises(TypeError, match="sequence of names"):
        loader.get_merged(Q)


# ------------------------------------------------------------------------ names and bookkeeping
@pytest.mark.parametrize("layout", ["sharded2", "dict"])
def test_missing_tensor_message(layout, tmp_path, tensors):
    loader = make_loader(layout, tmp_path / "ckpt", tensors)
    typo = "model.layers.0.self_attn.q_prj.weight"
    assert not loader.has(typo)
    with pytest.raises(WeightLoadError) as info:
        loader.get_tensor(typo)
    msg = str(info.value)
    assert typo in msg and f"'{Q}'" in msg  # names the tensor and suggests the close match
    if layout != "dict":
        assert "model-00001-of-00002.safetensors" in msg and "model-00002-of-00002" in msg
    for call in (lambda: loader.shape(typo), lambda: loader.get_sharded(typo, 0),
                 lambda: loader.mark_used(typo)):
        with pytest.raises(WeightLoadError, match="q_prj"):
            call()


@pytest.mark.parametrize("layout", ["single", "dict"])
def test_used_names_and_aliases(layout, tmp_path, tensors):
    loader = make_loader(layout, tmp_path / "ckpt", tensors)
    assert loader.unused_names() == sorted(tensors)
    assert not loader.has("lm_head.weight")
    loader.alias("lm_head.weight", EMBED)  # tied embeddings
    assert loader.has("lm_head.weight") and loader.shape("lm_head.weight") == (10, 12)
    assert torch.equal(loader.get_tensor("lm_head.weight"), tensors[EMBED])
    loader.get_sharded(Q, 0, rank=0, world_size=2)
    loader.get_merged([K, V])
    loader.mark_used(STEP)
    assert loader.unused_names() == sorted([QB, NORM])
    assert "lm_head.weight" not in loader.names()  # aliases are not checkpoint names
    loader.alias("model.missing", "model.also_missing")
    with pytest.raises(WeightLoadError, match="alias target 'model.also_missing'"):
        loader.get_tensor("model.missing")


def test_alias_never_shadows_a_stored_tensor(tmp_path, tensors):
    tensors = dict(tensors, **{"lm_head.weight": torch.full((10, 12), 7.0)})
    loader = make_loader("single", tmp_path / "ckpt", tensors)
    loader.alias("lm_head.weight", EMBED)
    assert torch.equal(loader.get_tensor("lm_head.weight"), tensors["lm_head.weight"])
    assert EMBED in loader.unused_names()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_row_views_read_a_fused_tensor_as_its_parts(layout, tmp_path, tensors):
    """Phi-3's fused q|k|v read as q, k and v: whole, sharded by rows or columns, the fused
    tensor marked used; a view never shadows a stored tensor; a range past the end is named."""
    fused = torch.arange(12 * 6, dtype=torch.float32).reshape(12, 6)
    loader = make_loader(layout, tmp_path / "ckpt", dict(tensors, **{"qkv.weight": fused}))
    for name, start, rows in (("q.weight", 0, 8), ("k.weight", 8, 2), ("v.weight", 10, 2)):
        loader.row_view(name, "qkv.weight", start, rows)
    assert loader.has("q.weight") and loader.shape("k.weight") == (2, 6)
    assert loader.stored_dtype("v.weight") in (torch.float32, None)
    assert torch.equal(loader.get_tensor("k.weight"), fused[8:10])
    assert torch.equal(loader.get_sharded("q.weight", 0, rank=1, world_size=2), fused[4:8])
    assert torch.equal(loader.get_sharded("v.weight", 1, rank=2, world_size=3), fused[10:, 4:])
    assert torch.equal(loader.get_merged(["q.weight", "v.weight"], shard_dim=0),
                       torch.cat([fused[:8], fused[10:]]))
    assert "qkv.weight" not in loader.unused_names() and "q.weight" not in loader.names()
    loader.row_view(Q, "qkv.weight", 0, 8)  # Q is stored: read as itself
    assert torch.equal(loader.get_tensor(Q), tensors[Q])
    with pytest.raises(WeightLoadError, match=r"'x.weight': rows 10\.\.12 of 'qkv.weight', "
                                              r"which has 12 rows"):
        loader.row_view("x.weight", "qkv.weight", 10, 3)


def test_row_views_of_a_quantized_tensor_narrow_its_codes():
    from tgraph.quant import quantize

    fused = torch.randn(96, 64)
    q = quantize(fused, kind="int8")
    loader = DictWeightLoader({})
    loader.register_quantized("qkv.weight", (96, 64), lambda: q)
    loader.row_view("k.weight", "qkv.weight", 64, 32)
    got = loader.get_sharded("k.weight", 0, rank=1, world_size=2)
    assert torch.equal(got.dequantize(torch.float32), q.dequantize(torch.float32)[80:96])


def test_expect_shape(tmp_path, tensors):
    loader = make_loader("single", tmp_path / "ckpt", tensors)
    loader.expect_shape(Q, (8, 12))
    loader.expect_shape(Q, (None, 12))
    loader.expect_shape(Q, [-1, 12])
    with pytest.raises(WeightLoadError, match=r"shape \[8, 12\].*expected \[8, 16\]"):
        loader.expect_shape(Q, (8, 16))
    with pytest.raises(WeightLoadError, match="expected"):
        loader.expect_shape(Q, (8, 12, 1))
    assert loader.unused_names() == sorted(tensors)  # checking a shape reads no data


def test_load_weights_helper(tensors):
    loader = load_weights(tensors.items(), dtype=torch.bfloat16, rank=1, world_size=2)
    assert isinstance(loader, DictWeightLoader)
    assert torch.equal(loader.get_sharded(K, 0), tensors[K][2:].bfloat16())
    assert load_weights(tensors).names() == sorted(tensors)  # a mapping works too


def test_loads_a_transformers_checkpoint(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                      tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(tmp_path / "hf", safe_serialization=True)
    loader = SafetensorFileLoader(tmp_path / "hf", rank=1, world_size=2)
    state = model.state_dict()
    assert "lm_head.weight" not in loader.names()  # tied: HF stores it once
    loader.alias("lm_head.weight", "model.embed_tokens.weight")
    assert torch.equal(loader.get_tensor("lm_head.weight"), state["lm_head.weight"])
    q = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(loader.get_sharded(q, 0), state[q].chunk(2)[1])


# ------------------------------------------------------------------------- refused / malformed
class _Tripwire:
    """Unpickling this creates a file: the refusal test checks that file never appears."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


@pytest.mark.parametrize("filename", ["pytorch_model.bin", "pytorch_model-00001-of-00002.bin",
                                      "weights.pt", "model.pth", "last.ckpt"])
def test_pickle_only_directory_is_refused_unopened(filename, tmp_path, monkeypatch):
    root = tmp_path / "ckpt"
    root.mkdir()
    sentinel = tmp_path / "unpickled"
    (root / filename).write_bytes(pickle.dumps(_Tripwire(sentinel)))

    def forbidden(*args, **kwargs):
        raise AssertionError("a pickle was loaded")

    monkeypatch.setattr(pickle, "load", forbidden)
    monkeypatch.setattr(pickle, "loads", forbidden)
    monkeypatch.setattr(torch, "load", forbidden)
    with pytest.raises(WeightLoadError) as info:
        SafetensorFileLoader(root)
    msg = str(info.value)
    assert filename in msg and "never unpickles" in msg
    assert "save_pretrained(" in msg and "safe_serialization=True" in msg
    assert not sentinel.exists()


def test_missing_or_empty_directory(tmp_path):
    with pytest.raises(WeightLoadError, match="does not exist"):
        SafetensorFileLoader(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(WeightLoadError, match="no safetensors checkpoint"):
        SafetensorFileLoader(tmp_path / "empty")
    (tmp_path / "w.bin").write_bytes(b"x")
    with pytest.raises(WeightLoadError, match="not a .safetensors file"):
        SafetensorFileLoader(tmp_path / "w.bin")


def test_malformed_index(tmp_path, tensors):
    root = save_sharded(tmp_path / "ckpt", tensors, 2)
    index = root / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["weight_map"][Q] = "model-00009-of-00009.safetensors"
    index.write_text(json.dumps(data))
    with pytest.raises(WeightLoadError, match="model-00009-of-00009.safetensors"):
        SafetensorFileLoader(root)
    index.write_text('{"weight_map": {\n  "a": 1,}')
    with pytest.raises(WeightLoadError, match="line 2"):
        SafetensorFileLoader(root)
    index.write_text('{"metadata": {}}')
    with pytest.raises(WeightLoadError, match="weight_map"):
        SafetensorFileLoader(root)


def test_index_listing_a_tensor_its_file_lacks(tmp_path, tensors):
    root = save_sharded(tmp_path / "ckpt", tensors, 2)
    index = root / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["weight_map"]["model.ghost"] = "model-00001-of-00002.safetensors"
    index.write_text(json.dumps(data))
    loader = SafetensorFileLoader(root)
    with pytest.raises(WeightLoadError, match="model.ghost.*cannot be read"):
        loader.shape("model.ghost")


def test_corrupt_safetensors_file(tmp_path):
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(WeightLoadError, match="cannot open safetensors file"):
        SafetensorFileLoader(root).names()


# ------------------------------------------------------------------------- progress, life cycle
def test_progress_bar(tmp_path, tensors, capsys, monkeypatch):
    root = save_single(tmp_path / "ckpt", tensors)
    for name in tensors:
        SafetensorFileLoader(root, progress=False).get_tensor(name)
    assert "Loading weights" not in capsys.readouterr().err  # small checkpoint: no bar

    loader = SafetensorFileLoader(root, progress=True)
    for name in tensors:
        loader.get_tensor(name)
    err = capsys.readouterr().err
    assert "Loading weights" in err and f"{len(tensors)}/{len(tensors)}" in err

    monkeypatch.setattr(wl, "PROGRESS_BYTES", 0)  # now the checkpoint counts as "large"
    SafetensorFileLoader(root).get_tensor(Q)
    assert "Loading weights" in capsys.readouterr().err


def test_close_and_reopen(tmp_path, tensors):
    root = save_single(tmp_path / "ckpt", tensors)
    with SafetensorFileLoader(root) as loader:
        loader.get_tensor(Q)
        assert loader._handles
    assert not loader._handles
    assert torch.equal(loader.get_tensor(K), tensors[K])  # reopened lazily


# ----------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_loads_straight_to_cuda_with_llm_shapes(dtype, tmp_path):
    # Llama-3-8B-like q/k/v shapes, stored bf16 as in real checkpoints.
    g = torch.Generator().manual_seed(0)
    tensors = {
        Q: torch.randn(4096, 4096, generator=g).bfloat16(),
        K: torch.randn(1024, 4096, generator=g).bfloat16(),
        V: torch.randn(1024, 4096, generator=g).bfloat16(),
    }
    root = save_sharded(tmp_path / "ckpt", tensors, 2)
    for rank in range(2):
        loader = SafetensorFileLoader(root, device="cuda", dtype=dtype, rank=rank, world_size=2)
        packed = loader.get_merged([Q, K, V], shard_dim=0)
        assert packed.device.type == "cuda" and packed.dtype == dtype
        expected = torch.cat([t.chunk(2)[rank] for t in tensors.values()]).to(dtype)
        assert torch.equal(packed.cpu(), expected)
