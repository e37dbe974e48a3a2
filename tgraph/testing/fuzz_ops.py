"""The op catalogue of the differential fuzzer (:mod:`tgraph.testing.fuzz`).

Each :class:`OpDef` says how to draw one step of a random program (which values it reads, its
parameters), which new leaves it needs (weights, extra graph inputs such as rope tables or a
paged KV cache), how to record it with :mod:`tgraph.nn.functional`, and how to compute it in
plain torch. The torch side is written from the math, never through tgraph's reference kernels,
so it is an independent oracle.

A drawn step keeps only JSON-able parameters; leaf shapes are derived from the operand shapes,
so a program stays valid (or is cleanly refused) when the shrinker makes its inputs smaller.
"""
from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tgraph.nn import functional as F
from tgraph.nn.module import Parameter

Shape = tuple[int, ...]
Params = dict[str, Any]


@dataclass(frozen=True)
class Leaf:
    """A new weight (a ``Parameter``) or graph input a step reads, with its data."""

    kind: str  # "weight" or "input"
    data: torch.Tensor
    mutated: bool = False  # an input the network writes in place (a KV cache)


@dataclass(frozen=True)
class OpDef:
    """One op of the catalogue.

    Attributes:
        name: the step's name in a program.
        draw: ``(rng, pool shapes, index of the first operand) -> (operand indices, params)``,
            or None when the op does not apply.
        sym: ``(operands, leaves, params) -> outputs``, recorded with tgraph.
        ref: ``(operands, leaves, params) -> outputs``, the fp64 torch oracle.
        leaves: ``(operand shapes, params, generator, dtype) -> {name: Leaf}``.
        triton_ok: ``(operand shapes, params) -> bool``: the Triton backend's kernels take it
            (False leaves the case out of the Triton configuration).
    """

    name: str
    draw: Callable[[random.Random, Sequence[Shape], int], tuple[list[int], Params] | None]
    sym: Callable[[list[Any], dict[str, Any], Params], list[Any]]
    ref: Callable[[list[torch.Tensor], dict[str, torch.Tensor], Params], list[torch.Tensor]]
    leaves: Callable[[list[Shape], Params, torch.Generator, torch.dtype], dict[str, Leaf]] = \
        lambda shapes, p, g, dtype: {}
    triton_ok: Callable[[list[Shape], Params], bool] = lambda shapes, p: True


def rand_data(shape: Sequence[int], gen: torch.Generator, dtype: torch.dtype, scale: float = 1.0
          ) -> torch.Tensor:
    return ((torch.rand(tuple(shape), generator=gen, dtype=torch.float64) * 2 - 1) * scale
            ).to(dtype)


def _bcast(a: Shape, b: Shape) -> bool:
    try:
        torch.broadcast_shapes(a, b)
    except RuntimeError:
        return False
    return True


def _one(x: Any) -> list[Any]:
    return [x]


# ---- pointwise -----------------------------------------------------------------------------------
def _sq(x):
    return x * x


