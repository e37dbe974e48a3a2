"""Tests of the ``tgraph`` command line, run in-process through :func:`tgraph.cli.main`."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tgraph.cli import main
from tgraph.testing import make_tiny_text_model

# The demo tokenizer has 768 tokens: the model's vocabulary must cover it.


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama checkpoint with the demo tokenizer saved in it."""
    return make_tiny_text_model(tmp_path_factory.mktemp("cli-llama"), seed=2)


def test_demo_tokens_agree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                           capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("TGRAPH_CACHE_DIR", str(tmp_path))
    assert main(["demo", "--random-model", "--max-tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert "tokens agree for 4/4" in out
    assert "DIFFER" not in out
    # The demo model was built under the cache dir, not in the user's home.
    assert (tmp_path / "demo-llama" / "config.json").is_file()


def test_check_model_ok(model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check-model", str(model_dir)]) == 0
    out = capsys.readouterr().out
    assert "model_type: llama" in out
    assert out.rstrip().endswith("OK")


def test_check_model_unknown_type(model_dir: Path, tmp_path: Path,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(model_dir, bad)
    config = json.loads((bad / "config.json").read_text())
    config["model_type"] = "not_a_model"
    config.pop("architectures", None)
    (bad / "config.json").write_text(json.dumps(config))
    assert main(["check-model", str(bad)]) != 0
    out = capsys.readouterr().out
    assert "not_a_model" in out
    for family in ("llama", "qwen2", "qwen3", "mistral"):  # the supported types are listed
        assert family in out
    assert "FAILED" in out


def test_check_model_missing_weight(model_dir: Path, tmp_path: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    """A checkpoint whose weights are not the config's shapes fails the check."""
    bad = tmp_path / "bad"
    shutil.copytree(model_dir, bad)
    config = json.loads((bad / "config.json").read_text())
    config["num_hidden_layers"] += 1  # the checkpoint lacks the last layer
    (bad / "config.json").write_text(json.dumps(config))
    assert main(["check-model", str(bad)]) != 0
    assert "FAILED" in capsys.readouterr().out


def test_generate_eager(model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tgraph.runtime.llm import LLM
    from tgraph.runtime.sampling_params import SamplingParams

    prompt = "The river began"
    rc = main(["generate", "--model", str(model_dir), "--prompt", prompt, "--max-tokens", "4",
               "--no-chat", "--graph", "eager", "--ignore-eos", "--max-model-len", "64",
               "--set", "llm.cache.num_blocks=32", "--set", "llm.cache.block_size=4"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    # The streamed text is the greedy output of the same model through the Python API.
    llm = LLM(model_dir, device="cpu", graph="eager", max_model_len=64, num_blocks=32,
              block_size=4)
    ref = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))[0]
    assert len(ref.token_ids) == 4
    # stdout is exactly the generated text; the summary goes to stderr.
    assert ref.text and captured.out == ref.text
    assert "[4 tokens" in captured.err and "finish: length" in captured.err


def test_generate_several_prompts(model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["generate", "--model", str(model_dir), "--prompt", "A computer", "--prompt",
               "The old library", "--max-tokens", "3", "--graph", "eager", "--ignore-eos",
               "--max-model-len", "64", "--set", "llm.cache.num_blocks=32"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "### A computer" in out and "### The old library" in out
    assert out.count("[3 tokens, finish: length]") == 2


def test_bad_setting_value(model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["generate", "--model", str(model_dir), "--prompt", "hi", "--max-tokens", "2",
               "--set", "llm.cache.num_blocks=abc"])
    err = capsys.readouterr().err
    assert rc != 0
    assert "llm.cache.num_blocks" in err and "abc" in err


def test_bad_setting_syntax(model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["generate", "--model", str(model_dir), "--prompt", "hi", "--set", "no_equals"])
    assert rc != 0
    assert "no_equals" in capsys.readouterr().err


def test_unknown_command_exits_with_usage(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["frobnicate"])
    assert info.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_generate_profile_and_dump(model_dir: Path, tmp_path: Path,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    import json

    trace, dump = tmp_path / "trace.json", tmp_path / "dump"
    rc = main(["generate", "--model", str(model_dir), "--prompt", "hi", "--max-tokens", "3",
               "--no-chat", "--profile", str(trace), "--dump-tensors", str(dump)])
    assert rc == 0
    names = {str(e.get("name", "")) for e in json.loads(trace.read_text())["traceEvents"]}
    # each step a named range (the CPU's native kernels are no torch ops), with torch ops inside
    assert {"tgraph.prefill", "tgraph.decode"} <= names and any(n.startswith("aten::")
                                                                for n in names)
    assert sorted(p.suffix for p in dump.iterdir()) == [".json", ".json", ".safetensors",
                                                        ".safetensors"]


def test_bench_subcommand_refuses_clearly_without_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this checks the message shown without CUDA")
    assert main(["bench", "models", "--presets", "llama-3.2-1b"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err


def test_generate_under_single_rank_torchrun(model_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """``torchrun --nproc-per-node 1`` is a plain run: no process group, normal output."""
    for name, value in {"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(name, value)
    rc = main(["generate", "--model", str(model_dir), "--prompt", "hi", "--max-tokens", "2",
               "--no-chat", "--graph", "eager", "--ignore-eos", "--max-model-len", "64",
               "--set", "llm.cache.num_blocks=32"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert captured.out and "[2 tokens" in captured.err


def test_generate_refuses_an_incomplete_torchrun_env(model_dir: Path,
                                                     monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """Two ranks announced but no rendezvous address: a clear error naming the rank, no hang."""
    from tgraph.nn import distributed

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    for name in ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    rc = main(["generate", "--model", str(model_dir), "--prompt", "hi", "--max-tokens", "2",
               "--set", "llm.model.device=cpu", "--dist-timeout", "5"])
    captured = capsys.readouterr()
    assert rc == 2 and captured.out == ""
    assert "tgraph: error: [rank 0 of 2] environment variable MASTER_PORT is not set" \
        in captured.err
    assert not distributed.is_initialized()
