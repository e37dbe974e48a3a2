"""Running the server: uvicorn on rank 0, the engine's followers on the other ranks.

SIGTERM (or SIGINT) stops accepting connections, lets the requests in flight finish (bounded by
``drain_seconds``), then closes the model, which frees its KV cache and stops the followers.
"""
from __future__ import annotations

import contextlib
import logging
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import uvicorn

from tgraph.serve.app import ServerConfig, build_app

__all__ = ["ServerThread", "serve"]

log = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    """uvicorn's server that says where it listens once it does (``--port 0`` picks a port)."""

    def __init__(self, config: uvicorn.Config, on_ready: Callable[[str, int], None]) -> None:
        super().__init__(config)
        self._on_ready = on_ready

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """SIGINT/SIGTERM start the graceful shutdown; unlike uvicorn's own handling the signal
        is not raised again afterwards, so a drained server exits with status 0."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit)
                    for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.should_exit:  # startup failed (e.g. the port is taken)
            return
        host, port = self.servers[0].sockets[0].getsockname()[:2]
        self._on_ready(host, port)


def _announce(host: str, port: int) -> None:
    print(f"tgraph: serving on http://{host}:{port}", flush=True)


def serve(llm: Any, config: ServerConfig, host: str = "127.0.0.1", port: int = 8000, *,
          drain_seconds: float = 30.0, log_level: str = "info",
          on_ready: Callable[[str, int], None] = _announce) -> int:
    """Serve ``llm`` over HTTP until SIGINT/SIGTERM; close it afterwards.

    Under tensor parallelism rank 0 serves and every other rank follows its engine (runs the
    steps rank 0 schedules) until rank 0 closes.

    Args:
        llm: the :class:`~tgraph.runtime.llm.LLM` to serve (closed on return).
        config: what the server answers with and admits (:class:`ServerConfig`).
        host: the address to bind.
        port: the TCP port (0: any free port; ``on_ready`` is told which).
        drain_seconds: on shutdown, how long requests in flight may still run.
        log_level: uvicorn's log level (access lines at ``info``).
        on_ready: called with ``(host, port)`` once the socket listens.

    Returns:
        The exit status: 0 after a clean shutdown, 1 if the server could not start.
    """
    interval = sys.getswitchinterval()
    if config.gil_switch_interval_s is not None:
        sys.setswitchinterval(config.gil_switch_interval_s)
    try:
        if llm.rank != 0:
            llm.engine.follow()
            return 0
        if llm.world_size > 1:
            llm.engine.lead()  # rank 0 takes the requests; the others run its steps
        app = build_app(llm, config)
        server = _Server(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                        timeout_graceful_shutdown=drain_seconds,
                                        lifespan="off"), on_ready)
        server.run()
        return 0 if server.started else 1
    finally:
        sys.setswitchinterval(interval)
        llm.close()
        sys.stdout.flush()


class ServerThread:
    """The server in a background thread of this process (tests, notebooks); the caller keeps
    the model and closes it.

    ``with ServerThread(llm, config) as url: ...`` serves on a free port of 127.0.0.1 and stops
    (draining requests in flight) when the block ends.

    Args:
        llm: the :class:`~tgraph.runtime.llm.LLM` to serve.
        config: what the server answers with and admits.
        host: the address to bind.
        port: the TCP port (0: any free port).
        drain_seconds: on stop, how long requests in flight may still run.
        start_timeout: how long ``start`` waits for the socket to listen.
    """

    def __init__(self, llm: Any, config: ServerConfig, host: str = "127.0.0.1", port: int = 0,
                 *, drain_seconds: float = 10.0, start_timeout: float = 60.0) -> None:
        self._ready = threading.Event()
        self._start_timeout = start_timeout
        self.url: str | None = None
        self.app = build_app(llm, config)
        self._server = _Server(uvicorn.Config(self.app, host=host, port=port, log_level="warning",
                                              timeout_graceful_shutdown=drain_seconds,
                                              lifespan="off"), self._listening)
        self._thread = threading.Thread(target=self._server.run, name="tgraph-server",
                                        daemon=True)

    def _listening(self, host: str, port: int) -> None:
        self.url = f"http://{host}:{port}"
        self._ready.set()

    def start(self) -> str:
        """Start serving; returns the base URL (``http://host:port``).

        Raises:
            RuntimeError: the server did not listen within ``start_timeout`` seconds.
        """
        self._thread.start()
        if not self._ready.wait(self._start_timeout) or self.url is None:
            self.stop()
            raise RuntimeError(f"the server did not start within {self._start_timeout} s")
        return self.url

    def stop(self, timeout: float | None = None) -> None:
        """Stop accepting requests, let those in flight finish, and join the thread."""
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout)

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
