"""QuantizedWeight: the three layouts' dequantization, shards and packing without dequantizing,
embedding rows, the checks on malformed parts, and the round-to-nearest quantizer."""
from __future__ import annotations

import pytest
import torch

from tgraph.errors import WeightLoadError
from tgraph.quant import QuantizedWeight, QuantScheme, quantize, unpack_int4

N, K = 12, 64


def _random(kind: str, block: tuple[int, int], offsets: bool = False, n: int = N, k: int = K,
            seed: int = 0) -> QuantizedWeight:
    g = torch.Generator().manual_seed(seed)
    if kind == "int4":
        q = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8)
    elif kind == "int8":
        q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    else:
        q = (torch.randn(n, k, generator=g) * 4).to(torch.float8_e4m3fn)
    shape = (-(-n // block[0]), -(-k // block[1]))
    scale = torch.rand(shape, generator=g) + 0.1
    offset = torch.randn(shape, generator=g) if offsets else None
    return QuantizedWeight(QuantScheme(kind, block, offsets), q, scale, offset, torch.float32,
                           f"{kind}.weight")


def _naive(w: QuantizedWeight) -> torch.Tensor:
    """Element by element from the layout's definition (independent of the vectorised code)."""
    n, k = w.shape
    rows, cols = w.scheme.block
    out = torch.empty(n, k)
    codes = unpack_int4(w.qdata) if w.scheme.kind == "int4" else w.qdata
    for i in range(n):
        for j in range(k):
            # fp32 scalars: the layout is defined by fp32 arithmetic (one rounding per op).
            s = w.scale[i // rows, j // cols]
            q = codes[i, j].to(torch.float32)
            if w.scheme.offsets:
                out[i, j] = s * q + w.offset[i // rows, j // cols]
            elif w.scheme.kind == "int4":
                out[i, j] = s * (q - 8)
            else:
                out[i, j] = s * q
    return out


LAYOUTS = [("int4", (1, 16), False), ("int4", (1, 32), True), ("int4", (1, K), False),
           ("int8", (1, 16), False), ("int8", (1, 32), True), ("fp8", (1, K), False),
           ("fp8", (N, K), False), ("fp8", (8, 16), False)]


@pytest.mark.parametrize("kind, block, offsets", LAYOUTS)
def test_dequantize_follows_the_layout(kind, block, offsets):
    w = _random(kind, block, offsets)
    # fp32 products of a <= 24-bit scale and a small integer code: both ways round the same.
    torch.testing.assert_close(w.dequantize(), _naive(w), rtol=0, atol=0)
    assert w.dequantize(torch.bfloat16).dtype == torch.bfloat16


@pytest.mark.parametrize("kind, block, offsets", LAYOUTS)
def test_shards_and_packing_never_dequantize_and_agree(kind, block, offsets):
    w = _random(kind, block, offsets)
    d = w.dequantize()
    rows = block[0] if block[0] < N else 1
    half = (N // 2) // rows * rows or rows
    top, bottom = w.narrow(0, 0, half), w.narrow(0, half, N - half)
    assert torch.equal(top.dequantize(), d[:half]) and torch.equal(bottom.dequantize(), d[half:])
    assert torch.equal(QuantizedWeight.cat([top, bottom]).dequantize(), d)
    cut = block[1] if block[1] < K else 32
    right = w.narrow(1, cut, K - cut)
    assert torch.equal(right.dequantize(), d[:, cut:])
    assert right.qdata.dtype == w.qdata.dtype and right.nbytes < w.nbytes


def test_resident_bytes_are_the_packed_ones():
    w = _random("int4", (1, 32))
    assert w.nbytes == N * K // 2 + N * (K // 32) * 4
    assert w.numel() == N * K and w.shape == (N, K) and w.dtype == torch.float32


def test_embedding_rows_dequantize_only_the_rows_asked_for():
    w = _random("int8", (1, 16), offsets=True)
    ids = torch.tensor([[3, 0], [11, 3]])
    torch.testing.assert_close(w.rows(ids), w.dequantize()[ids], rtol=0, atol=0)


def test_packing_needs_the_same_scheme():
    a, b = _random("int4", (1, 16)), _random("int4", (1, 32))
    assert not a.mergeable_with(b)
    with pytest.raises(WeightLoadError, match="cannot pack .* int4 g16 sym .* int4 g32 sym"):
        QuantizedWeight.cat([a, b])
    # fp8 per-tensor scales of different tensors stack as per-channel scales, exactly.
    f1, f2 = _random("fp8", (N, K), seed=1), _random("fp8", (N, K), seed=2)
    assert f1.mergeable_with(f2)
    both = QuantizedWeight.cat([f1, f2])
    assert both.scheme.block == (1, K)
    assert torch.equal(both.dequantize(), torch.cat([f1.dequantize(), f2.dequantize()]))


@pytest.mark.parametrize("dim, start, length, message", [
    (1, 8, 16, "16-wide scale blocks"),
    (1, 1, 16, "whole bytes"),
    (0, 0, N + 1, "rows 0..13"),
])
def test_shards_off_the_blocks_are_refused(dim, start, length, message):
    w = _random("int4", (1, 16))
    with pytest.raises(WeightLoadError, match=message):
        w.narrow(dim, start, length)


@pytest.mark.parametrize("bad, message", [
    (dict(qdata=torch.zeros(N, K, dtype=torch.int8)), "int4 data must be torch.uint8"),
    (dict(scale=torch.ones(N, 3)), r"scale must be float32 \[12, 4\]"),
    (dict(scale=torch.ones(N, 4, dtype=torch.float16)), "scale must be float32"),
    (dict(offset=torch.zeros(N, 4)), "takes no offsets"),
    (dict(scheme=QuantScheme("int4", (1, 24))), "group size 24 does not divide K=64"),
])
def test_malformed_parts_are_refused_by_name(bad, message):
    parts = dict(scheme=QuantScheme("int4", (1, 16)), qdata=torch.zeros(N, K // 2,
                 dtype=torch.uint8), scale=torch.ones(N, 4), offset=None)
    parts.update(bad)
    with pytest.raises(WeightLoadError, match=message):
        QuantizedWeight(parts["scheme"], parts["qdata"], parts["scale"], parts["offset"],
                        name="blk.0.attn_q.weight")


def test_scheme_checks():
    with pytest.raises(WeightLoadError, match="'int3' is not supported"):
        QuantScheme("int3", (1, 32))
    with pytest.raises(WeightLoadError, match="fp8 weights take scales only"):
        QuantScheme("fp8", (1, 32), offsets=True)
    with pytest.raises(WeightLoadError, match="even group size"):
        QuantScheme("int4", (1, 15))
    assert QuantScheme("int4", (1, 32), True).describe((4, 64)) == "int4 g32 offsets"
    assert QuantScheme("fp8", (128, 128)).describe((256, 256)) == "fp8 block 128x128"


@pytest.mark.parametrize("kind, group, offsets, bound", [
    ("int4", 32, False, 1 / 7), ("int4", 16, True, 1 / 15), ("int8", 64, False, 1 / 127),
    ("int8", None, True, 1 / 255), ("fp8", None, False, 1 / 8),
])
def test_round_to_nearest_quantizer(kind, group, offsets, bound):
    w = torch.randn(N, K)
    q = quantize(w, kind, group, offsets)
    # Round-to-nearest: at most half a step per weight (a step is the group's range over the
    # codes; fp8's relative step is 2**-3 of the value).
    err = (q.dequantize() - w).abs()
    if kind == "fp8":
        assert bool((err <= w.abs() * bound / 2 + 1e-6).all())
    else:
        rng = w.abs().amax() * 2
        assert float(err.max()) <= float(rng * bound / 2 + 1e-6)


def test_loader_reads_quantized_weights_whole_sharded_and_packed():
    from tgraph.io.weights import DictWeightLoader

    w, v = _random("int4", (1, 16), offsets=True), _random("int4", (1, 16), offsets=True, seed=4)
    loader = DictWeightLoader({"a.qweight": w.qdata, "a.scales": w.scale, "a.zeros": w.offset},
                              dtype=torch.bfloat16)
    parts = ["a.qweight", "a.scales", "a.zeros"]
    loader.register_quantized("a.weight", w.shape, lambda: w, parts)
    loader.register_quantized("b.weight", v.shape, lambda: v)
    assert loader.names() == ["a.weight", "b.weight"] and loader.shape("a.weight") == (N, K)
    whole = loader.get_tensor("a.weight")
    assert whole.dtype == torch.bfloat16 and torch.equal(whole.qdata, w.qdata)
    rows = [loader.get_sharded("a.weight", 0, r, 2) for r in range(2)]
    cols = [loader.get_sharded("a.weight", 1, r, 2) for r in range(2)]
    d = w.dequantize()
    assert torch.equal(torch.cat([r.dequantize(torch.float32) for r in rows]), d)
    assert torch.equal(torch.cat([c.dequantize(torch.float32) for c in cols], 1), d)
    packed = loader.get_merged(["a.weight", "b.weight"], shard_dim=0)
    assert packed.shape == (2 * N, K) and packed.scheme == w.scheme
    assert loader.unused_names() == []  # the parts count as read
    with pytest.raises(WeightLoadError, match="not divisible by world_size 5"):
        loader.get_sharded("a.weight", 0, 0, 5)


def test_permuted_columns_dequantize_to_their_logical_places():
    w = _random("int4", (1, 16), offsets=True)
    perm = torch.randperm(K)
    p = QuantizedWeight(w.scheme, w.qdata, w.scale, w.offset, torch.float32, "g", perm)
    stored = w.dequantize()
    assert torch.equal(p.dequantize()[:, perm], stored)
    assert torch.equal(p.narrow(0, 0, 4).dequantize(), p.dequantize()[:4])
    assert not p.mergeable_with(w) and p.mergeable_with(p.narrow(0, 4, 8))
    with pytest.raises(WeightLoadError, match="act-order"):
        p.narrow(1, 0, 16)
    with pytest.raises(WeightLoadError, match="perm must be int64"):
        QuantizedWeight(w.scheme, w.qdata, w.scale, w.offset, perm=perm.int())
