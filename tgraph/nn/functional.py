"""Ops on symbolic tensors. Each function records one node (or a few, for composite ops) into the
current network and returns its symbolic output(s); nothing is computed here.

Composite ops are written in terms of primitives (``activation(x, SWIGLU)`` is split + silu +
mul); fusion passes turn such patterns into fused kernels.
"""
from __future__ import annotations

import builtins
import enum
import threading
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from tgraph.errors import RecordError, user_frame
from tgraph.ir.network import Network
from tgraph.ir.node import Node
from tgraph.ir.ops import get_op
from tgraph.ir.ops.transfer import normalize_placement
from tgraph.ir.value import Value, ValueKind
from tgraph.nn.network_manager import get_default_net
from tgraph.nn.tensor import Tensor

Operand = Tensor | float | int | bool


class ActType(enum.Enum):
    """Activation functions for :func:`activation`."""

    SILU = "silu"
    GELU = "gelu"
    GELU_TANH = "gelu_tanh"
    RELU = "relu"
    SIGMOID = "sigmoid"
    SWIGLU = "swiglu"


def constant(value: float | int | bool) -> Tensor:
    """A Python scalar as a graph constant (weakly typed, like a scalar operand in torch)."""
    return Tensor.make(ValueKind.CONST, data=value, shape=())


def _as_value(x: Any, op: str) -> Value | None:
    if x is None or isinstance(x, Value):
        return x
    if isinstance(x, (bool, int, float)):
        return constant(x)
    if isinstance(x, torch.Tensor):
        raise RecordError(f"{op}: got a real torch.Tensor of shape {tuple(x.shape)}; symbolic ops "
                          "take tgraph Tensors (use Parameter for weights, Tensor(name) for inputs)"
                          f"\n  at {user_frame()}")
    raise RecordError(f"{op}: cannot use a {type(x).__name__} as an operand\n  at {user_frame()}")


def record(op: str, inputs: Sequence[Any], **attrs: Any) -> Tensor | tuple[Tensor, ...]:
    """Record ``op`` on ``inputs`` into the current network.

    Inside a :func:`placement` (a placed module's call), values that live on another device are
    first copied over by a ``to_device`` node (see :func:`placement`).

    Returns:
        the output tensor, or a tuple when the op has several outputs.
    """
    values = [_as_value(x, op) for x in inputs]
    net = get_default_net()
    state = _NETS.get(net) if _NETS else None
    if state is None and _stack.labels:
        state = _start_placement(net)
    if state is None:
        node = net.add_node(op, values, attrs, source=user_frame())
    else:
        node = _record_placed(net, state, op, values, attrs)
    return node.outputs[0] if len(node.outputs) == 1 else tuple(node.outputs)


# ---- device placement ----------------------------------------------------------------------------
# NOTE: placement is record-time bookkeeping kept beside the network. A network recorded with no
# placement in effect gets none of it, so single-device recording is exactly as before.

PLACEMENT = "placement"  # net.annotations key: {leaf value: placement label}
MAIN_DEVICE = "main_device"  # net.annotations key: the network's main placement label


class _Stack(threading.local):
    def __init__(self) -> None:
        self.labels: list[str] = []


_stack = _Stack()


@dataclass
class _NetPlacement:
    """Where each value of one network lives, and the copies already made (reused, not redone)."""

    main: str
    of: dict[Value, str]
    copies: dict[tuple[int, str], Value]


_NETS: weakref.WeakKeyDictionary[Network, _NetPlacement] = weakref.WeakKeyDictionary()
# Leaves declared with place() before any op reads them: id -> (weak reference, label).
_DECLARED: dict[int, tuple[weakref.ref, str]] = {}