# name -> (tgraph spelling, torch spelling); the spellings of the passes' patterns are included
# (x * sigmoid(x) for SiluFusion, sin(x) + sin(x) for CSE, (x + 0) * 1 for NoOpRemoval).
UNARY: dict[str, tuple[Callable, Callable]] = {
    "tanh": (F.tanh, torch.tanh), "sigmoid": (F.sigmoid, torch.sigmoid),
    "sin": (F.sin, torch.sin), "cos": (F.cos, torch.cos), "neg": (F.neg, torch.neg),
    "abs": (F.abs, torch.abs), "relu": (F.relu, torch.relu),
    "silu": (F.silu, lambda t: t * torch.sigmoid(t)),
    "gelu": (F.gelu, lambda t: 0.5 * t * (1 + torch.erf(t / math.sqrt(2)))),
    "gelu_tanh": (lambda x: F.gelu(x, "tanh"), lambda t: 0.5 * t * (1 + torch.tanh(
        math.sqrt(2 / math.pi) * (t + 0.044715 * t ** 3)))),
    "exp_tanh": (lambda x: F.exp(F.tanh(x)), lambda t: torch.exp(torch.tanh(t))),
    "sqrt_abs": (lambda x: F.sqrt(F.abs(x) + 0.5), lambda t: torch.sqrt(t.abs() + 0.5)),
    "rsqrt_abs": (lambda x: F.rsqrt(F.abs(x) + 0.5), lambda t: 1 / torch.sqrt(t.abs() + 0.5)),
    "log_abs": (lambda x: F.log(F.abs(x) + 1.0), lambda t: torch.log(t.abs() + 1.0)),
    "recip_abs": (lambda x: F.reciprocal(F.abs(x) + 1.0), lambda t: 1 / (t.abs() + 1.0)),
    "square": (lambda x: F.pow(x, 2), _sq),
    "x_sigmoid_x": (lambda x: x * F.sigmoid(x), lambda t: t * torch.sigmoid(t)),
    "twice": (lambda x: F.sin(x) + F.sin(x), lambda t: 2 * torch.sin(t)),
    "noop": (lambda x: (x + 0) * 1, lambda t: t),
    "leaky": (lambda x: F.where(F.gt(x, 0.0), x, x * 0.1),
              lambda t: torch.where(t > 0, t, t * 0.1)),
    "cast_f32": (lambda x: F.cast(F.cast(x, torch.float32) * 1.5, x.dtype), lambda t: t * 1.5),
}
SCALAR: dict[str, tuple[Callable, Callable]] = {
    "add": (lambda x, c: x + c, lambda t, c: t + c),
    "radd": (lambda x, c: c + x, lambda t, c: c + t),
    "sub": (lambda x, c: x - c, lambda t, c: t - c),
    "rsub": (lambda x, c: c - x, lambda t, c: c - t),
    "mul": (lambda x, c: x * c, lambda t, c: t * c),
    "div": (lambda x, c: x / c, lambda t, c: t / c),
}
BINARY: dict[str, tuple[Callable, Callable]] = {
    "add": (F.add, torch.add), "sub": (F.sub, torch.sub), "mul": (F.mul, torch.mul),
    "maximum": (F.maximum, torch.maximum), "minimum": (F.minimum, torch.minimum),
    "safe_div": (lambda a, b: a / (F.abs(b) + 1.0), lambda a, b: a / (b.abs() + 1.0)),
    "silu_mul": (lambda a, b: F.silu(a) * b, lambda a, b: a * torch.sigmoid(a) * b),
}


def _draw_unary(rng, shapes, i):
    return [i], {"fn": rng.choice(sorted(UNARY))}


def _draw_scalar(rng, shapes, i):
    return [i], {"fn": rng.choice(sorted(SCALAR)), "c": rng.choice([-1.5, -0.5, 0.25, 2.0, 3])}


def _draw_binary(rng, shapes, i):
    partners = [j for j, s in enumerate(shapes) if _bcast(shapes[i], s)]
    j = rng.choice(partners)
    return ([i, j] if rng.random() < 0.5 else [j, i]), {"fn": rng.choice(sorted(BINARY))}


def _draw_bcast_weight(rng, shapes, i):
    # A weight whose shape broadcasts against the operand: leading dims dropped, others set to 1.
    shape = shapes[i]
    keep = rng.randint(0, len(shape))
    ones = [rng.random() < 0.4 for _ in range(keep)]
    return [i], {"fn": rng.choice(sorted(BINARY)), "keep": keep, "ones": ones,
                 "swap": rng.random() < 0.3}


def _bcast_weight_shape(shape: Shape, p: Params) -> Shape:
    tail = shape[len(shape) - p["keep"]:] if p["keep"] else ()
    return tuple(1 if one else d for d, one in zip(tail, p["ones"]))


def _bcast_leaves(shapes, p, gen, dtype):
    return {"w": Leaf("weight", rand_data(_bcast_weight_shape(shapes[0], p), gen, dtype))}


