"""Random programs of the differential fuzzer: drawing, (de)serialising, the torch oracle, and
recording into a tgraph :class:`~tgraph.ir.network.Network`.

A :class:`Case` is pure data (JSON-able): input shapes, a dtype, and steps that name an op of
:data:`~tgraph.testing.fuzz_ops.OPS`, the values it reads and its parameters. Values are numbered
in creation order: the inputs, then each step's outputs. Leaf data (inputs, weights) is drawn
from the case's ``seed`` and the leaf's name, so a case replays exactly.
"""
from __future__ import annotations

import base64
import json
import random
import zlib
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from tgraph.nn.network_manager import recording
from tgraph.nn.tensor import Tensor
from tgraph.testing.fuzz_ops import OPS, WEIGHTS, Leaf, make_param, rand_data

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                                  "float16": torch.float16}
# Values an oracle step may reach: beyond this the program is refused (fp16 overflows near 6e4,
# and huge values only measure the growth of rounding error).
MAX_ABS = 1e3


class InvalidCase(Exception):
    """The program is not valid any more (a shrunk shape no longer fits a step's parameters)."""


@dataclass
class Step:
    op: str
    args: list[int]
    params: dict[str, Any]


@dataclass
class Case:
    """One random program.

    Attributes:
        seed: seeds the data of every leaf (with the leaf's name).
        dtype: the dtype of inputs and weights (a key of :data:`DTYPES`).
        inputs: the shapes of the program's first values (graph inputs ``x0``, ``x1``...).
        steps: the ops, in order.
        symbolic: record the inputs' first dim as the symbol ``n`` where it equals the first
            input's (a dynamic dim, resolved per call).
    """

    seed: str
    dtype: str
    inputs: list[list[int]]
    steps: list[Step] = field(default_factory=list)
    symbolic: bool = False

    def encode(self) -> str:
        """A replayable id: ``c:`` and the compressed JSON of the case."""
        raw = json.dumps(asdict(self), separators=(",", ":")).encode()
        return "c:" + base64.urlsafe_b64encode(zlib.compress(raw, 9)).decode()

    @staticmethod
    def decode(text: str) -> Case:
        data = json.loads(zlib.decompress(base64.urlsafe_b64decode(text[2:].encode())))
        data["steps"] = [Step(**s) for s in data["steps"]]
        return Case(**data)

    def describe(self) -> str:
        lines = [f"case seed={self.seed} dtype={self.dtype} symbolic={self.symbolic}"]
        n = len(self.inputs)
        lines += [f"  v{i} = input {shape}" for i, shape in enumerate(self.inputs)]
        for i, s in enumerate(self.steps):
            lines.append(f"  step {i}: {s.op}({', '.join(f'v{a}' for a in s.args)}) {s.params}"
                         f"  -> v{n}..")
            n += 1
        return "\n".join(lines)


def _generator(case: Case, name: str) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(f"{case.seed}/{name}".encode()))


@dataclass
class Evaluated:
    """A case run through the oracle: every value (fp64), its depth, and the leaves."""

    values: list[torch.Tensor]
    depth: list[int]
    inputs: dict[str, Leaf]
    step_leaves: list[dict[str, Leaf]]
    outputs: list[int]
    counts: list[int]  # values each step made
    triton_ok: bool  # every step is one the Triton backend's kernels take


def _ill_conditioned(step: Step, xs: list[torch.Tensor], dtype: str) -> bool:
    """Whether ``step`` magnifies its operands' rounding error past any dtype tolerance.

    Normalising rows of tiny RMS (or standard deviation, for LayerNorm) against the operand's
    scale does. In bf16/fp16, so do sin/cos and softmax of operands beyond 4 in magnitude: the
    operand's absolute error grows with it (a bf16 unit at 4 is 0.03) and passes straight into
    the result.
    """
    if step.op in ("norm", "add_rms_norm"):
        x = xs[0] + xs[1] if step.op == "add_rms_norm" else xs[0]
        rows = x - x.mean(-1, keepdim=True) if step.params.get("kind", "").startswith("layer") \
            else x
        spread = (rows * rows).mean(-1).sqrt()
        return bool((spread < 0.05 * x.abs().max().clamp_min(1e-3)).any())
    periodic = step.op == "unary" and step.params["fn"] in ("sin", "cos", "twice")
    if dtype != "float32" and (periodic or step.op == "softmax"):
        return bool(xs[0].abs().max() > 4)
    return False