@contextmanager
def placement(device: str | torch.device) -> Iterator[str]:
    """Record the ops of the ``with`` block on ``device`` (a placed module's call enters this).

    The first placement entered while recording a network is its *main* device: graph inputs not
    declared elsewhere (:func:`place`) are expected there and the engine returns the outputs
    there. An op reading a value that lives on another device reads a copy, recorded once per
    (value, device) as a ``to_device`` node. An op outside any placement (glue code of an
    unplaced module) runs where its first tensor operand lives. Weights live where
    :func:`place` (or their module's placement) says, else where their data is on CUDA, else on
    the main device; an input written in place (a KV cache) lives where it is written.

    Args:
        device: a placement label (``"cuda:1"``, ``"cpu:1"``) or torch device.

    Yields:
        The normalised label.
    """
    label = normalize_placement(device)
    _stack.labels.append(label)
    try:
        yield label
    finally:
        _stack.labels.pop()


def current_placement() -> str | None:
    """The placement ops are recorded on now (``None`` outside any :func:`placement`)."""
    return _stack.labels[-1] if _stack.labels else None


def place(value: Value, device: str | torch.device) -> Value:
    """Declare where a graph input or weight lives, before ops read it.

    Args:
        value: a leaf (``Tensor("k_cache_3", ...)`` or a ``Parameter``).
        device: its placement label.

    Returns:
        ``value``.

    Raises:
        TypeError: ``value`` is not a leaf.
    """
    if not isinstance(value, Value) or value.producer is not None or \
            value.kind is ValueKind.CONST:
        raise TypeError(f"place() declares graph inputs and weights, got "
                        f"{value.describe() if isinstance(value, Value) else type(value).__name__}")
    label = normalize_placement(device)
    key = id(value)

    def forget(ref: weakref.ref, key: int = key) -> None:
        entry = _DECLARED.get(key)
        if entry is not None and entry[0] is ref:
            del _DECLARED[key]

    _DECLARED[key] = (weakref.ref(value, forget), label)
    return value


def declared_placement(value: Value) -> str | None:
    """The label :func:`place` declared for ``value``, if any."""
    entry = _DECLARED.get(id(value))
    return entry[1] if entry is not None and entry[0]() is value else None


def _start_placement(net: Network) -> _NetPlacement:
    state = _NetPlacement(_stack.labels[0], {}, {})
    _NETS[net] = state
    net.annotations[MAIN_DEVICE] = state.main
    net.annotations.setdefault(PLACEMENT, {})
    return state


def _where(net: Network, state: _NetPlacement, v: Value, written_on: str | None) -> str:
    """Where ``v`` lives (deciding it, for a leaf read for the first time)."""
    label = state.of.get(v)
    if label is not None:
        return label
    label = declared_placement(v)
    if label is None:
        if v.kind is ValueKind.WEIGHT and isinstance(v.data, torch.Tensor) \
                and v.data.device.type == "cuda":
            label = normalize_placement(v.data.device)
        elif v.kind is ValueKind.INPUT and written_on is not None:
            label = written_on
        else:
            label = state.main
    state.of[v] = label
    if v.producer is None:
        net.annotations[PLACEMENT][v] = label
    return label


def _record_placed(net: Network, state: _NetPlacement, op: str, values: list[Value | None],
                   attrs: dict[str, Any]) -> Node:
    source = user_frame()
    tensors = [(i, v) for i, v in enumerate(values)
               if v is not None and v.kind is not ValueKind.CONST]
    if op == "to_device":  # an explicit copy runs on its destination and reads its source as is
        for _, v in tensors:
            _where(net, state, v, None)
        target = attrs["device"]
    else:
        target = current_placement()
        if target is None:
            target = _where(net, state, tensors[0][1], None) if tensors else state.main
        mutated = get_op(op).mutates
        for i, v in tensors:
            where = _where(net, state, v, target if i in mutated else None)
            if where == target:
                continue
            if i in mutated:
                raise RecordError(f"{op} on {target} writes {v.describe()} in place, but it "
                                  f"lives on {where}: a copy would take the write. Allocate it "
                                  f"on {target} (and declare it with F.place)\n  at {source}")
            values[i] = _copy_to(net, state, v, target, source)
    node = net.add_node(op, values, attrs, source=source)
    for out in node.outputs:
        state.of[out] = target
    if op == "to_device" and tensors:  # later reads on that device reuse the explicit copy
        state.copies.setdefault((tensors[0][1].id, target), node.outputs[0])
    return node


