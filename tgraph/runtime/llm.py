"""The Python API: ``LLM(model_dir).generate(prompts, SamplingParams(...))``.

``LLM`` loads the model and hands it to an :class:`~tgraph.runtime.engine_core.EngineCore`
(``llm.engine``), whose thread runs the scheduler and the model; ``generate`` and ``stream`` only
submit requests and read their own output queues. So one ``LLM`` is thread-safe: any number of
threads, streams and generate calls may share it, and each request gets the tokens it would get
alone (greedy, or seeded sampling).

Tensor parallelism: run the same script on every rank with ``torchrun --nproc-per-node N``.
``LLM`` sees torchrun's environment, joins the process group (NCCL on ``cuda:LOCAL_RANK``, gloo
on CPU), loads the rank's shards and checks that every rank got the same settings and model.
Then either every rank makes the same calls with the same prompts in the same order (one
thread per rank), or rank 0 calls ``llm.engine.lead()`` and takes the requests while the other
ranks call ``llm.engine.follow()`` (the server). Rank 0 samples and broadcasts the tokens; the
others run the same scheduler steps on them. A request that one rank rejects is rejected on
every rank with the same exception type, so the ranks stay in step.
"""
from __future__ import annotations

import gc
import logging
import operator
import os
import sys
import time
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from tgraph.config import Settings, load_settings, parse_override, tuning_of
from tgraph.errors import (
    ConfigError,
    InvalidRequestError,
    InvalidRequestTypeError,
    RequestTooLongError,
)
from tgraph.io.checkpoint import check_model_path
from tgraph.models.loading import check_max_model_len, load_model
from tgraph.nn import distributed
from tgraph.runtime.adapters import AdapterCommand, AdapterManager
from tgraph.runtime.block_manager import BlockAllocator
from tgraph.runtime.engine_core import BatchStream, EngineCore, EngineStats
from tgraph.runtime.kv_cache import bytes_per_block, plan_num_blocks
from tgraph.runtime.outputs import RequestOutput, StreamEvent
from tgraph.runtime.runner import ModelRunner
from tgraph.runtime.sampling_params import SamplingParams
from tgraph.runtime.scheduler import Scheduler

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
    "cpu_threads": "llm.engine.cpu_threads",
}

Prompts = str | Sequence[int] | Sequence[str | Sequence[int]]


def _feature_settings(llm: Any) -> dict[str, dict[str, Any]]:
    """The feature decorators' settings (``LlmConfig.features``) from ``llm.lora``."""
    lora = llm.lora
    return {"multi_lora": {"max_loras": lora.max_loras, "max_rank": lora.max_rank},
            "single_lora": {"max_rank": lora.max_rank, "merge": lora.merge_single}}


