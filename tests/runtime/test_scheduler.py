"""Tests of the continuous-batching scheduler, driven by a fake deterministic model.

The fake model keeps a fake paged KV cache that behaves like a real one: the entry it writes at
position ``p`` is a running hash of the adapter and every token up to ``p``, computed from the
entry at ``p - 1`` that it reads back through the block table (as attention reads the cached
keys and values). Its next token comes from the last entry, so a wrong slot, a block written by
two requests, a reused block whose content is another prefix's, a missed recompute after
preemption or a skipped chunk changes the generated tokens, and the test that compares them with
a plain one-request-at-a-time loop fails; every read also checks the entry it finds.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tgraph.errors import ConfigError, RequestTooLongError, TGraphError
from tgraph.runtime.block_manager import BlockAllocator
from tgraph.runtime.request import FinishReason, InvalidRequestError, Request, RequestStatus
from tgraph.runtime.scheduler import Scheduler, SchedulerError, SchedulerOutput

VOCAB = 13
EOS = 0


def kv_seed(lora: str | None) -> int:
    """The fake KV state before the first token: the adapter changes every entry."""
    return 17 if lora is None else 17 + sum(map(ord, lora))


def kv_entry(prev: int, token: int) -> int:
    """The fake KV entry of a token, from the entry before it."""
    return (prev * 1_000_003 + token + 1) % 2_147_483_647


def kv_entries(context: list[int], lora: str | None = None) -> list[int]:
    """The fake KV entries of a whole context, computed without any cache."""
    out, h = [], kv_seed(lora)
    for t in context:
        h = kv_entry(h, t)
        out.append(h)
    return out


def next_token(context: list[int], lora: str | None = None) -> int:
    """The fake model: a deterministic function of the adapter and every token so far."""
    return kv_entries(context, lora)[-1] % VOCAB


@dataclass(frozen=True)
class Spec:
    """How to build a request; Request objects are mutated by a run, so each run builds anew."""

    rid: str
    prompt: tuple[int, ...]
    max_tokens: int
    eos: tuple[int, ...] = (EOS,)
    stop: tuple[int, ...] = ()
    ignore_eos: bool = False
    lora: str | None = None

    def build(self) -> Request:
        return Request(
            self.rid,
            list(self.prompt),
            self.max_tokens,
            self.eos,
            self.stop,
            self.ignore_eos,
            lora=self.lora,
        )


def reference(spec: Spec) -> tuple[list[int], FinishReason]:
    """Generate for one request with a plain loop: no scheduler, no cache."""
    tokens, out = list(spec.prompt), []
    while True:
        t = next_token(tokens, spec.lora)
        tokens.append(t)
        out.append(t)
        if t in spec.stop or (not spec.ignore_eos and t in spec.eos):
            return out, FinishReason.STOP
        if len(out) >= spec.max_tokens:
            return out, FinishReason.LENGTH


class FakeModel:
    """Writes chained KV entries into a fake paged cache and samples from what it reads back."""

    def __init__(self, allocator: BlockAllocator) -> None:
        self.bs = allocator.block_size
        self.cache: list[tuple[int, int] | None] = [None] * allocator.capacity_tokens  # (pos, kv)
        self.computed_tokens: dict[str, int] = {}  # tokens written per request id

    def read(self, s, pos: int) -> int:
        entry = self.cache[s.block_table[pos // self.bs] * self.bs + pos % self.bs]
        assert entry is not None and entry[0] == pos, f"{s.request_id} pos {pos} reads {entry}"
        return entry[1]

    def step(self, out: SchedulerOutput) -> dict[str, int]:
        for s in out.scheduled:
            h = kv_seed(s.lora) if s.start == 0 else self.read(s, s.start - 1)
            for tok, pos, slot in zip(s.token_ids, s.position_ids, s.slots_mapping, strict=True):
                h = kv_entry(h, tok)
                self.cache[slot] = (pos, h)
            self.computed_tokens[s.request_id] = (
                self.computed_tokens.get(s.request_id, 0) + s.query_len
            )
        sampled = {}
        for s in out.scheduled:
            expected = kv_entries(s.request.all_token_ids[: s.seq_len], s.lora)
            got = [self.read(s, pos) for pos in range(s.seq_len)]
            assert got == expected, f"{s.request_id} reads a wrong KV entry"
            # NOTE: a token is sampled for every row, like a runner that samples the whole batch;
            # the scheduler must ignore the ones of unfinished prefill chunks
            sampled[s.request_id] = got[-1] % VOCAB
        return sampled


def check_step(sched: Scheduler, out: SchedulerOutput) -> None:
    """Invariants that must hold right after every schedule()."""
    alloc = sched.allocator
    bs = alloc.block_size
    held: dict[int, int] = {}
    for r in sched.running:
        ids = r.block_table.block_ids
        assert len(ids) == len(set(ids)), f"{r.request_id} holds a block twice"
        for b in ids:
            held[b] = held.get(b, 0) + 1
    assert all(alloc.ref_count(b) == n for b, n in held.items()), "a reference count is wrong"
    assert len(held) + alloc.num_free == alloc.num_blocks, "a block leaked"
    assert alloc.num_used == len(held)
    assert all(r.block_table is None for r in sched.waiting)
    assert [r.arrival for r in sched.waiting] == sorted(r.arrival for r in sched.waiting)
    assert [r.arrival for r in sched.running] == sorted(r.arrival for r in sched.running)
    assert len(sched.running) <= sched.max_num_seqs
    assert 0 < out.num_batched_tokens <= sched.max_num_batched_tokens
    assert all(not s.is_prefill and s.query_len == 1 and s.needs_logits for s in out.decodes)
    assert all(s.is_prefill for s in out.prefills)
    slots = out.flat_slots_mapping()
    assert len(slots) == len(set(slots)) == out.num_batched_tokens
    for s in out.scheduled:
        r = s.request
        assert r.status is RequestStatus.RUNNING
        assert s.start == r.num_computed_tokens and s.position_ids == list(
            range(s.start, s.seq_len)
        )
        assert s.token_ids == r.all_token_ids[s.start : s.seq_len]
        assert s.needs_logits == (s.seq_len == r.num_tokens)
        assert s.slots_mapping == [s.block_table[p // bs] * bs + p % bs for p in s.position_ids]
        assert len(s.block_table) * bs >= s.seq_len
        # a shared (cached) block is full: nobody writes into it again
        assert all(alloc.ref_count(slot // bs) == 1 for slot in s.slots_mapping)
    assert not {s.request_id for s in out.scheduled} & {r.request_id for r in out.preempted}


def run(
    sched: Scheduler, model: FakeModel | None = None, max_steps: int = 5000
) -> list[SchedulerOutput]:
    """Drive the scheduler with the fake model until every request finished."""
    model = model or FakeModel(sched.allocator)
    outputs = []
    while sched.has_unfinished():
        assert len(outputs) < max_steps, "no progress"
        out = sched.schedule()
        check_step(sched, out)
        sched.update(out, model.step(out))
        outputs.append(out)
    return outputs


def assert_matches_reference(sched: Scheduler, specs: list[Spec]) -> None:
    got = {r.request_id: (r.output_token_ids, r.finish_reason) for r in sched.finished}
    assert got == {s.rid: reference(s) for s in specs}
    assert all(r.block_table is None and r.status is RequestStatus.FINISHED for r in sched.finished)
    assert sched.allocator.num_free == sched.allocator.num_blocks
    assert sched.allocator.num_used == 0


def prompt(seed: int, n: int) -> tuple[int, ...]:
    return tuple((seed * 7 + 3 * i + 1) % VOCAB for i in range(n))


# ------------------------------------------------------------------ end to end


def test_more_requests_than_the_cache_holds_match_solo_runs_and_preempt():
    # 6 blocks of 4 = 24 slots; each request needs up to 15..22, together about 150
    specs = [Spec(f"r{i}", prompt(i, 3 + i), 12 + i % 3) for i in range(8)]
    specs.append(Spec("long-no-eos", prompt(9, 9), 12, ignore_eos=True))
    alloc = BlockAllocator(num_blocks=6, block_size=4)
    sched = Scheduler(alloc, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64)
    for s in specs:
        sched.add_request(s.build())
    outputs = run(sched)

    assert_matches_reference(sched, specs)
    assert sched.num_preemptions > 0 and any(o.preempted for o in outputs)
    recomputed = [r for r in sched.finished if r.num_preemptions > 0]
    assert recomputed, "no preempted request went on to finish"
    # the test covers both ways of finishing
    assert {r.finish_reason for r in sched.finished} == {FinishReason.STOP, FinishReason.LENGTH}
    # and the same requests run one at a time give the same tokens
    for s in specs:
        solo = Scheduler(BlockAllocator(6, 4), 1, 16, 64)
        solo.add_request(s.build())
        run(solo)
        assert solo.finished[0].output_token_ids == reference(s)[0]
        assert solo.num_preemptions == 0


def test_preempted_request_goes_to_front_and_is_recomputed_from_its_tokens():
    specs = [Spec(f"r{i}", prompt(i, 3), 6, ignore_eos=True) for i in range(3)]
    alloc = BlockAllocator(num_blocks=4, block_size=2)
    # without the prefix cache, which could hand r1 its own blocks back (tested below)
    sched = Scheduler(
        alloc, max_num_seqs=4, max_num_batched_tokens=8, max_model_len=16, prefix_caching=False
    )
    reqs = [s.build() for s in specs]
    for r in reqs:
        sched.add_request(r)
    model = FakeModel(alloc)

    def step() -> SchedulerOutput:
        out = sched.schedule()
        check_step(sched, out)
        sched.update(out, model.step(out))
        return out

    first = step()  # r0 and r1 take 2 blocks each; r2 waits
    assert [s.request_id for s in first.prefills] == ["r0", "r1"] and alloc.num_free == 0
    step()  # both decode position 3, still inside their second block
    out = sched.schedule()  # both need a third block: r0 preempts the newest, r1
    assert out.preempted == [reqs[1]]
    assert [s.request_id for s in out.decodes] == ["r0"] and not out.prefills
    assert reqs[1].status is RequestStatus.PREEMPTED and reqs[1].block_table is None
    assert reqs[1].num_computed_tokens == 0 and len(reqs[1].output_token_ids) == 2
    assert list(sched.waiting) == [reqs[1], reqs[2]]  # in front of the never-run r2
    sched.update(out, model.step(out))

    outputs = run(sched, model)
    again = next(s for o in outputs for s in o.prefills if s.request_id == "r1")
    assert (
        again.start == 0 and again.token_ids == list(specs[1].prompt) + reference(specs[1])[0][:2]
    )
    assert again.needs_logits
    assert_matches_reference(sched, specs)


def test_chunked_prefill_of_a_prompt_longer_than_the_token_budget():
    spec = Spec("long", prompt(1, 13), 3, ignore_eos=True)
    sched = Scheduler(BlockAllocator(8, 4), 4, max_num_batched_tokens=5, max_model_len=32)
    sched.add_request(spec.build())
    outputs = run(sched)
    chunks = [
        (s.start, s.query_len, s.needs_logits, s.is_prefill) for o in outputs for s in o.scheduled
    ]
    assert chunks == [
        (0, 5, False, True),
        (5, 5, False, True),
        (10, 3, True, True),
        (13, 1, True, False),
        (14, 1, True, False),
    ]
    assert_matches_reference(sched, [spec])


def test_decodes_come_first_and_share_the_budget_with_a_chunked_prefill():
    specs = [Spec("short", prompt(2, 2), 6, ignore_eos=True), Spec("long", prompt(3, 12), 2)]
    sched = Scheduler(BlockAllocator(16, 4), 4, max_num_batched_tokens=4, max_model_len=32)
    for s in specs:
        sched.add_request(s.build())
    outputs = run(sched)
    plan = [
        (
            [d.request_id for d in o.decodes],
            [(p.request_id, p.start, p.query_len) for p in o.prefills],
        )
        for o in outputs[:5]
    ]
    assert plan == [
        ([], [("short", 0, 2), ("long", 0, 2)]),
        (["short"], [("long", 2, 3)]),
        (["short"], [("long", 5, 3)]),
        (["short"], [("long", 8, 3)]),
        (["short"], [("long", 11, 1)]),
    ]
    assert_matches_reference(sched, specs)


def test_a_prefill_chunk_shrinks_to_the_free_blocks_instead_of_preempting():
    specs = [
        Spec("a", prompt(1, 2), 3, ignore_eos=True),
        Spec("b", prompt(2, 5), 2, ignore_eos=True),
    ]
    sched = Scheduler(BlockAllocator(4, 2), 4, max_num_batched_tokens=4, max_model_len=16)
    for s in specs:
        sched.add_request(s.build())
    outputs = run(sched)
    plan = [
        (
            [d.request_id for d in o.decodes],
            [(p.request_id, p.start, p.query_len) for p in o.prefills],
        )
        for o in outputs[:2]
    ]
    # step 1: "a" takes one of the two free blocks, so "b" gets 2 tokens (one block), not 3
    assert plan == [([], [("a", 0, 2), ("b", 0, 2)]), (["a"], [("b", 2, 2)])]
    assert not outputs[1].preempted
    assert_matches_reference(sched, specs)


def test_too_long_requests_are_refused_and_the_others_finish():
    # cache: 8 blocks of 2 = 16 token slots; max_model_len 20
    sched = Scheduler(BlockAllocator(8, 2), 4, 8, max_model_len=20)
    ok = [Spec("a", prompt(1, 4), 5), Spec("fills-cache", prompt(2, 10), 7, ignore_eos=True)]
    sched.add_request(ok[0].build())
    with pytest.raises(
        RequestTooLongError, match=r"15 tokens \+ max_tokens 6 = 21 .* max_model_len 20"
    ):
        sched.add_request(Spec("too-long", prompt(3, 15), 6).build())
    with pytest.raises(
        RequestTooLongError, match=r"needs up to 17 KV-cache tokens .* holds 16 tokens"
    ):
        sched.add_request(Spec("too-big", prompt(4, 10), 8).build())
    assert issubclass(RequestTooLongError, TGraphError) and issubclass(
        RequestTooLongError, ValueError
    )
    sched.add_request(ok[1].build())  # needs exactly the whole cache: accepted
    assert sched.num_waiting == 2
    run(sched)
    assert_matches_reference(sched, ok)


def test_max_num_seqs_is_respected():
    specs = [Spec(f"r{i}", prompt(i, 4), 5, ignore_eos=True) for i in range(6)]
    sched = Scheduler(
        BlockAllocator(64, 4), max_num_seqs=2, max_num_batched_tokens=64, max_model_len=32
    )
    for s in specs:
        sched.add_request(s.build())
    outputs = run(sched)  # check_step asserts running <= max_num_seqs after every step
    assert max(len(o.scheduled) for o in outputs) == 2
    assert len(outputs[0].prefills) == 2  # room for all six, the limit is what stops at two
    assert_matches_reference(sched, specs)


@pytest.mark.parametrize("prefix_caching", [True, False])
@settings(max_examples=120, deadline=None)
@given(
    block_size=st.sampled_from([1, 2, 4]),
    num_blocks=st.integers(2, 10),
    max_num_seqs=st.integers(1, 4),
    budget=st.integers(1, 12),
    shared=st.integers(0, 9),
    reqs=st.lists(
        st.tuples(st.integers(1, 10), st.integers(1, 8), st.booleans(), st.booleans()),
        min_size=1,
        max_size=6,
    ),
)
def test_random_workloads_give_the_same_tokens_as_solo_runs(
    prefix_caching, block_size, num_blocks, max_num_seqs, budget, shared, reqs
):
    alloc = BlockAllocator(num_blocks, block_size)
    sched = Scheduler(alloc, max_num_seqs, budget, max_model_len=16, prefix_caching=prefix_caching)
    accepted = []
    for i, (n, max_tokens, ignore_eos, lora) in enumerate(reqs):
        # the first ``shared`` tokens are common to every prompt, so the prefix cache gets hits
        tokens = (prompt(0, shared) + prompt(i + 1, n))[:n]
        spec = Spec(f"r{i}", tokens, max_tokens, ignore_eos=ignore_eos, lora="a" if lora else None)
        if n + max_tokens > 16 or n + max_tokens - 1 > alloc.capacity_tokens:
            with pytest.raises(RequestTooLongError):
                sched.add_request(spec.build())
        else:
            sched.add_request(spec.build())
            accepted.append(spec)
    run(sched)
    assert_matches_reference(sched, accepted)
    stats = sched.stats()
    assert stats.prefix_cache_hits <= stats.prefix_cache_queries
    if not prefix_caching:
        assert stats.prefix_cache_queries == 0 and alloc.num_cached == 0


# ------------------------------------------------------------------ prefix caching


def prefill_plan(outputs: list[SchedulerOutput], rid: str) -> list[tuple[int, int]]:
    """(start, query_len) of every prefill chunk of one request."""
    return [(p.start, p.query_len) for o in outputs for p in o.prefills if p.request_id == rid]


def test_a_later_request_reuses_the_longest_cached_prefix():
    system = prompt(5, 10)  # two full blocks of 4, and 2 tokens of a third
    first = Spec("first", system + (1, 2, 3), 3, ignore_eos=True)
    second = Spec("second", system + (4, 5), 3, ignore_eos=True)
    alloc = BlockAllocator(16, 4)
    sched = Scheduler(alloc, 4, 64, 32)
    model = FakeModel(alloc)
    sched.add_request(first.build())
    run(sched, model)
    assert alloc.num_cached == 3  # (13 prompt + 2 fed back outputs) // 4 full blocks written
    sched.add_request(second.build())
    outputs = run(sched, model)
    # blocks 0 and 1 hold the shared 8 tokens; block 2 differs (tokens 8..11 are not shared)
    assert prefill_plan(outputs, "second") == [(8, 4)]
    assert model.computed_tokens["second"] == 4 + 2  # the rest of the prompt, then 2 decodes
    stats = sched.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (13 + 12, 8)
    assert stats.finished == {"length": 2}
    assert_matches_reference(sched, [first, second])


def test_a_fully_cached_prompt_still_computes_its_last_token():
    spec = Spec("a", prompt(3, 8), 2, ignore_eos=True)
    again = Spec("b", prompt(3, 8), 2, ignore_eos=True)
    alloc = BlockAllocator(8, 4)
    sched = Scheduler(alloc, 4, 64, 32)
    model = FakeModel(alloc)
    for s in (spec, again):
        sched.add_request(s.build())
        outputs = run(sched, model)
    # 8 tokens fill both blocks, but the last one's logits are needed: block 1 is recomputed
    assert prefill_plan(outputs, "b") == [(4, 4)]
    assert sched.prefix_cache_hits == 4
    assert_matches_reference(sched, [spec, again])


def test_other_adapters_never_share_blocks():
    base = Spec("base", prompt(2, 9), 2, ignore_eos=True)
    specs = [base, Spec("sql", base.prompt, 2, ignore_eos=True, lora="sql"),
             Spec("sql-again", base.prompt, 2, ignore_eos=True, lora="sql")]
    alloc = BlockAllocator(16, 4)
    sched = Scheduler(alloc, 4, 64, 32)
    model = FakeModel(alloc)
    plans = []
    for s in specs:
        sched.add_request(s.build())
        plans.append(prefill_plan(run(sched, model), s.rid)[0])
    assert plans == [(0, 9), (0, 9), (8, 1)]  # only the same adapter's blocks are reused
    assert_matches_reference(sched, specs)


def test_requests_admitted_together_compute_their_prefix_once_it_is_cached_later():
    system = prompt(4, 8)
    specs = [Spec(f"r{i}", system + (i,), 2, ignore_eos=True) for i in range(3)]
    alloc = BlockAllocator(16, 4)
    sched = Scheduler(alloc, 4, 64, 32)
    model = FakeModel(alloc)
    for s in specs[:2]:
        sched.add_request(s.build())
    first = sched.schedule()
    # nothing is cached before a step has written it: both compute the whole prompt
    assert [(p.start, p.query_len) for p in first.prefills] == [(0, 9), (0, 9)]
    sched.update(first, model.step(first))
    # both wrote the same two blocks; the first registered wins, the copy stays private
    assert alloc.num_cached == 2 and alloc.num_used == 6
    sched.add_request(specs[2].build())
    outputs = run(sched, model)
    assert prefill_plan(outputs, "r2") == [(8, 1)]
    assert_matches_reference(sched, specs)


def test_only_written_blocks_are_cached():
    a = Spec("a", prompt(7, 13), 2, ignore_eos=True)
    alloc = BlockAllocator(8, 4)
    sched = Scheduler(alloc, 4, max_num_batched_tokens=5, max_model_len=32)
    model = FakeModel(alloc)
    sched.add_request(a.build())
    out = sched.schedule()  # positions 0..4: block 1 is allocated but only 1 of 4 is written
    sched.update(out, model.step(out))
    assert alloc.num_cached == 1
    sched.abort_request("a")  # block 1 is never completed
    b = Spec("b", a.prompt, 2, ignore_eos=True)
    sched.add_request(b.build())
    assert prefill_plan(run(sched, model), "b") == [(4, 5), (9, 4)]
    assert sched.finished[-1].output_token_ids == reference(b)[0]


def test_chunked_prefill_starts_after_the_cached_prefix():
    system = prompt(6, 12)
    specs = [Spec("a", system + (1,), 2, ignore_eos=True),
             Spec("b", system + (2, 3, 4, 5, 6), 2, ignore_eos=True)]
    alloc = BlockAllocator(16, 4)
    sched = Scheduler(alloc, 4, max_num_batched_tokens=3, max_model_len=32)
    model = FakeModel(alloc)
    sched.add_request(specs[0].build())
    run(sched, model)
    sched.add_request(specs[1].build())
    outputs = run(sched, model)
    assert prefill_plan(outputs, "b") == [(12, 3), (15, 2)]
    assert_matches_reference(sched, specs)


def test_a_preempted_request_gets_its_own_cached_blocks_back():
    # two requests of 8 prompt tokens in 10 blocks of 2: their decodes outgrow the cache
    specs = [Spec(f"r{i}", prompt(i, 8), 6, ignore_eos=True) for i in range(2)]
    alloc = BlockAllocator(num_blocks=10, block_size=2)
    sched = Scheduler(alloc, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=16)
    for s in specs:
        sched.add_request(s.build())
    outputs = run(sched)
    assert [r.request_id for o in outputs for r in o.preempted] == ["r1"]
    before = next(s for o in outputs for s in o.scheduled if s.request_id == "r1").block_table
    resumed = [p for o in outputs for p in o.prefills if p.request_id == "r1"][1]
    # r1 held 5 full blocks (8 prompt + 2 fed-back tokens); freed deepest first, its last two
    # were evicted for r0's decodes, its first three come back and 6 + 5 = 11 tokens
    # (8 prompt + 3 generated) are in the cache again
    assert (resumed.start, resumed.query_len) == (6, 5)
    assert resumed.block_table[:3] == before[:3]
    assert sched.prefix_cache_hits == 6
    assert_matches_reference(sched, specs)


def test_capacity_is_never_reduced_by_cached_blocks():
    alloc = BlockAllocator(6, 2)
    sched = Scheduler(alloc, 4, 64, 16)
    specs = [Spec(f"r{i}", prompt(i, 5), 2, ignore_eos=True) for i in range(3)]
    for s in specs:
        sched.add_request(s.build())
    run(sched)
    assert alloc.num_cached > 0 and alloc.num_free == 6  # cached but free
    big = Spec("big", prompt(9, 7), 6, ignore_eos=True)  # needs all 6 blocks (12 tokens)
    sched.add_request(big.build())
    run(sched)
    assert sched.num_preemptions == 0 and alloc.num_evictions > 0
    assert_matches_reference(sched, [*specs, big])


def test_prefix_caching_off_computes_everything():
    specs = [Spec(f"r{i}", prompt(1, 9), 2, ignore_eos=True) for i in range(2)]
    alloc = BlockAllocator(16, 4)
    sched = Scheduler(alloc, 4, 64, 32, prefix_caching=False)
    model = FakeModel(alloc)
    for s in specs:
        sched.add_request(s.build())
        run(sched, model)
    assert model.computed_tokens == {"r0": 10, "r1": 10}
    assert alloc.num_cached == 0 and sched.stats().prefix_cache_queries == 0
    assert_matches_reference(sched, specs)


def test_reset_prefix_cache_forgets_cached_blocks():
    spec = Spec("a", prompt(1, 9), 2, ignore_eos=True)
    alloc = BlockAllocator(16, 4)
    sched = Scheduler(alloc, 4, 64, 32)
    sched.add_request(spec.build())
    run(sched)
    assert sched.reset_prefix_cache() == 2 and alloc.num_cached == 0
    again = Spec("b", spec.prompt, 2, ignore_eos=True)
    sched.add_request(again.build())
    assert prefill_plan(run(sched), "b") == [(0, 9)]


# ------------------------------------------------------------------ stopping, aborting, protocol


def scripted_step(sched: Scheduler, token: int) -> SchedulerOutput:
    out = sched.schedule()
    sched.update(out, {s.request_id: token for s in out.scheduled if s.needs_logits})
    return out


@pytest.mark.parametrize(
    ("kwargs", "tokens", "expected"),
    [
        ({}, [5, 0, 5], ([5, 0], FinishReason.STOP)),
        ({"ignore_eos": True}, [5, 0, 5, 5], ([5, 0, 5, 5], FinishReason.LENGTH)),
        ({"ignore_eos": True, "stop_token_ids": [7]}, [0, 7, 5], ([0, 7], FinishReason.STOP)),
        ({"eos_token_ids": [3, 0]}, [5, 3], ([5, 3], FinishReason.STOP)),
        ({"eos_token_ids": None}, [0, 0, 0, 0], ([0, 0, 0, 0], FinishReason.LENGTH)),
    ],
)
def test_stop_conditions(kwargs, tokens, expected):
    alloc = BlockAllocator(8, 2)
    sched = Scheduler(alloc, 2, 8, 16)
    args = {"eos_token_ids": [0], **kwargs}
    req = Request("r", [1, 2, 3], max_tokens=4, **args)
    sched.add_request(req)
    for t in tokens:
        if not sched.has_unfinished():
            break
        scripted_step(sched, t)
    assert not sched.has_unfinished()
    assert (req.output_token_ids, req.finish_reason) == expected
    assert alloc.num_free == 8 and sched.finished == [req]


def test_tokens_for_unfinished_prefill_chunks_are_ignored():
    sched = Scheduler(BlockAllocator(8, 2), 2, 3, 16)
    req = Request("r", [1, 2, 3, 4, 5], max_tokens=2)
    sched.add_request(req)
    out = sched.schedule()
    assert not out.scheduled[0].needs_logits
    assert sched.update(out, {"r": 9}) == []
    assert req.output_token_ids == [] and req.num_computed_tokens == 3


def test_abort_frees_blocks_and_finishes():
    alloc = BlockAllocator(8, 2)
    sched = Scheduler(alloc, 1, 8, 16)
    a, b = Request("a", [1, 2, 3], 4), Request("b", [1], 4)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    assert a.status is RequestStatus.RUNNING and b.status is RequestStatus.WAITING
    assert sched.abort_request("a") and sched.abort_request("b")
    assert not sched.abort_request("a") and not sched.abort_request("nope")
    assert sched.update(out, {"a": 1}) == []  # the aborted request's step is dropped
    assert a.output_token_ids == [] and a.finish_reason is FinishReason.ABORT
    assert alloc.num_free == 8 and not sched.has_unfinished()


def test_finish_request_from_outside_for_stop_strings():
    alloc = BlockAllocator(8, 2)
    sched = Scheduler(alloc, 2, 8, 16)
    req = Request("r", [1, 2], 5)
    sched.add_request(req)
    scripted_step(sched, 4)
    assert sched.finish_request("r", FinishReason.STOP)
    assert req.finish_reason is FinishReason.STOP and req.output_token_ids == [4]
    assert alloc.num_free == 8 and sched.finished == [req] and not sched.has_unfinished()
    with pytest.raises(TypeError, match="FinishReason"):
        sched.finish_request("r", "stop")


def test_request_from_sampling_params():
    from tgraph.runtime.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=7, stop_token_ids=[3], ignore_eos=True, lora="sql")
    req = Request.from_sampling_params("r", [1, 2], params, eos_token_ids=2)
    assert (req.max_tokens, req.stop_token_ids, req.eos_token_ids) == (7, (3,), (2,))
    assert req.ignore_eos and req.lora == "sql" and req.sampling_params is params


def test_protocol_errors():
    sched = Scheduler(BlockAllocator(8, 2), 2, 8, 16)
    req = Request("r", [1, 2], 3)
    sched.add_request(req)
    with pytest.raises(InvalidRequestError, match="already in the scheduler"):
        sched.add_request(Request("r", [1], 1))
    out = sched.schedule()
    with pytest.raises(SchedulerError, match="before update"):
        sched.schedule()
    with pytest.raises(InvalidRequestError, match="no sampled token for request 'r'"):
        sched.update(out, {})
    with pytest.raises(InvalidRequestError, match="unscheduled"):
        sched.update(out, {"r": 1, "x": 2})
    with pytest.raises(InvalidRequestError, match="must be an int"):
        sched.update(out, {"r": 1.5})
    with pytest.raises(InvalidRequestError, match="negative"):
        sched.update(out, {"r": -1})
    assert (
        req.num_computed_tokens == 0 and req.output_token_ids == []
    )  # failed updates changed nothing
    sched.update(out, {"r": 4})
    with pytest.raises(SchedulerError, match="last schedule"):
        sched.update(out, {"r": 4})
    assert req.output_token_ids == [4]
    while sched.has_unfinished():
        scripted_step(sched, 4)
    with pytest.raises(InvalidRequestError, match="already scheduled once"):
        sched.add_request(req)


def test_empty_schedule_when_idle():
    sched = Scheduler(BlockAllocator(2, 2), 1, 4, 8)
    out = sched.schedule()
    assert out.is_empty and out.num_batched_tokens == 0
    sched.update(out, {})


def test_output_flat_metadata():
    sched = Scheduler(BlockAllocator(8, 2), 4, 16, 16)
    a, b = Request("a", [5, 6, 7], 3, lora="math"), Request("b", [8, 9], 3)
    sched.add_request(a)
    sched.add_request(b)
    sched.update(sched.schedule(), {"a": 1, "b": 2})
    sched.add_request(Request("c", [1, 2, 3, 4], 3))
    out = sched.schedule()
    assert [s.request_id for s in out.scheduled] == ["a", "b", "c"]
    assert out.flat_token_ids() == [1, 2, 1, 2, 3, 4]
    assert out.flat_position_ids() == [3, 2, 0, 1, 2, 3]
    assert out.query_start_loc() == [0, 1, 2, 6]
    assert out.seq_len() == [4, 3, 4]
    assert out.lm_head_indices() == [0, 1, 5]
    assert out.scheduled[0].lora == "math" and out.scheduled[1].lora is None
    rows = out.block_table_rows(pad_value=-1, width=3)
    assert rows == [s.block_table + [-1] * (3 - len(s.block_table)) for s in out.scheduled]
    with pytest.raises(ValueError, match="width"):
        out.block_table_rows(width=1)


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"prompt_token_ids": []}, InvalidRequestError, "empty prompt"),
        ({"max_tokens": 0}, InvalidRequestError, "max_tokens must be >= 1"),
        ({"prompt_token_ids": [1, -2]}, InvalidRequestError, "non-negative"),
        ({"prompt_token_ids": [1, 2.0]}, TypeError, "ints"),
        ({"prompt_token_ids": "hello"}, TypeError, "token ids"),
        ({"request_id": 3}, TypeError, "request_id"),
        ({"lora": 1}, TypeError, "lora"),
    ],
)
def test_bad_requests_are_refused(kwargs, exc, match):
    args = {"request_id": "r", "prompt_token_ids": [1, 2], "max_tokens": 2, **kwargs}
    with pytest.raises(exc, match=match):
        Request(**args)


@pytest.mark.parametrize(
    ("args", "exc"),
    [
        ((BlockAllocator(2, 2), 0, 4, 8), ConfigError),
        ((BlockAllocator(2, 2), 1, 0, 8), ConfigError),
        ((BlockAllocator(2, 2), 1, 4, 0), ConfigError),
        ((BlockAllocator(2, 2), 1.0, 4, 8), TypeError),
        ((None, 1, 4, 8), TypeError),
        ((BlockAllocator(2, 2), 1, 4, 8, 1), TypeError),
    ],
)
def test_scheduler_rejects_bad_settings(args, exc):
    with pytest.raises(exc):
        Scheduler(*args)