def _copy_to(net: Network, state: _NetPlacement, v: Value, target: str, source: str) -> Value:
    key = (v.id, target)  # by id: Tensor's == records an op
    copy = state.copies.get(key)
    if copy is None:
        copy = net.add_node("to_device", [v], {"device": target}, source=source).outputs[0]
        state.of[copy] = target
        state.copies[key] = copy
    return copy


def to_device(x: Tensor, device: str | torch.device) -> Tensor:
    """A copy of ``x`` on ``device`` (a placement label). Networks spread over devices get these
    automatically where a value crosses devices; call it to move a value explicitly."""
    return _one("to_device", [x], device=normalize_placement(device))


def _one(op: str, inputs: Sequence[Any], **attrs: Any) -> Tensor:
    out = record(op, inputs, **attrs)
    assert not isinstance(out, tuple)
    return out


# ---- pointwise ----------------------------------------------------------------------------------
def add(a: Operand, b: Operand) -> Tensor:
    return _one("add", [a, b])


def sub(a: Operand, b: Operand) -> Tensor:
    return _one("sub", [a, b])


def mul(a: Operand, b: Operand) -> Tensor:
    return _one("mul", [a, b])


def div(a: Operand, b: Operand) -> Tensor:
    return _one("div", [a, b])


def pow(a: Operand, b: Operand) -> Tensor:
    return _one("pow", [a, b])


def maximum(a: Operand, b: Operand) -> Tensor:
    return _one("maximum", [a, b])


def minimum(a: Operand, b: Operand) -> Tensor:
    return _one("minimum", [a, b])


def neg(x: Tensor) -> Tensor:
    return _one("neg", [x])


def abs(x: Tensor) -> Tensor:
    return _one("abs", [x])


def exp(x: Tensor) -> Tensor:
    return _one("exp", [x])


def log(x: Tensor) -> Tensor:
    return _one("log", [x])


def sqrt(x: Tensor) -> Tensor:
    return _one("sqrt", [x])


def rsqrt(x: Tensor) -> Tensor:
    return _one("rsqrt", [x])


def reciprocal(x: Tensor) -> Tensor:
    return _one("reciprocal", [x])


def sin(x: Tensor) -> Tensor:
    return _one("sin", [x])


def cos(x: Tensor) -> Tensor:
    return _one("cos", [x])


def tanh(x: Tensor) -> Tensor:
    return _one("tanh", [x])


def sigmoid(x: Tensor) -> Tensor:
    return _one("sigmoid", [x])


def silu(x: Tensor) -> Tensor:
    return _one("silu", [x])


def gelu(x: Tensor, approximate: str = "none") -> Tensor:
    return _one("gelu_tanh" if approximate == "tanh" else "gelu", [x])


def relu(x: Tensor) -> Tensor:
    return _one("relu", [x])


def eq(a: Operand, b: Operand) -> Tensor:
    return _one("eq", [a, b])


def ne(a: Operand, b: Operand) -> Tensor:
    return _one("ne", [a, b])


def lt(a: Operand, b: Operand) -> Tensor:
    return _one("lt", [a, b])


def le(a: Operand, b: Operand) -> Tensor:
    return _one("le", [a, b])


def gt(a: Operand, b: Operand) -> Tensor:
    return _one("gt", [a, b])


def ge(a: Operand, b: Operand) -> Tensor:
    return _one("ge", [a, b])


def logical_not(x: Tensor) -> Tensor:
    return _one("logical_not", [x])


def where(cond: Tensor, a: Operand, b: Operand) -> Tensor:
    """``a`` where ``cond`` is true, else ``b`` (broadcasting)."""
    return _one("where", [cond, a, b])


def cast(x: Tensor, dtype: torch.dtype) -> Tensor:
    return _one("cast", [x], dtype=dtype)