class LLM:
    """Load a model directory and serve prompts with continuous batching.

    Thread-safe: ``generate``, ``stream``, ``encode``, ``abort``, ``stats`` and the adapter calls
    may be used from any number of threads at once, and streams may be read at any pace (a
    request runs in ``llm.engine``'s thread whether or not its stream is being read). Each
    request gets the tokens it would get alone. ``close()`` (or dropping the last reference)
    stops the engine and frees the KV cache.

    Args:
        model_dir: Hugging Face-style directory (config.json, safetensors, tokenizer files).
        config: a settings JSON file, or :class:`Settings`.
        tokenizer: a tokenizer to use instead of the one in ``model_dir``, or the directory (or
            GGUF file) to load it from (e.g. the Hugging Face tokenizer of a GGUF model whose
            architecture transformers cannot build a tokenizer for).
        max_model_len: longest prompt + output (default: the model's, capped at 8192).
        module_map: a Python file registering custom models.
        loras: LoRA adapters (PEFT directories) by name, loaded into the multi-LoRA feature; a
            request picks one with ``SamplingParams(lora=NAME)`` or ``generate(..., lora=NAME)``.
        single_lora: a PEFT adapter directory applied to every request (e.g. a domain
            fine-tune), stacked with the adapter a request names; swap it with
            :meth:`set_single_lora`.
        dist_timeout: seconds a tensor-parallel rank waits in a collective for the others before
            failing (default 300); only used under torchrun with more than one rank.
        overrides: settings by dotted key (``{"llm.engine.graph": "eager"}``) or by short name
            (``graph``, ``cuda_graph``, ``num_blocks``, ``block_size``, ``max_num_seqs``,
            ``max_num_batched_tokens``, ``dtype``, ``device``, ``gpu_memory_utilization``...).

    Under torchrun (``WORLD_SIZE`` > 1) the model is split over the ranks; see the module doc.

    Bad options (``max_model_len``, unknown ``disabled_passes``, a model path that is neither a
    directory nor a ``.gguf`` file, a tokenizer that cannot load) raise a
    :class:`~tgraph.errors.ConfigError` before any weight is read; a weight stored as integers
    outside a quantization scheme raises :class:`~tgraph.errors.WeightLoadError`. Bad prompts
    and parameters given to ``generate`` / ``stream`` raise
    :class:`~tgraph.errors.InvalidRequestError` before anything is queued.

    Attributes:
        engine: the :class:`~tgraph.runtime.engine_core.EngineCore` that runs the requests
            (``submit`` for one request with its own stream, ``abort``, ``stats``).
    """

    def __init__(self, model_dir: str | Path, config: str | Path | Settings | None = None, *,
                 tokenizer: Any = None, max_model_len: int | None = None,
                 module_map: str | Path | None = None, settings_overrides: Sequence[str] = (),
                 loras: dict[str, str | Path] | None = None,
                 single_lora: str | Path | None = None, dist_timeout: float | None = None,
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
        # Everything checkable is checked before the process group is joined or a weight read.
        check_max_model_len(max_model_len)
        _check_disabled_passes(llm.engine.disabled_passes)
        check_model_path(model_dir)
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

            # Refused before weights load; rules from settings name classes only in tgraph, the
            # file's `modules:` or the module map.
            rules = load_rules(llm.engine.rules, module_map=module_map, any_module=False)
        # A tokenizer that cannot load is refused before the weights are read.
        if tokenizer is None:
            tokenizer = _load_tokenizer(model_dir)
        elif isinstance(tokenizer, (str, os.PathLike)):
            path = tokenizer
            if not Path(path).exists():
                raise ConfigError(f"tokenizer: '{path}' not found; expected a tokenizer "
                                  "directory or a .gguf file")
            if (tokenizer := _load_tokenizer(path)) is None:
                raise ConfigError(f"tokenizer: '{path}' has no tokenizer files (tokenizer.json, "
                                  "tokenizer_config.json or tokenizer.model)")
        self.tokenizer = tokenizer
        start = time.perf_counter()
        # The rules are applied before any graph is recorded; placed weights load in place.
        self.model = load_model(
            model_dir, dtype=llm.model.dtype, device=device, max_model_len=max_model_len,
            module_map=module_map, graph=llm.engine.graph, cuda_graph=llm.engine.cuda_graph,
            block_size=llm.cache.block_size, batch_buckets=tuple(llm.engine.batch_buckets),
            prefill_graph_tokens=llm.engine.prefill_graph_tokens,
            disabled_passes=tuple(llm.engine.disabled_passes), tuning=tuning_of(settings),
            rank=rank, world_size=world_size, rules=rules, features=_feature_settings(llm))
        if world_size > 1:
            distributed.check_same_config(self.model.llm_config, what="model config")
        if self.model.llm_config.device.type == "cpu":
            torch.set_num_threads(cpu_threads(llm.engine.cpu_threads, world_size))
        self.load_seconds = time.perf_counter() - start
        # Adapters first: loading the first one re-lays the target weights out with room for
        # the adapters' B columns, which the KV-cache sizing below must see, and which would
        # otherwise drop the decode graphs captured below.
        self._adapters = AdapterManager(self.model)
        for name, path in (loras or {}).items():
            self.load_lora(name, path)
        if single_lora is not None:
            self.set_single_lora(single_lora)
        c = self.model.llm_config
        if c.device.type == "cuda":
            # A dropped LLM's weights and arenas sit in reference cycles until the garbage
            # collector runs; the cache is sized from what is allocated now.
            gc.collect()
            torch.cuda.empty_cache()
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
        scheduler = Scheduler(BlockAllocator(num_blocks, c.block_size),
                              max_num_seqs=llm.scheduler.max_num_seqs,
                              max_num_batched_tokens=llm.scheduler.max_num_batched_tokens,
                              max_model_len=c.max_model_len,
                              prefix_caching=llm.cache.prefix_caching)
        self.eos_token_ids = _eos_ids(self.model.config, self.tokenizer)
        self.engine = EngineCore(self.model, scheduler, runner=ModelRunner(self.model),
                                 tokenizer=self.tokenizer, eos_token_ids=self.eos_token_ids,
                                 adapters=self._adapters)
        # NOTE: the engine's thread holds neither the LLM nor the engine, so dropping the last
        # reference to the LLM runs this at once: it stops the thread and frees the memory.
        self._finalizer = weakref.finalize(self, _release, self.engine, self.model)
        self._finalizer.atexit = False  # at exit the engine's own finalizer stops its thread

    @property
    def rank(self) -> int:
        """This process's tensor-parallel rank (0 without tensor parallelism)."""
        return self.model.llm_config.rank

    @property
    def world_size(self) -> int:
        """Number of tensor-parallel ranks (1 without tensor parallelism)."""
        return self.model.llm_config.world_size

    @property
    def scheduler(self) -> Scheduler:
        """The engine's scheduler (its thread's; read it only while no request runs)."""
        return self.engine.scheduler

    @property
    def runner(self) -> ModelRunner:
        """The engine's model runner."""
        return self.engine.runner

    def close(self) -> None:
        """Stop the engine and free the model's memory; then leave the process group this
        ``LLM`` joined, if any (call it on every rank at the end of a tensor-parallel run).

        Requests in flight end with :class:`~tgraph.runtime.engine_core.EngineClosedError`.
        The KV cache, the engines and their captured graphs are dropped (on a GPU the memory
        goes back to the device, so another ``LLM`` can size its cache); the ``LLM`` takes no
        requests afterwards. Dropping the last reference to an ``LLM`` does the same, except
        leaving the process group. Idempotent.
        """
        self._finalizer()
        if self._owns_group:
            distributed.destroy_process_group()
            self._owns_group = False

    def abort(self, request_id: str) -> None:
        """Abort a request (its stream ends with finish reason ``"abort"``, and its blocks are
        freed at the next step); unknown or finished ids are ignored."""
        self.engine.abort(request_id)

    def stats(self) -> EngineStats:
        """The engine's gauges and counters (see :class:`EngineStats`)."""
        return self.engine.stats()

    def load_lora(self, name: str, path: str | Path, *, replace: bool = True) -> None:
        """Load the PEFT adapter at ``path`` for requests that name it (multi-LoRA: mixed in one
        batch), from the next step on; no engine is built.

        Args:
            name: the adapter's name (``SamplingParams(lora=name)``).
            path: the adapter directory (``adapter_config.json``, ``adapter_model.safetensors``).
            replace: an adapter already loaded under ``name`` is replaced (else refused); never
                while requests in flight use it.

        Raises:
            WeightLoadError / ConfigError: a bad directory or adapter file, a rank above the
                feature's ``max_rank``, every ``max_loras`` slot taken; nothing changed.
            AdapterInUseError: replacing an adapter that requests in flight use.

        Under tensor parallelism every rank makes the same call (see the module doc), or rank
        0 alone while the others follow it; every rank loads it at the same step.
        """
        self._adapter_command(AdapterCommand.load(name, path, replace))

    def unload_lora(self, name: str) -> None:
        """Unload a per-request adapter, from the next step on.

        Raises:
            AdapterNotFoundError: no adapter of that name is loaded.
            AdapterInUseError: requests in flight use it (retry once they finish, or abort
                them); nothing changed.
        """
        self._adapter_command(AdapterCommand.unload(name))

    def set_single_lora(self, path: str | Path | None) -> None:
        """Apply the PEFT adapter at ``path`` to every request from the next step on (requests
        in flight included), stacked with the adapter a request names (``None``: no such
        adapter). The previous one is unloaded; no engine is built or rebuilt for a switch. An
        adapter that cannot load raises and leaves the previous one in place.

        Under tensor parallelism every rank makes the same call (see the module doc).
        """
        self._adapter_command(AdapterCommand.single(path))

    @property
    def single_lora(self) -> str | None:
        """The directory of the adapter applied to every request (:meth:`set_single_lora`)."""
        return self._adapters.state().single_lora

    def _adapter_command(self, command: AdapterCommand) -> None:
        """Apply ``command`` between two steps of the engine (directly before it exists)."""
        engine = getattr(self, "engine", None)
        if engine is None:
            self._adapters.apply(command)
        else:
            engine.apply_adapters(command)

    # ---- prompts -------------------------------------------------------------------------------
    def encode(self, prompt: str | Sequence[int], chat: bool = False) -> list[int]:
        """Token ids of a prompt (text is tokenised; with ``chat`` the chat template is used)."""
        return encode_prompt(self.tokenizer, prompt, chat)

    @property
    def adapters(self) -> list[str]:
        """The LoRA adapters loaded for per-request use (:meth:`load_lora`), sorted."""
        return self._adapters.state().names

    # ---- generation ------------------------------------------------------------------------------
    def stream(self, prompts: Prompts, params: SamplingParams | Sequence[SamplingParams] | None
               = None, *, chat: bool = False, lora: str | None = None) -> Iterator[StreamEvent]:
        """Submit prompts and yield their output as it is produced (continuous batching).

        A prompt that can never fit (longer than ``max_model_len`` or the whole cache) raises
        :class:`RequestTooLongError` before anything runs; no other prompt is lost. The
        requests run in the engine whether or not the generator is being read; closing the
        generator (or dropping it) aborts those not finished. Under tensor parallelism every
        rank must stream the same prompts (see the module doc); a request any rank rejects
        raises on every rank.
        """
        stream = self._submit(prompts, params, chat, lora)
        try:
            yield from stream
        finally:
            stream.cancel()

    def _submit(self, prompts: Prompts, params: SamplingParams | Sequence[SamplingParams] | None,
                chat: bool, lora: str | None) -> BatchStream:
        """Encode and submit the requests together; raises before anything is queued."""
        try:
            batch = _as_batch(prompts)
            if params is None or isinstance(params, SamplingParams):
                params = [params or SamplingParams()] * len(batch)
            if isinstance(params, (str, Mapping)) or not isinstance(params, Sequence):
                raise InvalidRequestTypeError(
                    "params must be SamplingParams or a list of them (one per prompt), got "
                    f"{type(params).__name__} {params!r:.60}; build one with "
                    "SamplingParams(**options)")
            for p in params:
                if not isinstance(p, SamplingParams):
                    raise InvalidRequestTypeError(
                        f"params must hold SamplingParams, got {type(p).__name__} {p!r:.60}")
            if len(params) != len(batch):
                raise InvalidRequestError(
                    f"got {len(params)} SamplingParams for {len(batch)} prompts; expected one "
                    "per prompt")
            if lora is not None:
                params = [p if p.lora is not None else replace(p, lora=lora) for p in params]
            ids = [self.encode(prompt, chat) for prompt in batch]
        except Exception as err:  # shared with the other ranks before it is raised
            self.engine.submit_failed(err)
        return self.engine.submit_batch(ids, list(params))

    def generate(self, prompts: Prompts,
                 params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 chat: bool = False, lora: str | None = None,
                 progress: bool | None = None) -> list[RequestOutput]:
        """Generate for every prompt; returns one :class:`RequestOutput` per prompt, in order.

        A request aborted meanwhile (:meth:`abort`) returns what it had, with finish reason
        ``"abort"``; a request whose step failed raises the error (the others are aborted).
        Under tensor parallelism every rank returns the same ``token_ids``, ``text`` and
        ``finish_reason``; ``logprobs`` are only on rank 0 (``None`` elsewhere) and the timings
        are each rank's own.

        Args:
            progress: show a progress bar of generated tokens (default: for long generations,
                at least 1024 requested tokens, when stderr is a terminal; rank 0 only).
        """
        stream = self._submit(prompts, params, chat, lora)
        try:
            n = len(stream.request_ids)
            per = [params] * n if params is None or isinstance(params, SamplingParams) else params
            budget = sum((p or SamplingParams()).max_tokens for p in per)
            if progress is None:
                progress = budget >= 1024 and sys.stderr.isatty()
            bar = tqdm(total=budget, unit="tok", desc="generating",
                       disable=not (progress and self.rank == 0))
            for event in stream:
                bar.update(len(event.token_ids))
            bar.close()
        finally:
            stream.cancel()
        return [stream.outputs[rid] for rid in stream.request_ids]


def cpu_threads(setting: int | None, world_size: int = 1) -> int:
    """The torch threads a CPU model runs on: ``llm.engine.cpu_threads``, or every core this
    process may use shared among ``world_size`` ranks (at least one)."""
    if setting is not None:
        return setting
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, cores // world_size)


def encode_prompt(tokenizer: Any, prompt: str | Sequence[int], chat: bool = False) -> list[int]:
    """Token ids of a prompt: token ids are checked and kept; text is tokenised by
    ``tokenizer`` (with ``chat``, through its chat template when it has one)."""
    if not isinstance(prompt, str):
        if isinstance(prompt, (bytes, Mapping)) or not isinstance(prompt, Sequence):
            raise InvalidRequestTypeError(_PROMPT_TYPES + f", got {type(prompt).__name__} "
                                          f"{prompt!r:.60}{_hint(prompt)}")
        ids = [_token_id(t) for t in prompt]
        if not ids:
            raise InvalidRequestError("a prompt is a string or a non-empty list of token ids, "
                                      "got an empty list")
        return ids
    if tokenizer is None:
        raise ConfigError("this model directory has no tokenizer: pass token ids")
    if chat and getattr(tokenizer, "chat_template", None):
        return list(tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True,
            return_dict=False))
    return list(tokenizer.encode(prompt))


