"""Same-process A/B of a change: ``python -m tgraph.bench.ab PRESET [--disable PASS ...]
[--set MODULE.NAME=VALUE ...] [--batch B]``.

Builds the preset twice on one GPU: variant A as configured, variant B without the named passes
and/or with module constants overridden while it is built and captured (e.g.
``--set tgraph.kernels.triton.attention_decode.MIN_KEYS_PER_SPLIT=100000`` for unsplit decode
attention; a launch heuristic read at capture time stays baked into B's graph). The decode step of
each is captured and timed alternately: graph replays alone (no host time) and the whole
``model.run``. Machines differ by up to 10% in step time, so a change is only judged against the
other variant of the same run.
"""
from __future__ import annotations

import argparse
import ast
import importlib
from contextlib import contextmanager
from typing import Iterator

import torch

from tgraph.bench.models import CONTEXT, captured_decode, random_model, random_weights
from tgraph.bench.timing import time_ms
from tgraph.models.presets import preset


def parse_override(text: str) -> tuple[object, str, object]:
    """``"pkg.module.NAME=VALUE"`` -> (module, NAME, VALUE as a Python literal)."""
    target, sep, value = text.partition("=")
    module_name, _, attr = target.rpartition(".")
    if not sep or not module_name or not attr:
        raise SystemExit(f"--set expects MODULE.NAME=VALUE, got {text!r}")
    module = importlib.import_module(module_name)
    if not hasattr(module, attr):
        raise SystemExit(f"--set: {module_name} has no attribute {attr!r}")
    try:
        parsed = ast.literal_eval(value)
    except (ValueError, SyntaxError):
        raise SystemExit(f"--set {target}: {value!r} is not a Python literal") from None
    return module, attr, parsed


@contextmanager
def overridden(overrides: list[tuple[object, str, object]]) -> Iterator[None]:
    saved = [(m, a, getattr(m, a)) for m, a, _ in overrides]
    try:
        for m, a, v in overrides:
            setattr(m, a, v)
        yield
    finally:
        for m, a, v in saved:
            setattr(m, a, v)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("preset")
    parser.add_argument("--disable", nargs="+", default=[], help="pass names for variant B")
    parser.add_argument("--set", nargs="+", default=[], dest="overrides",
                        help="MODULE.NAME=VALUE overrides for variant B")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    if not (args.disable or args.overrides):
        raise SystemExit("give variant B something to differ by: --disable and/or --set")
    if not torch.cuda.is_available():
        raise SystemExit("tgraph.bench.ab needs a CUDA device")
    overrides = [parse_override(t) for t in args.overrides]
    hf = preset(args.preset)
    weights = random_weights(hf, torch.bfloat16, "cuda")
    b = args.batch
    label_b = " ".join([f"without {','.join(args.disable)}"] * bool(args.disable) + args.overrides)
    variants = {}
    for label, disabled, sets in (("A (as configured)", (), []),
                                  (label_b, tuple(args.disable), overrides)):
        with overridden(sets):
            model = random_model(hf, weights, max_model_len=4096, disabled_passes=disabled)
            meta = captured_decode(model, b)
        variants[label] = model
    print(f"{args.preset} batch {b}, context {CONTEXT}: ms per decode step (rounds alternate)")
    for _ in range(args.rounds):
        for label, model in variants.items():
            engine = model.engines[(False, ())]
            graphs = model.decode_graphs(b)
            replay = time_ms(lambda: [g.replay() for g in graphs], iters=100)
            step = time_ms(lambda: model.run(meta), iters=100)
            print(f"  {label:48s} replay {replay:.3f}  model.run {step:.3f}  "
                  f"({engine.stats.kernel_count} kernels)")


if __name__ == "__main__":
    main()
