"""The Python API: ``LLM(model_dir).generate(prompts, SamplingParams(...))``.

Tensor parallelism: run the same script on every rank with ``torchrun --nproc-per-node N``.
``LLM`` sees torchrun's environment, joins the process group (NCCL on ``cuda:LOCAL_RANK``, gloo
on CPU), loads the rank's shards and checks that every rank got the same settings and model.
Every rank must then make the same calls with the same prompts: rank 0 samples and broadcasts
the tokens, the others run the same scheduler steps on them. A request that one rank rejects is
rejected on every rank with the same exception type, so the ranks stay in step.
"""
from __future__ import annotations

import hashlib
import json
import logging
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from tgraph.config import Settings, load_settings, parse_override, tuning_of
from tgraph.errors import ConfigError, RequestTooLongError
from tgraph.models.loading import load_model
from tgraph.nn import distributed
from tgraph.runtime.block_manager import BlockAllocator
from tgraph.runtime.kv_cache import bytes_per_block, plan_num_blocks
from tgraph.runtime.request import FinishReason, Request
from tgraph.runtime.runner import ModelRunner, RankFailedError, synchronize
from tgraph.runtime.sampler import TokenLogprobs
from tgraph.runtime.sampling_params import SamplingParams
from tgraph.runtime.scheduler import Scheduler, SchedulerOutput
from tgraph.runtime.stop import StopChecker

logger = logging.getLogger("tgraph.runtime")

# Short keyword overrides of LLM(...) -> settings keys.
_SHORT_KEYS = {
    "graph": "llm.engine.graph", "cuda_graph": "llm.engine.cuda_graph",
    "batch_buckets": "llm.engine.batch_buckets", "disabled_passes": "llm.engine.disabled_passes",
    "prefill_graph_tokens": "llm.engine.prefill_graph_tokens",
    "block_size": "llm.cache.block_size", "num_blocks": "llm.cache.num_blocks",
    "gpu_memory_utilization": "llm.cache.gpu_memory_utilization",
    "max_num_seqs": "llm.scheduler.max_num_seqs",
    "max_num_batched_tokens": "llm.scheduler.max_num_batched_tokens",
    "dtype": "llm.model.dtype", "device": "llm.model.device",
    "capture_collectives": "llm.engine.capture_collectives",
}

# Errors a rank re-raises, by name, when another rank rejected a request (the same type on
# every rank keeps SPMD scripts that catch it in step).
_SHARED_ERRORS: dict[str, type[Exception]] = {
    cls.__name__: cls for cls in (RequestTooLongError, ConfigError, ValueError, TypeError)}


@dataclass
class RequestOutput:
    """The result of one prompt.

    Attributes:
        text: generated text (stop strings removed); ``""`` without a tokenizer.
        token_ids: generated token ids.
        finish_reason: ``"stop"`` or ``"length"``.
        logprobs: per generated token, when asked for.
        time_to_first_token, total_seconds: wall-clock timings from submission.
    """

    request_id: str
    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[TokenLogprobs] | None = None
    time_to_first_token: float | None = None
    total_seconds: float = 0.0

    @property
    def tokens_per_second(self) -> float:
        return len(self.token_ids) / self.total_seconds if self.total_seconds > 0 else 0.0


@dataclass
class StreamEvent:
    """New output of one request: text and tokens since the last event."""

    request_id: str
    text: str
    token_ids: list[int]
    finished: bool
    output: RequestOutput


