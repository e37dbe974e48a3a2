"""Launching 2-process torchrun jobs from tests: a free port, a bounded wait, the whole session
killed on timeout (so a hung rank fails the test instead of hanging the suite)."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_env(**extra: str) -> dict[str, str]:
    """This environment (TRITON_INTERPRET included) with the repository importable and one
    thread per rank (2 ranks share 2 cores)."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path, **extra)


def torchrun_cmd(target: list[str], nproc: int = 2) -> list[str]:
    """``python -m torch.distributed.run`` on one node, no restarts, a free local port.

    Args:
        target: what torchrun runs: a script and its args, or ``["-m", module, ...]``.
        nproc: ranks.
    """
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
            "--nproc-per-node", str(nproc), "--max-restarts", "0",
            "--master-addr", "127.0.0.1", "--master-port", str(free_port()), *target]


@dataclass
class Launch:
    rc: int
    stdout: str
    stderr: str
    seconds: float

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


@dataclass
class Running:
    """A started torchrun job (see :func:`start_torchrun`)."""

    proc: subprocess.Popen
    start: float


def start_torchrun(target: list[str], nproc: int = 2, **env: str) -> Running:
    """Start a torchrun job in its own session, stdout and stderr piped.

    Args:
        target: see :func:`torchrun_cmd`.
        nproc: ranks.
        env: extra environment variables.
    """
    proc = subprocess.Popen(torchrun_cmd(target, nproc), cwd=REPO, env=torchrun_env(**env),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    return Running(proc, time.monotonic())


def finish(job: Running, timeout: float) -> Launch:
    """Wait for a started job; on timeout kill its session and fail with its output.

    Returns:
        the exit status, stdout, stderr and wall time since the start.
    """
    try:
        stdout, stderr = job.proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(job.proc.pid, signal.SIGKILL)
        stdout, stderr = job.proc.communicate()
        pytest.fail(f"torchrun did not finish within {timeout:.0f} s (hang?); stdout:\n"
                    f"{stdout[-3000:]}\nstderr:\n{stderr[-6000:]}")
    return Launch(job.proc.returncode, stdout, stderr, time.monotonic() - job.start)


def run_torchrun(target: list[str], timeout: float, nproc: int = 2, **env: str) -> Launch:
    """Run a torchrun job to the end (:func:`start_torchrun`, then :func:`finish`)."""
    return finish(start_torchrun(target, nproc, **env), timeout)


def server_url(job: Running, timeout: float) -> str:
    """The URL a ``tgraph serve`` job prints ("tgraph: serving on URL"), read from its stdout by
    a thread that keeps draining it; on timeout or exit the job is killed and the test fails with
    its output. Afterwards the job's stdout belongs to that thread (``finish`` skips it)."""
    url: list[str] = []
    lines: list[str] = []

    def read() -> None:
        for line in job.proc.stdout:
            lines.append(line)
            if line.startswith("tgraph: serving on "):
                url.append(line.split()[-1])

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + timeout
    while not url and time.monotonic() < deadline and job.proc.poll() is None:
        time.sleep(0.1)
    if not url:
        os.killpg(job.proc.pid, signal.SIGKILL)
        pytest.fail("the server did not start:\n" + "".join(lines) + job.proc.stderr.read())
    return url[0]
