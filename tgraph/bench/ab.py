"""Same-process A/B of two settings: ``python -m tgraph.bench.ab PRESET [--set-a KEY=VALUE ...]
[--set-b KEY=VALUE ...] [--disable PASS ...] [--batch B] [--rounds R]``.

Builds the preset twice on one GPU from the same random weights: variant A with the ``--set-a``
overrides, variant B with ``--set-b`` and without the ``--disable`` passes. Keys are settings
keys (``llm.engine.tuning.gemv.tma_weights=false``, ``llm.engine.disabled_passes=["L2Prefetch"]``;
``python -m tgraph.config --tuning`` lists the tuning ones). Each variant is its own model with
its own engines, so each captured graph holds its own variant's settings. The decode step of each
is captured and timed alternately: graph replays alone (no host time) and the whole ``model.run``.
Machines differ by up to 10% in step time, so a change is only judged against the other variant
of the same run.
"""
from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tgraph.config import Settings, load_settings, tuning_of
from tgraph.errors import ConfigError

__all__ = ["Variant", "build_variant", "parse_variants"]


@dataclass(frozen=True)
class Variant:
    """One side of the A/B: a label and its settings."""

    label: str
    settings: Settings

    @property
    def llm_options(self) -> dict:
        """The model options these settings give (for ``build_model``)."""
        engine = self.settings.llm.engine
        return {"disabled_passes": tuple(engine.disabled_passes),
                "tuning": tuning_of(self.settings)}


def parse_variants(set_a: Sequence[str] = (), set_b: Sequence[str] = (),
                   disable: Sequence[str] = ()) -> tuple[Variant, Variant]:
    """The two variants of an A/B.

    Args:
        set_a, set_b: ``KEY=VALUE`` settings overrides of each side.
        disable: pass names B runs without (added to its ``llm.engine.disabled_passes``).

    Raises:
        SystemExit: an override is malformed, names an unknown key or a bad value, or the two
            sides would not differ.
    """
    if not (set_a or set_b or disable):
        raise SystemExit("give the variants something to differ by: --set-a, --set-b and/or "
                         "--disable")
    try:
        a = load_settings(None, list(set_a))
        b = load_settings(None, list(set_b))
        if disable:
            passes = [*b.llm.engine.disabled_passes,
                      *(p for p in disable if p not in b.llm.engine.disabled_passes)]
            b = load_settings(None, [*set_b, "llm.engine.disabled_passes=" + json.dumps(passes)])
    except ConfigError as err:
        raise SystemExit(f"tgraph.bench.ab: {err}") from None
    if a == b:
        raise SystemExit("tgraph.bench.ab: the two variants have the same settings")
    label_b = " ".join(list(set_b) + ([f"without {','.join(disable)}"] if disable else []))
    return Variant("A " + (" ".join(set_a) or "(defaults)"), a), Variant("B " + label_b, b)


def build_variant(hf_config: dict, weights: dict[str, torch.Tensor], variant: Variant,
                  batch: int):
    """The variant's model on the GPU, its decode bucket captured and staged (see
    :func:`tgraph.bench.models.captured_decode`); returns ``(model, batch meta)``."""
    from tgraph.bench.models import captured_decode, random_model

    model = random_model(hf_config, weights, max_model_len=4096, **variant.llm_options)
    return model, captured_decode(model, batch)


def main(argv: Sequence[str] | None = None) -> None:
    from tgraph.bench.models import CONTEXT, random_weights
    from tgraph.bench.timing import time_ms
    from tgraph.models.presets import preset

    parser = argparse.ArgumentParser(prog="python -m tgraph.bench.ab", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("preset")
    parser.add_argument("--set-a", nargs="+", default=[], metavar="KEY=VALUE")
    parser.add_argument("--set-b", nargs="+", default=[], metavar="KEY=VALUE")
    parser.add_argument("--disable", nargs="+", default=[], metavar="PASS",
                        help="pass names variant B runs without")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    variants = parse_variants(args.set_a, args.set_b, args.disable)
    if not torch.cuda.is_available():
        raise SystemExit("tgraph.bench.ab needs a CUDA device")
    hf = preset(args.preset)
    weights = random_weights(hf, torch.bfloat16, "cuda")
    built = {v.label: build_variant(hf, weights, v, args.batch) for v in variants}
    print(f"{args.preset} batch {args.batch}, context {CONTEXT}: ms per decode step "
          "(rounds alternate)")
    for _ in range(args.rounds):
        for label, (model, meta) in built.items():
            engine = model.engines[(False, ())]
            graphs = model.decode_graphs(args.batch)
            replay = time_ms(lambda: [g.replay() for g in graphs], iters=100)
            step = time_ms(lambda: model.run(meta), iters=100)
            print(f"  {label:48s} replay {replay:.3f}  model.run {step:.3f}  "
                  f"({engine.stats.kernel_count} kernels)")


if __name__ == "__main__":
    main()