def evaluate(case: Case) -> Evaluated:
    """Run ``case`` through the torch oracle in fp64 (leaf data rounded to the case's dtype).

    Raises:
        InvalidCase: a step does not apply to its operands, or a value leaves
            ``[-MAX_ABS, MAX_ABS]`` or is not finite.
    """
    dtype = DTYPES[case.dtype]
    inputs = {f"x{i}": Leaf("input", rand_data(shape, _generator(case, f"x{i}"), dtype, 2.0))
              for i, shape in enumerate(case.inputs)}
    values = [leaf.data.double() for leaf in inputs.values()]
    depth = [0] * len(values)
    consumed: set[int] = set()
    step_leaves = []
    counts = []
    triton_ok = True
    for i, step in enumerate(case.steps):
        op = OPS[step.op]
        try:
            if any(a >= len(values) for a in step.args):
                raise InvalidCase(f"step {i} reads a value not yet made")
            xs = [values[a] for a in step.args]
            leaves = op.leaves([tuple(x.shape) for x in xs], step.params,
                               _generator(case, f"s{i}"), dtype)
            outs = op.ref(xs, {k: v.data.double() if v.data.is_floating_point() else v.data
                               for k, v in leaves.items()}, step.params)
        except InvalidCase:
            raise
        except (RuntimeError, ValueError, IndexError, KeyError, TypeError, ZeroDivisionError) as e:
            raise InvalidCase(f"step {i} ({step.op}): {e}") from e
        for out in outs:
            if not out.numel():
                raise InvalidCase(f"step {i} ({step.op}) makes an empty value")
            if (not torch.isfinite(out).all() or out.abs().max() > MAX_ABS):
                raise InvalidCase(f"step {i} ({step.op}) leaves the value range")
        if _ill_conditioned(step, xs, case.dtype):
            raise InvalidCase(f"step {i} ({step.op}) is ill-conditioned at its operands")
        d = 1 + max((depth[a] for a in step.args), default=0)
        step_leaves.append(leaves)
        consumed.update(step.args)
        values += [o.contiguous() for o in outs]
        counts.append(len(outs))
        triton_ok = triton_ok and op.triton_ok([tuple(x.shape) for x in xs], step.params)
        depth += [d] * len(outs)
    first = len(case.inputs)
    sinks = [v for v in range(first, len(values)) if v not in consumed]
    outputs = sinks[-3:] if sinks else ([len(values) - 1] if case.steps else [])
    if not outputs:
        raise InvalidCase("no outputs")
    return Evaluated(values, depth, inputs, step_leaves, outputs, counts, triton_ok)


def record(case: Case, ev: Evaluated) -> tuple[Any, dict[str, torch.Tensor]]:
    """Record ``case`` into a new network.

    Returns:
        ``(network, inputs)``: the network (outputs ``out0``...) and the real graph inputs by
        name (only those the network reads).
    """
    dtype = DTYPES[case.dtype]
    data: dict[str, torch.Tensor] = {}
    with recording("fuzz") as net:
        first_dim = case.inputs[0][0] if case.inputs and case.inputs[0] else None
        values: list[Any] = []
        for name, leaf in ev.inputs.items():
            shape: list[Any] = list(leaf.data.shape)
            if case.symbolic and shape and shape[0] == first_dim:
                shape[0] = "n"
            values.append(Tensor(name, dtype, shape))
            data[name] = leaf.data
        for i, (step, leaves) in enumerate(zip(case.steps, ev.step_leaves)):
            syms = {}
            for k, leaf in leaves.items():
                name = f"s{i}_{k}"
                if leaf.kind == "weight":
                    syms[k] = make_param(leaf.data, name)
                else:
                    syms[k] = Tensor(name, leaf.data.dtype, tuple(leaf.data.shape))
                    data[name] = leaf.data
            values += OPS[step.op].sym([values[a] for a in step.args], syms, step.params)
        for j, v in enumerate(ev.outputs):
            net.mark_output(values[v], f"out{j}")
    used = {v.name for v in net.inputs}
    return net, {k: t for k, t in data.items() if k in used}


def draw_case(seed: str, *, max_ops: int = 8, dtypes: tuple[str, ...] = tuple(DTYPES)) -> Case:
    """Draw one random case from ``seed`` (a string: the same string gives the same case).

    Args:
        seed: the case's seed (the fuzzer uses ``"<run seed>:<index>"``).
        max_ops: the most steps.
        dtypes: the dtypes to draw from (fp32 three times as often as each other).
    """
    rng = random.Random(seed)
    pool = [d for d in dtypes for _ in range(3 if d == "float32" else 1)]
    dtype = rng.choice(pool)
    rows = rng.randint(1, 6)
    kind = rng.choice(["2d", "3d", "heads", "heads"])
    if kind == "heads":  # (tokens, heads, head_dim), for rope and attention
        base = [rows, rng.choice([1, 2, 4]), rng.choice([2, 4, 8, 16])]
    elif kind == "3d":
        base = [rows, rng.randint(1, 5), rng.randint(1, 8)]
    else:
        base = [rows, rng.randint(1, 16)]
    inputs = [base]
    for _ in range(rng.randint(0, 2)):
        inputs.append(rng.choice([base, base[1:], [1] + base[1:], base[:-1] + [1]]) or [1])
    case = Case(seed, dtype, inputs, [], symbolic=rng.random() < 0.3)
    shapes = [tuple(s) for s in inputs]
    names, weights = zip(*sorted(WEIGHTS.items()))
    target = rng.randint(1, max_ops)
    for _ in range(target * 4):
        if len(case.steps) >= target:
            break
        op = rng.choices(names, weights)[0]
        first = rng.randrange(len(shapes)) if rng.random() < 0.4 else len(shapes) - 1
        drawn = OPS[op].draw(rng, shapes, first)
        if drawn is None:
            continue
        case.steps.append(Step(op, *drawn))
        try:
            ev = evaluate(case)
        except InvalidCase:
            case.steps.pop()
            continue
        shapes = [tuple(v.shape) for v in ev.values]
    return case
