"""Continuous batching over a paged KV cache, with chunked prefill and preemption by recompute.

One step is ``out = scheduler.schedule()``, the model runs ``out``, then
``scheduler.update(out, sampled)``. Each step:

1. Running requests that finished their prefill decode one token each, oldest first.
2. Running requests part-way through a chunked prefill get their next chunk, oldest first.
3. Waiting requests (preempted ones first, then new ones in arrival order) are admitted while
   there is room in ``max_num_seqs``, the token budget and the cache.

All three share ``max_num_batched_tokens``. A running request that needs a block when none is
free preempts the newest running request (itself, if it is the newest): the victim's blocks are
freed and it is queued at the front of the waiting queue, to be recomputed later from its prompt
and the tokens generated so far. The oldest running request is therefore never preempted, which
is what guarantees progress: it always fits, since requests that cannot fit the whole cache are
refused by :meth:`Scheduler.add_request`.

Prefix caching (on by default): a block is offered to the allocator's prefix cache once the step
that fills it has run (see :meth:`Scheduler.update`). An admitted request first takes the cached
blocks of the longest cached prefix of its tokens (prompt, plus generated tokens after a
preemption) and starts its prefill after them, so the step's ``start`` / ``position_ids`` /
``seq_len`` tell attention to read those positions from the shared blocks. At least the last
token is always computed, since its logits are needed.
"""

from __future__ import annotations

import bisect
import operator
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from tgraph.errors import ConfigError, RequestTooLongError, TGraphError
from tgraph.runtime.block_manager import BlockAllocator, BlockHash, BlockTable, hash_block
from tgraph.runtime.request import FinishReason, InvalidRequestError, Request, RequestStatus

__all__ = [
    "ScheduledRequest",
    "Scheduler",
    "SchedulerError",
    "SchedulerOutput",
    "SchedulerStats",
]


def check_fits(request: Request, max_model_len: int, num_blocks: int, block_size: int) -> None:
    """Raise :class:`RequestTooLongError` if ``request`` could never be served by a scheduler
    of these limits.

    Raises:
        RequestTooLongError: prompt + max_tokens exceed ``max_model_len``, or the request
            could not fit the whole KV cache even alone; the message names both numbers.
    """
    rid = request.request_id
    total = request.num_prompt_tokens + request.max_tokens
    if total > max_model_len:
        raise RequestTooLongError(
            f"request {rid!r}: prompt of {request.num_prompt_tokens} tokens + max_tokens "
            f"{request.max_tokens} = {total} tokens exceeds max_model_len {max_model_len}")
    cap = num_blocks * block_size
    if request.max_kv_tokens > cap:
        raise RequestTooLongError(
            f"request {rid!r} needs up to {request.max_kv_tokens} KV-cache tokens (prompt "
            f"{request.num_prompt_tokens} + max_tokens {request.max_tokens} - 1) but the whole "
            f"cache holds {cap} tokens ({num_blocks} blocks of {block_size})")


class SchedulerError(TGraphError, RuntimeError):
    """The scheduler's protocol was broken (e.g. ``schedule()`` twice without ``update()``)."""


@dataclass
class ScheduledRequest:
    """What the model must compute for one request in one step. All fields are plain lists.

    Attributes:
        request: the request (read-only for the runner).
        token_ids: input tokens of this step.
        position_ids: their positions, ``start .. start + query_len - 1``.
        slots_mapping: flat KV-cache slot each token's key/value is written to.
        block_table: the request's block table row after this step's allocation.
        seq_len: KV length after this step (``start + query_len``), what attention reads.
        query_len: number of tokens in this step.
        needs_logits: whether the last token's logits are needed (a prefill chunk that completes
            the prompt, or a decode); other chunks need no lm_head.
        is_prefill: False for a decode (one token after a completed prefill).
    """

    request: Request
    token_ids: list[int]
    position_ids: list[int]
    slots_mapping: list[int]
    block_table: list[int]
    seq_len: int
    query_len: int
    needs_logits: bool
    is_prefill: bool

    @property
    def request_id(self) -> str:
        """The request's id."""
        return self.request.request_id

    @property
    def start(self) -> int:
        """Position of the first token of this step (= tokens already in the cache)."""
        return self.seq_len - self.query_len

    @property
    def lora(self) -> str | None:
        """The request's LoRA adapter name, or None."""
        return self.request.lora