def activation(x: Tensor, act: ActType) -> Tensor:
    """Apply an activation. ``SWIGLU`` takes a packed ``[..., 2n]`` gate|up tensor and returns
    ``silu(gate) * up`` of shape ``[..., n]``."""
    if act is ActType.SWIGLU:
        width = x.shape[-1] if x.shape else None
        if not isinstance(width, int) or width % 2:
            raise RecordError(f"activation SWIGLU needs a known, even last dim, got "
                              f"{x.describe()}\n  at {user_frame()}")
        gate, up = split(x, [width // 2, width // 2], dim=-1)
        return mul(silu(gate), up)
    if not isinstance(act, ActType):
        raise RecordError(f"activation: expected an ActType, got {act!r}\n  at {user_frame()}")
    return _one(act.value, [x])


# ---- reductions ---------------------------------------------------------------------------------
def sum(x: Tensor, dim: int | tuple[int, ...], keepdim: bool = False) -> Tensor:
    return _one("sum", [x], dim=dim, keepdim=keepdim)


def mean(x: Tensor, dim: int | tuple[int, ...], keepdim: bool = False) -> Tensor:
    return _one("mean", [x], dim=dim, keepdim=keepdim)


def amax(x: Tensor, dim: int | tuple[int, ...], keepdim: bool = False) -> Tensor:
    return _one("amax", [x], dim=dim, keepdim=keepdim)


def softmax(x: Tensor, dim: int = -1) -> Tensor:
    """Softmax computed in fp32 and returned in the input dtype."""
    return _one("softmax", [x], dim=dim)


# ---- linear algebra and normalisation ----------------------------------------------------------
def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, transpose_a: bool = False,
           transpose_b: bool = True) -> Tensor:
    """``x @ weight.T + bias`` (``weight`` ``[out, in]`` as in torch) or, with
    ``transpose_b=False``, ``x @ weight`` (``weight`` ``[in, out]``).

    Args:
        x: ``[..., in]`` (or ``[in, m]`` with ``transpose_a``).
        weight: 2-D weight.
        bias: optional ``[out]``.
        transpose_a: use ``x.T`` (2-D ``x`` only).
        transpose_b: use ``weight.T``; the default matches ``torch.nn.Linear``.
    Returns:
        ``[..., out]``.
    """
    return _one("linear", [x, weight, bias], transpose_a=transpose_a, transpose_b=transpose_b)


def moe(x: Tensor, router_logits: Tensor, w13: Tensor, w2: Tensor, top_k: int,
        renormalize: bool) -> Tensor:
    """Routed SwiGLU experts (see :mod:`tgraph.ir.ops.moe`).

    Args:
        x: ``[tokens, hidden]``.
        router_logits: ``[tokens, experts]``.
        w13: ``[experts, 2 * inter, hidden]``, each expert's gate rows then up rows (quantized:
            ``[experts * 2 * inter, hidden]``, expert after expert).
        w2: ``[experts, hidden, inter]`` (quantized: ``[experts * hidden, inter]``).
        top_k: experts per token.
        renormalize: scale each token's chosen probabilities to sum to one.

    Returns:
        ``[tokens, hidden]``.
    """
    return _one("moe", [x, router_logits, w13, w2], top_k=top_k, renormalize=renormalize)


def matmul(a: Tensor, b: Tensor) -> Tensor:
    """Batched matrix product with broadcasting of the batch dims (rank >= 2 operands)."""
    return _one("matmul", [a, b])


def rms_norm(x: Tensor, weight: Tensor | None = None, eps: float = 1e-6) -> Tensor:
    """RMSNorm over the last dim (normalised in fp32, rounded to x's dtype, then scaled)."""
    return _one("rms_norm", [x, weight], eps=eps)


def layer_norm(x: Tensor, weight: Tensor | None = None, bias: Tensor | None = None,
               eps: float = 1e-5) -> Tensor:
    """LayerNorm over the last dim."""
    return _one("layer_norm", [x, weight, bias], eps=eps)


# ---- shape and memory ----------------------------------------------------------------------------
def reshape(x: Tensor, shape: Sequence[int | str]) -> Tensor:
    """Reshape (a view); one dim may be -1, and dims may be symbol names."""
    return _one("reshape", [x], shape=tuple(shape))


view = reshape


def permute(x: Tensor, dims: Sequence[int]) -> Tensor:
    return _one("permute", [x], dims=tuple(dims))


def transpose(x: Tensor, dim0: int, dim1: int) -> Tensor:
    return _one("transpose", [x], dim0=dim0, dim1=dim1)


def unsqueeze(x: Tensor, dim: int) -> Tensor:
    return _one("unsqueeze", [x], dim=dim)


def squeeze(x: Tensor, dim: int) -> Tensor:
    return _one("squeeze", [x], dim=dim)


def contiguous(x: Tensor) -> Tensor:
    """A contiguous copy of ``x`` (materialises a view for a kernel that needs dense input)."""
    return _one("contiguous", [x])


def slice(x: Tensor, dim: int, start: int = 0, end: int | None = None,
          step: int = 1) -> Tensor:
    """``x[..., start:end:step, ...]`` along ``dim`` (a view)."""
    return _one("slice", [x], dim=dim, start=start, end=end, step=step)


def select(x: Tensor, dim: int, index: int) -> Tensor:
    """``x[..., index, ...]`` along ``dim``, removing that dim (a view)."""
    return _one("select", [x], dim=dim, index=index)


def split(x: Tensor, split_size_or_sections: int | Sequence[int], dim: int = 0
          ) -> tuple[Tensor, ...]:
    """Split into views along ``dim``: into chunks of a size, or into the given sizes."""
    if isinstance(split_size_or_sections, int):
        size = x.shape[dim] if x.shape else None
        if not isinstance(size, int):
            raise RecordError(f"split by chunk size needs a known dim {dim}, got {x.describe()}; "
                              f"pass explicit sizes\n  at {user_frame()}")
        step = split_size_or_sections
        sizes = [builtins.min(step, size - i) for i in range(0, size, step)]
    else:
        sizes = list(split_size_or_sections)
    out = record("split", [x], sizes=tuple(sizes), dim=dim)
    return out if isinstance(out, tuple) else (out,)


def cat(*tensors: Tensor | Sequence[Tensor], dim: int = 0) -> Tensor:
    """Concatenate any number of tensors along ``dim``: ``cat(a, b, c)`` or ``cat([a, b, c])``."""
    if len(tensors) == 1 and isinstance(tensors[0], (list, tuple)):
        tensors = tuple(tensors[0])
    return _one("cat", list(tensors), dim=dim)


def gather(x: Tensor, dim: int, index: Tensor) -> Tensor:
    """Pick entries of ``x`` along ``dim`` by ``index`` (numpy ``take``): the result has shape
    ``x.shape[:dim] + index.shape + x.shape[dim+1:]``. ``gather(hidden, 0, rows)`` picks rows."""
    return _one("gather", [x, index], dim=dim)


def embedding(ids: Tensor, weight: Tensor) -> Tensor:
    """Rows of ``weight`` ``[vocab, hidden]`` for each id."""
    return _one("embedding", [ids, weight])


def getitem(x: Tensor, key: Any) -> Tensor:
    """Python indexing: ints, slices (positive step), ``...``, ``None`` and index tensors."""
    items = key if isinstance(key, tuple) else (key,)
    consumed = builtins.sum(1 for k in items if k is not None and k is not Ellipsis)
    if builtins.sum(1 for k in items if isinstance(k, Value)) > 1:
        # NOTE: torch pairs several index tensors elementwise (advanced indexing); one gather per
        # tensor would silently take their outer product instead.
        raise RecordError(f"indexing {x.describe()} with more than one index tensor is not "
                          f"supported; combine them into one index (e.g. flatten and gather)"
                          f"\n  at {user_frame()}")
    out, dim = x, 0
    for item in items:
        if item is Ellipsis:
            if x.rank is None:
                raise RecordError(f"indexing with ... needs a known rank, got {x.describe()}"
                                  f"\n  at {user_frame()}")
            dim += x.rank - consumed
        elif item is None:
            out = unsqueeze(out, dim)
            dim += 1
        elif isinstance(item, bool) or not isinstance(item, (int, builtins.slice, Value)):
            raise RecordError(f"cannot index a symbolic tensor with {item!r}\n  at {user_frame()}")
        elif isinstance(item, int):
            out = select(out, dim, item)
        elif isinstance(item, builtins.slice):
            if item != builtins.slice(None):
                out = slice(out, dim, item.start or 0, item.stop, item.step or 1)
            dim += 1
        else:
            if item.rank is None and item is not items[-1]:
                raise RecordError(f"index tensor {item.describe()} needs a known rank when more "
                                  f"indices follow it\n  at {user_frame()}")
            out = gather(out, dim, item)
            dim += item.rank if item.rank is not None else 1
    return out


# ---- rotary embedding, KV cache, attention -------------------------------------------------------
def rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, interleaved: bool = False
         ) -> tuple[Tensor, Tensor]:
    """Rotate q ``[tokens, q_heads, head_dim]`` and k ``[tokens, kv_heads, head_dim]`` by
    ``cos``/``sin`` ``[tokens, rot_dim / 2]``: half-rotation style (GPT-NeoX, Llama) by default,
    pairs of adjacent dims (GPT-J) with ``interleaved``. Dims past ``rot_dim`` are kept."""
    out = record("rope", [q, k, cos, sin], interleaved=interleaved)
    assert isinstance(out, tuple)
    return out[0], out[1]


