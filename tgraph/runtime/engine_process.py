"""An :class:`~tgraph.runtime.llm.LLM` whose engine runs in a child process, for asyncio servers.

In one process the HTTP side (parsing, JSON, one server-sent event per token per request) and
the engine's loop share one interpreter lock, so every token the server sends slows the step
that makes the next ones. :class:`EngineProcess` loads the model in a child process (spawned)
and speaks to it over a pipe: submissions and aborts go down, each step's updates of all
requests come up as one message, with the engine's stats. The parent holds the tokenizer and
the limits, so it refuses bad requests itself, at once, with the engine's own errors.

It offers what :func:`tgraph.serve.build_app` uses of an ``LLM``: ``engine`` (``submit``,
``abort``, ``stats``, ``adapter_state``), ``tokenizer``, ``encode``, ``adapters``, ``load_lora``,
``unload_lora``, ``set_single_lora``, ``rank`` and ``close``. Its streams are read with
``async for`` on one asyncio event loop, the one that first submits; the adapter calls block
until the child applied them (between two steps), so an asyncio caller runs them in a worker
thread (``asyncio.to_thread``).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import pickle
import signal
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tgraph.errors import ConfigError, InvalidRequestError
from tgraph.runtime.adapters import AdapterCommand, AdapterState
from tgraph.runtime.engine_core import (
    EngineClosedError,
    EngineStats,
    RequestFailure,
    RequestStream,
    RequestUpdate,
    UpdateQueue,
)
from tgraph.runtime.request import Request
from tgraph.runtime.sampling_params import SamplingParams
from tgraph.runtime.scheduler import check_fits

__all__ = ["EngineProcess"]

logger = logging.getLogger("tgraph.runtime")

_STOP = "stop"  # ends the child's forwarding thread
_POLL_S = 0.05  # how long an adapter call without an event loop reads the pipe at a time


@dataclass(frozen=True)
class _Ready:
    """What the child tells the parent once the model is loaded."""

    tokenizer: Any
    eos_token_ids: list[int]
    adapters: AdapterState
    max_model_len: int
    num_blocks: int
    block_size: int
    stats: EngineStats
    vocab_size: int


class EngineProcess:
    """Load ``model_dir`` in a child process and run its engine there.

    Args:
        model_dir: as for :class:`~tgraph.runtime.llm.LLM`.
        config: as for ``LLM``.
        llm_options: the other ``LLM`` keyword arguments (``max_model_len``,
            ``settings_overrides``, ``loras``...); they must pickle.

    Raises:
        whatever ``LLM(...)`` raised in the child (a bad directory, settings or adapter),
        or :class:`EngineClosedError` if the child died while loading.
    """

    rank = 0
    world_size = 1

    def __init__(self, model_dir: str | Path, config: Any = None, **llm_options: Any) -> None:
        context = multiprocessing.get_context("spawn")  # CUDA cannot be forked
        self._conn, child = context.Pipe()
        self._process = context.Process(target=_child_main, name="tgraph-engine", daemon=True,
                                        args=(child, str(model_dir), config, llm_options))
        self._process.start()
        child.close()
        try:
            kind, payload = self._conn.recv()
        except (EOFError, OSError):
            self._process.join()
            raise EngineClosedError(f"the engine process exited with code "
                                    f"{self._process.exitcode} while loading the model") from None
        if kind == "failed":
            self._process.join()
            raise payload
        ready: _Ready = payload
        self.tokenizer = ready.tokenizer
        self.engine = _RemoteEngine(self._conn, ready, self._process)

    @property
    def adapters(self) -> list[str]:
        """The per-request LoRA adapters loaded, sorted (as :attr:`LLM.adapters
        <tgraph.runtime.llm.LLM.adapters>`)."""
        return self.engine.adapter_state.names

    @property
    def single_lora(self) -> str | None:
        """The directory of the adapter applied to every request (None: none)."""
        return self.engine.adapter_state.single_lora

    def load_lora(self, name: str, path: str | Path, *, replace: bool = True) -> None:
        """As :meth:`LLM.load_lora <tgraph.runtime.llm.LLM.load_lora>`, in the child; returns
        once it applied it (call it off the event loop that reads the streams)."""
        self.engine.apply_adapters(AdapterCommand.load(name, path, replace))

    def unload_lora(self, name: str) -> None:
        """As :meth:`LLM.unload_lora <tgraph.runtime.llm.LLM.unload_lora>`, in the child."""
        self.engine.apply_adapters(AdapterCommand.unload(name))

    def set_single_lora(self, path: str | Path | None) -> None:
        """As :meth:`LLM.set_single_lora <tgraph.runtime.llm.LLM.set_single_lora>`, in the
        child."""
        self.engine.apply_adapters(AdapterCommand.single(path))

    def encode(self, prompt: str | Sequence[int], chat: bool = False) -> list[int]:
        """Token ids of a prompt, as :meth:`LLM.encode <tgraph.runtime.llm.LLM.encode>`."""
        from tgraph.runtime.llm import encode_prompt

        return encode_prompt(self.tokenizer, prompt, chat)

    def close(self, timeout: float = 60.0) -> None:
        """Close the engine (requests in flight end with :class:`EngineClosedError`) and wait
        for the child to exit, freeing its GPU memory. Idempotent."""
        self.engine._shut(timeout)
        self._process.join(timeout)
        if self._process.is_alive():
            logger.warning("the engine process did not exit within %s s; terminating it", timeout)
            self._process.terminate()
            self._process.join()


class _RemoteEngine:
    """The parent's side of the pipe: the engine's submit/abort/stats, and the reader that
    hands each update to its request's stream."""

    def __init__(self, conn: Any, ready: _Ready, process: Any) -> None:
        self._conn = conn
        self._ready = ready
        self._process = process
        self._stats = ready.stats
        self._sinks: dict[str, UpdateQueue] = {}
        self._send_lock = threading.Lock()
        self._recv_lock = threading.Lock()  # the event loop's reader, or an adapter call's
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self._adapters = ready.adapters
        self._replies: dict[int, Future] = {}  # adapter commands sent, by token
        self._tokens = itertools.count()

    @property
    def closed(self) -> bool:
        """Whether the engine was closed or its process is gone."""
        return self._closed or not self._process.is_alive()

    # ---- the engine's interface ----------------------------------------------------------------
    def submit(self, prompt_token_ids: Sequence[int], params: SamplingParams | None = None,
               request_id: str | None = None) -> RequestStream:
        """Queue one request (see :meth:`EngineCore.submit
        <tgraph.runtime.engine_core.EngineCore.submit>`); call it from the event loop that
        reads the streams. Bad requests are refused here, before anything is sent."""
        if self.closed:
            raise EngineClosedError("the engine is closed (or its process is gone)")
        self._attach()
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        if request_id is None:
            raise ValueError("an engine in another process needs explicit request ids")
        if request_id in self._sinks:
            raise ValueError(f"request id(s) {[request_id]} are already in use")
        r = self._ready
        request = Request.from_sampling_params(request_id, list(prompt_token_ids), params,
                                               r.eos_token_ids)
        check_fits(request, r.max_model_len, r.num_blocks, r.block_size)
        if params.lora is not None and params.lora not in self._adapters.loras:
            raise ValueError(f"request {request_id!r}: LoRA adapter {params.lora!r} is not "
                             f"loaded; loaded: {self._adapters.names}")
        named = [t for t in params.token_ids_named() if t >= r.vocab_size]
        if named:
            raise InvalidRequestError(
                f"request {request_id!r}: SamplingParams.logit_bias / allowed_token_ids holds "
                f"token id(s) {named[:8]}; expected ids below the vocabulary size {r.vocab_size}")
        if params.allowed_token_ids_fn is not None:
            raise InvalidRequestError(
                f"request {request_id!r}: SamplingParams.allowed_token_ids_fn cannot be sent to "
                "an engine in another process; give allowed_token_ids, or use an in-process LLM")
        sink = UpdateQueue()
        self._sinks[request_id] = sink
        stream = RequestStream(self, [request], sink, self)
        self._send(("submit", request_id, request.prompt_token_ids, params))
        return stream

    def abort(self, request_id: str) -> None:
        """Abort a request (ignored when unknown or finished)."""
        if request_id in self._sinks and not self.closed:
            self._send(("abort", request_id))

    post_abort = abort  # what a dropped stream's finalizer calls

    def stats(self) -> EngineStats:
        """The engine's stats as of its last reported step (any thread may ask)."""
        return self._stats

    @property
    def adapter_state(self) -> AdapterState:
        """The LoRA adapters served, as of the last adapter command."""
        return self._adapters

    def apply_adapters(self, command: AdapterCommand) -> AdapterState:
        """Have the child apply ``command`` (see :meth:`EngineCore.apply_adapters
        <tgraph.runtime.engine_core.EngineCore.apply_adapters>`) and wait for it. From any
        thread but the event loop's that reads the streams.

        An adapter being unloaded is refused to new submissions at once (and served again if
        the child refuses to unload it).
        """
        if self.closed:
            raise EngineClosedError("the engine is closed (or its process is gone)")
        command.check()
        if self._loop is not None and _running_loop() is self._loop:
            raise ConfigError("adapter calls on an engine in another process wait for the "
                              "child; run them off the event loop (asyncio.to_thread)")
        future: Future = Future()
        token = next(self._tokens)
        self._replies[token] = future
        hidden = None  # (name, path) of the adapter being unloaded
        if command.kind == "unload" and command.name in self._adapters.loras:
            hidden = (command.name, self._adapters.loras[command.name])
            self._adapters = _with(self._adapters, drop=command.name)
        try:
            self._send(("adapter", token, command))
            while not future.done() and self._unread() and not self._closed:
                self._read_here()
            return future.result()
        except BaseException:
            if hidden is not None and not self._closed:
                self._adapters = _with(self._adapters, add=hidden)
            raise
        finally:
            self._replies.pop(token, None)

    def _unread(self) -> bool:
        """Whether no event loop reads the pipe (none attached, or its loop has closed)."""
        return self._loop is None or self._loop.is_closed()

    def _read_here(self) -> None:
        """Read the pipe in this thread for a moment (while no event loop reads it)."""
        with self._recv_lock:
            if not self._unread():
                return
            self._loop = None  # a closed loop reads nothing; the next submission attaches anew
            try:
                if self._conn.poll(_POLL_S):
                    self._dispatch(self._conn.recv())
            except (EOFError, OSError):
                self._lost()

    # ---- the pipe ------------------------------------------------------------------------------
    def _send(self, message: tuple) -> None:
        try:
            with self._send_lock:
                self._conn.send(message)
        except (OSError, EOFError, BrokenPipeError):
            self._lost()
            raise EngineClosedError("the engine process is gone") from None

    def _attach(self) -> None:
        """Read the pipe from the running event loop (the first one that asks, or the next
        once that one has closed)."""
        if (self._loop is not None and not self._loop.is_closed()) or self.closed:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            raise ConfigError("an engine in another process is used from an asyncio event "
                              "loop") from None
        loop.add_reader(self._conn.fileno(), self._read)
        self._loop = loop

    def _read(self) -> None:
        try:
            with self._recv_lock:
                while self._conn.poll():
                    self._dispatch(self._conn.recv())
        except (EOFError, OSError):
            self._lost()

    def _dispatch(self, message: tuple) -> None:
        kind = message[0]
        if kind == "updates":
            _, items, self._stats = message
            for item in items:
                sink = self._sinks.get(item.request_id)
                if sink is None:
                    continue
                if isinstance(item, RequestFailure) or item.finish_reason is not None:
                    del self._sinks[item.request_id]
                sink.put(item)
        elif kind == "adapter":
            _, token, state, error = message
            if error is None:
                self._adapters = state
            future = self._replies.get(token)
            if future is not None and not future.done():
                if error is None:
                    future.set_result(state)
                else:
                    future.set_exception(error)
        elif kind == "closed":
            self._lost("the engine was closed before the request finished")

    def _detach(self) -> None:
        """Stop reading the pipe from the event loop (a closed loop or pipe: nothing to undo)."""
        if self._loop is not None:
            try:
                self._loop.remove_reader(self._conn.fileno())
            except (OSError, ValueError, RuntimeError):
                pass
            self._loop = None

    def _lost(self, why: str = "the engine process exited") -> None:
        """Fail every open request: nothing more will come."""
        self._detach()
        self._closed = True
        sinks, self._sinks = self._sinks, {}
        for rid, sink in sinks.items():
            sink.put(RequestFailure(rid, EngineClosedError(why)))
        for future in list(self._replies.values()):
            if not future.done():
                future.set_exception(EngineClosedError(why))

    def _shut(self, timeout: float) -> None:
        """Ask the child to close and read what it still sends until it has."""
        if self._closed:
            return
        self._detach()
        try:
            with self._send_lock:
                self._conn.send(("close",))
            while self._conn.poll(timeout):
                message = self._conn.recv()
                self._dispatch(message)
                if message[0] == "closed":
                    break
        except (EOFError, OSError):
            pass
        self._lost("the engine was closed before the request finished")