@dataclass
class SchedulerOutput:
    """One step's batch: decodes first, then prefill chunks.

    The ``flat_*`` helpers concatenate per-request lists in :attr:`scheduled` order, the layout a
    varlen attention kernel and the runner's input tensors use.
    """

    step: int
    decodes: list[ScheduledRequest] = field(default_factory=list)
    prefills: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    """Requests preempted while building this step (not part of the batch)."""

    @property
    def scheduled(self) -> list[ScheduledRequest]:
        """Every scheduled request: decodes (oldest first), then prefills."""
        return self.decodes + self.prefills

    @property
    def num_batched_tokens(self) -> int:
        """Tokens in this step."""
        return sum(s.query_len for s in self.decodes) + sum(s.query_len for s in self.prefills)

    @property
    def is_empty(self) -> bool:
        """True when nothing was scheduled."""
        return not self.decodes and not self.prefills

    def flat_token_ids(self) -> list[int]:
        """All input tokens, concatenated."""
        return [t for s in self.scheduled for t in s.token_ids]

    def flat_position_ids(self) -> list[int]:
        """All positions, concatenated."""
        return [p for s in self.scheduled for p in s.position_ids]

    def flat_slots_mapping(self) -> list[int]:
        """All KV-cache slots, concatenated (the ``slots_mapping`` input)."""
        return [x for s in self.scheduled for x in s.slots_mapping]

    def query_start_loc(self) -> list[int]:
        """Cumulative query lengths, ``[0, q0, q0 + q1, ...]`` (``cu_seqlens_q``)."""
        out = [0]
        for s in self.scheduled:
            out.append(out[-1] + s.query_len)
        return out

    def seq_len(self) -> list[int]:
        """KV length of each scheduled request after this step."""
        return [s.seq_len for s in self.scheduled]

    def lm_head_indices(self) -> list[int]:
        """Indices into the flat tokens whose logits are needed (``lm_head_indices``)."""
        out = []
        end = 0
        for s in self.scheduled:
            end += s.query_len
            if s.needs_logits:
                out.append(end - 1)
        return out

    def block_table_rows(self, pad_value: int = 0, width: int | None = None) -> list[list[int]]:
        """Block table rows padded to one width.

        Args:
            pad_value: id written after a row's last block (never read by attention, since
                ``seq_len`` bounds the read).
            width: row length; the longest row when None.

        Returns:
            One row per scheduled request.
        """
        rows = [s.block_table for s in self.scheduled]
        w = max((len(r) for r in rows), default=0) if width is None else width
        if any(len(r) > w for r in rows):
            raise ValueError(f"width {w} is smaller than the longest block table row")
        return [r + [pad_value] * (w - len(r)) for r in rows]


@dataclass(frozen=True)
class SchedulerStats:
    """A snapshot of the scheduler: gauges now and counters since it was created.

    Attributes:
        running: requests holding blocks.
        waiting: requests queued (new or preempted).
        kv_blocks_used: blocks held by at least one request.
        kv_blocks_total: blocks in the cache.
        kv_blocks_cached: blocks whose content the prefix cache can hand out (held or free).
        prefix_cache_queries: tokens looked up in the prefix cache at admissions (a preempted
            request's prompt and generated tokens count again when it is admitted again).
        prefix_cache_hits: of those, tokens found (their prefill was skipped).
        preemptions: requests preempted.
        finished: finished requests by finish reason (``"stop"``, ``"length"``, ``"abort"``).
    """

    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    kv_blocks_cached: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    preemptions: int
    finished: dict[str, int]


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ConfigError(f"{name} must be >= 1, got {value}")
    return value


