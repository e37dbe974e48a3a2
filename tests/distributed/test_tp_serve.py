"""``tgraph serve`` under torchrun (2 gloo ranks on CPU): rank 0 serves, rank 1 follows its
engine; completions equal a single process's greedy tokens, and SIGTERM to rank 0 drains, closes
and ends rank 1 too, every process exiting 0."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import urllib.request
from pathlib import Path

from tests.distributed.launch import finish, server_url, start_torchrun
from tests.distributed.llm_worker import LLM_OPTIONS, MAX_TOKENS, PROMPT_LISTS

START_TIMEOUT_S = 120.0
SETTINGS = [f"--set=llm.model.device={LLM_OPTIONS['device']}",
            f"--set=llm.cache.num_blocks={LLM_OPTIONS['num_blocks']}",
            f"--set=llm.cache.block_size={LLM_OPTIONS['block_size']}",
            f"--max-model-len={LLM_OPTIONS['max_model_len']}"]


def _rank0_pid(torchrun_pid: int) -> int:
    """The worker of torchrun whose environment says RANK=0."""
    children = subprocess.run(["pgrep", "-P", str(torchrun_pid)], capture_output=True,
                              text=True).stdout.split()
    for pid in children:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        if b"RANK=0" in environ:
            return int(pid)
    raise AssertionError(f"no rank 0 among torchrun's children {children}")


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def test_rank0_serves_and_rank1_follows(tp_ids_model_dir: Path) -> None:
    from tgraph.runtime.llm import LLM
    from tgraph.runtime.sampling_params import SamplingParams

    ref = LLM(tp_ids_model_dir, graph="static", **LLM_OPTIONS)
    expected = [o.token_ids for o in ref.generate(
        PROMPT_LISTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))]
    ref.close()

    job = start_torchrun(["-m", "tgraph", "serve", "--model", str(tp_ids_model_dir),
                          "--port", "0", "--served-model-name", "tp", "--log-level", "warning",
                          *SETTINGS])
    url = server_url(job, START_TIMEOUT_S)
    got = [_post(url, {"model": "tp", "prompt": p, "max_tokens": MAX_TOKENS,
                       "temperature": 0.0, "ignore_eos": True, "return_token_ids": True})
           for p in PROMPT_LISTS]
    assert [g["choices"][0]["token_ids"] for g in got] == expected
    os.kill(_rank0_pid(job.proc.pid), signal.SIGTERM)
    job.proc.stdout = None  # the reader thread owns it
    launch = finish(job, START_TIMEOUT_S)
    assert launch.rc == 0, launch.stderr[-4000:]
