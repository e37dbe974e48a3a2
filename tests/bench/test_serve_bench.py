"""A CPU smoke run of ``tgraph bench serve`` (tgraph.bench.serve) on a tiny model: both prefix
caching settings, the offline baseline, a saturation and a Poisson run, and the JSON it writes.
The numbers themselves are a GPU matter (docs/performance.md); here every request must finish
with all its tokens."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from tgraph.bench.serve import make_requests, run_serve_bench
from tgraph.testing import make_tiny_hf_model

CPU = ["llm.model.device=cpu", "llm.model.dtype=float32", "llm.engine.graph=eager",
       "llm.cache.block_size=4", "llm.cache.num_blocks=64"]


def test_requests_share_the_system_prompt() -> None:
    prompts = make_requests(5, 16, (2, 6), 100, seed=3)
    assert len(prompts) == 5 and all(p[:16] == prompts[0][:16] for p in prompts)
    assert all(18 <= len(p) <= 22 and all(0 < t < 100 for t in p) for p in prompts)
    assert make_requests(5, 16, (2, 6), 100, seed=3) == prompts


def test_serve_bench_smoke(tmp_path: Path) -> None:
    model = make_tiny_hf_model("llama", tmp_path / "model", seed=0)
    out = tmp_path / "serve.json"
    runs = run_serve_bench(model_dir=model, num_requests=4, rates=[50.0], system_tokens=8,
                           user_tokens=(2, 4), max_tokens=3, settings=CPU, json_path=str(out),
                           start_timeout=180.0, clients=2)
    assert [(r.label, r.prefix_caching) for r in runs] == [
        ("offline", True), ("saturation", True), ("poisson", True),
        ("offline", False), ("saturation", False), ("poisson", False)]
    for r in runs:
        assert r.errors == 0 and r.output_tokens == 4 * 3 and r.throughput > 0, r
    streamed = runs[1:3] + runs[4:]
    for r in streamed:
        # A gap may be 0: tokens the engine wrote while the client was busy arrive in one chunk.
        assert 0 < r.ttft_ms["p50"] <= r.ttft_ms["p99"], r
        assert 0 <= r.itl_ms["p50"] <= r.itl_ms["p99"], r
    assert any(r.itl_ms["p99"] > 0 for r in streamed), "no inter-token gap was measured"
    data = json.loads(out.read_text())
    assert len(data["runs"]) == 6 and data["max_tokens"] == 3