def _bcast_apply(fn, x, w, p):
    return fn(w, x) if p["swap"] else fn(x, w)


# ---- reductions and norms ------------------------------------------------------------------------
def _draw_reduce(rng, shapes, i):
    rank = len(shapes[i])
    if rank == 0:
        return None
    return [i], {"fn": rng.choice(["sum", "mean", "amax"]), "dim": rng.randint(-rank, rank - 1),
                 "keepdim": rng.random() < 0.5}


def _draw_softmax(rng, shapes, i):
    rank = len(shapes[i])
    return ([i], {"dim": rng.randint(-rank, rank - 1)}) if rank else None


def _draw_norm(rng, shapes, i):
    if not shapes[i]:
        return None
    return [i], {"kind": rng.choice(["rms", "rms_noweight", "rms_hf", "layer", "layer_nobias"]),
                 "eps": rng.choice([1e-6, 1e-5])}


def _norm_leaves(shapes, p, gen, dtype):
    n = shapes[0][-1]
    out = {}
    if p["kind"] != "rms_noweight":
        out["w"] = Leaf("weight", (1 + 0.2 * rand_data((n,), gen, torch.float64)).to(dtype))
    if p["kind"] == "layer":
        out["b"] = Leaf("weight", rand_data((n,), gen, dtype, 0.1))
    return out


def _norm_sym(xs, lv, p):
    x, kind, eps = xs[0], p["kind"], p["eps"]
    if kind == "rms_hf":  # the Hugging Face spelling, which RmsNormFusion recognises
        x32 = F.cast(x, torch.float32)
        var = F.mean(x32 * x32, -1, keepdim=True)
        return [lv["w"] * F.cast(x32 * F.rsqrt(var + eps), x.dtype)]
    if kind.startswith("rms"):
        return [F.rms_norm(x, lv.get("w"), eps)]
    return [F.layer_norm(x, lv["w"], lv.get("b"), eps)]


def _norm_ref(xs, lv, p):
    x, kind, eps = xs[0], p["kind"], p["eps"]
    if kind.startswith("rms"):
        y = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)
        return [y * lv["w"] if "w" in lv else y]
    y = (x - x.mean(-1, keepdim=True)) / torch.sqrt(x.var(-1, unbiased=False, keepdim=True) + eps)
    y = y * lv["w"]
    return [y + lv["b"] if "b" in lv else y]


def _draw_add_norm(rng, shapes, i):
    same = [j for j, s in enumerate(shapes) if s == shapes[i] and j != i]
    if not shapes[i] or not same:
        return None
    return [i, rng.choice(same)], {"eps": rng.choice([1e-6, 1e-5])}


def _add_norm_sym(xs, lv, p):
    s = xs[0] + xs[1]  # AddRmsNorm: the residual sum stays an output
    return [F.rms_norm(s, lv["w"], p["eps"]), s]


def _add_norm_ref(xs, lv, p):
    s = xs[0] + xs[1]
    return [s / torch.sqrt((s * s).mean(-1, keepdim=True) + p["eps"]) * lv["w"], s]


# ---- linears ------------------------------------------------------------------------------------
def _draw_linear(rng, shapes, i):
    shape = shapes[i]
    if not shape:
        return None
    out = rng.randint(1, 12)
    epi = rng.choice(["none", "act", "residual", "shared", "swiglu", "bias_act"])
    res = [j for j, s in enumerate(shapes) if s == shape[:-1] + (out,)]
    p = {"out": out, "bias": rng.random() < 0.4, "tb": rng.random() < 0.8, "epi": epi,
         "act": rng.choice(["silu", "gelu", "relu", "gelu_tanh"])}
    if epi == "residual" and res:
        return [i, rng.choice(res)], p
    if epi == "residual":
        p["epi"] = "residual_new"
    return [i], p