class LLM:
    """Load a model directory and serve prompts with continuous batching.

    Args:
        model_dir: Hugging Face-style directory (config.json, safetensors, tokenizer files).
        config: a settings JSON file, or :class:`Settings`.
        tokenizer: a tokenizer to use instead of the one in ``model_dir``.
        max_model_len: longest prompt + output (default: the model's, capped at 8192).
        module_map: a Python file registering custom models.
        loras: LoRA adapters (PEFT directories) by name, loaded into the multi-LoRA feature; a
            request picks one with ``SamplingParams(lora=NAME)`` or ``generate(..., lora=NAME)``.
        dist_timeout: seconds a tensor-parallel rank waits in a collective for the others before
            failing (default 300); only used under torchrun with more than one rank.
        overrides: settings by dotted key (``{"llm.engine.graph": "eager"}``) or by short name
            (``graph``, ``cuda_graph``, ``num_blocks``, ``block_size``, ``max_num_seqs``,
            ``max_num_batched_tokens``, ``dtype``, ``device``, ``gpu_memory_utilization``...).

    Under torchrun (``WORLD_SIZE`` > 1) the model is split over the ranks; see the module doc.
    """

    def __init__(self, model_dir: str | Path, config: str | Path | Settings | None = None, *,
                 tokenizer: Any = None, max_model_len: int | None = None,
                 module_map: str | Path | None = None, settings_overrides: Sequence[str] = (),
                 loras: dict[str, str | Path] | None = None, dist_timeout: float | None = None,
                 **overrides: Any) -> None:
        mapped = {}
        for key, value in overrides.items():
            if key not in _SHORT_KEYS and "." not in key:
                raise ConfigError(f"unknown LLM option {key!r}; expected one of "
                                  f"{sorted(_SHORT_KEYS)} or a dotted settings key")
            mapped[_SHORT_KEYS.get(key, key)] = list(value) if isinstance(value, tuple) else value
        if isinstance(config, Settings):
            settings = load_settings(None, mapped, base=config)
        else:
            settings = load_settings(config, mapped)
        if settings_overrides:
            settings = load_settings(None, dict(parse_override(o) for o in settings_overrides),
                                     base=settings)
        self.settings = settings
        llm = settings.llm
        self.dist_info, self._owns_group = _join_tensor_parallel(settings, dist_timeout)
        rank = self.dist_info.rank if self.dist_info else 0
        world_size = self.dist_info.world_size if self.dist_info else 1
        device = self.dist_info.device if self.dist_info else llm.model.device
        if world_size > 1:
            # Before any weight is read: differing settings would make the ranks diverge.
            distributed.check_same_config(settings.to_dict(), what="configuration")
        rules = None
        if llm.engine.rules:
            from tgraph.rules import load_rules

            rules = load_rules(llm.engine.rules)  # bad rules are refused before weights load
        start = time.perf_counter()
        # The rules are applied before any graph is recorded; placed weights load in place.
        self.model = load_model(
            model_dir, dtype=llm.model.dtype, device=device, max_model_len=max_model_len,
            module_map=module_map, graph=llm.engine.graph, cuda_graph=llm.engine.cuda_graph,
            block_size=llm.cache.block_size, batch_buckets=tuple(llm.engine.batch_buckets),
            prefill_graph_tokens=llm.engine.prefill_graph_tokens,
            disabled_passes=tuple(llm.engine.disabled_passes), tuning=tuning_of(settings),
            rank=rank, world_size=world_size, rules=rules)
        if world_size > 1:
            distributed.check_same_config(self.model.llm_config, what="model config")
        self.load_seconds = time.perf_counter() - start
        self.tokenizer = tokenizer if tokenizer is not None else _load_tokenizer(model_dir)
        # Adapters first: loading the first one re-lays the target weights out with room for
        # the adapters' B columns, which the KV-cache sizing below must see, and which would
        # otherwise drop the decode graphs captured below.
        for name, path in (loras or {}).items():
            self.load_lora(name, path)
        c = self.model.llm_config
        num_blocks = plan_num_blocks(self.model, llm.cache.num_blocks,
                                     llm.cache.gpu_memory_utilization, llm.scheduler.max_num_seqs,
                                     llm.scheduler.max_num_batched_tokens)
        # Free GPU memory may differ per rank; every rank's scheduler must see the same cache.
        num_blocks = distributed.min_over_ranks(num_blocks)
        self.model.allocate_kv_cache(num_blocks)
        self.num_blocks = num_blocks
        self.capacity_tokens = num_blocks * c.block_size
        logger.info("KV cache: %d blocks x %d tokens = %d tokens (%.2f GiB)", num_blocks,
                    c.block_size, self.capacity_tokens,
                    num_blocks * bytes_per_block(self.model) / 2**30)
        self.captured_buckets = self.model.capture_decode_graphs(
            [b for b in c.batch_buckets if b <= llm.scheduler.max_num_seqs])
        self.scheduler = Scheduler(BlockAllocator(num_blocks, c.block_size),
                                   max_num_seqs=llm.scheduler.max_num_seqs,
                                   max_num_batched_tokens=llm.scheduler.max_num_batched_tokens,
                                   max_model_len=c.max_model_len)
        self.runner = ModelRunner(self.model)
        # Request ids are taken only once a stream's requests are accepted (on every rank), so
        # a rejected call leaves the ranks' counters equal.
        self._next_id = 0
        self.eos_token_ids = _eos_ids(self.model.config, self.tokenizer)

    @property
    def rank(self) -> int:
        """This process's tensor-parallel rank (0 without tensor parallelism)."""
        return self.model.llm_config.rank

    @property
    def world_size(self) -> int:
        """Number of tensor-parallel ranks (1 without tensor parallelism)."""
        return self.model.llm_config.world_size

    def close(self) -> None:
        """Leave the process group this ``LLM`` joined (no-op otherwise); call it on every rank
        at the end of a tensor-parallel run."""
        if self._owns_group:
            self.model.release_graphs()  # they may hold NCCL collectives
            distributed.destroy_process_group()
            self._owns_group = False

    def load_lora(self, name: str, path: str | Path) -> None:
        """Load a PEFT adapter for requests that name it (multi-LoRA: mixed in one batch)."""
        features = getattr(self.model, "features", {})
        if "multi_lora" not in features:
            raise ConfigError(f"{type(self.model).__name__} has no multi-LoRA feature")
        features["multi_lora"].load(name, path)

    def unload_lora(self, name: str) -> None:
        self.model.features["multi_lora"].unload(name)

    # ---- prompts -------------------------------------------------------------------------------
    def encode(self, prompt: str | Sequence[int], chat: bool = False) -> list[int]:
        """Token ids of a prompt (text is tokenised; with ``chat`` the chat template is used)."""
        if not isinstance(prompt, str):
            ids = list(prompt)
            if not ids or not all(isinstance(t, int) for t in ids):
                raise ValueError("a prompt is a string or a non-empty list of token ids")
            return ids
        if self.tokenizer is None:
            raise ConfigError("this model directory has no tokenizer: pass token ids")
        if chat and getattr(self.tokenizer, "chat_template", None):
            return list(self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True,
                return_dict=False))
        return list(self.tokenizer.encode(prompt))

    # ---- generation ------------------------------------------------------------------------------
    def stream(self, prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
               params: SamplingParams | Sequence[SamplingParams] | None = None, *,
               chat: bool = False, lora: str | None = None) -> Iterator[StreamEvent]:
        """Submit prompts and yield their output as it is produced (continuous batching).

        A prompt that can never fit (longer than ``max_model_len`` or the whole cache) raises
        :class:`RequestTooLongError` before anything runs; no other prompt is lost. Under tensor
        parallelism every rank must stream the same prompts and consume the events alike; a
        request any rank rejects raises on every rank.
        """
        try:
            states = self._prepare(prompts, params, chat, lora)
            error = None
        except Exception as err:  # shared with the other ranks before it is raised
            states, error = {}, err
        if self.world_size > 1:
            self._agree_on_requests(states, error)
        elif error is not None:
            raise error
        self._next_id += len(states)
        for state in states.values():
            self.scheduler.add_request(state.request)
        try:
            yield from self._loop(states)
        finally:
            for rid, state in states.items():
                if not state.done:
                    self.scheduler.abort_request(rid)

    def _prepare(self, prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None, chat: bool,
                 lora: str | None) -> dict[str, _State]:
        """Encode and check the requests; raises before anything is queued."""
        batch = [prompts] if isinstance(prompts, str) or (
            prompts and isinstance(prompts[0], int)) else list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(batch)
        if len(params) != len(batch):
            raise ValueError(f"got {len(params)} SamplingParams for {len(batch)} prompts")
        states: dict[str, _State] = {}
        for i, (prompt, p) in enumerate(zip(batch, params)):
            if lora is not None and p.lora is None:
                p = _with_lora(p, lora)
            ids = self.encode(prompt, chat)
            rid = f"req-{self._next_id + i}"
            request = Request.from_sampling_params(rid, ids, p, self.eos_token_ids)
            states[rid] = _State(request, RequestOutput(rid, ids), time.perf_counter(),
                                 StopChecker(self.tokenizer, p, self.eos_token_ids, ids)
                                 if self.tokenizer is not None else None)
        # Reject what can never fit before anything is queued, so that no request is lost.
        for state in states.values():
            self.scheduler.check_fits(state.request)
        return states

    def _agree_on_requests(self, states: dict[str, _State], error: Exception | None) -> None:
        """Every rank shares whether it accepted its requests and a digest of them; then each
        raises if any rank failed or the requests differ, so no rank runs a step alone."""
        digest = hashlib.sha256(json.dumps(
            [[rid, s.request.prompt_token_ids, distributed.config_json(s.request.sampling_params)]
             for rid, s in states.items()]).encode()).hexdigest()
        mine = {"error": None if error is None else [type(error).__name__, str(error)],
                "digest": digest}
        reports = [json.loads(b) for b in
                   distributed.all_gather_bytes(json.dumps(mine).encode())]
        if error is not None:
            raise error
        failed = [(r, rep["error"]) for r, rep in enumerate(reports) if rep["error"]]
        if failed:
            r, (kind, message) = failed[0]
            raise _SHARED_ERRORS.get(kind, RankFailedError)(
                f"rank {r} rejected the request(s) with {kind}: {message}")
        differ = [r for r, rep in enumerate(reports) if rep["digest"] != reports[0]["digest"]]
        if differ:
            raise ConfigError(f"ranks {differ} submitted other prompts or sampling parameters "
                              "than rank 0; under tensor parallelism every rank must call "
                              "generate/stream with the same requests")

    def generate(self, prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 chat: bool = False, lora: str | None = None,
                 progress: bool | None = None) -> list[RequestOutput]:
        """Generate for every prompt; returns one :class:`RequestOutput` per prompt, in order.

        Under tensor parallelism every rank returns the same ``token_ids``, ``text`` and
        ``finish_reason``; ``logprobs`` are only on rank 0 (``None`` elsewhere) and the timings
        are each rank's own.

        Args:
            progress: show a progress bar of generated tokens (default: for long generations,
                at least 1024 requested tokens, when stderr is a terminal; rank 0 only).
        """
        n = 1 if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)) \
            else len(prompts)
        per = [params] * n if params is None or isinstance(params, SamplingParams) else params
        budget = sum((p or SamplingParams()).max_tokens for p in per)
        if progress is None:
            progress = budget >= 1024 and sys.stderr.isatty()
        progress = progress and self.rank == 0
        bar = tqdm(total=budget, unit="tok", desc="generating", disable=not progress)
        outputs: dict[str, RequestOutput] = {}
        for event in self.stream(prompts, params, chat=chat, lora=lora):
            outputs[event.request_id] = event.output
            bar.update(len(event.token_ids))
        bar.close()
        return [outputs[r] for r in sorted(outputs, key=lambda r: int(r.split("-")[1]))]

    def _loop(self, states: dict[str, _State]) -> Iterator[StreamEvent]:
        device = self.model.llm_config.device
        while any(not s.done for s in states.values()):
            out = self.scheduler.schedule()
            if out.is_empty:
                raise RuntimeError("the scheduler has unfinished requests but scheduled nothing")
            try:
                result = self.runner.execute(out)
            except BaseException:
                self._drop_step(out)
                raise
            synchronize(device)
            now = time.perf_counter()
            finished = {r.request_id for r in self.scheduler.update(out, result.tokens)}
            for rid, token in result.tokens.items():
                state = states.get(rid)
                if state is None:
                    continue
                yield from self._emit(state, token, result.logprobs.get(rid), now,
                                      rid in finished)

    def _drop_step(self, out: SchedulerOutput) -> None:
        """A step that failed ends its requests: they are aborted and the step is closed, so
        the scheduler (and, under tensor parallelism, every rank's alike) can go on."""
        for s in out.scheduled:
            self.scheduler.abort_request(s.request_id)
        self.scheduler.update(out, {})

    def _emit(self, state: _State, token: int, logprobs: TokenLogprobs | None, now: float,
              finished: bool) -> Iterator[StreamEvent]:
        out = state.output
        if out.time_to_first_token is None:
            out.time_to_first_token = now - state.start
        out.token_ids.append(token)
        if state.request.sampling_params.logprobs is not None and logprobs is not None:
            out.logprobs = (out.logprobs or []) + [logprobs]
        text = ""
        if state.stop is not None:
            step = state.stop.step(token)
            text = step.text
            out.text += text
            if step.finished and not finished:
                # A stop string (seen only in text) ends the request here.
                self.scheduler.finish_request(out.request_id, FinishReason.STOP)
                finished = True
            if step.finished:
                # A stop string truncates the text; the tokens that formed it are kept.
                out.finish_reason = step.finish_reason
        if finished:
            state.done = True
            if out.finish_reason is None:
                out.finish_reason = (state.request.finish_reason.value
                                     if state.request.finish_reason else "stop")
        out.total_seconds = now - state.start
        yield StreamEvent(out.request_id, text, [token], state.done, out)


