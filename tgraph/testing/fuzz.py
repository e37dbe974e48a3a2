"""Differential fuzzer: random networks built with every pass on, with passes off, and on the
Triton backend, each compared with an eager fp64 torch evaluation of the same program.

::

    python -m tgraph.testing.fuzz --cases N --seed S [--backend reference|triton] [--max-ops K]
    python -m tgraph.testing.fuzz --replay CASE_ID

A case id is ``S:I:K`` (case ``I`` of seed ``S`` drawn with at most ``K`` ops) or ``c:...``
(the program itself, compressed: what a shrunk case prints). On a failure the case is shrunk by
delta debugging (drop steps and what depends on them, bypass steps, smaller shapes and
parameters, fp32, static shapes) while the same configuration still fails the same way, and both
ids are printed.

Without CUDA, ``--backend triton`` runs the kernels in Triton's interpreter
(``TRITON_INTERPRET=1``, set here before any kernel is imported). Cases are deterministic per
seed: the same id gives the same program and data, and so the same verdict.

Not generated: dynamic dims changing between calls of one engine, integer or boolean outputs,
mixed dtypes in one program, empty tensors, LoRA, quantized weights, collectives and placement.

The programs and the oracle live in :mod:`tgraph.testing.fuzz_case` and
:mod:`tgraph.testing.fuzz_ops`. Tolerances (compared elementwise as
``|got - want| <= tol * (|want| + max(1, max|want|))``): fp32 ``1e-4``, about 1,700 units of
roundoff, room for growth through softmax and norms over at most ~12 ops; bf16 and fp16
``u * (4 + 2 * depth)``, with ``u`` the dtype's unit roundoff and ``depth`` the longest op chain
that made the output, since every op may round its result once in the unfused network and
fused kernels round at other places.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from tgraph import envs
from tgraph.testing.fuzz_case import Case, InvalidCase, Step, draw_case, evaluate, record

__all__ = ["CONFIGS", "Failure", "Report", "case_from_id", "check_case", "fuzz", "main",
           "run_one", "shrink", "tolerance"]

# configuration -> build_engine options.
CONFIGS: dict[str, dict] = {
    "fused": {"passes": True, "backend": "reference"},
    "plain": {"passes": False, "backend": "reference"},
    "triton": {"passes": True, "backend": "triton"},
}
UNIT_ROUNDOFF = {"float32": 2.0 ** -24, "bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}


@dataclass(frozen=True)
class Failure:
    """One configuration that disagreed with the oracle (or raised)."""

    config: str
    kind: str  # "mismatch", "dtype", "shape", "wrote-input" or "error:<exception type>"
    detail: str

    @property
    def signature(self) -> tuple[str, str]:
        return self.config, self.kind


def tolerance(dtype: str, depth: int) -> float:
    """The relative tolerance of an output of ``dtype`` made by a chain of ``depth`` ops."""
    if dtype == "float32":
        return 1e-4
    return UNIT_ROUNDOFF[dtype] * (4 + 2 * depth)


def _compare(got: torch.Tensor, want: torch.Tensor, dtype: str, depth: int, config: str,
             name: str) -> Failure | None:
    if tuple(got.shape) != tuple(want.shape):
        return Failure(config, "shape", f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}")
    if str(got.dtype).removeprefix("torch.") != dtype:
        return Failure(config, "dtype", f"{name}: dtype {got.dtype} != {dtype}")
    if not want.numel():
        return None
    tol = tolerance(dtype, depth)
    g = got.detach().cpu().double()
    err = (g - want).abs()
    bound = tol * (want.abs() + max(1.0, float(want.abs().max())))
    bad = ~(err <= bound)  # NaN fails
    if bad.any():
        i = int(bad.flatten().nonzero()[0])
        return Failure(config, "mismatch",
                       f"{name}: {int(bad.sum())}/{bad.numel()} elements off (tol {tol:.2e}); "
                       f"first at flat {i}: got {float(g.flatten()[i]):.6g}, want "
                       f"{float(want.flatten()[i]):.6g}")
    return None


def check_case(case: Case, configs: Sequence[str] = ("fused", "plain")) -> list[Failure]:
    """Build and run ``case`` in each configuration and compare with the oracle.

    Returns:
        The failures (empty: every configuration matched).

    Raises:
        InvalidCase: the program is not valid (only shrinking makes such cases).
    """
    ev = evaluate(case)
    try:
        net, inputs = record(case, ev)
    except Exception as e:  # a program the recorder refuses is a finding too
        return [Failure("record", f"error:{type(e).__name__}", str(e).splitlines()[0])]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    written = {f"s{i}_{k}" for i, leaves in enumerate(ev.step_leaves)
               for k, leaf in leaves.items() if leaf.mutated}
    failures = []
    for config in configs:
        if config == "triton" and not ev.triton_ok:
            continue
        try:
            engine = net.build_engine(**CONFIGS[config])
            if device != "cpu":
                engine.to(device)  # the recorded weights are CPU tensors
            given = {k: v.clone().to(device) for k, v in inputs.items()}
            out = engine.forward(given)
        except Exception as e:  # any exception of an engine is a finding
            failures.append(Failure(config, f"error:{type(e).__name__}",
                                    str(e).splitlines()[0] if str(e) else ""))
            continue
        for j, v in enumerate(ev.outputs):
            found = _compare(out[f"out{j}"], ev.values[v], case.dtype, ev.depth[v], config,
                             f"out{j} (v{v})")
            if found:
                failures.append(found)
                break
        else:
            changed = [k for k, v in given.items() if k not in written
                       and not torch.equal(v.cpu(), inputs[k])]
            if changed:
                failures.append(Failure(config, "wrote-input", f"inputs {changed} changed"))
    return failures


# ---- shrinking -----------------------------------------------------------------------------------
def _without(case: Case, counts: Sequence[int], step: int, replace_with: int | None = None
             ) -> Case:
    """``case`` without ``step`` (whose steps make ``counts`` values each): its readers read
    ``replace_with`` instead, or are dropped too (and their readers, transitively) when None."""
    first = len(case.inputs)
    mapping = {v: v for v in range(first)}  # old value number -> new
    dropped: set[int] = set()
    steps: list[Step] = []
    old = new = first
    for i, s in enumerate(case.steps):
        olds = range(old, old + counts[i])
        old += counts[i]
        if i == step:
            if replace_with is None:
                dropped.update(olds)
            else:
                mapping[olds[0]] = mapping[replace_with]
            continue
        if any(a in dropped for a in s.args):
            dropped.update(olds)
            continue
        steps.append(Step(s.op, [mapping[a] for a in s.args], dict(s.params)))
        for o in olds:
            mapping[o] = new
            new += 1
    return dataclasses.replace(case, steps=steps)


def _simpler_params(value: object) -> list[object]:
    if value is True:
        return [False]
    if isinstance(value, int) and not isinstance(value, bool) and value > 1:
        return [1]
    if value in ("act", "bias_act", "residual", "residual_new", "shared", "swiglu"):
        return ["none"]  # a linear's epilogue
    return []


def _candidates(case: Case) -> Iterator[Case]:
    """Smaller variants of ``case``, the biggest reductions first."""
    ev = evaluate(case)
    counts = ev.counts
    first = len(case.inputs)
    for i in reversed(range(len(case.steps))):  # drop a step and what reads it
        yield _without(case, counts, i)
    for i in reversed(range(len(case.steps))):  # bypass a step by an operand of its shape
        out = first + sum(counts[:i])
        for a in case.steps[i].args:
            if counts[i] == 1 and ev.values[a].shape == ev.values[out].shape:
                yield _without(case, counts, i, a)
                break
    read = {a for s in case.steps for a in s.args}
    for k in reversed(range(1, first)):  # inputs no step reads (the first one stays)
        if k not in read:
            yield dataclasses.replace(case, inputs=case.inputs[:k] + case.inputs[k + 1:], steps=[
                Step(s.op, [a - (a > k) for a in s.args], dict(s.params)) for s in case.steps])
    if case.dtype != "float32":
        yield dataclasses.replace(case, dtype="float32")
    if case.symbolic:
        yield dataclasses.replace(case, symbolic=False)
    for k, shape in enumerate(case.inputs):  # smaller inputs
        for d, size in enumerate(shape):
            for smaller in sorted({1, size // 2, size - 1}):
                if 0 < smaller < size:
                    inputs = [list(s) for s in case.inputs]
                    inputs[k][d] = smaller
                    yield dataclasses.replace(case, inputs=inputs)
    for i, s in enumerate(case.steps):  # simpler parameters
        for key, value in s.params.items():
            for v in _simpler_params(value):
                steps = [Step(t.op, list(t.args), dict(t.params)) for t in case.steps]
                steps[i].params[key] = v
                yield dataclasses.replace(case, steps=steps)


def shrink(case: Case, failure: Failure, *, budget: int = 400,
           log: Callable[[str], None] | None = None) -> Case:
    """The smallest case found that still fails like ``failure`` (same configuration and kind).

    Args:
        case: a failing case.
        failure: the failure to keep.
        budget: the most candidate cases to run.
        log: called with a line per accepted reduction.

    Returns:
        The shrunk case (``case`` itself when nothing smaller fails).
    """
    tried = 0
    best = case
    progress = True
    while progress and tried < budget:
        progress = False
        for cand in _candidates(best):
            if tried >= budget:
                break
            tried += 1
            try:
                found = check_case(cand, (failure.config,) if failure.config != "record"
                                   else ())
            except InvalidCase:
                continue
            if any(f.signature == failure.signature for f in found):
                best = cand
                progress = True
                if log:
                    log(f"  shrunk to {len(best.steps)} steps, inputs {best.inputs}")
                break
    return best


# ---- driving -------------------------------------------------------------------------------------
def case_from_id(case_id: str) -> Case:
    """The case a printed id names (``S:I:K`` or ``c:...``)."""
    if case_id.startswith("c:"):
        return Case.decode(case_id)
    seed, index, max_ops = case_id.split(":")
    return draw_case(f"{seed}:{index}", max_ops=int(max_ops))


@dataclass
class Report:
    """What a fuzzing run found."""

    cases: int = 0
    invalid: int = 0
    failures: list[tuple[str, str, Failure]] = dataclasses.field(default_factory=list)
    repeats: int = 0  # failing cases that raised an exception already shrunk
    ops: dict[str, int] = dataclasses.field(default_factory=dict)


def _configs(backend: str) -> tuple[str, ...]:
    return ("fused", "plain", "triton") if backend == "triton" else ("fused", "plain")


def run_one(case_id: str, configs: Sequence[str], report: Report, *, shrink_budget: int = 400,
            out: Callable[[str], None] = print) -> None:
    """Check one case, shrink and print it if it fails, and add it to ``report``."""
    case = case_from_id(case_id)
    try:
        failures = check_case(case, configs)
    except InvalidCase:
        report.invalid += 1
        return
    report.cases += 1
    for s in case.steps:
        report.ops[s.op] = report.ops.get(s.op, 0) + 1
    if not failures:
        return
    first = failures[0]
    out(f"FAIL {case_id} [{first.config}] {first.kind}: {first.detail}")
    if first.kind.startswith("error:"):  # the same exception again: counted, not shrunk again
        seen = {(f.config, f.kind, f.detail) for _, _, f in report.failures}
        if (first.config, first.kind, first.detail) in seen:
            report.repeats += 1
            return
    small = shrink(case, first, budget=shrink_budget)
    small_failure = next((f for f in check_case(small, (first.config,) if first.config != "record"
                                                else ()) if f.signature == first.signature),
                         first)
    out(small.describe())
    out(f"  [{small_failure.config}] {small_failure.kind}: {small_failure.detail}")
    out(f"  replay: python -m tgraph.testing.fuzz --replay {small.encode()}")
    report.failures.append((case_id, small.encode(), small_failure))


def fuzz(cases: int, seed: int, *, backend: str = "reference", max_ops: int = 8,
         shrink_budget: int = 400, out: Callable[[str], None] = print) -> Report:
    """Draw and check ``cases`` cases of ``seed``.

    Args:
        cases: how many cases.
        seed: the run's seed: case ``i`` is ``f"{seed}:{i}:{max_ops}"``.
        backend: ``"reference"`` (passes on and off) or ``"triton"`` (also the Triton backend).
        max_ops: the most steps of a case.
        shrink_budget: the most candidates the shrinker runs per failure.
        out: where lines go.

    Returns:
        The report; its ``failures`` hold ``(case id, shrunk case id, failure)``.
    """
    report = Report()
    for i in range(cases):
        run_one(f"{seed}:{i}:{max_ops}", _configs(backend), report, shrink_budget=shrink_budget,
                out=out)
    return report


def main(argv: Sequence[str] | None = None) -> int:
    """The command line; returns the exit status (1 when a case failed)."""
    parser = argparse.ArgumentParser(prog="python -m tgraph.testing.fuzz", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", choices=("reference", "triton"), default="reference")
    parser.add_argument("--max-ops", type=int, default=8)
    parser.add_argument("--replay", metavar="CASE", help="check one case id (S:I:K or c:...)")
    parser.add_argument("--shrink-budget", type=int, default=400)
    args = parser.parse_args(argv)
    if args.backend == "triton" and not torch.cuda.is_available():
        # NOTE: Triton reads this when a kernel is first decorated, so before any kernel import.
        envs.set_default("TRITON_INTERPRET", "1")
    start = time.perf_counter()
    if args.replay:
        report = Report()
        case = case_from_id(args.replay)
        print(case.describe())
        run_one(args.replay, _configs(args.backend), report, shrink_budget=args.shrink_budget)
        print("ok" if not report.failures and report.cases else
              "invalid case" if report.invalid else "FAILED")
        return 1 if report.failures else 0
    report = fuzz(args.cases, args.seed, backend=args.backend, max_ops=args.max_ops,
                  shrink_budget=args.shrink_budget)
    took = time.perf_counter() - start
    ops = ", ".join(f"{k} {v}" for k, v in sorted(report.ops.items()))
    print(f"{report.cases} cases checked ({report.invalid} invalid skipped), "
          f"{len(report.failures) + report.repeats} failed ({report.repeats} repeats of an "
          f"error already shown), {took:.1f} s; seed {args.seed}, backend "
          f"{args.backend}, max ops {args.max_ops}\nsteps by op: {ops}")
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