# ---- the child -----------------------------------------------------------------------------------
def _child_main(conn: Any, model_dir: str, config: Any, options: dict[str, Any]) -> None:
    """Load the model, then serve the parent's messages until it says close (or goes away)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the group; the parent drains
    from tgraph.runtime.llm import LLM

    try:
        llm = LLM(model_dir, config, **options)
    except BaseException as err:  # told to the parent, which raises it
        conn.send(("failed", _portable(err)))
        conn.close()
        return
    engine = llm.engine
    scheduler = engine.scheduler
    allocator = scheduler.allocator
    conn.send(("ready", _Ready(llm.tokenizer, list(llm.eos_token_ids), engine.adapter_state,
                               scheduler.max_model_len, allocator.num_blocks,
                               allocator.block_size, engine.stats(),
                               llm.model.config.vocab_size)))
    sink = UpdateQueue()  # every request's updates, in the order the loop produced them
    send_lock = threading.Lock()
    forwarder = threading.Thread(target=_forward, args=(conn, sink, engine, send_lock),
                                 name="tgraph-engine-forwarder", daemon=True)
    forwarder.start()
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the parent is gone
            break
        kind = message[0]
        if kind == "submit":
            _, rid, prompt, params = message
            try:
                engine.submit_to(sink, prompt, params, rid)
            except Exception as err:
                sink.put(RequestFailure(rid, _portable(err)))
        elif kind == "abort":
            engine.abort(message[1])
        elif kind == "adapter":
            # applied between two steps: waited for off this thread, which keeps reading
            threading.Thread(target=_adapt, args=(conn, engine, send_lock, *message[1:]),
                             name="tgraph-engine-adapter", daemon=True).start()
        elif kind == "close":
            break
    llm.close()  # fails what is still in flight, into the sink
    sink.put(_STOP)  # type: ignore[arg-type]
    forwarder.join()
    try:
        with send_lock:
            conn.send(("closed",))
        conn.close()
    except (OSError, EOFError):
        pass


def _forward(conn: Any, sink: UpdateQueue, engine: Any, send_lock: threading.Lock) -> None:
    """Send what the loop put in ``sink``, everything queued at once, with the stats."""
    while True:
        items: list[RequestUpdate | RequestFailure] = [sink.get()]
        while (item := sink.get_nowait()) is not None:
            items.append(item)
        stop = _STOP in items
        items = [i for i in items if i is not _STOP]
        for i, item in enumerate(items):
            if isinstance(item, RequestFailure):
                items[i] = RequestFailure(item.request_id, _portable(item.error))
        try:
            stats = engine.stats()
            with send_lock:
                conn.send(("updates", items, stats))
        except (OSError, EOFError):  # the parent is gone
            return
        if stop:
            return


def _adapt(conn: Any, engine: Any, send_lock: threading.Lock, token: int,
           command: AdapterCommand) -> None:
    """Apply one adapter command and send the outcome back."""
    try:
        reply = ("adapter", token, engine.apply_adapters(command), None)
    except Exception as err:
        reply = ("adapter", token, None, _portable(err))
    try:
        with send_lock:
            conn.send(reply)
    except (OSError, EOFError):  # the parent is gone, or the engine closed meanwhile
        pass


def _with(state: AdapterState, drop: str | None = None,
          add: tuple[str, str] | None = None) -> AdapterState:
    """``state`` without adapter ``drop`` / with ``add`` (name, path)."""
    loras = {n: p for n, p in state.loras.items() if n != drop}
    if add is not None:
        loras[add[0]] = add[1]
    return AdapterState(loras, state.single_lora)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _portable(err: BaseException) -> BaseException:
    """``err`` if it pickles, else a RuntimeError with its text."""
    try:
        pickle.loads(pickle.dumps(err))
        return err
    except Exception:
        return RuntimeError(f"{type(err).__name__}: {err}")