@dataclass
class _State:
    request: Request
    output: RequestOutput
    start: float
    stop: StopChecker | None
    done: bool = False


def _join_tensor_parallel(settings: Settings, timeout: float | None
                          ) -> tuple[distributed.DistInfo | None, bool]:
    """Join the process group when launched by torchrun with more than one rank.

    Returns:
        ``(info, owns_group)``: ``(None, False)`` for a single process; ``owns_group`` is False
        when the caller had already initialized ``torch.distributed``.
    """
    if distributed.launched_world_size() == 1:
        return None, False
    owned = not distributed.is_initialized()
    info = distributed.init_process_group(
        settings.llm.model.device,
        timeout=distributed.DEFAULT_TIMEOUT if timeout is None else timeout,
        capture_collectives=settings.llm.engine.capture_collectives)
    return info, owned


def _with_lora(p: SamplingParams, lora: str) -> SamplingParams:
    from dataclasses import replace

    return replace(p, lora=lora)


def _eos_ids(config, tokenizer) -> list[int]:
    ids = list(config.eos_token_ids)
    tok_eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    if tok_eos is not None and tok_eos not in ids:
        ids.append(tok_eos)
    return ids


def _load_tokenizer(model_dir: str | Path):
    from tgraph.io.checkpoint import load_tokenizer

    return load_tokenizer(model_dir)


__all__ = ["LLM", "RequestOutput", "SamplingParams", "StreamEvent", "RequestTooLongError"]
