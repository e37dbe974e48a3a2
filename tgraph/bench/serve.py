"""Serving benchmark: ``tgraph serve`` under a replayed request mix, prefix caching on and off.

A random-weight model of a preset's shape (default Llama-3.2-1B, bf16) is written to a temporary
directory. The request mix: every request shares one system prompt (default 1024 tokens) and adds
its own user turn (32-128 tokens), all as token ids; each asks for ``max_tokens`` tokens with
``ignore_eos``, so every run produces the same number of tokens.

For each prefix-caching setting (on, off):

1. **offline**: :meth:`LLM.generate` on all requests at once in this process (the ceiling the
   server is compared with), then the model is closed, freeing the GPU for the server;
2. the server starts as its own process (``python -m tgraph serve``), is warmed up, and replays
   the requests with async HTTP clients (httpx, streaming, spread over 4 processes): a
   **saturation** run (all requests at t=0), then **Poisson** arrivals at each rate.

Reported per run: output tokens/s, time to first token (mean, p50, p99) and inter-token latency
(p50, p99, from the arrival times of the streamed chunks: a chunk of several tokens, sent
by a server behind the engine, shares its gap between them), plus the saturated
server's throughput as a fraction of offline. JSON and a PNG (matplotlib, if installed).
"""
from __future__ import annotations

import asyncio
import json
import math
import queue
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["ServeRun", "make_requests", "replay", "run_serve_bench", "write_random_model"]

DEFAULT_PRESET = "llama-3.2-1b"
# The server process runs ``python -m tgraph`` from here, so it imports the tgraph we run.
_ROOT = Path(__file__).resolve().parents[2]


@dataclass
class ServeRun:
    """One replay of the request mix against a server (or the offline baseline).

    Attributes:
        label: ``offline``, ``saturation`` or ``poisson``.
        prefix_caching: whether the engine cached prefixes.
        rate: requests per second (None: all at once).
        requests: requests sent; ``errors``: those that did not finish with 200 and all tokens.
        seconds: wall time from the first request sent to the last token.
        output_tokens: tokens generated in all.
        throughput: ``output_tokens / seconds``.
        ttft_ms: time to first token: mean, p50, p99 (server runs only).
        itl_ms: inter-token latency: p50, p99 (server runs only).
    """

    label: str
    prefix_caching: bool
    rate: float | None
    requests: int
    seconds: float
    output_tokens: int
    throughput: float
    errors: int = 0
    ttft_ms: dict[str, float] = field(default_factory=dict)
    itl_ms: dict[str, float] = field(default_factory=dict)


