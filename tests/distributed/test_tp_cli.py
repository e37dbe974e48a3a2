"""``tgraph generate`` under torchrun: 2 gloo ranks on CPU, each launch bounded by a timeout that
kills the whole job.

stdout is exactly world size 1's text (so only rank 0 printed); a rank that raises or hangs ends
the job nonzero within a bounded time, naming the error.
"""
from __future__ import annotations

from pathlib import Path

from tests.distributed.launch import finish, run_torchrun, start_torchrun

LAUNCH_TIMEOUT_S = 120.0  # a launch takes 10-25 s on 2 CPU cores; a hang fails here instead
FAILURE_BOUND_S = 60.0  # a failed rank must end the job well before the launch timeout
CLI_PROMPT = "The river began"
MAX_TOKENS = 4


def _generate_cmd(model_dir: Path, *extra: str) -> list[str]:
    return ["-m", "tgraph", "generate", "--model", str(model_dir), "--prompt", CLI_PROMPT,
            "--max-tokens", str(MAX_TOKENS), "--no-chat", "--ignore-eos", "--max-model-len", "64",
            "--set", "llm.model.device=cpu", "--set", "llm.cache.num_blocks=32",
            "--set", "llm.cache.block_size=4", *extra]


def test_cli_generate_under_torchrun(tp_model_dir: Path) -> None:
    from tgraph.runtime.llm import LLM
    from tgraph.runtime.sampling_params import SamplingParams

    launch = run_torchrun(_generate_cmd(tp_model_dir, "--dist-timeout", "60"), LAUNCH_TIMEOUT_S)
    assert launch.rc == 0, launch.output[-6000:]
    llm = LLM(tp_model_dir, device="cpu", max_model_len=64, num_blocks=32, block_size=4)
    (ref,) = llm.generate(CLI_PROMPT, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                     ignore_eos=True))
    # Exactly world size 1's text, once: rank 1's stdout is suppressed.
    assert ref.text and launch.stdout == ref.text
    assert launch.stderr.count("[4 tokens") == 1 and "finish: length" in launch.stderr
    assert "error" not in launch.stderr.lower()


_MODULE_MAP = """\
import os
import time

if os.environ.get("RANK") == "1":
    if {hang!r}:
        time.sleep(600)  # stuck, not dead: only the timeout can end rank 0's wait
    raise RuntimeError("injected failure on rank 1")
"""


def test_cli_failure_on_one_rank_ends_the_job(tp_model_dir: Path, tmp_path: Path) -> None:
    """Rank 1 fails while loading (raises, or hangs: stuck, not dead); rank 0 then waits for it
    in the config check. Both launches run at once (they mostly wait)."""
    jobs = {}
    for how in ("raise", "hang"):
        module_map = tmp_path / f"module_map_{how}.py"
        module_map.write_text(_MODULE_MAP.format(hang=how == "hang"))
        jobs[how] = start_torchrun(_generate_cmd(tp_model_dir, "--module-map", str(module_map),
                                                 "--dist-timeout", "3"))
    launches = {how: finish(job, LAUNCH_TIMEOUT_S) for how, job in jobs.items()}
    for how, launch in launches.items():
        assert launch.rc != 0, f"{how}: {launch.output[-6000:]}"
        assert launch.seconds < FAILURE_BOUND_S, f"{how}: took {launch.seconds:.0f} s"
        assert launch.stdout == "", f"{how}: no rank may print a generation"
    assert "tgraph: error: [rank 1 of 2] RuntimeError: injected failure on rank 1" \
        in launches["raise"].stderr
    # Rank 0 gave up after the 3 s process-group timeout and said so.
    hang = launches["hang"].stderr
    assert "tgraph: error: [rank 0 of 2]" in hang and "another rank" in hang
    assert "injected failure" not in hang
