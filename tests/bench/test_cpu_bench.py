"""``tgraph bench cpu`` at a tiny shape: its code runs end to end without a GPU and reports every
system at every batch (no timing is asserted: the numbers are the machine's)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as Q

from tests.io.test_gguf import VOCAB, demo_vocab, write_gguf
from tgraph.bench.__main__ import main
from tgraph.testing import random_hf_model

pytestmark = pytest.mark.filterwarnings("ignore")


def test_cpu_bench_reports_every_system(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TGRAPH_CACHE_DIR", str(tmp_path / "cache"))  # its fp32 checkpoint
    hf = random_hf_model("llama", seed=3, vocab_size=VOCAB, tie_word_embeddings=True)
    path = write_gguf(tmp_path / "tiny.gguf", hf, demo_vocab(tmp_path / "tok"),
                      lambda n, s: Q.Q8_0 if "embed" in n else Q.Q4_1)
    out = tmp_path / "cpu.json"
    assert main(["cpu", "--gguf", str(path), "--batches", "1", "2", "--max-tokens", "3",
                 "--threads", "1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["threads"] == 1 and report["max_tokens"] == 3
    rows = {(r["system"], r["batch"]): r for r in report["results"]}
    systems = ("tgraph fp32", "tgraph quantized", "transformers fp32")
    assert set(rows) == {(s, b) for s in systems for b in (1, 2)}
    for (system, _), row in rows.items():
        assert row["tokens"] == 4 * 3 and row["tokens_per_s"] > 0
        if system == "tgraph fp32":  # the very weights transformers runs, in fp32
            assert row["tokens_equal_transformers"] == "4/4"
    assert "tgraph quantized b2 / transformers b1" in report["ratios"]