# ---- the workload --------------------------------------------------------------------------------
def make_requests(num_requests: int, system_tokens: int, user_tokens: tuple[int, int],
                  vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Prompts of token ids: one shared system prompt, then a varied user turn each.

    Args:
        num_requests: how many prompts.
        system_tokens: length of the shared prefix.
        user_tokens: ``(least, most)`` tokens of each user turn.
        vocab_size: ids are drawn from ``[1, vocab_size)``.
        seed: the draw's seed.
    """
    rng = random.Random(seed)
    system = [rng.randrange(1, vocab_size) for _ in range(system_tokens)]
    return [system + [rng.randrange(1, vocab_size) for _ in range(rng.randint(*user_tokens))]
            for _ in range(num_requests)]


def write_random_model(preset_name: str, path: str | Path, device: str = "cpu") -> Path:
    """A checkpoint directory (``config.json`` + safetensors) of random bf16 weights of a preset's
    shape (see :mod:`tgraph.models.presets`); no tokenizer (the benchmark sends token ids)."""
    import torch
    from safetensors.torch import save_file

    from tgraph.bench.models import random_weights
    from tgraph.models.presets import preset

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = preset(preset_name)
    weights = random_weights(config, torch.bfloat16, device)
    save_file({k: v.cpu().contiguous() for k, v in weights.items()},
              str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return path


def _percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


# ---- the client side -----------------------------------------------------------------------------
async def _one(http: Any, url: str, model: str, prompt: list[int], max_tokens: int,
               send_at: float) -> tuple[float, list[tuple[float, int]], int] | None:
    """Send one streamed completion at ``send_at`` (``time.time()``): (sent at, [(chunk time,
    its tokens)], tokens) or None. A server that falls behind sends several tokens a chunk."""
    await asyncio.sleep(max(0.0, send_at - time.time()))
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
            "return_token_ids": True}
    sent, chunks, tokens = time.time(), [], 0
    async with http.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            return None
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            elif chunk.get("choices") and chunk["choices"][0].get("token_ids"):
                chunks.append((time.time(), len(chunk["choices"][0]["token_ids"])))
    return (sent, chunks, tokens) if tokens == max_tokens else None


def _client(url: str, model: str, prompts: Sequence[list[int]], max_tokens: int,
            send_at: Sequence[float]) -> list[Any]:
    """One client process's share of a replay (asyncio, one connection per request)."""
    import httpx

    async def main() -> list[Any]:
        limits = httpx.Limits(max_connections=max(1, len(prompts)), max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=None, limits=limits) as http:
            return await asyncio.gather(*(_one(http, url, model, p, max_tokens, t)
                                          for p, t in zip(prompts, send_at)))

    return asyncio.run(main())


def _ready() -> None:
    """A client process is up (its imports done)."""


def _inter_token_ms(chunks: Sequence[tuple[float, int]]) -> list[float]:
    """Per token after the first: the gap to the previous chunk, shared by the chunk's tokens
    (the first chunk's later tokens came with the first: gap 0)."""
    gaps = [0.0] * (chunks[0][1] - 1) if chunks else []
    for (before, _), (at, n) in zip(chunks, chunks[1:]):
        gaps += [(at - before) * 1e3 / n] * n
    return gaps


def replay(url: str, model: str, prompts: Sequence[list[int]], max_tokens: int,
           rate: float | None, *, prefix_caching: bool, seed: int = 0,
           clients: int = 1) -> ServeRun:
    """Replay ``prompts`` against the server at ``url`` (Poisson arrivals at ``rate`` per second,
    or all at once when ``rate`` is None) and measure it.

    Args:
        clients: client processes sharing the requests (round robin), so that parsing
            thousands of chunks a second does not make the load generator the bottleneck.
    """
    rng = random.Random(seed)
    delays, t = [], 0.0
    for _ in prompts:
        delays.append(t)
        if rate is not None:
            t += rng.expovariate(rate)
    if clients <= 1:
        start = time.time()
        results = _client(url, model, prompts, max_tokens, [start + d for d in delays])
    else:
        import multiprocessing

        shares = [list(range(k, len(prompts), clients)) for k in range(clients)]
        with multiprocessing.get_context("spawn").Pool(clients) as pool:
            pool.starmap(_ready, [()] * clients)
            start = time.time() + 0.1
            parts = pool.starmap(_client, [
                (url, model, [prompts[i] for i in share], max_tokens,
                 [start + delays[i] for i in share]) for share in shares])
        results = [None] * len(prompts)
        for share, part in zip(shares, parts):
            for i, r in zip(share, part):
                results[i] = r
    done = [r for r in results if r is not None]
    end = max((r[1][-1][0] for r in done if r[1]), default=time.time())
    ttft = [(r[1][0][0] - r[0]) * 1e3 for r in done if r[1]]
    itl = [gap for r in done for gap in _inter_token_ms(r[1])]
    tokens = sum(r[2] for r in done)
    seconds = end - start
    return ServeRun(
        label="saturation" if rate is None else "poisson", prefix_caching=prefix_caching,
        rate=rate, requests=len(prompts), seconds=seconds, output_tokens=tokens,
        throughput=tokens / seconds if seconds > 0 else 0.0, errors=len(prompts) - len(done),
        ttft_ms={"mean": statistics.fmean(ttft) if ttft else math.nan,
                 "p50": _percentile(ttft, 0.5), "p99": _percentile(ttft, 0.99)},
        itl_ms={"p50": _percentile(itl, 0.5), "p99": _percentile(itl, 0.99)})


# ---- the server and the offline baseline ---------------------------------------------------------
class _ServerProcess:
    """``python -m tgraph serve`` on a free port; stopped with SIGTERM (it drains, then exits)."""

    def __init__(self, model_dir: Path, overrides: Sequence[str], start_timeout: float,
                 server_args: Sequence[str] = ()) -> None:
        cmd = [sys.executable, "-m", "tgraph", "serve", "--model", str(model_dir), "--port", "0",
               "--served-model-name", "bench", "--log-level", "warning", *server_args]
        for item in overrides:
            cmd += ["--set", item]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, cwd=_ROOT)
        lines: queue.Queue[str | None] = queue.Queue()
        self.log: list[str] = []

        def read() -> None:
            for line in self.proc.stdout:
                lines.put(line)
            lines.put(None)

        threading.Thread(target=read, daemon=True).start()
        deadline = time.monotonic() + start_timeout
        while True:
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self.proc.kill()
                raise RuntimeError("the server did not start: " + "".join(self.log)) from None
            if line is None:
                raise RuntimeError(f"the server exited ({self.proc.wait()}): "
                                   + "".join(self.log))
            self.log.append(line)
            if line.startswith("tgraph: serving on "):
                self.url = line.split()[-1]
                return

    def stop(self, timeout: float = 120.0) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def _offline(model_dir: Path, prompts: Sequence[list[int]], max_tokens: int,
             overrides: Sequence[str], prefix_caching: bool) -> ServeRun:
    from tgraph.runtime.llm import LLM
    from tgraph.runtime.sampling_params import SamplingParams

    llm = LLM(model_dir, settings_overrides=list(overrides))
    try:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        llm.generate(_warm_prompts(prompts), params)  # builds and captures every graph it meets
        start = time.perf_counter()
        outputs = llm.generate([list(p) for p in prompts], params)
        seconds = time.perf_counter() - start
    finally:
        llm.close()
    tokens = sum(len(o.token_ids) for o in outputs)
    return ServeRun("offline", prefix_caching, None, len(prompts), seconds, tokens,
                    tokens / seconds)