def _linear_leaves(shapes, p, gen, dtype):
    k, n = shapes[0][-1], p["out"] * (2 if p["epi"] == "swiglu" else 1)
    scale = 1 / math.sqrt(k)
    out = {"w": Leaf("weight", rand_data((n, k) if p["tb"] else (k, n), gen, dtype, scale))}
    if p["bias"] or p["epi"] == "bias_act":
        out["b"] = Leaf("weight", rand_data((n,), gen, dtype, 0.2))
    if p["epi"] == "shared":
        out["w2"] = Leaf("weight", rand_data((n, k) if p["tb"] else (k, n), gen, dtype, scale))
    if p["epi"] == "residual_new":
        out["r"] = Leaf("input", rand_data(shapes[0][:-1] + (n,), gen, dtype))
    return out


_ACTS = {"silu": (F.ActType.SILU, lambda t: t * torch.sigmoid(t)),
         "relu": (F.ActType.RELU, torch.relu),
         "gelu": (F.ActType.GELU, UNARY["gelu"][1]),
         "gelu_tanh": (F.ActType.GELU_TANH, UNARY["gelu_tanh"][1])}


def _linear_sym(xs, lv, p):
    y = F.linear(xs[0], lv["w"], lv.get("b"), transpose_b=p["tb"])
    epi = p["epi"]
    if epi in ("act", "bias_act"):
        return [F.activation(y, _ACTS[p["act"]][0])]
    if epi == "residual":
        return [y + xs[1]]
    if epi == "residual_new":
        return [lv["r"] + y]
    if epi == "shared":  # HorizontalLinear merges linears of one input
        return [y * F.linear(xs[0], lv["w2"], lv.get("b"), transpose_b=p["tb"])]
    if epi == "swiglu":
        return [F.activation(y, F.ActType.SWIGLU)]
    return [y]


def _linear_ref(xs, lv, p):
    def lin(w):
        y = xs[0] @ (w.t() if p["tb"] else w)
        return y + lv["b"] if "b" in lv else y

    y, epi = lin(lv["w"]), p["epi"]
    if epi in ("act", "bias_act"):
        return [_ACTS[p["act"]][1](y)]
    if epi == "residual":
        return [y + xs[1]]
    if epi == "residual_new":
        return [lv["r"] + y]
    if epi == "shared":
        return [y * lin(lv["w2"])]
    if epi == "swiglu":
        gate, up = y.chunk(2, dim=-1)
        return [gate * torch.sigmoid(gate) * up]
    return [y]


def _draw_matmul(rng, shapes, i):
    if len(shapes[i]) < 2:
        return None
    return [i], {"kind": rng.choice(["gram", "weight"]), "n": rng.randint(1, 6)}


def _matmul_leaves(shapes, p, gen, dtype):
    if p["kind"] != "weight":
        return {}
    k = shapes[0][-1]
    return {"w": Leaf("weight", rand_data((k, p["n"]), gen, dtype, 1 / math.sqrt(k)))}


def _matmul_sym(xs, lv, p):
    x = xs[0]
    return [F.matmul(x, F.transpose(x, -1, -2)) if p["kind"] == "gram" else F.matmul(x, lv["w"])]


def _matmul_ref(xs, lv, p):
    x = xs[0]
    return [x @ x.transpose(-1, -2) if p["kind"] == "gram" else x @ lv["w"]]


