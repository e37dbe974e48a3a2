"""The engine core: one thread owns the scheduler and the model; callers submit and read queues.

``EngineCore.submit`` checks a request, puts it in a thread-safe inbox and returns a
:class:`RequestStream` that reads the request's own output queue. One loop thread per engine,
started by the first submission and parked while nothing is pending, drains the inbox (new
requests, aborts, calls such as loading an adapter), runs a scheduler step on the model and
pushes each request's new tokens to its queue. Nothing else touches the scheduler or the model,
so any number of threads, streams and asyncio tasks can share one engine, and each request gets
the tokens it would get alone (greedy, or seeded sampling). A failing step ends only the requests
of that step: their streams raise the error and the loop goes on.

Tensor parallelism: every rank runs an engine on its shard of the model. Before each step the
ranks agree on what to apply (new requests and aborts), so their schedulers take identical
steps. Either every rank submits the same requests in the same order (SPMD: the way a script
calls ``LLM.generate`` on every rank; a submission returns once every rank made it, and a request
any rank rejects is rejected on every rank), or rank 0 leads (:meth:`EngineCore.lead`) and the
other ranks follow it (:meth:`EngineCore.follow`): they run rank 0's requests and steps until
rank 0 closes (the server). An abort on any rank aborts the request on every rank.

Adapter commands (:meth:`EngineCore.apply_adapters`: load or unload a LoRA adapter, set the
single one) queue with the submissions and are agreed like them, so every rank applies a command
at the same step, between the same two steps (see :mod:`tgraph.runtime.adapters`).
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import itertools
import json
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, NoReturn

import torch

from tgraph.errors import (
    ConfigError,
    InvalidRequestError,
    InvalidRequestTypeError,
    RequestTooLongError,
    TGraphError,
)
from tgraph.nn import distributed
from tgraph.runtime.adapters import AdapterCommand, AdapterManager, AdapterState, shared_error
from tgraph.runtime.outputs import RequestOutput, StreamEvent
from tgraph.runtime.request import FinishReason, Request
from tgraph.runtime.runner import ModelRunner, RankFailedError, synchronize, use_device
from tgraph.runtime.sampler import TokenLogprobs
from tgraph.runtime.sampling_params import SamplingParams
from tgraph.runtime.scheduler import Scheduler, SchedulerError, SchedulerOutput, SchedulerStats
from tgraph.runtime.stop import StopChecker

__all__ = ["BatchStream", "EngineClosedError", "EngineCore", "EngineStats", "RequestFailure",
           "RequestStream", "RequestUpdate", "UpdateQueue"]

logger = logging.getLogger("tgraph.runtime")

# Errors a rank re-raises, by name, when another rank rejected a submission (the same type on
# every rank keeps SPMD scripts that catch it in step).
_SHARED_ERRORS: dict[str, type[Exception]] = {
    cls.__name__: cls for cls in (RequestTooLongError, InvalidRequestError,
                                  InvalidRequestTypeError, ConfigError, ValueError, TypeError)}

_INT32_LIMIT = 2**31
"""Token ids run through the model as int32."""

HEARTBEAT_S = 5.0
"""How often an idle leading rank 0 syncs with its followers, well inside any collective
timeout, so that they never time out waiting for the next step."""


class EngineClosedError(TGraphError, RuntimeError):
    """The engine was closed (or its loop died) before the request finished."""


# The engine's gauges and counters are the scheduler's, with submissions not yet handed to it
# counted as waiting.
EngineStats = SchedulerStats


# ---- per-request queues ---------------------------------------------------------------------
@dataclass
class RequestUpdate:
    """One step of one request, as the loop reports it."""

    request_id: str
    token_id: int | None  # None: the request was aborted
    text: str
    logprobs: TokenLogprobs | None
    finish_reason: str | None  # set on the request's last update
    seconds: float  # since submission


@dataclass
class RequestFailure:
    """A request that ended with an error (a failed step, or the engine closing)."""

    request_id: str
    error: BaseException


class UpdateQueue:
    """A thread-safe queue the loop writes and one consumer reads, blocking or from asyncio."""

    def __init__(self) -> None:
        self._items: deque[RequestUpdate | RequestFailure] = deque()
        self._cond = threading.Condition(threading.Lock())
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []

    def put(self, item: RequestUpdate | RequestFailure) -> None:
        with self._cond:
            self._items.append(item)
            self._cond.notify()
            waiters, self._waiters = self._waiters, []
        if not waiters:
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        for loop, future in waiters:
            if loop is running:  # put from the waiter's own loop: no cross-thread wake-up
                loop.call_soon(_wake, future)
                continue
            try:
                loop.call_soon_threadsafe(_wake, future)
            except RuntimeError:  # that event loop is closed: nobody is waiting any more
                pass

    def get(self) -> RequestUpdate | RequestFailure:
        with self._cond:
            while not self._items:
                self._cond.wait()
            return self._items.popleft()

    def get_nowait(self) -> RequestUpdate | RequestFailure | None:
        with self._cond:
            return self._items.popleft() if self._items else None

    async def wait(self) -> None:
        """Return once an item is queued (at once if one is)."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._cond:
            if self._items:
                return
            self._waiters.append((loop, future))
        try:
            await future
        finally:
            with self._cond:
                if (loop, future) in self._waiters:
                    self._waiters.remove((loop, future))