def _warm_prompts(prompts: Sequence[list[int]]) -> list[list[int]]:
    """Prompts of the same lengths and sharing as the measured ones, other tokens: a run over
    them captures the CUDA graphs the measured run needs, and leaves nothing it could reuse."""
    return [[t - 1 for t in p] for p in prompts]  # ids are drawn from [1, vocab)


def _warm_up(url: str, prompts: Sequence[list[int]], max_tokens: int, clients: int) -> None:
    """Build and capture the server's engines as :func:`_warm_prompts` does offline."""
    replay(url, "bench", _warm_prompts(prompts), max_tokens, None, prefix_caching=False,
           clients=clients)


# ---- the benchmark -------------------------------------------------------------------------------
def run_serve_bench(preset_name: str | None = None, *, model_dir: str | Path | None = None,
                    num_requests: int = 256, rates: Sequence[float] = (4.0, 16.0),
                    system_tokens: int = 1024, user_tokens: tuple[int, int] = (32, 128),
                    max_tokens: int = 128, prefix_modes: Sequence[bool] = (True, False),
                    settings: Sequence[str] = (), json_path: str | None = None,
                    png_path: str | None = None, start_timeout: float = 600.0,
                    server_args: Sequence[str] = (), clients: int = 4) -> list[ServeRun]:
    """Run the serving benchmark and print its table.

    Args:
        preset_name: the model shape (random weights); ignored when ``model_dir`` is given.
        model_dir: an existing checkpoint directory to serve instead.
        num_requests: requests per run.
        rates: Poisson arrival rates (requests per second), besides the saturation run.
        system_tokens: the shared system prompt's length.
        user_tokens: ``(least, most)`` tokens of each user turn.
        max_tokens: tokens generated per request.
        prefix_modes: the ``llm.cache.prefix_caching`` values to measure.
        settings: extra ``KEY=VALUE`` setting overrides for the offline model and the server.
        json_path: write the runs as JSON here.
        png_path: draw throughput and TTFT here.
        start_timeout: seconds the server may take to start.
        server_args: more ``tgraph serve`` options (e.g. ``["--in-process"]``).
        clients: client processes replaying the requests.

    Returns:
        Every run, offline baselines included.
    """
    from tgraph.io.model_config import ModelConfig

    with tempfile.TemporaryDirectory(prefix="tgraph-bench-serve-") as tmp:
        if model_dir is None:
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
            model_dir = write_random_model(preset_name or DEFAULT_PRESET, Path(tmp) / "model",
                                           device)
        model_dir = Path(model_dir)
        vocab = ModelConfig.from_dict(json.loads((model_dir / "config.json").read_text()))
        prompts = make_requests(num_requests, system_tokens, user_tokens, vocab.vocab_size)
        runs: list[ServeRun] = []
        for prefix in prefix_modes:
            overrides = [*settings, f"llm.cache.prefix_caching={str(prefix).lower()}"]
            runs.append(_offline(model_dir, prompts, max_tokens, overrides, prefix))
            print(_row(runs[-1]), flush=True)
            server = _ServerProcess(model_dir, overrides, start_timeout, server_args)
            try:
                _warm_up(server.url, prompts, max_tokens, clients)
                for rate in (None, *rates):
                    runs.append(replay(server.url, "bench", prompts, max_tokens, rate,
                                       prefix_caching=prefix, clients=clients))
                    print(_row(runs[-1]), flush=True)
            finally:
                code = server.stop()
                if code != 0:
                    print(f"the server exited with {code}:\n" + "".join(server.log[-20:]))
    print_table(runs)
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"preset": preset_name or DEFAULT_PRESET, "num_requests": num_requests,
                       "system_tokens": system_tokens, "user_tokens": list(user_tokens),
                       "max_tokens": max_tokens, "runs": [asdict(r) for r in runs]}, f, indent=1)
    if png_path:
        draw_chart(runs, png_path)
    return runs


