"""The ``tgraph`` command line."""
from __future__ import annotations

import argparse
import sys
from typing import Sequence


def _demo(args: argparse.Namespace) -> int:
    from tgraph.demo import run_demo

    return run_demo()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tgraph", description="Graph-capture LLM inference.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the built-in demo (no downloads, no GPU needed)")
    demo.set_defaults(func=_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
