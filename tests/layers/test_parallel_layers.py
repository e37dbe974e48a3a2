"""Tensor-parallel sharding of the linear and embedding layers.

Each layer is built for every rank of a world of 2 (or 4) from the same checkpoint; the shards
must put the full weights back together exactly (loading copies bytes, so comparisons are
``torch.equal``). Both loaders are used: in-memory and safetensors on disk.
An end-to-end run of a tiny model over 2 gloo ranks checks that the collectives recombine the
shards into the single-rank logits.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tgraph.errors import ConfigError, WeightLoadError
from tgraph.io.weights import DictWeightLoader, SafetensorFileLoader
from tgraph.layers.embedding import ParallelEmbedding
from tgraph.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)

HIDDEN, HEAD_DIM = 16, 4


def make_loader(kind: str, tensors: dict[str, torch.Tensor], tmp_path: Path, rank: int = 0,
                world_size: int = 1):
    if kind == "dict":
        return DictWeightLoader(tensors, rank=rank, world_size=world_size)
    file = tmp_path / "model.safetensors"
    if not file.exists():
        save_file(tensors, str(file))
    return SafetensorFileLoader(tmp_path, rank=rank, world_size=world_size, progress=False)


def weight(p) -> torch.Tensor:
    return p.data


LOADERS = pytest.mark.parametrize("kind", ["dict", "safetensors"])


@LOADERS
@pytest.mark.parametrize("bias", [False, True])
def test_column_parallel_concatenates_on_dim0(kind, bias, tmp_path):
    w, b = torch.randn(12, HIDDEN), torch.randn(12)
    tensors = {"p.weight": w, **({"p.bias": b} if bias else {})}
    layers = [ColumnParallelLinear(make_loader(kind, tensors, tmp_path), "p", HIDDEN, 12,
                                   bias=bias, rank=r, world_size=2) for r in range(2)]
    assert all(layer.out_features == 6 and layer.in_features == HIDDEN for layer in layers)
    assert torch.equal(torch.cat([weight(layer.weight) for layer in layers], 0), w)
    if bias:
        assert torch.equal(torch.cat([weight(layer.bias) for layer in layers]), b)
    else:
        assert all(layer.bias is None for layer in layers)


@LOADERS
def test_row_parallel_concatenates_on_dim1_with_bias_once(kind, tmp_path):
    w, b = torch.randn(HIDDEN, 12), torch.randn(HIDDEN)
    tensors = {"o.weight": w, "o.bias": b}
    loaders = [make_loader(kind, tensors, tmp_path, rank=r, world_size=2) for r in range(2)]
    # rank / world_size come from the loader here
    layers = [RowParallelLinear(ld, "o", 12, HIDDEN, bias=True) for ld in loaders]
    assert [(layer.rank, layer.world_size) for layer in layers] == [(0, 2), (1, 2)]
    assert torch.equal(torch.cat([weight(layer.weight) for layer in layers], 1), w)
    # The bias is added once, by rank 0, before the all-reduce; rank 1 still consumes it.
    assert torch.equal(weight(layers[0].bias), b) and layers[1].bias is None
    assert all(ld.unused_names() == [] for ld in loaders)
    # The partial products of the ranks sum to the full linear.
    x = torch.randn(5, 12, dtype=torch.float64)
    partial = [x[:, 6 * r:6 * (r + 1)] @ weight(layer.weight).double().T for r, layer in
               enumerate(layers)]
    full = x @ w.double().T + b.double()
    assert torch.allclose(partial[0] + partial[1] + b.double(), full, rtol=1e-12, atol=1e-12)


@LOADERS
def test_merged_column_holds_each_parts_shard(kind, tmp_path):
    gate, up = torch.randn(8, HIDDEN), torch.randn(8, HIDDEN)
    tensors = {"mlp.gate_proj.weight": gate, "mlp.up_proj.weight": up}
    layers = [MergedColumnParallelLinear(make_loader(kind, tensors, tmp_path),
                                         ["mlp.gate_proj", "mlp.up_proj"], HIDDEN, [8, 8],
                                         rank=r, world_size=2) for r in range(2)]
    parts = [torch.split(weight(layer.weight), layer.output_sizes) for layer in layers]
    assert all(layer.output_sizes == [4, 4] for layer in layers)
    assert torch.equal(torch.cat([p[0] for p in parts]), gate)
    assert torch.equal(torch.cat([p[1] for p in parts]), up)
    # rank 0 holds [gate rows 0..3; up rows 0..3], not the first half of cat(gate, up)
    assert torch.equal(weight(layers[0].weight), torch.cat([gate[:4], up[:4]]))


def qkv_tensors(heads: int, kv_heads: int, bias: bool) -> dict[str, torch.Tensor]:
    t = {f"a.{n}_proj.weight": torch.randn(h * HEAD_DIM, HIDDEN)
         for n, h in (("q", heads), ("k", kv_heads), ("v", kv_heads))}
    if bias:
        t.update({f"a.{n}_proj.bias": torch.randn(h * HEAD_DIM)
                  for n, h in (("q", heads), ("k", kv_heads), ("v", kv_heads))})
    return t


@LOADERS
@pytest.mark.parametrize("heads, kv_heads, world_size", [
    (4, 2, 2),  # GQA, KV heads split
    (4, 4, 2),  # MHA
    (4, 1, 2),  # one KV head replicated on both ranks
    (8, 2, 4),  # each of 2 KV heads replicated on 2 of 4 ranks
])
@pytest.mark.parametrize("bias", [False, True])
def test_qkv_sharded_by_heads(kind, heads, kv_heads, world_size, bias, tmp_path):
    tensors = qkv_tensors(heads, kv_heads, bias)
    prefixes = ["a.q_proj", "a.k_proj", "a.v_proj"]
    loaders = [make_loader(kind, tensors, tmp_path, r, world_size) for r in range(world_size)]
    layers = [QKVParallelLinear(ld, prefixes, HIDDEN, HEAD_DIM, heads, kv_heads, bias=bias)
              for ld in loaders]
    local_kv = max(1, kv_heads // world_size)
    for r, layer in enumerate(layers):
        assert layer.num_heads == heads // world_size and layer.num_kv_heads == local_kv
        assert layer.output_sizes == [heads // world_size * HEAD_DIM, local_kv * HEAD_DIM,
                                      local_kv * HEAD_DIM]
        assert loaders[r].unused_names() == []
    for what in ("weight", "bias") if bias else ("weight",):
        q, k, v = zip(*(torch.split(weight(getattr(layer, what)), layer.output_sizes)
                        for layer in layers))
        assert torch.equal(torch.cat(q), tensors[f"a.q_proj.{what}"])
        for got, name in ((k, "a.k_proj"), (v, "a.v_proj")):
            full = tensors[f"{name}.{what}"]
            if kv_heads >= world_size:
                assert torch.equal(torch.cat(got), full)
            else:  # rank r holds KV head r * kv_heads // world_size, whole
                for r, part in enumerate(got):
                    head = r * kv_heads // world_size
                    assert torch.equal(part, full[head * HEAD_DIM:(head + 1) * HEAD_DIM])


@LOADERS
def test_embedding_split_by_vocab(kind, tmp_path):
    w = torch.randn(10, HIDDEN)
    layers = [ParallelEmbedding(make_loader(kind, {"e.weight": w}, tmp_path), "e", 10, HIDDEN,
                                rank=r, world_size=2) for r in range(2)]
    assert [layer.vocab_per_rank for layer in layers] == [5, 5]
    assert torch.equal(torch.cat([weight(layer.weight) for layer in layers]), w)


def test_replicated_linear_is_whole():
    w = torch.randn(6, HIDDEN)
    layer = ReplicatedLinear(DictWeightLoader({"r.weight": w}, rank=1, world_size=2), "r",
                             HIDDEN, 6)
    assert torch.equal(weight(layer.weight), w)


def test_world_size_one_holds_everything():
    tensors = qkv_tensors(4, 2, True)
    layer = QKVParallelLinear(DictWeightLoader(tensors), ["a.q_proj", "a.k_proj", "a.v_proj"],
                              HIDDEN, HEAD_DIM, 4, 2, bias=True)
    expected = torch.cat([tensors[f"a.{n}_proj.weight"] for n in "qkv"])
    assert torch.equal(weight(layer.weight), expected)


# ----------------------------------------------------------------------------- bad shardings
def test_heads_not_divisible_by_world_size():
    loader = DictWeightLoader(qkv_tensors(4, 2, False))
    with pytest.raises(ConfigError, match=r"num_attention_heads \(4\).*world size \(3\)"):
        QKVParallelLinear(loader, ["a.q_proj", "a.k_proj", "a.v_proj"], HIDDEN, HEAD_DIM, 4, 2,
                          rank=0, world_size=3)


def test_kv_heads_that_cannot_be_replicated_evenly():
    loader = DictWeightLoader(qkv_tensors(12, 3, False))
    with pytest.raises(ConfigError, match="num_key_value_heads"):
        QKVParallelLinear(loader, ["a.q_proj", "a.k_proj", "a.v_proj"], HIDDEN, HEAD_DIM, 12, 3,
                          rank=0, world_size=4)


@pytest.mark.parametrize("make", [
    lambda ld: ColumnParallelLinear(ld, "p", HIDDEN, 10, rank=0, world_size=4),
    lambda ld: RowParallelLinear(ld, "q", 10, HIDDEN, rank=0, world_size=4),
    lambda ld: ParallelEmbedding(ld, "e", 10, HIDDEN, rank=0, world_size=4),
])
def test_features_not_divisible_by_world_size(make):
    loader = DictWeightLoader({"p.weight": torch.randn(10, HIDDEN),
                               "q.weight": torch.randn(HIDDEN, 10),
                               "e.weight": torch.randn(10, HIDDEN)})
    with pytest.raises(ConfigError, match=r"\(10\) is not divisible by the tensor-parallel "
                                          r"world size \(4\)"):
        make(loader)


def test_wrong_checkpoint_shape_is_refused_before_sharding():
    loader = DictWeightLoader({"p.weight": torch.randn(12, HIDDEN + 1)})
    with pytest.raises(WeightLoadError, match=r"'p.weight' has shape \[12, 17\].*expected "
                                              r"\[12, 16\]"):
        ColumnParallelLinear(loader, "p", HIDDEN, 12, rank=1, world_size=2)


# ------------------------------------------------------------------------- end to end, gloo
WORKER = '''
import os, sys
import torch
from tgraph.models import load_model
from tgraph.nn import distributed
from tgraph.testing import PagedBatcher

info = distributed.init_process_group("cpu")
model = load_model(sys.argv[1], device="cpu", dtype="float32", max_model_len=32,
                   block_size=4, rank=info.rank, world_size=info.world_size)
model.allocate_kv_cache(32)
b = PagedBatcher.for_model(model)
ids = [b.add([1, 5, 9, 22, 7, 3]), b.add([3, 4])]
prefill = model.run(b.step(ids, all_logits=True)).clone()
for s in ids:
    b.append(s, 11)
decode = model.run(b.step(ids)).clone()
torch.save({"prefill": prefill, "decode": decode}, f"{sys.argv[2]}/rank{info.rank}.pt")
distributed.destroy_process_group()
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_rank_model_matches_one_rank(tmp_path):
    """A tiny Llama (4 heads, 2 KV heads, vocab 192) on 2 gloo ranks: every rank's logits equal
    the single-rank logits within fp32 reduction-order noise (1e-5 relative: the all-reduces
    add two partial sums where one rank adds them in one GEMM)."""
    from tgraph.models import load_model
    from tgraph.testing import PagedBatcher, make_tiny_hf_model

    ckpt = make_tiny_hf_model("llama", tmp_path / "ckpt")
    (tmp_path / "worker.py").write_text(textwrap.dedent(WORKER))
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(_free_port()), "PYTHONPATH": str(root)}
    procs = [subprocess.Popen([sys.executable, str(tmp_path / "worker.py"), str(ckpt),
                               str(tmp_path)], env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for r in range(2)]
    for r, p in enumerate(procs):
        out, _ = p.communicate(timeout=240)
        assert p.returncode == 0, f"rank {r} failed:\n{out.decode()[-3000:]}"

    model = load_model(ckpt, device="cpu", dtype="float32", max_model_len=32, block_size=4)
    model.allocate_kv_cache(32)
    b = PagedBatcher.for_model(model)
    ids = [b.add([1, 5, 9, 22, 7, 3]), b.add([3, 4])]
    ref = {"prefill": model.run(b.step(ids, all_logits=True)).clone()}
    for s in ids:
        b.append(s, 11)
    ref["decode"] = model.run(b.step(ids)).clone()
    for r in range(2):
        got = torch.load(tmp_path / f"rank{r}.pt", weights_only=True)
        for key, expected in ref.items():
            scale = expected.abs().max()
            err = (got[key] - expected).abs().max() / scale
            assert got[key].shape == expected.shape and err <= 1e-5, (r, key, float(err))