def reshape_and_cache(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slots_mapping: Tensor
                      ) -> tuple[Tensor, Tensor]:
    """Write each token's k/v ``[tokens, kv_heads, head_dim]`` into the paged caches
    ``[num_blocks, block_size, kv_heads, head_dim]`` at flat slot ``slots_mapping[t]``
    (negative: skip).

    Returns:
        the updated caches; pass them to :func:`paged_attention` so that it reads after the write.
    """
    out = record("reshape_and_cache", [k, v, k_cache, v_cache, slots_mapping])
    assert isinstance(out, tuple)
    return out[0], out[1]


def paged_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor,
                    seq_len: Tensor, query_start_loc: Tensor | None = None, *,
                    scale: float | None = None, sliding_window: int | None = None,
                    new_kv: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """Causal attention of q over keys/values in the paged cache.

    Args:
        q: ``[tokens, q_heads, head_dim]``: packed queries of all sequences (prefill) or one per
            sequence (decode, when ``query_start_loc`` is None).
        k_cache, v_cache: ``[num_blocks, block_size, kv_heads, head_dim]``; q_heads must be a
            multiple of kv_heads (GQA).
        block_table: ``[batch, max_blocks]`` int32, the cache blocks of each sequence.
        seq_len: ``[batch]`` int32, tokens of each sequence in the cache (new ones included).
        query_start_loc: ``[batch + 1]`` int32 cumulative query counts, for packed queries.
        scale: softmax scale, ``head_dim ** -0.5`` by default.
        sliding_window: attend only the last ``sliding_window`` positions (Mistral).
        new_kv: packed queries only: ``(k, v)``, ``[tokens, kv_heads, head_dim]``, the keys and
            values this step wrote to the cache, in query order. The result is the same; the
            GPU kernel reads a sequence without cached context from them (contiguous rows)
            instead of gathering its pages.
    Returns:
        ``[tokens, q_heads, head_dim]`` in q's dtype.
    """
    inputs = [q, k_cache, v_cache, block_table, seq_len, query_start_loc]
    if new_kv is not None:
        if query_start_loc is None:
            raise ValueError("paged_attention: new_kv is for packed queries (prefill), "
                             "it needs query_start_loc")
        inputs += list(new_kv)
    return _one("paged_attention", inputs, scale=scale, sliding_window=sliding_window)


def sdpa_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor,
                   seq_len: Tensor, query_start_loc: Tensor, *, scale: float | None = None,
                   sliding_window: int | None = None) -> Tensor:
    """Packed (prefill) causal attention over the paged cache through torch SDPA, one call per
    sequence: the same operands and result as :func:`paged_attention` with ``query_start_loc``.

    Returns:
        ``[tokens, q_heads, head_dim]`` in q's dtype.
    """
    return _one("sdpa_attention", [q, k_cache, v_cache, block_table, seq_len, query_start_loc],
                scale=scale, sliding_window=sliding_window)
