"""Every tgraph error in the CLI ends the command with one clean line on stderr and exit code 2
(no traceback), and bad options are refused before the model loads."""
from __future__ import annotations

from pathlib import Path

import pytest

from tgraph.cli import main
from tgraph.testing import make_tiny_hf_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_hf_model("llama", tmp_path_factory.mktemp("cli-errors"), seed=0)


@pytest.fixture
def no_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model was loaded before the bad option was refused")

    monkeypatch.setattr("tgraph.runtime.llm.LLM.__init__", refuse)


def _one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("tgraph: error: ") and "Traceback" not in err
    return lines[0]


@pytest.mark.parametrize(("options", "words"), [
    (["--max-tokens", "0"], ["SamplingParams.max_tokens", "0", ">= 1"]),
    (["--temperature", "nan"], ["SamplingParams.temperature", "nan", "finite"]),
    (["--top-p", "0"], ["SamplingParams.top_p", "0", "(0, 1]"]),
    (["--seed", str(2**64)], ["SamplingParams.seed", str(2**64)]),
    (["--use-lora", "nope"], ["--use-lora 'nope'", "expected one of []"]),
    (["--lora", "broken"], ["--lora expects NAME=DIR", "'broken'"]),
])
def test_generate_bad_option_exits_2(model_dir: Path, no_weights: None, options: list[str],
                                     words: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["generate", "--model", str(model_dir), "--prompt", "hi", *options])
    line = _one_error_line(capsys.readouterr().err)
    assert rc == 2
    for word in words:
        assert word in line


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_model_file_instead_of_directory_exits_2(model_dir: Path, command: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    args = [command, "--model", str(model_dir / "model.safetensors")]
    rc = main(args + (["--prompt", "hi"] if command == "generate" else []))
    line = _one_error_line(capsys.readouterr().err)
    assert rc == 2
    assert "is a file, not a model directory" in line


def test_generate_max_model_len_zero_exits_2(model_dir: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["generate", "--model", str(model_dir), "--prompt", "hi", "--max-model-len", "0"])
    line = _one_error_line(capsys.readouterr().err)
    assert rc == 2 and "max_model_len must be" in line and "got 0" in line


def test_serve_bad_server_option_exits_2(model_dir: Path, no_weights: None,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["serve", "--model", str(model_dir), "--gil-switch-interval", "0", "--in-process"])
    line = _one_error_line(capsys.readouterr().err)
    assert rc == 2 and "gil_switch_interval_s must be > 0" in line