# ---- shapes and views ----------------------------------------------------------------------------
def _draw_reshape(rng, shapes, i):
    numel = math.prod(shapes[i])
    last = rng.choice([d for d in range(1, numel + 1) if numel % d == 0] or [1])
    return [i], {"shape": rng.choice([[-1], [-1, last], [numel // last, last, 1],
                                      [1, -1, last]])}


def _draw_transpose(rng, shapes, i):
    rank = len(shapes[i])
    if rank < 2:
        return None
    kind = rng.choice(["transpose", "permute", "transpose_contiguous"])
    dims = list(range(rank))
    rng.shuffle(dims)
    return [i], {"kind": kind, "d0": rng.randrange(rank), "d1": rng.randrange(rank), "dims": dims}


def _transpose_sym(xs, lv, p):
    x = xs[0]
    if p["kind"] == "permute":
        return [F.permute(x, p["dims"])]
    y = F.transpose(x, p["d0"], p["d1"])
    return [F.contiguous(y) if p["kind"] == "transpose_contiguous" else y]


def _transpose_ref(xs, lv, p):
    x = xs[0]
    return [x.permute(p["dims"]) if p["kind"] == "permute" else x.transpose(p["d0"], p["d1"])]


def _draw_squeeze(rng, shapes, i):
    rank = len(shapes[i])
    ones = [d for d, n in enumerate(shapes[i]) if n == 1]
    if ones and rng.random() < 0.5:
        return [i], {"kind": "squeeze", "dim": rng.choice(ones)}
    return [i], {"kind": "unsqueeze", "dim": rng.randint(0, rank)}


def _draw_slice(rng, shapes, i):
    rank = len(shapes[i])
    if not rank:
        return None
    dim = rng.randint(-rank, rank - 1)
    size = shapes[i][dim]
    start = rng.randint(0, size - 1)
    if rng.random() < 0.25 and size > 1:
        return [i], {"kind": "select", "dim": dim, "index": start}
    return [i], {"kind": "slice", "dim": dim, "start": start,
                 "end": rng.choice([None, rng.randint(start + 1, size + 2)]),
                 "step": rng.randint(1, 3)}


def _slice_sym(xs, lv, p):
    if p["kind"] == "select":
        return [F.select(xs[0], p["dim"], p["index"])]
    return [F.slice(xs[0], p["dim"], p["start"], p["end"], p["step"])]


def _slice_ref(xs, lv, p):
    x = xs[0]
    if p["kind"] == "select":
        return [x.select(p["dim"], p["index"])]
    index = [slice(None)] * x.dim()
    index[p["dim"]] = slice(p["start"], p["end"], p["step"])
    return [x[tuple(index)]]


def _draw_split(rng, shapes, i):
    rank = len(shapes[i])
    if not rank:
        return None
    dim = rng.randint(-rank, rank - 1)
    size = shapes[i][dim]
    if size < 2:
        return None
    cuts = sorted(rng.sample(range(1, size), min(size - 1, rng.randint(1, 2))))
    sizes = [b - a for a, b in zip([0] + cuts, cuts + [size])]
    return [i], {"dim": dim, "sizes": sizes}


def _draw_cat(rng, shapes, i):
    rank = len(shapes[i])
    if not rank:
        return None
    dim = rng.randint(-rank, rank - 1)
    same = [j for j, s in enumerate(shapes) if len(s) == rank and all(
        s[d] == shapes[i][d] for d in range(rank) if d != dim % rank)]
    return [i] + [rng.choice(same) for _ in range(rng.randint(1, 2))], {"dim": dim}


# ---- indexing ------------------------------------------------------------------------------------
def _draw_gather(rng, shapes, i):
    rank = len(shapes[i])
    if not rank:
        return None
    kind = "embedding" if rank == 2 and rng.random() < 0.5 else "gather"
    return [i], {"kind": kind, "dim": rng.randint(-rank, rank - 1), "count": rng.randint(1, 5),
                 "vocab": rng.randint(2, 12)}


def _gather_leaves(shapes, p, gen, dtype):
    shape = shapes[0]
    if p["kind"] == "embedding":  # x + embedding(ids, table): one id per row of x
        return {"ids": Leaf("input", torch.randint(0, p["vocab"], (shape[0],), generator=gen)),
                "table": Leaf("weight", rand_data((p["vocab"], shape[1]), gen, dtype))}
    size = shape[p["dim"]]
    return {"index": Leaf("input", torch.randint(0, size, (p["count"],), generator=gen))}


def _gather_sym(xs, lv, p):
    if p["kind"] == "embedding":
        return [xs[0] + F.embedding(lv["ids"], lv["table"])]
    return [F.gather(xs[0], p["dim"], lv["index"])]


def _gather_ref(xs, lv, p):
    if p["kind"] == "embedding":
        return [xs[0] + lv["table"][lv["ids"]]]
    return [xs[0].index_select(p["dim"], lv["index"])]


# ---- rope and attention --------------------------------------------------------------------------
def _heads(shape: Shape) -> bool:
    return len(shape) == 3 and shape[2] % 2 == 0


def _draw_rope(rng, shapes, i):
    if not _heads(shapes[i]):
        return None
    ks = [j for j, s in enumerate(shapes) if _heads(s) and s[0] == shapes[i][0]
          and s[2] == shapes[i][2]]
    half = shapes[i][2] // 2
    return [i, rng.choice(ks)], {"interleaved": rng.random() < 0.4,
                                 "rot_half": rng.choice([half, max(1, half // 2)])}


def _rope_tables(tokens: int, half: int, gen: torch.Generator, dtype: torch.dtype
                 ) -> dict[str, Leaf]:
    theta = torch.rand((tokens, half), generator=gen, dtype=torch.float64) * 2 * math.pi
    return {"cos": Leaf("input", theta.cos().to(dtype)),
            "sin": Leaf("input", theta.sin().to(dtype))}


def _rope_leaves(shapes, p, gen, dtype):
    return _rope_tables(shapes[0][0], min(p["rot_half"], shapes[0][2] // 2), gen, dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool
            ) -> torch.Tensor:
    half = cos.shape[-1]
    c, s = cos[:, None, :], sin[:, None, :]
    if interleaved:  # pairs (2i, 2i + 1)
        a, b = x[..., 0:2 * half:2], x[..., 1:2 * half:2]
        rot = torch.stack((a * c - b * s, b * c + a * s), dim=-1).flatten(-2)
    else:
        a, b = x[..., :half], x[..., half:2 * half]
        rot = torch.cat((a * c - b * s, b * c + a * s), dim=-1)
    return torch.cat((rot, x[..., 2 * half:]), dim=-1)


def _rope_sym(xs, lv, p):
    return list(F.rope(xs[0], xs[1], lv["cos"], lv["sin"], interleaved=p["interleaved"]))


def _rope_ref(xs, lv, p):
    return [_rotate(x, lv["cos"], lv["sin"], p["interleaved"]) for x in xs]


def _draw_attention(rng, shapes, i):
    if not _heads(shapes[i]):
        return None
    tokens, heads, _ = shapes[i]
    kv = rng.choice([h for h in range(1, heads + 1) if heads % h == 0])
    decode = rng.random() < 0.4
    batch = tokens if decode else rng.randint(1, min(2, tokens))
    return [i], {"kv_heads": kv, "decode": decode, "batch": batch, "block": rng.choice([2, 4]),
                 "context": [rng.randint(0 if not decode else 1, 5) for _ in range(batch)],
                 "rope": rng.choice([None, "half", "interleaved"]),
                 "window": rng.choice([None, None, rng.randint(1, 4)]),
                 "scale": rng.choice([None, None, 0.3])}


def _attention_layout(tokens: int, p: Params) -> tuple[list[int], list[int]] | None:
    """Query and context lengths per sequence (None: the step no longer fits ``tokens``)."""
    batch = p["batch"]
    if p["decode"]:
        return ([1] * tokens, (p["context"] * tokens)[:tokens]) if batch == tokens else None
    if batch > tokens:
        return None
    queries = [tokens // batch] * batch
    queries[-1] += tokens - sum(queries)
    return queries, p["context"][:batch]


def _attention_leaves(shapes, p, gen, dtype):
    tokens, _, dim = shapes[0]
    layout = _attention_layout(tokens, p)
    if layout is None:
        raise ValueError("attention layout no longer fits the operand")
    queries, context = layout
    bs, kv = p["block"], p["kv_heads"]
    need = [-(-(q + c) // bs) for q, c in zip(queries, context)]
    order = torch.randperm(sum(need) + 1, generator=gen).tolist()
    width = max(need)
    table = torch.zeros((len(need), width), dtype=torch.int32)
    slots = []
    for b, (q, c) in enumerate(zip(queries, context)):
        blocks = [order.pop() for _ in range(need[b])]
        table[b, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        slots += [blocks[pos // bs] * bs + pos % bs for pos in range(c, c + q)]
    cache = (sum(need) + 1, bs, kv, dim)
    out = {"k": Leaf("input", rand_data((tokens, kv, dim), gen, dtype)),
           "v": Leaf("input", rand_data((tokens, kv, dim), gen, dtype)),
           "k_cache": Leaf("input", rand_data(cache, gen, dtype), mutated=True),
           "v_cache": Leaf("input", rand_data(cache, gen, dtype), mutated=True),
           "slots": Leaf("input", torch.tensor(slots, dtype=torch.int64)),
           "block_table": Leaf("input", table),
           "seq_len": Leaf("input", torch.tensor([q + c for q, c in zip(queries, context)],
                                                 dtype=torch.int32))}
    if not p["decode"]:
        starts = [0]
        for q in queries:
            starts.append(starts[-1] + q)
        out["query_start_loc"] = Leaf("input", torch.tensor(starts, dtype=torch.int32))
    if p["rope"]:
        out.update(_rope_tables(tokens, dim // 2, gen, dtype))
    return out


def _attention_sym(xs, lv, p):
    q, k = xs[0], lv["k"]
    if p["rope"]:
        q, k = F.rope(q, k, lv["cos"], lv["sin"], interleaved=p["rope"] == "interleaved")
    kc, vc = F.reshape_and_cache(k, lv["v"], lv["k_cache"], lv["v_cache"], lv["slots"])
    return [F.paged_attention(q, kc, vc, lv["block_table"], lv["seq_len"],
                              lv.get("query_start_loc"), scale=p.get("scale"),
                              sliding_window=p.get("window"))]


def _attention_ref(xs, lv, p):
    q, k, v = xs[0], lv["k"], lv["v"]
    if p["rope"]:
        q, k = (_rotate(t, lv["cos"], lv["sin"], p["rope"] == "interleaved") for t in (q, k))
    _, bs, kv, dim = lv["k_cache"].shape
    kc = lv["k_cache"].reshape(-1, kv, dim).clone()
    vc = lv["v_cache"].reshape(-1, kv, dim).clone()
    kc[lv["slots"]] = k
    vc[lv["slots"]] = v
    group = q.shape[1] // kv
    out = torch.empty_like(q)
    lens = lv["seq_len"].tolist()
    starts = (lv["query_start_loc"].tolist() if "query_start_loc" in lv
              else list(range(len(lens) + 1)))
    for b, n_keys in enumerate(lens):
        s, e = int(starts[b]), int(starts[b + 1])
        pos = [int(lv["block_table"][b, t // bs]) * bs + t % bs for t in range(n_keys)]
        keys = kc[pos].repeat_interleave(group, dim=1)  # (keys, heads, dim)
        vals = vc[pos].repeat_interleave(group, dim=1)
        scale = p.get("scale") or 1 / math.sqrt(dim)
        scores = torch.einsum("qhd,khd->hqk", q[s:e], keys) * scale
        q_pos = torch.arange(n_keys - (e - s), n_keys)[:, None]
        k_pos = torch.arange(n_keys)[None, :]
        hidden = k_pos > q_pos
        if p.get("window"):  # only the last `window` positions, the query's own included
            hidden |= q_pos - k_pos >= p["window"]
        scores = scores.masked_fill(hidden, float("-inf"))
        out[s:e] = torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), vals)
    return [out]


# ---- the catalogue -------------------------------------------------------------------------------
OPS: dict[str, OpDef] = {op.name: op for op in [
    OpDef("unary", _draw_unary, lambda xs, lv, p: [UNARY[p["fn"]][0](xs[0])],
          lambda xs, lv, p: [UNARY[p["fn"]][1](xs[0])]),
    OpDef("scalar", _draw_scalar, lambda xs, lv, p: [SCALAR[p["fn"]][0](xs[0], p["c"])],
          lambda xs, lv, p: [SCALAR[p["fn"]][1](xs[0], p["c"])]),
    OpDef("binary", _draw_binary, lambda xs, lv, p: [BINARY[p["fn"]][0](*xs)],
          lambda xs, lv, p: [BINARY[p["fn"]][1](*xs)]),
    OpDef("bcast_weight", _draw_bcast_weight,
          lambda xs, lv, p: [_bcast_apply(BINARY[p["fn"]][0], xs[0], lv["w"], p)],
          lambda xs, lv, p: [_bcast_apply(BINARY[p["fn"]][1], xs[0], lv["w"], p)],
          _bcast_leaves),
    OpDef("reduce", _draw_reduce,
          lambda xs, lv, p: [getattr(F, p["fn"])(xs[0], p["dim"], p["keepdim"])],
          lambda xs, lv, p: [getattr(torch, p["fn"])(xs[0], p["dim"], keepdim=p["keepdim"])]),
    OpDef("softmax", _draw_softmax, lambda xs, lv, p: [F.softmax(xs[0], p["dim"])],
          lambda xs, lv, p: [torch.softmax(xs[0], p["dim"])]),
    OpDef("norm", _draw_norm, _norm_sym, _norm_ref, _norm_leaves),
    OpDef("add_rms_norm", _draw_add_norm, _add_norm_sym, _add_norm_ref,
          lambda shapes, p, g, dtype: _norm_leaves(shapes, {"kind": "rms"}, g, dtype)),
    OpDef("linear", _draw_linear, _linear_sym, _linear_ref, _linear_leaves),
    OpDef("matmul", _draw_matmul, _matmul_sym, _matmul_ref, _matmul_leaves),
    OpDef("reshape", _draw_reshape, lambda xs, lv, p: [F.reshape(xs[0], p["shape"])],
          lambda xs, lv, p: [xs[0].reshape(p["shape"])]),
    OpDef("transpose", _draw_transpose, _transpose_sym, _transpose_ref),
    OpDef("squeeze", _draw_squeeze, lambda xs, lv, p: [getattr(F, p["kind"])(xs[0], p["dim"])],
          lambda xs, lv, p: [getattr(xs[0], p["kind"])(p["dim"])]),
    OpDef("slice", _draw_slice, _slice_sym, _slice_ref),
    OpDef("split", _draw_split, lambda xs, lv, p: list(F.split(xs[0], p["sizes"], p["dim"])),
          lambda xs, lv, p: list(torch.split(xs[0], p["sizes"], p["dim"]))),
    OpDef("cat", _draw_cat, lambda xs, lv, p: [F.cat(xs, dim=p["dim"])],
          lambda xs, lv, p: [torch.cat(xs, p["dim"])]),
    OpDef("gather", _draw_gather, _gather_sym, _gather_ref, _gather_leaves),
    OpDef("rope", _draw_rope, _rope_sym, _rope_ref, _rope_leaves),
    OpDef("attention", _draw_attention, _attention_sym, _attention_ref, _attention_leaves,
          # the Triton attention kernels take head_dim a power of two in [16, 256]
          lambda shapes, p: shapes[0][2] in (16, 32, 64, 128, 256)),
]}

# Relative draw weights: pointwise and linears dominate, as in a transformer block.
WEIGHTS: dict[str, int] = {
    "unary": 6, "scalar": 3, "binary": 5, "bcast_weight": 3, "reduce": 2, "softmax": 2, "norm": 3,
    "add_rms_norm": 2, "linear": 5, "matmul": 1, "reshape": 2, "transpose": 2, "squeeze": 1,
    "slice": 2, "split": 2, "cat": 2, "gather": 1, "rope": 2, "attention": 2,
}


def make_param(data: torch.Tensor, name: str) -> Parameter:
    """A ``Parameter`` holding ``data`` (the weights of a recorded step)."""
    return Parameter(data, name=name)