_PROMPT_TYPES = "prompts must be a string, a list of token ids (ints), or a list of those"


def _hint(value: object) -> str:
    return "; convert a tensor with .tolist()" if isinstance(value, torch.Tensor) else ""


def _token_id(t: object) -> int:
    """``t`` as a token id (an int, not a bool), else a typed refusal."""
    try:
        if isinstance(t, bool):
            raise TypeError
        return operator.index(t)  # type: ignore[arg-type]
    except TypeError:
        raise InvalidRequestTypeError(
            f"a prompt of token ids must hold ints, got {type(t).__name__} {t!r:.40}") from None


def _as_batch(prompts: Prompts) -> list[str | Sequence[int]]:
    """One prompt (text or token ids) or a list of them, as a list."""
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, (bytes, Mapping)) or not isinstance(prompts, Sequence):
        raise InvalidRequestTypeError(
            f"{_PROMPT_TYPES}, got {type(prompts).__name__} {prompts!r:.60}{_hint(prompts)}")
    if prompts and not isinstance(prompts[0], (str, Sequence)):
        return [prompts]  # type: ignore[list-item]  # one prompt of token ids
    return list(prompts)  # type: ignore[arg-type]


def _release(engine: EngineCore, model: Any) -> None:
    """Stop ``engine`` and drop what holds the model's memory: the KV cache, the captured
    graphs and the engines (on a GPU, also their weights and arenas, which reference cycles
    inside the model would otherwise keep until the garbage collector runs)."""
    if not engine.close():
        return  # a step is still running on that memory
    model.release_graphs()
    model.engines.clear()
    model.kv_caches.clear()
    device = model.llm_config.device
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


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


def _eos_ids(config, tokenizer) -> list[int]:
    ids = list(config.eos_token_ids)
    tok_eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    if tok_eos is not None and tok_eos not in ids:
        ids.append(tok_eos)
    return ids


def _check_disabled_passes(names: Sequence[str]) -> None:
    """Refuse unknown pass names (an eager model builds no engine that would notice)."""
    from tgraph.passes.pipeline import pass_names

    known = pass_names()
    unknown = sorted(set(names) - set(known))
    if unknown:
        raise ConfigError(f"llm.engine.disabled_passes names unknown pass(es) {unknown}; "
                          f"expected names from the pipeline: {', '.join(known)}")


def _load_tokenizer(model_dir: str | Path):
    from tgraph.io.checkpoint import load_tokenizer

    return load_tokenizer(model_dir)


__all__ = ["LLM", "RequestOutput", "RequestTooLongError", "SamplingParams", "StreamEvent"]