class Scheduler:
    """Decides, step by step, which tokens of which requests the model computes.

    Args:
        allocator: the KV-cache blocks shared by all requests.
        max_num_seqs: most requests running (holding blocks) at once.
        max_num_batched_tokens: most tokens in one step, decodes and prefill chunks together;
            longer prompts are prefilled in chunks over several steps.
        max_model_len: longest sequence (prompt + generated tokens) the model accepts.
        prefix_caching: reuse the KV blocks of cached prefixes (``llm.cache.prefix_caching``).
    """

    def __init__(
        self,
        allocator: BlockAllocator,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        prefix_caching: bool = True,
    ) -> None:
        if not isinstance(allocator, BlockAllocator):
            raise TypeError(f"allocator must be a BlockAllocator, got {type(allocator).__name__}")
        self.allocator = allocator
        self.max_num_seqs = _positive_int("max_num_seqs", max_num_seqs)
        self.max_num_batched_tokens = _positive_int(
            "max_num_batched_tokens", max_num_batched_tokens
        )
        self.max_model_len = _positive_int("max_model_len", max_model_len)
        if not isinstance(prefix_caching, bool):
            raise TypeError(f"prefix_caching must be a bool, got {type(prefix_caching).__name__}")
        self.prefix_caching = prefix_caching
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # sorted by arrival, oldest first
        self.finished: list[Request] = []  # every finished request, in finishing order
        self.num_preemptions = 0
        self.prefix_cache_queries = 0
        """Tokens looked up in the prefix cache at admissions (0 with prefix caching off)."""
        self.prefix_cache_hits = 0
        """Tokens found in the prefix cache at admissions (their prefill was skipped)."""
        self._finished_counts: dict[str, int] = {}
        self._requests: dict[str, Request] = {}  # unfinished requests by id
        # chained hashes of each unfinished request's full blocks, extended lazily; they depend
        # only on the tokens, so they survive preemption
        self._block_hashes: dict[str, list[BlockHash]] = {}
        self._next_arrival = 0
        self._step = 0
        self._pending: SchedulerOutput | None = None

    # ---------------------------------------------------------------- requests

    def add_request(self, request: Request) -> None:
        """Queue a request.

        Args:
            request: a new request (status WAITING, never added before).

        Raises:
            RequestTooLongError: prompt + max_tokens exceed ``max_model_len``, or the request
                could not fit the whole KV cache even alone. The scheduler is unchanged.
            InvalidRequestError: the id is already in use or the request was used before.
        """
        if not isinstance(request, Request):
            raise TypeError(f"expected a Request, got {type(request).__name__}")
        rid = request.request_id
        if rid in self._requests:
            raise InvalidRequestError(f"request id {rid!r} is already in the scheduler")
        if request.status is not RequestStatus.WAITING or request.arrival >= 0:
            raise InvalidRequestError(
                f"request {rid!r} was already scheduled once (status {request.status.value})"
            )
        self.check_fits(request)
        request.arrival = self._next_arrival
        self._next_arrival += 1
        self._requests[rid] = request
        self.waiting.append(request)

    def check_fits(self, request: Request) -> None:
        """Raise :class:`RequestTooLongError` if ``request`` could never be served (see
        :func:`check_fits`)."""
        a = self.allocator
        check_fits(request, self.max_model_len, a.num_blocks, a.block_size)

    def finish_request(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> bool:
        """Finish a request now and free its blocks.

        For stops the scheduler cannot see (a stop string matched in the detokenized text) and
        for aborts. Called between ``schedule()`` and ``update()``, the request's part of the
        pending step is dropped by ``update()``.

        Args:
            request_id: the request's id.
            reason: recorded as the request's ``finish_reason``.

        Returns:
            True if it was unfinished, False if unknown or already finished.
        """
        if not isinstance(reason, FinishReason):
            raise TypeError(f"reason must be a FinishReason, got {type(reason).__name__}")
        req = self._requests.get(request_id)
        if req is None:
            return False
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        self._finish(req, reason)
        return True

    def abort_request(self, request_id: str) -> bool:
        """Finish a request now with reason ABORT (see :meth:`finish_request`).

        Returns:
            True if it was unfinished, False if unknown or already finished.
        """
        return self.finish_request(request_id, FinishReason.ABORT)

    def get_request(self, request_id: str) -> Request | None:
        """Return the unfinished request with this id, or None."""
        return self._requests.get(request_id)

    def has_unfinished(self) -> bool:
        """True while any request is waiting or running."""
        return bool(self._requests)

    @property
    def num_waiting(self) -> int:
        """Requests queued (new or preempted)."""
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        """Requests holding blocks."""
        return len(self.running)

    def stats(self) -> SchedulerStats:
        """Return the gauges and counters the metrics report.

        Only reads counters; call it from the thread that drives the scheduler for an exact
        snapshot.
        """
        a = self.allocator
        return SchedulerStats(
            running=len(self.running),
            waiting=len(self.waiting),
            kv_blocks_used=a.num_used,
            kv_blocks_total=a.num_blocks,
            kv_blocks_cached=a.num_cached,
            prefix_cache_queries=self.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits,
            preemptions=self.num_preemptions,
            finished=dict(self._finished_counts),
        )

    def reset_prefix_cache(self) -> int:
        """Forget every cached block (call it when an adapter's or the model's weights change).

        Returns:
            The number of cache entries dropped.
        """
        return self.allocator.reset_prefix_cache()

    # ---------------------------------------------------------------- scheduling

    def schedule(self) -> SchedulerOutput:
        """Build the next step's batch, allocating the blocks it writes to.

        Returns:
            The batch; empty only when there is nothing to do.

        Raises:
            SchedulerError: the previous output has not been passed to :meth:`update`.
        """
        if self._pending is not None:
            raise SchedulerError(
                f"schedule() called again before update() for step {self._pending.step}"
            )
        out = SchedulerOutput(step=self._step)
        self._step += 1
        budget = self.max_num_batched_tokens

        decoding = [r for r in self.running if not r.in_prefill]
        prefilling = [r for r in self.running if r.in_prefill]
        for req in decoding + prefilling:
            if budget == 0:
                break
            if req.status is not RequestStatus.RUNNING:  # preempted earlier in this step
                continue
            want = min(req.num_tokens - req.num_computed_tokens, budget)
            length = self._grow_or_preempt(req, want, out)
            if length == 0:  # req preempted itself
                continue
            sched = self._make_scheduled(req, length)
            (out.prefills if sched.is_prefill else out.decodes).append(sched)
            budget -= length

        # NOTE: after a preemption the cache is full; admitting the victim (or anyone) again now
        # would only get it preempted again next step.
        while (
            not out.preempted
            and self.waiting
            and budget > 0
            and len(self.running) < self.max_num_seqs
        ):
            req = self.waiting[0]
            cached = self._cached_prefix(req)
            num_cached = len(cached) * self.allocator.block_size
            length = min(req.num_tokens - num_cached, budget)
            table = BlockTable(self.allocator)
            # cached blocks nobody holds count as free, and taking them uses that room up
            revived = sum(1 for b in cached if self.allocator.ref_count(b) == 0)
            need = table.blocks_needed(num_cached + length) - len(cached) + revived
            # admission needs blocks for the whole chunk; the queue is FIFO, so stop at the first
            # request that does not fit rather than letting later ones overtake it
            if not self.allocator.can_allocate(need):
                break
            self.waiting.popleft()
            table.share_prefix(cached)  # before allocating, which could evict them
            table.ensure_capacity(num_cached + length)
            if self.prefix_caching:
                self.prefix_cache_queries += req.num_tokens
                self.prefix_cache_hits += num_cached
            req.block_table = table
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_cached
            req.prefill_len = req.num_tokens
            bisect.insort(self.running, req, key=lambda r: r.arrival)
            out.prefills.append(self._make_scheduled(req, length))
            budget -= length

        self._pending = out
        return out

    def _cached_prefix(self, req: Request) -> list[int]:
        """The cached blocks of the longest cached prefix of ``req``'s tokens, leaving at least
        its last token to compute."""
        if not self.prefix_caching:
            return []
        return self.allocator.lookup(
            self._iter_hashes(req, (req.num_tokens - 1) // self.allocator.block_size))

    def _iter_hashes(self, req: Request, num_blocks: int) -> Iterator[BlockHash]:
        """Yield the hashes of ``req``'s first ``num_blocks`` full blocks, computing lazily."""
        hashes = self._block_hashes.setdefault(req.request_id, [])
        bs = self.allocator.block_size
        for i in range(num_blocks):
            if i == len(hashes):
                parent = hashes[-1] if hashes else None
                hashes.append(hash_block(parent, req.token_ids(i * bs, (i + 1) * bs), req.lora))
            yield hashes[i]

    def _cache_written_blocks(self, req: Request) -> None:
        """Offer ``req``'s blocks that its computed tokens fill to the prefix cache."""
        table = req.block_table
        assert table is not None
        full = req.num_computed_tokens // self.allocator.block_size
        if full > table.num_cached_blocks:
            hashes = list(self._iter_hashes(req, full))
            table.register_full_blocks(hashes, req.num_computed_tokens)

    def _grow_or_preempt(self, req: Request, want: int, out: SchedulerOutput) -> int:
        """Make room in ``req``'s block table for up to ``want`` more tokens.

        A prefill chunk shrinks to what the free blocks hold; only when not one token fits is the
        newest running request preempted, repeatedly, until one fits or ``req`` is the newest and
        preempts itself.

        Returns:
            Tokens that now fit (``1 .. want``), or 0 when ``req`` was preempted.
        """
        table = req.block_table
        assert table is not None
        start = req.num_computed_tokens
        bs = self.allocator.block_size
        while True:
            fits = min(want, table.capacity_tokens + self.allocator.num_free * bs - start)
            if fits > 0:
                table.ensure_capacity(start + fits)
                return fits
            victim = self.running[-1]
            self._preempt(victim, out)
            if victim is req:
                return 0

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        """Free all of ``req``'s blocks and queue it at the front for recomputation."""
        # NOTE: a victim is never in this step's batch yet. Running requests are in arrival
        # order; every admission step leaves at most one prefill unfinished, the newest, so the
        # decodes-then-prefills loop visits them oldest first, and a victim (the newest) is
        # either the requester itself or one not visited yet.
        assert all(s.request is not req for s in out.scheduled), "preempting a scheduled request"
        self.running.remove(req)
        assert req.block_table is not None
        req.block_table.free()
        req.block_table = None
        req.num_computed_tokens = 0
        req.prefill_len = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        # victims are taken newest first, so pushing each to the front keeps the queue in
        # arrival order
        self.waiting.appendleft(req)
        out.preempted.append(req)

    def _make_scheduled(self, req: Request, length: int) -> ScheduledRequest:
        table = req.block_table
        assert table is not None
        start = req.num_computed_tokens
        end = start + length
        return ScheduledRequest(
            request=req,
            token_ids=req.token_ids(start, end),
            position_ids=list(range(start, end)),
            slots_mapping=table.slots(start, length),
            block_table=table.block_ids,
            seq_len=end,
            query_len=length,
            needs_logits=end == req.num_tokens,
            is_prefill=req.in_prefill,
        )

    # ---------------------------------------------------------------- results

    def update(self, output: SchedulerOutput, sampled_tokens: Mapping[str, int]) -> list[Request]:
        """Record that the model ran ``output`` and append the sampled tokens.

        Tokens are appended only for requests whose ``needs_logits`` is set (their prompt is
        fully computed); tokens given for other scheduled requests (a runner that samples every
        row) are ignored. Blocks the step filled are offered to the prefix cache (their KV
        entries are now written). Finished requests free their blocks at once.

        Args:
            output: the output of the last :meth:`schedule` call.
            sampled_tokens: request id -> sampled token id.

        Returns:
            The requests that finished in this step.

        Raises:
            SchedulerError: ``output`` is not the pending output.
            InvalidRequestError: a token is missing for a request that needs one, a token is not
                a non-negative int, or an id was not scheduled in this step. Nothing changes.
        """
        if output is not self._pending:
            pending = self._pending.step if self._pending else "none pending"
            raise SchedulerError(
                f"update() expects the output of the last schedule() call (step {pending}), "
                f"got step {output.step}"
            )
        scheduled = output.scheduled
        ids = {s.request_id for s in scheduled}
        unknown = [rid for rid in sampled_tokens if rid not in ids]
        if unknown:
            raise InvalidRequestError(f"sampled tokens given for unscheduled requests {unknown}")
        tokens: dict[str, int] = {}
        for s in scheduled:
            if not s.needs_logits or s.request.status is not RequestStatus.RUNNING:
                continue
            if s.request_id not in sampled_tokens:
                raise InvalidRequestError(f"no sampled token for request {s.request_id!r}")
            tok = sampled_tokens[s.request_id]
            if isinstance(tok, bool):
                raise InvalidRequestError(f"sampled token for {s.request_id!r} is a bool")
            try:
                tok = operator.index(tok)
            except TypeError:
                raise InvalidRequestError(
                    f"sampled token for {s.request_id!r} must be an int, got {type(tok).__name__}"
                ) from None
            if tok < 0:
                raise InvalidRequestError(f"sampled token for {s.request_id!r} is negative: {tok}")
            tokens[s.request_id] = tok

        self._pending = None
        done: list[Request] = []
        for s in scheduled:
            req = s.request
            if req.status is not RequestStatus.RUNNING:  # aborted after schedule()
                continue
            req.num_computed_tokens += s.query_len
            if self.prefix_caching:
                self._cache_written_blocks(req)
            if not s.needs_logits:
                continue
            req.output_token_ids.append(tokens[req.request_id])
            reason = req.stop_reason()
            if reason is not None:
                self.running.remove(req)
                self._finish(req, reason)
                done.append(req)
        return done

    def _finish(self, req: Request, reason: FinishReason) -> None:
        if req.block_table is not None:
            req.block_table.free()
            req.block_table = None
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        del self._requests[req.request_id]
        self._block_hashes.pop(req.request_id, None)
        self._finished_counts[reason.value] = self._finished_counts.get(reason.value, 0) + 1
        self.finished.append(req)

    def __repr__(self) -> str:
        return (
            f"Scheduler(waiting={len(self.waiting)}, running={len(self.running)}, "
            f"finished={len(self.finished)}, free_blocks={self.allocator.num_free}/"
            f"{self.allocator.num_blocks}, preemptions={self.num_preemptions}, "
            f"prefix_cache_hits={self.prefix_cache_hits}/{self.prefix_cache_queries})"
        )