def _wake(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


class BatchStream:
    """The output of requests submitted together, as one stream of :class:`StreamEvent`.

    Iterate it (``for event in stream``, blocking) or ``async for`` it (asyncio); events of the
    requests come in the order the engine produced them, and the iteration ends after each
    request's last event. A request that failed raises its error from the iterator (the others
    go on in the engine). One consumer at a time. Dropping the stream (garbage collection)
    before its requests finished aborts them.

    Attributes:
        request_ids: the requests' ids, in submission order.
        outputs: each request's :class:`RequestOutput`, updated as events are read.
    """

    def __init__(self, engine: EngineCore, requests: Sequence[Request], sink: UpdateQueue,
                 loop: _Loop) -> None:
        self._engine = engine  # a stream keeps its engine alive
        self._sink = sink
        self.request_ids = [r.request_id for r in requests]
        self.outputs = {r.request_id: RequestOutput(r.request_id, list(r.prompt_token_ids))
                        for r in requests}
        self._open = set(self.request_ids)
        self._finalizer = weakref.finalize(self, _abort_open, loop, self._open)

    @property
    def finished(self) -> bool:
        """Whether every request's last event (or error) has been read."""
        return not self._open

    def cancel(self) -> None:
        """Abort the requests that have not finished (their blocks are freed at the next step);
        their streams end with an ``"abort"`` event."""
        for rid in list(self._open):
            self._engine.abort(rid)

    def __iter__(self) -> Iterator[StreamEvent]:
        while self._open:
            yield self._read(self._sink.get())

    def __aiter__(self) -> AsyncIterator[StreamEvent]:
        return self._aiter()

    async def _aiter(self) -> AsyncIterator[StreamEvent]:
        while self._open:
            item = self._sink.get_nowait()
            if item is None:
                await self._sink.wait()
                continue
            yield self._read(item)

    def ready(self) -> list[StreamEvent]:
        """The events already queued, without waiting (a consumer that fell behind takes them
        together); raises a failed request's error as the iterator does."""
        events = []
        while self._open:
            item = self._sink.get_nowait()
            if item is None:
                break
            events.append(self._read(item))
        return events

    def _read(self, item: RequestUpdate | RequestFailure) -> StreamEvent:
        rid = item.request_id
        out = self.outputs[rid]
        if isinstance(item, RequestFailure):
            self._close(rid)
            out.finish_reason = FinishReason.ABORT.value
            raise item.error
        tokens = [] if item.token_id is None else [item.token_id]
        if tokens:
            if out.time_to_first_token is None:
                out.time_to_first_token = item.seconds
            out.token_ids.append(item.token_id)
            if item.logprobs is not None:
                if out.logprobs is None:
                    out.logprobs = []
                out.logprobs.append(item.logprobs)
        out.text += item.text
        out.total_seconds = item.seconds
        if item.finish_reason is not None:
            out.finish_reason = item.finish_reason
            self._close(rid)
        return StreamEvent(rid, item.text, tokens, item.finish_reason is not None, out)

    def _close(self, rid: str) -> None:
        self._open.discard(rid)
        if not self._open:
            self._finalizer.detach()


class RequestStream(BatchStream):
    """The output of one request (see :class:`BatchStream`).

    Attributes:
        request_id: the request's id.
    """

    @property
    def request_id(self) -> str:
        return self.request_ids[0]

    @property
    def output(self) -> RequestOutput:
        """The request's output so far (final once the stream ended)."""
        return self.outputs[self.request_id]


def _abort_open(loop: _Loop, open_ids: set[str]) -> None:
    """A stream was dropped: abort what it had not finished."""
    for rid in list(open_ids):
        loop.post_abort(rid)


# ---- the loop -------------------------------------------------------------------------------
@dataclass
class _Group:
    """Requests submitted together, or one adapter command; under tensor parallelism, what the
    ranks agree on."""

    requests: list[Request]
    sink: UpdateQueue | None  # None on a follower: nobody reads its events
    start: float
    error: Exception | None = None  # this rank could not prepare it (tensor parallel only)
    decided: threading.Event = dataclasses.field(default_factory=threading.Event)
    rejection: Exception | None = None
    command: AdapterCommand | None = None
    adapters: AdapterState | None = None  # after the command

    def announcement(self, rank: int) -> dict[str, Any]:
        """What this rank tells the others: a digest (and rank 0 the requests themselves)."""
        items = [[r.request_id, r.prompt_token_ids,
                  dataclasses.asdict(r.sampling_params or SamplingParams())]
                 for r in self.requests]
        command = None if self.command is None else self.command.to_json()
        text = json.dumps([items, command], sort_keys=True)
        said: dict[str, Any] = {
            "digest": hashlib.sha256(text.encode()).hexdigest(),
            "error": None if self.error is None else [type(self.error).__name__,
                                                      str(self.error)]}
        if rank == 0:
            said["items"] = items
            said["command"] = command
        return said

    def reject(self, error: Exception) -> None:
        self.rejection = error
        self.decided.set()


@dataclass
class _State:
    """The loop's view of one running request."""

    request: Request
    sink: UpdateQueue | None
    start: float
    stop: StopChecker | None


class _Loop:
    """Everything the loop thread owns; the thread holds this, never the :class:`EngineCore`,
    so that dropping the engine (or the ``LLM``) can stop the thread."""

    def __init__(self, scheduler: Scheduler, runner: ModelRunner, tokenizer: Any,
                 eos_token_ids: Sequence[int], device: Any, name: str,
                 heartbeat_s: float, adapters: AdapterManager) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.adapters = adapters
        self.tokenizer = tokenizer
        self.eos_token_ids = list(eos_token_ids)
        if device.type == "cuda" and device.index is None:
            # bare "cuda" is the creating thread's device; the loop thread must use the same one
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.rank, self.world_size = runner.rank, runner.world_size
        self.name = name
        self.heartbeat_s = heartbeat_s
        # Reentrant: a stream collected by the garbage collector posts its aborts from whatever
        # this thread was doing, possibly while holding the lock.
        self.lock = threading.RLock()
        self.cond = threading.Condition(self.lock)
        # ---- shared with the callers (under the lock)
        self.inbox: deque[tuple[str, Any]] = deque()
        self.live: set[str] = set()  # ids submitted and not finished (for duplicate checks)
        self.queued = 0  # requests submitted, not yet handed to the scheduler
        self.next_id = 0
        self.closing = False
        self.leading = False
        self.following = False
        self.thread: threading.Thread | None = None
        self.fatal: BaseException | None = None
        self.snapshot = scheduler.stats()
        # ---- the loop thread's own
        self.states: dict[str, _State] = {}
        self.mine: deque[_Group] = deque()  # announced, not yet agreed (tensor parallel)
        self.announced: list[deque[dict[str, Any]]] = [deque() for _ in range(self.world_size)]
        self.followers = [False] * self.world_size
        self.outbox: list[tuple[UpdateQueue, RequestUpdate | RequestFailure]] = []

    # ---- the callers' side (any thread) -----------------------------------------------------
    def post(self, kind: str, payload: Any = None) -> None:
        with self.lock:
            self._check_open()
            self.inbox.append((kind, payload))
            if kind == "group":
                self.queued += len(payload.requests)
            self._start_locked()
            self.cond.notify()

    def post_abort(self, rid: str) -> None:
        with self.lock:
            if self.closing or rid not in self.live:
                return  # finished, unknown, or the engine is gone: nothing to free
            self.inbox.append(("abort", rid))
            self.cond.notify()

    def _check_open(self) -> None:
        if self.closing:
            raise EngineClosedError("the engine is closed") from self.fatal

    def _start_locked(self) -> None:
        if self.thread is None:
            self.thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self.thread.start()

    def stop(self, timeout: float | None) -> bool:
        """Stop the thread (after a last sync when leading); True once it has ended."""
        with self.lock:
            self.closing = True
            self.cond.notify()
            thread = self.thread
        if thread is None:
            self._fail_all(EngineClosedError("the engine was closed"))
            return True
        if thread is threading.current_thread():
            return False
        thread.join(timeout)
        if thread.is_alive():
            logger.warning("the engine thread %s did not stop within %s s", self.name, timeout)
            return False
        return True

    # ---- the thread --------------------------------------------------------------------------
    def _run(self) -> None:
        error: BaseException | None = None
        try:
            use_device(self.device)
            while self._iterate():
                pass
        except BaseException as err:  # the loop itself broke (e.g. a collective failed)
            logger.exception("the engine loop %s stopped", self.name)
            error = err
        with self.lock:
            self.closing = True
            self.fatal = error
        message = "the engine was closed before the request finished"
        closed = EngineClosedError(message if error is None else
                                   f"the engine loop failed: {type(error).__name__}: {error}")
        closed.__cause__ = error
        self._fail_all(closed)

    def _fail_all(self, error: EngineClosedError) -> None:
        """Fail every request and every waiting caller (the loop is gone)."""
        with self.lock:
            ops = list(self.inbox)
            self.inbox.clear()
            self.queued = 0
        for kind, payload in ops:
            if kind == "group":
                self._fail_group(payload, error)
            elif kind == "call" and payload[1].set_running_or_notify_cancel():
                payload[1].set_exception(error)
        while self.mine:
            self._fail_group(self.mine.popleft(), error)
        for state in list(self.states.values()):
            self._fail(state, error, abort=False)
        outbox, self.outbox = self.outbox, []
        for sink, item in outbox:
            sink.put(item)

    def _fail_group(self, group: _Group, error: Exception) -> None:
        for req in group.requests:
            self._send(group.sink, RequestFailure(req.request_id, error))
            with self.lock:
                self.live.discard(req.request_id)
        group.reject(error)

    def _busy(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.mine) or self.following

    def _iterate(self) -> bool:
        """One iteration: take the inbox, agree with the other ranks, apply, step.

        Returns:
            False once the loop must end.
        """
        with self.lock:
            while not self.inbox and not self.closing and not self._busy():
                if self.leading:
                    if not self.cond.wait(self.heartbeat_s):
                        break  # an empty sync keeps the followers' collectives alive
                else:
                    self.cond.wait()
            closing = self.closing
            # popleft, not clear(): what a collected stream posts meanwhile stays queued
            ops = [] if closing else [self.inbox.popleft() for _ in range(len(self.inbox))]
            self.queued -= sum(len(p.requests) for kind, p in ops if kind == "group")
        if closing:
            # What is still in the inbox fails once the loop ends. A leading rank 0 tells its
            # followers first; SPMD ranks each close on their own, with nothing in flight
            # (every rank made the same calls).
            if self.world_size > 1 and self.leading:
                self._agree([], [], closing=True)
            return False
        groups = [p for kind, p in ops if kind == "group"]
        # Aborts of requests that already finished need no agreement nor step.
        known = set(self.states).union(*({r.request_id for r in g.requests}
                                         for g in [*groups, *self.mine]))
        aborts = [p for kind, p in ops if kind == "abort" and p in known]
        calls = [p for kind, p in ops if kind == "call"]
        if self.world_size > 1:
            if groups or aborts or self._busy() or self.leading:
                groups, aborts, stop = self._agree(groups, aborts, closing=False)
                if stop:
                    return False
            # else: only local calls, so no step and nothing to agree on
        for group in groups:
            self._apply(group)
        for rid in aborts:
            state = self.states.get(rid)
            if state is not None:
                self._abort(state)
        if groups or aborts:
            self._publish()  # the submissions taken from the inbox count as waiting again
        for fn, future in calls:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as err:
                    future.set_exception(err)
        if self.scheduler.has_unfinished():
            self._step()
        self._flush()
        return True

    # ---- tensor parallel agreement -----------------------------------------------------------
    def _agree(self, groups: list[_Group], aborts: list[str],
               closing: bool) -> tuple[list[_Group], list[str], bool]:
        """Share this rank's new submissions and aborts; return what every rank applies now.

        Every rank runs this once per iteration with the same outcome: the submissions that
        every submitting rank has announced (in order; rank 0's content, checked against the
        others' digests), the union of the aborts, and whether rank 0 closed.
        """
        said = {"follow": self.following, "close": closing, "aborts": aborts,
                "groups": [g.announcement(self.rank) for g in groups]}
        self.mine.extend(groups)
        anything = 1 if (groups or aborts or closing) else 0
        if -distributed.min_over_ranks(-anything) == 0:
            return [], [], False  # nobody has news: the usual decode step costs one reduction
        reports = [json.loads(b) for b in
                   distributed.all_gather_bytes(json.dumps(said).encode())]
        for r, report in enumerate(reports):
            self.followers[r] = bool(report["follow"])
            self.announced[r].extend(report["groups"])
        if self.rank == 0 and any(self.followers[1:]) and not self.leading:
            with self.lock:
                self.leading = True  # followers wait in collectives: keep them fed
        agreed = self._match()
        all_aborts = sorted({rid for report in reports for rid in report["aborts"]})
        return agreed, all_aborts, bool(reports[0]["close"])

    def _match(self) -> list[_Group]:
        voters = [r for r in range(self.world_size) if r == 0 or not self.followers[r]]
        agreed = []
        while all(self.announced[r] for r in voters):
            heads = {r: self.announced[r].popleft() for r in voters}
            if self.rank in heads:
                group = self.mine.popleft()
            else:  # a follower runs rank 0's requests, nobody reads their events
                group = self._follower_group(heads[0])
            rejection = self._verdict(heads, group)
            if rejection is None:
                agreed.append(group)
            else:
                self._fail_group(group, rejection)
        return agreed

    def _verdict(self, heads: dict[int, dict[str, Any]], group: _Group) -> Exception | None:
        """``None`` if every rank accepted the same requests, else the error this rank raises."""
        failed = [(r, h["error"]) for r, h in sorted(heads.items()) if h["error"]]
        if failed:
            if group.error is not None:
                return group.error
            r, (kind, message) = failed[0]
            return _SHARED_ERRORS.get(kind, RankFailedError)(
                f"rank {r} rejected the request(s) with {kind}: {message}")
        differ = [r for r, h in sorted(heads.items()) if h["digest"] != heads[0]["digest"]]
        if differ:
            return ConfigError(f"ranks {differ} submitted other prompts or sampling parameters "
                               "than rank 0; under tensor parallelism every rank must submit "
                               "the same requests in the same order (or follow rank 0)")
        return None

    def _follower_group(self, head: dict[str, Any]) -> _Group:
        requests = [Request.from_sampling_params(rid, prompt, SamplingParams(**params),
                                                 self.eos_token_ids)
                    for rid, prompt, params in head.get("items", [])]
        with self.lock:
            self.live.update(r.request_id for r in requests)
        command = head.get("command")
        return _Group(requests, None, time.perf_counter(),
                      command=None if command is None else AdapterCommand.from_json(command))

    # ---- requests ----------------------------------------------------------------------------
    def _apply(self, group: _Group) -> None:
        if group.command is not None:
            self._command(group)
            return
        loaded = self.adapters.state().loras
        for req in group.requests:
            params = req.sampling_params or SamplingParams()
            stop = None
            if self.tokenizer is not None:
                stop = StopChecker(self.tokenizer, params, self.eos_token_ids,
                                   req.prompt_token_ids)
            state = _State(req, group.sink, group.start, stop)
            self.states[req.request_id] = state
            if req.lora is not None and req.lora not in loaded:
                # unloaded between its submission and this step: it alone fails
                self._fail(state, InvalidRequestError(
                    f"request {req.request_id!r}: LoRA adapter {req.lora!r} was unloaded "
                    f"before the request started; loaded: {sorted(loaded)}"), abort=False)
                continue
            try:
                self.scheduler.add_request(req)
            except Exception as err:  # checked at submission: only a bug gets here
                self._fail(state, err, abort=False)
        group.decided.set()

    def _command(self, group: _Group) -> None:
        """Apply an adapter command: prepare, agree on the outcome with the other ranks, then
        commit everywhere or undo everywhere."""
        assert group.command is not None
        in_use: dict[str, int] = {}
        for state in self.states.values():
            if state.request.lora is not None:
                in_use[state.request.lora] = in_use.get(state.request.lora, 0) + 1
        prepared, error = None, None
        try:
            prepared = self.adapters.prepare(group.command, in_use)
        except Exception as err:
            error = err
        if self.world_size > 1:
            error = self._outcome(error)
        if error is not None:
            if prepared is not None:
                prepared.undo()
            group.reject(error)
            return
        assert prepared is not None
        try:
            prepared.commit()
        except Exception as err:  # only a replacement re-reads its files here; the loop goes on
            logger.exception("adapter command %s failed at commit", group.command)
            group.reject(err)
            return
        finally:
            # cached blocks were hashed under the adapters' names, whose weights may differ now
            self.scheduler.reset_prefix_cache()
        logger.info("adapter command applied: %s", group.command)
        group.adapters = self.adapters.state()
        group.decided.set()

    def _outcome(self, error: Exception | None) -> Exception | None:
        """This rank's error, else the first other rank's (the same on every rank that
        prepared), else None."""
        said = None if error is None else [type(error).__name__, str(error)]
        reports = [json.loads(b) for b in
                   distributed.all_gather_bytes(json.dumps(said).encode())]
        if error is not None:
            return error
        for r, report in enumerate(reports):
            if report is not None:
                kind, message = report
                return shared_error(kind, f"rank {r}: {message}")
        return None

    def _retire(self, state: _State) -> None:
        rid = state.request.request_id
        self.states.pop(rid, None)
        with self.lock:
            self.live.discard(rid)

    def _abort(self, state: _State) -> None:
        self.scheduler.abort_request(state.request.request_id)
        self._retire(state)
        self._send(state.sink, RequestUpdate(state.request.request_id, None, "", None,
                                       FinishReason.ABORT.value, time.perf_counter() - state.start))

    def _fail(self, state: _State, error: BaseException, abort: bool = True) -> None:
        if abort:
            self.scheduler.abort_request(state.request.request_id)
        self._retire(state)
        self._send(state.sink, RequestFailure(state.request.request_id, error))

    def _step(self) -> None:
        out = self.scheduler.schedule()
        if out.is_empty:
            self.scheduler.update(out, {})
            error = SchedulerError("the scheduler has unfinished requests but scheduled nothing")
            for state in list(self.states.values()):
                self._fail(state, error)
            return
        try:
            result = self.runner.execute(out)
            synchronize(self.device)
            finished = {r.request_id for r in self.scheduler.update(out, result.tokens)}
        except Exception as err:
            self._fail_step(out, err)
            return
        # The engine reports finished requests through their streams; the scheduler's list of
        # them would only grow.
        self.scheduler.finished.clear()
        now = time.perf_counter()
        for rid, token in result.tokens.items():
            state = self.states.get(rid)
            if state is None:
                continue
            try:
                self._emit(state, token, result.logprobs.get(rid), now, rid in finished)
            except Exception as err:  # e.g. the tokenizer failed on this request's tokens
                self._fail(state, err)

    def _fail_step(self, out: SchedulerOutput, error: Exception) -> None:
        """A failed step ends its requests with the error; the scheduler goes on (and, under
        tensor parallelism, every rank's alike: the others failed the same step)."""
        for s in out.scheduled:
            self.scheduler.abort_request(s.request_id)
        try:
            self.scheduler.update(out, {})
        except SchedulerError:
            pass  # update() had already taken the step before it failed
        for s in out.scheduled:
            state = self.states.get(s.request_id)
            if state is not None:
                self._fail(state, error, abort=False)

    def _emit(self, state: _State, token: int, logprobs: TokenLogprobs | None, now: float,
              finished: bool) -> None:
        req = state.request
        text = ""
        reason = None
        if state.stop is not None:
            step = state.stop.step(token)
            text = step.text
            if step.finished and not finished:
                # A stop string (seen only in text) ends the request here.
                self.scheduler.finish_request(req.request_id, FinishReason.STOP)
                finished = True
            if step.finished:
                reason = step.finish_reason
        if finished:
            if reason is None:
                reason = req.finish_reason.value if req.finish_reason else "stop"
            self._retire(state)
        wanted = req.sampling_params is not None and req.sampling_params.logprobs is not None
        self._send(state.sink, RequestUpdate(req.request_id, token, text,
                                       logprobs if wanted else None, reason, now - state.start))

    def _publish(self) -> None:
        stats = self.scheduler.stats()
        with self.lock:
            self.snapshot = stats

    def _send(self, sink: UpdateQueue | None, item: RequestUpdate | RequestFailure) -> None:
        """Queue an update for the end of the iteration (a follower's requests have no sink)."""
        if sink is not None:
            self.outbox.append((sink, item))

    def _flush(self) -> None:
        """Publish the stats, then deliver: a caller that has read a request's last event sees
        stats that count it finished."""
        self._publish()
        outbox, self.outbox = self.outbox, []
        for sink, item in outbox:
            sink.put(item)


class EngineCore:
    """Owns the scheduler; one background thread steps the model while requests are pending.

    Thread-safe: submit, abort, stats and call may be used from any thread (and the streams from
    any thread or asyncio loop) at once. See the module doc for tensor parallelism.

    Args:
        model: the loaded model (KV cache allocated).
        scheduler: the scheduler over the model's KV cache; the engine's thread is its only user
            from now on.
        runner: runs a scheduler step on the model (a :class:`ModelRunner` of ``model`` if None).
        tokenizer: detokenizes outputs and finds stop strings (None: token ids only).
        eos_token_ids: end-of-sequence ids of every request.
        name: the loop thread's name.
        heartbeat_s: how often an idle leading rank 0 syncs with its followers.
        adapters: the model's LoRA adapters, as loaded before the engine (a new
            :class:`AdapterManager` of ``model`` if None).
    """

    _names = itertools.count()

    def __init__(self, model: Any, scheduler: Scheduler, *, runner: ModelRunner | None = None,
                 tokenizer: Any = None, eos_token_ids: Sequence[int] = (),
                 name: str | None = None, heartbeat_s: float = HEARTBEAT_S,
                 adapters: AdapterManager | None = None) -> None:
        self.model = model
        runner = runner if runner is not None else ModelRunner(model)
        self._adapters = adapters if adapters is not None else AdapterManager(model)
        self._loop = _Loop(scheduler, runner, tokenizer, eos_token_ids, model.llm_config.device,
                           name or f"tgraph-engine-{next(self._names)}", heartbeat_s,
                           self._adapters)
        self._spmd = threading.Lock()  # SPMD submissions wait for agreement one at a time
        # Stops the thread when the engine is dropped (the thread holds only the loop).
        self._finalizer = weakref.finalize(self, self._loop.stop, 30.0)

    @property
    def scheduler(self) -> Scheduler:
        """The scheduler (used by the engine's thread; read it only while the engine is idle)."""
        return self._loop.scheduler

    @property
    def runner(self) -> ModelRunner:
        """The model runner (used by the engine's thread)."""
        return self._loop.runner

    @property
    def thread(self) -> threading.Thread | None:
        """The loop thread, once the first request started it."""
        return self._loop.thread

    @property
    def closed(self) -> bool:
        """Whether the engine was closed (or its loop failed)."""
        return self._loop.closing

    # ---- submitting ------------------------------------------------------------------------------
    def submit(self, prompt_token_ids: Sequence[int], params: SamplingParams | None = None,
               request_id: str | None = None) -> RequestStream:
        """Queue one request.

        Args:
            prompt_token_ids: the prompt.
            params: sampling and stopping (``SamplingParams()`` if None).
            request_id: a unique id among unfinished requests (``"req-N"`` if None).

        Returns:
            The request's stream.

        Raises:
            RequestTooLongError: the request can never fit (``max_model_len`` or the cache).
            InvalidRequestError: an unknown LoRA adapter, a bad prompt (a token id outside
                the vocabulary), stop strings without a tokenizer (a ``ValueError``; its
                ``InvalidRequestTypeError`` subclass, also a ``TypeError``, for wrong types).
            ValueError: a duplicate ``request_id``.
            EngineClosedError: the engine is closed.
        """
        stream = self._submit([prompt_token_ids], [params or SamplingParams()],
                              None if request_id is None else [request_id], RequestStream)
        assert isinstance(stream, RequestStream)
        return stream

    def submit_to(self, queue: UpdateQueue, prompt_token_ids: Sequence[int],
                  params: SamplingParams, request_id: str) -> None:
        """Queue one request whose updates go to ``queue`` (which many requests may share, and
        its owner reads) instead of a stream of its own; only :meth:`abort` ends it early.

        Raises:
            see :meth:`submit`.
        """
        stream = self._submit([prompt_token_ids], [params], [request_id], RequestStream, queue)
        stream._finalizer.detach()  # no stream object to drop: the queue's owner aborts

    def submit_batch(self, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams],
                     request_ids: Sequence[str] | None = None) -> BatchStream:
        """Queue requests together: all are checked first (none is queued if one is refused),
        then handed to the scheduler in order, at the same step.

        Args:
            prompts: token ids of each prompt.
            params: one :class:`SamplingParams` per prompt.
            request_ids: one unique id per prompt (``"req-N"`` if None).

        Returns:
            One stream of all their events.

        Raises:
            see :meth:`submit`.
        """
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        return self._submit(prompts, params, request_ids, BatchStream)

    def submit_failed(self, error: Exception) -> NoReturn:
        """Raise ``error`` for a submission this rank could not even prepare (e.g. a prompt that
        does not encode). Under tensor parallelism with every rank submitting, the other ranks'
        matching submission then fails too (so none waits for this one).

        Raises:
            ``error``, or the error the ranks agreed on.
        """
        if not self._agreeing():
            raise error
        with self._spmd:
            group = _Group([], None, time.perf_counter(), error=error)
            self._loop.post("group", group)
            group.decided.wait()
        raise group.rejection or error

    def _agreeing(self) -> bool:
        """Whether submissions wait for every rank (tensor parallel and not leading)."""
        return self._loop.world_size > 1 and not self._loop.leading

    def _submit(self, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams],
                request_ids: Sequence[str] | None, kind: type[BatchStream],
                sink: UpdateQueue | None = None) -> BatchStream:
        loop = self._loop
        if loop.following:
            raise ConfigError("this engine follows rank 0; it takes no submissions")
        agreeing = self._agreeing()
        with self._spmd if agreeing else contextlib.nullcontext():
            start = time.perf_counter()
            ids: list[str] = []
            # Under SPMD the ranks refuse a submission alike and rewind their id counters alike.
            rewind = loop.next_id if agreeing else None
            try:
                ids = self._reserve(len(prompts), request_ids)
                requests = [self._request(rid, prompt, p)
                            for rid, prompt, p in zip(ids, prompts, params)]
                error = None
            except EngineClosedError:
                raise
            except Exception as err:
                self._release(ids, rewind)
                if not agreeing:
                    raise
                ids, requests, error = [], [], err
            sink = sink or UpdateQueue()
            group = _Group(requests, sink, start, error=error)
            stream = kind(self, requests, sink, loop)
            try:
                loop.post("group", group)
            except EngineClosedError:
                stream._finalizer.detach()
                self._release(ids, None)
                raise
            if agreeing:
                group.decided.wait()
                if group.rejection is not None:
                    stream._finalizer.detach()
                    self._release(ids, rewind)
                    raise group.rejection
            return stream

    def _reserve(self, n: int, request_ids: Sequence[str] | None) -> list[str]:
        """Take ``n`` ids (the given ones, checked unique, or the next free ``req-N``)."""
        loop = self._loop
        with loop.lock:
            loop._check_open()
            if request_ids is not None:
                ids = [str(r) for r in request_ids]
                if len(ids) != n:
                    raise ValueError(f"got {len(ids)} request ids for {n} prompts")
                taken = sorted({r for r in ids if r in loop.live} |
                               {r for r in ids if ids.count(r) > 1})
                if taken:
                    raise ValueError(f"request id(s) {taken} are already in use")
            else:
                ids = []
                while len(ids) < n:
                    rid = f"req-{loop.next_id}"
                    loop.next_id += 1
                    if rid not in loop.live:
                        ids.append(rid)
            loop.live.update(ids)
            return ids

    def _release(self, ids: list[str], rewind: int | None) -> None:
        """Give back the ids of a refused submission, and set the id counter back to
        ``rewind`` unless it is None."""
        loop = self._loop
        with loop.lock:
            loop.live.difference_update(ids)
            if rewind is not None:
                loop.next_id = rewind

    def _request(self, rid: str, prompt: Sequence[int], params: SamplingParams) -> Request:
        """Check one request completely (nothing runs for a refused one) and build it."""
        if not isinstance(params, SamplingParams):
            raise InvalidRequestTypeError(
                f"request {rid!r}: params must be SamplingParams, got "
                f"{type(params).__name__} {params!r:.60}")
        if isinstance(prompt, (str, bytes)) or not isinstance(prompt, Sequence):
            raise InvalidRequestTypeError(
                f"request {rid!r}: prompt_token_ids must be a list of token ids, got "
                f"{type(prompt).__name__} {prompt!r:.60}")
        request = Request.from_sampling_params(rid, list(prompt), params,
                                               self._loop.eos_token_ids)
        self._check_token_ids(rid, request.prompt_token_ids, "prompt_token_ids")
        if params.stop and self._loop.tokenizer is None:
            raise InvalidRequestError(
                f"request {rid!r}: SamplingParams.stop={params.stop!r} needs a tokenizer to find "
                "the strings in the output, and this model has none; use stop_token_ids instead")
        self._loop.scheduler.check_fits(request)  # reads only the fixed limits
        if params.lora is not None:
            multi = getattr(self.model, "features", {}).get("multi_lora")
            if multi is None:
                raise ConfigError(f"request {rid!r} names LoRA adapter {params.lora!r}, but "
                                  f"{type(self.model).__name__} has no multi-LoRA feature")
            adapters = self._adapters.state()
            if params.lora not in adapters.loras:
                raise InvalidRequestError(
                    f"request {rid!r}: SamplingParams.lora: LoRA adapter {params.lora!r} is "
                    f"not loaded; expected one of {adapters.names}")
        if (params.logit_bias is not None or params.allowed_token_ids is not None
                or params.allowed_token_ids_fn is not None):
            self._check_logit_bias(rid, params)
        return request

    def _check_logit_bias(self, rid: str, params: SamplingParams) -> None:
        if "logit_bias" not in getattr(self.model, "features", {}):
            raise ConfigError(f"request {rid!r} has a logit bias or allow-list, but "
                              f"{type(self.model).__name__} has no logit_bias feature")
        self._check_token_ids(rid, params.token_ids_named(),
                              "SamplingParams.logit_bias / allowed_token_ids")
        if params.allowed_token_ids_fn is not None and self._loop.world_size > 1:
            raise InvalidRequestError(
                f"request {rid!r}: SamplingParams.allowed_token_ids_fn runs on rank 0 only and "
                "cannot be sent to the other tensor-parallel ranks; give allowed_token_ids")

    def _check_token_ids(self, rid: str, ids: Sequence[int], field: str) -> None:
        """Refuse token ids outside the model's vocabulary (they would index past the
        embedding) or beyond int32 (the model's token dtype)."""
        vocab = getattr(getattr(self.model, "config", None), "vocab_size", None)
        limit = vocab if isinstance(vocab, int) and vocab > 0 else _INT32_LIMIT
        bad = [t for t in ids if t >= limit]
        if bad:
            what = f"the vocabulary size {vocab}" if limit == vocab else "2**31 (int32)"
            raise InvalidRequestError(
                f"request {rid!r}: {field} holds token id(s) {bad[:8]}; expected ids below "
                f"{what}")

    # ---- control -------------------------------------------------------------------------------
    def abort(self, request_id: str) -> None:
        """Abort a request: its blocks are freed at the next step and its stream ends with an
        ``"abort"`` event. Unknown or finished ids are ignored."""
        self._loop.post_abort(request_id)

    def stats(self) -> EngineStats:
        """A snapshot of the engine's gauges and counters (as of the last step)."""
        loop = self._loop
        with loop.lock:
            s, queued = loop.snapshot, loop.queued
        return dataclasses.replace(s, waiting=s.waiting + queued, finished=dict(s.finished))

    def call(self, fn: Callable[[], Any], timeout: float | None = None) -> Any:
        """Run ``fn`` on the engine's thread between two steps and return its result (for what
        changes the model or the scheduler, e.g. loading an adapter).

        Args:
            fn: called with no arguments.
            timeout: seconds to wait for the result (``fn`` still runs if they pass).

        Raises:
            whatever ``fn`` raised; EngineClosedError if the engine is closed.
        """
        if threading.current_thread() is self._loop.thread:
            return fn()
        future: Future = Future()
        self._loop.post("call", (fn, future))
        return future.result(timeout)

    @property
    def adapter_state(self) -> AdapterState:
        """The LoRA adapters served now (as of the last adapter command)."""
        return self._adapters.state()

    def apply_adapters(self, command: AdapterCommand) -> AdapterState:
        """Apply an adapter command between two steps and return the adapters afterwards.

        The command queues behind the requests submitted before it (an unload sees them in
        flight). Under tensor parallelism it is agreed like a submission: every rank makes the
        same call (SPMD), or rank 0 leads and its followers apply its commands; every rank
        applies it at the same step, and a failure on any rank leaves every rank unchanged.

        Raises:
            InvalidRequestError, ConfigError, WeightLoadError, AdapterNotFoundError,
                AdapterInUseError: see :meth:`AdapterManager.prepare
                <tgraph.runtime.adapters.AdapterManager.prepare>`; nothing changed.
            ConfigError: on a following rank (rank 0 gives the commands).
            EngineClosedError: the engine is closed.
        """
        loop = self._loop
        if loop.following:
            raise ConfigError("this engine follows rank 0; adapter commands are given on rank 0")
        agreeing = self._agreeing()
        group = _Group([], None, time.perf_counter(), command=command)
        try:
            command.check()
        except Exception as err:
            if not agreeing:
                raise
            group.error = err  # the other ranks' matching command fails too
        if threading.current_thread() is loop.thread:  # e.g. from a call(): apply it now
            if loop.world_size > 1:
                raise ConfigError("adapter commands cannot be given from the engine's thread "
                                  "under tensor parallelism (the ranks must agree on them)")
            loop._command(group)
        else:
            with self._spmd if agreeing else contextlib.nullcontext():
                loop.post("group", group)
                group.decided.wait()
        if group.rejection is not None:
            raise group.rejection
        assert group.adapters is not None
        return group.adapters

    def lead(self) -> None:
        """On rank 0 of a tensor-parallel group whose other ranks :meth:`follow`: start the loop
        now and keep it syncing while idle, so the followers never time out waiting; closing
        then stops the followers too. A no-op without tensor parallelism."""
        loop = self._loop
        if loop.world_size == 1:
            return
        if loop.rank != 0:
            raise ConfigError("only rank 0 leads; the other ranks follow()")
        with loop.lock:
            loop._check_open()
            loop.leading = True
            loop._start_locked()
            loop.cond.notify()

    def follow(self) -> None:
        """On a tensor-parallel rank other than 0: run rank 0's requests and steps (see
        :meth:`lead`) until rank 0 closes; blocks until then. This rank takes no submissions.

        Raises:
            ConfigError: on rank 0 or without tensor parallelism.
            EngineClosedError: the loop failed (e.g. rank 0 went away); the cause is chained.
        """
        loop = self._loop
        if loop.world_size == 1 or loop.rank == 0:
            raise ConfigError("follow() runs on tensor-parallel ranks other than 0")
        with loop.lock:
            loop._check_open()
            loop.following = True
            loop._start_locked()
            loop.cond.notify()
            thread = loop.thread
        assert thread is not None
        thread.join()
        if loop.fatal is not None:
            raise EngineClosedError(f"following rank 0 failed: {loop.fatal}") from loop.fatal

    def close(self, timeout: float | None = 30.0) -> bool:
        """Stop the loop: requests in flight end with :class:`EngineClosedError` (a leading
        rank 0 also stops its followers). Idempotent.

        Args:
            timeout: how long to wait for a step in progress to end.

        Returns:
            True once the thread has ended (False if it is still in a step after ``timeout``).
        """
        return self._loop.stop(timeout)