def _row(r: ServeRun) -> str:
    rate = "all" if r.rate is None else f"{r.rate:g}/s"
    ttft = r.ttft_ms or {}
    itl = r.itl_ms or {}

    def ms(d: dict[str, float], k: str) -> str:
        return f"{d[k]:9.1f}" if k in d and not math.isnan(d[k]) else f"{'-':>9}"

    return (f"{r.label:<10} {'on' if r.prefix_caching else 'off':>6} {rate:>6} "
            f"{r.throughput:10.1f} {ms(ttft, 'mean')} {ms(ttft, 'p50')} {ms(ttft, 'p99')} "
            f"{ms(itl, 'p50')} {ms(itl, 'p99')} {r.errors:>6}")


def print_table(runs: Sequence[ServeRun]) -> None:
    """The runs as a table, then the two target ratios."""
    print(f"\n{'run':<10} {'prefix':>6} {'rate':>6} {'tok/s':>10} {'TTFT mean':>9} "
          f"{'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>9} {'ITL p99':>9} {'errors':>6}")
    for r in runs:
        print(_row(r))
    for prefix in sorted({r.prefix_caching for r in runs}, reverse=True):
        offline = [r for r in runs if r.label == "offline" and r.prefix_caching == prefix]
        saturated = [r for r in runs if r.label == "saturation" and r.prefix_caching == prefix]
        if offline and saturated and offline[0].throughput > 0:
            print(f"prefix caching {'on' if prefix else 'off'}: saturated server "
                  f"{saturated[0].throughput / offline[0].throughput:.1%} of offline")
    for rate in sorted({r.rate for r in runs if r.rate is not None}):
        on = [r for r in runs if r.rate == rate and r.prefix_caching]
        off = [r for r in runs if r.rate == rate and not r.prefix_caching]
        if on and off and on[0].ttft_ms.get("mean"):
            ratio = off[0].ttft_ms["mean"] / on[0].ttft_ms["mean"]
            print(f"rate {rate:g}/s: mean TTFT {ratio:.1f}x lower with prefix caching")


def draw_chart(runs: Sequence[ServeRun], path: str) -> None:
    """Throughput and mean TTFT per run, prefix caching on vs off."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no chart")
        return
    labels = []
    for r in runs:
        if r.label != "offline" and r.prefix_caching and r.label + str(r.rate) not in labels:
            labels.append(r.label + str(r.rate))
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    width = 0.4
    for i, prefix in enumerate((True, False)):
        by = {r.label + str(r.rate): r for r in runs if r.prefix_caching == prefix}
        xs = [x + i * width for x in range(len(labels))]
        name = f"prefix caching {'on' if prefix else 'off'}"
        left.bar(xs, [by[k].throughput if k in by else 0 for k in labels], width, label=name)
        right.bar(xs, [by[k].ttft_ms.get("mean", 0) if k in by else 0 for k in labels], width,
                  label=name)
    ticks = ["all at once" if k == "saturationNone" else k.replace("poisson", "") + "/s"
             for k in labels]
    for ax, title in ((left, "output tokens/s"), (right, "mean TTFT (ms)")):
        ax.set_xticks([x + width / 2 for x in range(len(labels))], ticks)
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
