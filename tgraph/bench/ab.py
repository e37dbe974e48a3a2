"""Same-process A/B of a pass: ``python -m tgraph.bench.ab PRESET --disable PASS [--batch B]``.

Builds the preset twice on one GPU (all passes, then without the named ones), captures the
decode step of each and times them alternately: graph replays alone (no host time) and the whole
``model.run``. Machines differ by up to 10% in step time, so a change is only judged against the
other variant of the same run.
"""
from __future__ import annotations

import argparse

import torch

from tgraph.bench.models import CONTEXT, captured_decode, random_model, random_weights
from tgraph.bench.timing import time_ms
from tgraph.models.presets import preset


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("preset")
    parser.add_argument("--disable", nargs="+", required=True, help="pass names for variant B")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("tgraph.bench.ab needs a CUDA device")
    hf = preset(args.preset)
    weights = random_weights(hf, torch.bfloat16, "cuda")
    b = args.batch
    variants = {}
    for label, disabled in (("all passes", ()), ("without " + ",".join(args.disable), tuple(args.disable))):
        model = random_model(hf, weights, max_model_len=4096, disabled_passes=disabled)
        meta = captured_decode(model, b)
        variants[label] = model
    print(f"{args.preset} batch {b}, context {CONTEXT}: ms per decode step (rounds alternate)")
    for _ in range(args.rounds):
        for label, model in variants.items():
            engine = model.engines[(False, ())]
            graphs = engine.captured_graphs
            replay = time_ms(lambda: [g.replay() for g in graphs], iters=100)
            step = time_ms(lambda: model.run(meta), iters=100)
            print(f"  {label:32s} replay {replay:.3f}  model.run {step:.3f}  "
                  f"({engine.stats.kernel_count} kernels)")


if __name__ == "__main__":
    main()
