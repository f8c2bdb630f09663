"""HTTP server and CLI of the engine emulator (``prefix-worker emulate``). Does I/O.

One process, one uvloop event loop, K replicas. Each replica has its own
aiohttp application on ``port + i``, its own KV block pool, scheduler,
Prometheus registry and KV-event publisher, and one engine task that runs
scheduler steps and sleeps for each step's duration (engine seconds divided by
``--time-scale``); an idle replica waits on a future, so an idle fleet costs no
CPU. The HTTP surface follows vLLM 0.33's OpenAI server (``../shared/vllm-spec.md`` §4).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import json
import logging
import math
import os
import signal
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Final

import msgspec
import zmq
from aiohttp import web

from router.hashing import BlockHasher, HashConfigError
from worker.emulator.config import (
    DEFAULT_STREAM_INTERVAL_S,
    VLLM_VERSION,
    ConfigError,
    EmulatorConfig,
    from_args,
    replica_endpoint,
)
from worker.emulator.kv_cache import BlockPool, KVCacheManager
from worker.emulator.metrics import ReplicaMetrics
from worker.emulator.offload import CpuOffload
from worker.emulator.profiles import LatencyModel
from worker.emulator.publisher import KVEventPublisher, PublisherConfig, PublisherError
from worker.emulator.scheduler import (
    FinishReason,
    Request,
    RequestOutput,
    Scheduler,
    SchedulerConfig,
)
from worker.emulator.tokenizer import SharedTokenizer, TokenizerError

logger = logging.getLogger(__name__)

STREAM_INTERVAL_S: Final = DEFAULT_STREAM_INTERVAL_S  # wall seconds between a stream's writes

MAX_CACHE_SALT_CHARS: Final = 128  # vLLM validate_cache_salt
FORBIDDEN_SALT_CHARS: Final = ("@", "/", "\\", "\x00")
OUTPUT_WORDS: Final = (" the", " quick", " brown", " fox", " jumps", " over", " a", " lazy",
                       " dog", ".")  # text of generated token i is OUTPUT_WORDS[i % 10]
MAX_BODY_BYTES: Final = 64 * 1024 * 1024

_json_encode = msgspec.json.encode
_json_decode = msgspec.json.decode


class ApiError(Exception):
    """An error the client sees as vLLM's JSON error body with ``status``."""

    def __init__(self, status: int, message: str, err_type: str = "BadRequestError",
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type
        self.param = param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.err_type, "param": self.param,
                          "code": self.status}}


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, "BadRequestError", param)


def output_text(start: int, count: int) -> str:
    return "".join(OUTPUT_WORDS[i % 10] for i in range(start, start + count))


def validate_cache_salt(salt: Any) -> str | None:
    """vLLM 0.33 ``validate_cache_salt``: None, or 1-128 chars without ``@ / \\ NUL``."""
    if salt is None:
        return None
    if not isinstance(salt, str):
        raise bad_request("cache_salt must be a string", "cache_salt")
    if not 1 <= len(salt) <= MAX_CACHE_SALT_CHARS:
        raise bad_request(f"cache_salt must be between 1 and {MAX_CACHE_SALT_CHARS} characters",
                          "cache_salt")
    if any(c in salt for c in FORBIDDEN_SALT_CHARS):
        raise bad_request("cache_salt must not contain '@', '/', '\\' or NUL characters",
                          "cache_salt")
    return salt


def check_vocab(token_ids: list[int], vocab_size: int) -> None:
    """Reject a prompt with an id >= ``vocab_size``: ApiError 400, param ``prompt``.

    vLLM 0.33 ``Processor._validate_model_input``: ``max(prompt_ids)`` above the largest
    valid id raises ``ValueError(f"Token id {max_input_id} is out of vocabulary")``, which the
    OpenAI server returns as a 400 BadRequestError.
    """
    top = max(token_ids)
    if top >= vocab_size:
        raise bad_request(f"Token id {top} is out of vocabulary", "prompt")


def _is_token_list(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(
        type(t) is int for t in value)


@functools.cache
def _valid_ids_type(vocab_size: int) -> Any:
    """``list[int]`` with every id in ``[0, vocab_size)``, for msgspec.convert (one pass in C)."""
    return list[Annotated[int, msgspec.Meta(ge=0, lt=vocab_size)]]


def valid_token_ids(value: Any, vocab_size: int) -> bool:
    """True if ``value`` is a non-empty list of ints in ``[0, vocab_size)`` (bools and floats
    are not ints). The common case, checked in C; the caller falls back to the per-item checks
    below for the error message when it is False."""
    if not isinstance(value, list) or not value:
        return False
    try:
        msgspec.convert(value, _valid_ids_type(vocab_size), strict=True)
    except msgspec.ValidationError:
        return False
    return True


@dataclass(slots=True)
class Sequence_:
    """One generated sequence of an HTTP request (a choice)."""

    index: int
    request: Request
    num_output: int = 0
    finish: FinishReason | None = None


@dataclass(slots=True)
class HttpState:
    """Per-HTTP-request delivery state shared by its sequences."""

    arrival: float
    queue: asyncio.Queue[tuple[int, int, FinishReason | None]] = field(
        default_factory=asyncio.Queue)
    first_token_at: dict[int, float] = field(default_factory=dict)


@dataclass(slots=True)
class Sink:
    """Where one sequence's outputs go: its HTTP request's state and its choice index, with
    the tokens generated but not yet handed over (``pending``) and when it last got some."""

    state: HttpState
    index: int
    pending: int = 0
    delivered_at: float = -math.inf  # loop time


@dataclass(slots=True)
class GenerationParams:
    max_tokens: int | None
    ignore_eos: bool
    stream: bool
    include_usage: bool
    cache_salt: str | None
    n: int


class Replica:
    """One emulated vLLM replica: engine task, cache, scheduler, publisher, HTTP app."""

    def __init__(self, index: int, config: EmulatorConfig, hasher: BlockHasher,
                 tokenizer: SharedTokenizer, zmq_ctx: zmq.Context[Any]) -> None:
        self.index = index
        self.config = config
        self.hasher = hasher
        self.tokenizer = tokenizer
        self.pool = BlockPool(config.num_gpu_blocks,
                              enable_kv_cache_events=config.kv_events.enabled)
        self.kv = KVCacheManager(self.pool, config.block_size,
                                 enable_caching=config.enable_prefix_caching)
        self.latency = LatencyModel(config.model_profile, config.gpu_profile,
                                    config.step_overhead_s)
        self.offload: CpuOffload | None = None
        if config.num_cpu_blocks:
            self.offload = CpuOffload(
                config.num_cpu_blocks, config.block_size,
                config.model_profile.kv_bytes_per_token * config.block_size,
                config.gpu_profile.host_link_gbps * 1e9,
                max_concurrent_loads=config.max_num_seqs,
                enable_events=config.kv_events.enabled)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_batched_tokens, config.max_num_seqs,
                            max_decode_burst_s=DEFAULT_STREAM_INTERVAL_S * config.time_scale),
            self.kv, self.latency, self._update_hashes, self.offload)
        self.lora_ids = {name: i + 1 for i, (name, _) in enumerate(config.lora_modules)}
        self.lora_paths = dict(config.lora_modules)
        self.metrics = ReplicaMetrics(
            config.model_name,
            {"block_size": str(config.block_size),
             "prefix_caching_hash_algo": config.hash_algo,
             "num_gpu_blocks": str(config.num_gpu_blocks),
             "enable_prefix_caching": str(config.enable_prefix_caching),
             "cache_dtype": "auto",
             "gpu_memory_utilization": "0.9",
             "engine": "0"},
            lambda: len(self.scheduler.running),
            lambda: len(self.scheduler.waiting) + len(self._arrivals),
            lambda: self.pool.usage,
        )
        offload = self.offload
        self.offload_metrics = (self.metrics.enable_offload(lambda: offload.usage)
                                if offload is not None else None)
        self.publisher: KVEventPublisher | None = None
        if config.kv_events.enabled:
            ev = config.kv_events
            pub = replica_endpoint(ev.endpoint, index, config.host)
            replay = (replica_endpoint(ev.replay_endpoint, index, config.host)
                      if ev.replay_endpoint else None)
            self.publisher = KVEventPublisher(PublisherConfig(
                endpoint=pub.address, bind=pub.bind,
                replay_endpoint=replay.address if replay else None,
                topic=ev.topic, buffer_steps=ev.buffer_steps, hwm=ev.hwm,
                int_block_hashes=config.int_block_hashes, block_size=config.block_size),
                zmq_ctx)
        self._waiter: asyncio.Future[None] | None = None
        # Requests that arrived (loop time) but are not yet the scheduler's, because the engine
        # clock has not reached their arrival (see _engine_loop).
        self._arrivals: deque[tuple[float, Request]] = deque()
        self.clock = 0.0  # engine time in loop-time seconds; set when the engine starts
        self._engine_task: asyncio.Task[None] | None = None
        self._last_queries = 0
        self._last_hits = 0
        self._num_inflight = 0
        self.url = ""
        self.app = self._build_app()
        self._runner: web.AppRunner | None = None

    # ---------------------------------------------------------------- engine

    def _update_hashes(self, request: Request) -> None:
        hashes = request.block_hashes
        if len(request.all_token_ids) // self.config.block_size <= len(hashes):
            return
        lora = None
        if request.lora_name is not None:
            lora = (request.lora_name, self.lora_paths[request.lora_name])
        hashes.extend(self.hasher.digests(
            request.all_token_ids, lora=lora, cache_salt=request.cache_salt,
            parent=hashes[-1] if hashes else None, start_block=len(hashes)))

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _sleep_until(self, deadline: float | None, interruptible: bool) -> None:
        loop = asyncio.get_running_loop()
        if deadline is not None and deadline <= loop.time():
            # Behind schedule: no sleep, but still yield once, so HTTP handlers (deliveries,
            # new arrivals) run between the steps the engine runs back to back to catch up.
            await asyncio.sleep(0)
            return
        fut: asyncio.Future[None] = loop.create_future()
        handle = None
        if deadline is not None:
            handle = loop.call_at(deadline, _resolve, fut)
        if interruptible:
            self._waiter = fut
        try:
            await fut
        finally:
            if handle is not None:
                handle.cancel()
            if self._waiter is fut:
                self._waiter = None

    def _admit_arrivals(self, clock: float) -> None:
        """Hand the scheduler the requests that had arrived by engine time ``clock``.

        A request that arrived after the engine's current step started (in engine time) must
        not join it, even when the process runs that step late: the emulated GPU would not
        have seen it yet.
        """
        arrivals = self._arrivals
        while arrivals and arrivals[0][0] <= clock:
            _, request = arrivals.popleft()
            if request.finished is None:  # aborted while it waited here
                self.scheduler.add_request(request)

    async def _engine_loop(self) -> None:
        """Run the engine on its own clock (``self.clock``, loop-time seconds).

        A step of ``d`` engine seconds ends ``d / time_scale`` after it started on that clock,
        not after the process got around to it: when the host keeps the process from running
        (a busy machine, SIGSTOP), the steps that fell due meanwhile run back to back until the
        clock has caught up with wall time, so the emulated GPU's capacity is never lost, only
        its outputs are delivered late. How late each step started is the lag
        (``emulator_engine_lag_seconds``); idle time is skipped, not caught up.
        """
        loop = asyncio.get_running_loop()
        scheduler = self.scheduler
        scale = self.config.time_scale
        self.clock = loop.time()
        while True:
            try:
                self._admit_arrivals(self.clock)
                if not scheduler.has_work():
                    if self._arrivals:  # idle until the next arrival, in engine time
                        self.clock = max(self.clock, self._arrivals[0][0])
                        continue
                    if self.offload is not None and self.offload.next_done_s() is not None:
                        await self._await_transfer()  # CPU-tier stores still copying
                        continue
                    await self._sleep_until(None, interruptible=True)
                    self.clock = max(self.clock, loop.time())
                    continue
                step = scheduler.schedule(self.clock * scale)
                if step is None and self.offload is not None and self.offload.has_pending_loads():
                    await self._await_transfer()  # every request waits for a CPU-tier load
                    continue
                if step is None:
                    # Nothing fits even in an empty pool (cannot happen within max_model_len).
                    request = scheduler.waiting.popleft()
                    request.finished = FinishReason.ABORT
                    self._deliver([RequestOutput(request, 0, FinishReason.ABORT)], self.clock)
                    continue
                start = self.clock
                self.metrics.observe_lag(loop.time() - start)
                repeats = 1
                if step.max_repeat == 1:
                    end = start + step.durations_s[0] / scale
                    await self._sleep_until(end, interruptible=False)
                else:
                    ends: list[float] = []
                    t = start
                    for d in step.durations_s:
                        t += d / scale
                        ends.append(t)
                    await self._sleep_until(ends[-1], interruptible=True)
                    # Woken early by an arrival: stop the decode burst after the steps that
                    # had ended by then; the newcomer joins the next step.
                    now = loop.time()
                    repeats = sum(1 for e in ends if e <= now)
                    if repeats == 0:
                        repeats = 1
                        await self._sleep_until(ends[0], interruptible=False)
                    end = ends[repeats - 1]
                self.clock = end
                outputs = scheduler.complete(step, repeats)
                if self.offload is not None:
                    self._publish_offload()
                elif self.publisher is not None:
                    self.publisher.publish(self.pool.take_events())
                if step.num_preempted:
                    self.metrics.num_preemptions.inc(step.num_preempted)
                self._deliver(outputs, end)
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("replica %d: engine step failed", self.index)
                await asyncio.sleep(0.01)

    async def _await_transfer(self) -> None:
        """Idle until the CPU tier's next transfer ends (engine time skips there, as it skips
        idle time to an arrival) or a request arrives; then apply what ended by then."""
        assert self.offload is not None
        done_s = self.offload.next_done_s()
        assert done_s is not None
        scale = self.config.time_scale
        target = done_s / scale
        await self._sleep_until(target, interruptible=True)
        self.clock = max(self.clock, min(target, asyncio.get_running_loop().time()))
        if not self.offload.has_pending_loads():  # only stores: schedule() would not run
            self.offload.advance(self.clock * scale)
            self._publish_offload()

    def _publish_offload(self) -> None:
        """Publish the GPU pool's and the CPU tier's events as one batch (vLLM: the cache
        manager's events, then the connector's) and bring the tier's counters up to date."""
        assert self.offload is not None and self.offload_metrics is not None
        if self.publisher is not None:
            self.publisher.publish([*self.pool.take_events(), *self.offload.take_events()])
        self.offload_metrics.sync(self.offload.stats)

    def _deliver(self, outputs: list[RequestOutput], now: float) -> None:
        """Hand each request its new tokens; ``now`` is the engine time (clock) of the step's
        end, so the engine's own latency metrics say what the emulated GPU would report."""
        stats = self.kv.stats
        metrics = self.metrics
        if stats.queries != self._last_queries:
            metrics.prefix_cache_queries.inc(stats.queries - self._last_queries)
            metrics.prefix_cache_hits.inc(stats.hits - self._last_hits)
            self._last_queries, self._last_hits = stats.queries, stats.hits
        scale = self.config.time_scale
        wall = asyncio.get_running_loop().time()
        generated = 0
        for out in outputs:
            sink: Sink = out.request.sink
            state = sink.state
            first = False
            if out.num_new_tokens:
                generated += out.num_new_tokens
                sink.pending += out.num_new_tokens
                if sink.index not in state.first_token_at:
                    first = True
                    state.first_token_at[sink.index] = now
                    metrics.ttft.observe((now - state.arrival) * scale)
                    metrics.prompt_tokens.inc(out.request.num_prompt_tokens)
                    metrics.prompt_tokens_cached.inc(max(out.request.num_cached_tokens, 0))
            if out.finished is not None:
                metrics.request_success[out.finished.value].inc()
                metrics.e2e_latency.observe((now - state.arrival) * scale)
            # The first token and the end go out at once; tokens in between at most once per
            # stream interval (wall time), several in one SSE write, as vLLM's output collector
            # merges the outputs a slow reader has not taken yet. 8 emulated GPUs at 10x speed
            # make 80x one GPU's steps per second: one write per step per request would cost
            # this process more than everything else it does.
            if first or out.finished is not None or (
                    sink.pending and wall - sink.delivered_at >= STREAM_INTERVAL_S):
                state.queue.put_nowait((sink.index, sink.pending, out.finished))
                sink.pending = 0
                sink.delivered_at = wall
        if generated:
            metrics.generation_tokens.inc(generated)

    # ---------------------------------------------------------------- lifecycle

    async def start(self, port: int) -> None:
        if self.publisher is not None:
            self.publisher.start()
        self._engine_task = asyncio.get_running_loop().create_task(self._engine_loop())
        # handler_cancellation: a client that goes away cancels its handler (aiohttp >= 3.9
        # defaults to not cancelling), so _generate's finally aborts the request as vLLM does.
        self._runner = web.AppRunner(self.app, access_log=None, handle_signals=False,
                                     handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, port, reuse_address=True)
        await site.start()
        server = site._server
        sockets = getattr(server, "sockets", None) or []
        bound_port = sockets[0].getsockname()[1] if sockets else port
        host = self.config.host
        url_host = f"[{host}]" if ":" in host else host
        self.url = f"http://{url_host}:{bound_port}"

    async def stop(self) -> None:
        if self._engine_task is not None:
            self._engine_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._engine_task
        if self._runner is not None:
            await self._runner.cleanup()
        if self.publisher is not None:
            self.publisher.close()

    def describe(self) -> dict[str, Any]:
        pub = self.publisher
        return {
            "index": self.index,
            "url": self.url,
            "kv_events_endpoint": pub.endpoint if pub else None,
            "kv_replay_endpoint": pub.replay_endpoint if pub else None,
        }

    # ---------------------------------------------------------------- HTTP

    def _build_app(self) -> web.Application:
        app = web.Application(middlewares=[_error_middleware], client_max_size=MAX_BODY_BYTES)
        r = app.router
        r.add_post("/v1/completions", self.handle_completions)
        r.add_post("/v1/chat/completions", self.handle_chat)
        r.add_post("/v1/completions/render", self.handle_completions_render)
        r.add_post("/v1/chat/completions/render", self.handle_chat_render)
        r.add_get("/v1/models", self.handle_models)
        r.add_get("/health", self.handle_health)
        r.add_get("/version", self.handle_version)
        r.add_get("/load", self.handle_load)
        r.add_get("/metrics", self.handle_metrics)
        r.add_post("/tokenize", self.handle_tokenize)
        r.add_post("/detokenize", self.handle_detokenize)
        r.add_get("/kv_event_sources", self.handle_kv_event_sources)
        r.add_post("/reset_prefix_cache", self.handle_reset_prefix_cache)
        return app

    async def _body(self, request: web.Request) -> dict[str, Any]:
        raw = await request.read()
        try:
            data = _json_decode(raw)
        except msgspec.DecodeError as exc:
            raise bad_request(f"invalid JSON body: {exc}") from exc
        if not isinstance(data, dict):
            raise bad_request("request body must be a JSON object")
        return data

    def _resolve_model(self, data: dict[str, Any]) -> tuple[str, str | None]:
        """(model name echoed back, LoRA adapter name or None). 404 for unknown models."""
        model = data.get("model")
        if model is None:
            return self.config.served_model_names[0], None
        if not isinstance(model, str):
            raise bad_request("model must be a string", "model")
        if model in self.config.served_model_names:
            return model, None
        if model in self.lora_paths:
            return model, model
        raise ApiError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")

    def _params(self, data: dict[str, Any], chat: bool) -> GenerationParams:
        max_tokens = data.get("max_completion_tokens") if chat else None
        if max_tokens is None:
            max_tokens = data.get("max_tokens")
        if max_tokens is not None and type(max_tokens) is not int:
            raise bad_request("max_tokens must be an integer, got " + repr(max_tokens), "max_tokens")
        if max_tokens is not None and max_tokens < 1:
            raise bad_request("max_tokens must be at least 1, got " + repr(max_tokens), "max_tokens")
        n = data.get("n", 1)
        if n is None:
            n = 1
        if type(n) is not int or n < 1:
            raise bad_request("n must be at least 1", "n")
        stream = bool(data.get("stream", False))
        options = data.get("stream_options")
        if options is not None:
            if not stream:
                raise bad_request("Stream options can only be defined when `stream=True`.",
                                  "stream_options")
            if not isinstance(options, dict):
                raise bad_request("stream_options must be an object", "stream_options")
        include_usage = bool(options.get("include_usage")) if options else False
        return GenerationParams(
            max_tokens=max_tokens, ignore_eos=bool(data.get("ignore_eos", False)), stream=stream,
            include_usage=include_usage, cache_salt=validate_cache_salt(data.get("cache_salt")),
            n=n)

    async def _completion_prompts(self, data: dict[str, Any]) -> list[list[int]]:
        if "prompt" not in data or data["prompt"] is None:
            raise bad_request("prompt is required", "prompt")
        prompt = data["prompt"]
        if isinstance(prompt, list) and prompt and type(prompt[0]) is int and valid_token_ids(
                prompt, await self._vocab_size()):
            return [prompt]  # one valid token-id prompt: the common case, checked in C
        add_special = data.get("add_special_tokens", True)
        items: list[Any]
        if isinstance(prompt, str) or _is_token_list(prompt):
            items = [prompt]
        elif isinstance(prompt, list) and prompt:
            items = prompt
        else:
            raise bad_request("prompt must be a string, a list of token ids, or a non-empty list "
                              "of either", "prompt")
        out: list[list[int]] = []
        vocab_size: int | None = None
        for item in items:
            if isinstance(item, str):
                out.append(await self._encode(item, bool(add_special)))
            elif isinstance(item, list) and all(type(t) is int for t in item):
                if any(t < 0 for t in item):
                    raise bad_request("token ids must be non-negative integers", "prompt")
                if item:
                    if vocab_size is None:
                        vocab_size = await self._vocab_size()
                    check_vocab(item, vocab_size)
                out.append(item)
            else:
                raise bad_request("each prompt must be a string or a list of token ids", "prompt")
            if not out[-1]:
                raise bad_request("The decoder prompt cannot be empty", "prompt")
        return out

    async def _vocab_size(self) -> int:
        if self.config.vocab_size is not None:
            return self.config.vocab_size
        try:
            return await self.tokenizer.vocab_size()
        except TokenizerError as exc:
            raise ApiError(500, str(exc), "InternalServerError") from exc

    async def _encode(self, text: str, add_special: bool) -> list[int]:
        try:
            return await self.tokenizer.encode(text, add_special)
        except TokenizerError as exc:
            raise ApiError(500, str(exc), "InternalServerError") from exc

    async def _chat_prompt(self, data: dict[str, Any]) -> list[int]:
        messages = data.get("messages")
        if not isinstance(messages, list) or not messages:
            raise bad_request("messages must be a non-empty list", "messages")
        add_generation_prompt = data.get("add_generation_prompt", True)
        continue_final = data.get("continue_final_message", False)
        if add_generation_prompt and continue_final:
            raise bad_request("Cannot set both `continue_final_message` and "
                              "`add_generation_prompt` to True.")
        kwargs = data.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise bad_request("chat_template_kwargs must be an object", "chat_template_kwargs")
        reserved = {"chat_template", "tokenize"} & kwargs.keys()  # vLLM resolve_chat_template_kwargs
        if reserved:
            raise bad_request(f"Found unexpected chat template kwargs from request: {reserved}",
                              "chat_template_kwargs")
        try:
            ids = await self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=bool(add_generation_prompt),
                continue_final_message=bool(continue_final), tools=data.get("tools"),
                chat_template_kwargs=kwargs,
                add_special_tokens=bool(data.get("add_special_tokens", False)))
        except TokenizerError as exc:
            raise bad_request(str(exc), "messages") from exc
        if not ids:
            raise bad_request("The decoder prompt cannot be empty", "messages")
        return ids

    def _check_length(self, prompt_len: int, max_tokens: int | None) -> int:
        limit = self.config.max_model_len
        if prompt_len >= limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, your request "
                f"has {prompt_len} input tokens. Please reduce the length of the input messages.")
        if max_tokens is None:
            return min(self.config.eos_after_tokens, limit - prompt_len)
        if prompt_len + max_tokens > limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_len + max_tokens} tokens ({prompt_len} in the messages, {max_tokens} in "
                "the completion). Please reduce the length of the messages or completion.")
        return max_tokens

    def _submit(self, prompts: list[list[int]], params: GenerationParams, lora: str | None,
                prefix: str) -> tuple[HttpState, list[Sequence_]]:
        loop = asyncio.get_running_loop()
        state = HttpState(arrival=loop.time())
        lengths = [self._check_length(len(p), params.max_tokens) for p in prompts]
        seqs: list[Sequence_] = []
        lora_path = self.lora_paths[lora] if lora else None
        for p_index, (prompt, limit) in enumerate(zip(prompts, lengths, strict=True)):
            hashes = self.hasher.digests(
                prompt, lora=(lora, lora_path) if lora and lora_path else None,
                cache_salt=params.cache_salt)
            reason = (FinishReason.LENGTH if params.max_tokens is not None or params.ignore_eos
                      else FinishReason.STOP)
            for j in range(params.n):
                index = p_index * params.n + j
                request = Request(
                    request_id=f"{prefix}-{index}", all_token_ids=list(prompt),
                    max_output_tokens=limit, finish_reason_at_limit=reason,
                    lora_id=self.lora_ids.get(lora) if lora else None, lora_name=lora,
                    cache_salt=params.cache_salt, block_hashes=list(hashes))
                request.sink = Sink(state, index)
                seqs.append(Sequence_(index, request))
                self._arrivals.append((state.arrival, request))
        self._wake()
        return state, seqs

    def _abort(self, seqs: list[Sequence_]) -> None:
        for seq in seqs:
            if seq.request.finished is None:
                self.scheduler.abort(seq.request)

    def _usage(self, seqs: list[Sequence_], prompt_lens: list[int]) -> dict[str, Any]:
        """OpenAI usage as vLLM's serving code counts it: each prompt once (``prompt_lens`` has
        one entry per prompt, not per choice), completion tokens of every choice, and the cached
        tokens of each prompt once (its first choice)."""
        prompt_tokens = sum(prompt_lens)
        n = max(1, len(seqs) // max(1, len(prompt_lens)))
        completion = sum(s.num_output for s in seqs)
        usage: dict[str, Any] = {"prompt_tokens": prompt_tokens,
                                 "total_tokens": prompt_tokens + completion,
                                 "completion_tokens": completion,
                                 "prompt_tokens_details": None}
        if self.config.enable_prompt_tokens_details:
            cached = sum(max(s.request.num_cached_tokens, 0) for s in seqs if s.index % n == 0)
            usage["prompt_tokens_details"] = {"cached_tokens": cached}
        return usage

    async def _generate(
        self,
        request: web.Request,
        prompts: list[list[int]],
        params: GenerationParams,
        model: str,
        lora: str | None,
        chat: bool,
    ) -> web.StreamResponse:
        kind = "chatcmpl" if chat else "cmpl"
        rid = f"{kind}-{uuid.uuid4().hex}"
        created = int(time.time())
        state, seqs = self._submit(prompts, params, lora, rid)
        prompt_lens = [len(p) for p in prompts]  # one per prompt: usage counts each once
        by_index = {s.index: s for s in seqs}
        self._num_inflight += 1
        try:
            if params.stream:
                return await self._stream(request, state, seqs, by_index, prompt_lens, params,
                                          rid, created, model, chat)
            remaining = len(seqs)
            while remaining:
                index, n_new, finished = await state.queue.get()
                seq = by_index[index]
                seq.num_output += n_new
                if finished is not None:
                    seq.finish = finished
                    remaining -= 1
            choices = []
            for seq in seqs:
                text = output_text(0, seq.num_output)
                reason = seq.finish.value if seq.finish else None
                if chat:
                    choices.append({"index": seq.index, "message": {
                        "role": "assistant", "content": text, "refusal": None,
                        "annotations": None, "audio": None, "function_call": None,
                        "tool_calls": [], "reasoning_content": None},
                        "logprobs": None, "finish_reason": reason, "stop_reason": None})
                else:
                    choices.append({"index": seq.index, "text": text, "logprobs": None,
                                    "finish_reason": reason, "stop_reason": None,
                                    "prompt_logprobs": None})
            body = {"id": rid, "object": "chat.completion" if chat else "text_completion",
                    "created": created, "model": model, "choices": choices,
                    "usage": self._usage(seqs, prompt_lens), "system_fingerprint": None,
                    "kv_transfer_params": None}
            if chat:
                body["prompt_logprobs"] = None
            return web.Response(body=_json_encode(body), content_type="application/json")
        finally:
            self._num_inflight -= 1
            self._abort(seqs)

    async def _stream(self, request: web.Request, state: HttpState, seqs: list[Sequence_],
                      by_index: dict[int, Sequence_], prompt_lens: list[int],
                      params: GenerationParams, rid: str, created: int, model: str,
                      chat: bool) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
        await resp.prepare(request)
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(choices: list[dict[str, Any]], usage: Any = None) -> bytes:
            body: dict[str, Any] = {"id": rid, "object": obj, "created": created, "model": model,
                                    "choices": choices}
            if usage is not None:
                body["usage"] = usage
            return b"data: " + _json_encode(body) + b"\n\n"

        if chat:
            first = [{"index": s.index, "delta": {"role": "assistant", "content": ""},
                      "logprobs": None, "finish_reason": None} for s in seqs]
            await resp.write(chunk(first))
        remaining = len(seqs)
        while remaining:
            items = [await state.queue.get()]
            while not state.queue.empty():
                items.append(state.queue.get_nowait())
            out = bytearray()
            for index, n_new, finished in items:
                seq = by_index[index]
                text = output_text(seq.num_output, n_new)
                seq.num_output += n_new
                reason = None
                if finished is not None:
                    seq.finish = finished
                    reason = finished.value
                    remaining -= 1
                if chat:
                    choice: dict[str, Any] = {"index": index, "delta": {"content": text},
                                              "logprobs": None, "finish_reason": reason}
                else:
                    choice = {"index": index, "text": text, "logprobs": None,
                              "finish_reason": reason, "stop_reason": None}
                if reason is not None:
                    choice["stop_reason"] = None
                out += chunk([choice])
            await resp.write(bytes(out))
        tail = b""
        if params.include_usage:
            tail = chunk([], self._usage(seqs, prompt_lens))
        await resp.write(tail + b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def handle_completions(self, request: web.Request) -> web.StreamResponse:
        data = await self._body(request)
        model, lora = self._resolve_model(data)
        params = self._params(data, chat=False)
        prompts = await self._completion_prompts(data)
        return await self._generate(request, prompts, params, model, lora, chat=False)

    async def handle_chat(self, request: web.Request) -> web.StreamResponse:
        data = await self._body(request)
        model, lora = self._resolve_model(data)
        params = self._params(data, chat=True)
        prompt = await self._chat_prompt(data)
        return await self._generate(request, [prompt], params, model, lora, chat=True)

    def _render_item(self, prefix: str, model: str, tokens: list[int],
                     params: GenerationParams) -> dict[str, Any]:
        return {"request_id": f"{prefix}-{uuid.uuid4().hex}", "model": model, "token_ids": tokens,
                "sampling_params": {"max_tokens": params.max_tokens, "ignore_eos": params.ignore_eos,
                                    "n": params.n},
                "cache_salt": params.cache_salt, "stream": params.stream}

    async def handle_completions_render(self, request: web.Request) -> web.Response:
        """vLLM scale-out render: a list of GenerateRequest-shaped objects, one per prompt."""
        data = await self._body(request)
        model, _ = self._resolve_model(data)
        params = self._params(data, chat=False)
        prompts = await self._completion_prompts(data)
        items = [self._render_item("cmpl", model, p, params) for p in prompts]
        return web.Response(body=_json_encode(items), content_type="application/json")

    async def handle_chat_render(self, request: web.Request) -> web.Response:
        """vLLM scale-out chat render: one GenerateRequest-shaped object."""
        data = await self._body(request)
        model, _ = self._resolve_model(data)
        params = self._params(data, chat=True)
        prompt = await self._chat_prompt(data)
        item = self._render_item("chatcmpl", model, prompt, params)
        return web.Response(body=_json_encode(item), content_type="application/json")

    async def handle_models(self, request: web.Request) -> web.Response:
        created = int(time.time())

        def card(model_id: str, root: str, parent: str | None) -> dict[str, Any]:
            return {"id": model_id, "object": "model", "created": created, "owned_by": "vllm",
                    "root": root, "parent": parent, "max_model_len": self.config.max_model_len,
                    "permission": [{"id": f"modelperm-{uuid.uuid4().hex}",
                                    "object": "model_permission", "created": created,
                                    "allow_create_engine": False, "allow_sampling": True,
                                    "allow_logprobs": True, "allow_search_indices": False,
                                    "allow_view": True, "allow_fine_tuning": False,
                                    "organization": "*", "group": None, "is_blocking": False}]}

        cards = [card(name, self.config.model, None) for name in self.config.served_model_names]
        base = self.config.served_model_names[0]
        cards += [card(name, path, base) for name, path in self.config.lora_modules]
        return web.json_response({"object": "list", "data": cards})

    async def handle_health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def handle_version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": VLLM_VERSION})

    async def handle_load(self, request: web.Request) -> web.Response:
        return web.json_response({"server_load": self._num_inflight})

    async def handle_metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.exposition(),
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def handle_tokenize(self, request: web.Request) -> web.Response:
        data = await self._body(request)
        self._resolve_model(data)
        if "messages" in data:
            tokens = await self._chat_prompt(data)
        else:
            prompt = data.get("prompt")
            if not isinstance(prompt, str):
                raise bad_request("prompt must be a string", "prompt")
            tokens = await self._encode(prompt, bool(data.get("add_special_tokens", True)))
        token_strs = None
        if data.get("return_token_strs"):
            token_strs = await self.tokenizer.convert_ids_to_tokens(tokens)
        return web.json_response({"count": len(tokens), "max_model_len": self.config.max_model_len,
                                  "tokens": tokens, "token_strs": token_strs})

    async def handle_detokenize(self, request: web.Request) -> web.Response:
        data = await self._body(request)
        self._resolve_model(data)
        tokens = data.get("tokens")
        if not isinstance(tokens, list) or not all(type(t) is int and t >= 0 for t in tokens):
            raise bad_request("tokens must be a list of non-negative token ids", "tokens")
        try:
            text = await self.tokenizer.decode(tokens)
        except TokenizerError as exc:
            raise ApiError(500, str(exc), "InternalServerError") from exc
        return web.json_response({"prompt": text})

    async def handle_kv_event_sources(self, request: web.Request) -> web.Response:
        """vLLM 0.33: a bare JSON array, one entry per DP rank with the resolved endpoints."""
        pub = self.publisher
        if pub is None:
            return web.json_response([])
        return web.json_response([{"data_parallel_rank": 0, "endpoint": pub.endpoint,
                                   "replay_endpoint": pub.replay_endpoint,
                                   "topic": self.config.kv_events.topic}])

    async def handle_reset_prefix_cache(self, request: web.Request) -> web.Response:
        if not self.kv.reset_prefix_cache():
            raise ApiError(409, "Cannot reset the prefix cache while requests hold blocks.",
                           "ConflictError")
        if self.publisher is not None:
            self.publisher.publish(self.pool.take_events())
        return web.Response(status=200)


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def _error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """The one place that turns errors into vLLM-shaped JSON bodies."""
    try:
        return await handler(request)
    except ApiError as exc:
        return web.Response(status=exc.status, body=_json_encode(exc.body()),
                            content_type="application/json")
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        err = ApiError(exc.status, exc.reason,
                       "NotFoundError" if exc.status == 404 else "BadRequestError")
        return web.Response(status=exc.status, body=_json_encode(err.body()),
                            content_type="application/json")


def make_hasher(config: EmulatorConfig) -> BlockHasher:
    if config.hash_seed_is_random:
        logger.warning(
            "PYTHONHASHSEED is not set: using a random NONE_HASH seed for %s, as vLLM does; "
            "no router can reproduce these block hashes. Set PYTHONHASHSEED on engines and router.",
            config.hash_algo)
    # The seed string is resolved already; BlockHasher takes it as PYTHONHASHSEED would.
    return BlockHasher(config.block_size, config.hash_algo, config.hash_seed)


class Emulator:
    """K replicas in this process; ``start()`` listens, ``stop()`` shuts down."""

    def __init__(self, config: EmulatorConfig) -> None:
        self.config = config
        self.hasher = make_hasher(config)
        self.tokenizer = SharedTokenizer(config.tokenizer)
        self.zmq_ctx: zmq.Context[Any] = zmq.Context()
        self.replicas = [Replica(i, config, self.hasher, self.tokenizer, self.zmq_ctx)
                         for i in range(config.replicas)]

    async def start(self) -> None:
        for replica in self.replicas:
            port = self.config.port + replica.index if self.config.port else 0
            await replica.start(port)
        if self.config.ready_file:
            write_ready_file(self.config.ready_file, [r.describe() for r in self.replicas])
        logger.info("emulator ready: %s", json.dumps([r.describe() for r in self.replicas]))

    async def stop(self) -> None:
        for replica in self.replicas:
            await replica.stop()
        self.zmq_ctx.term()


def write_ready_file(path: str, replicas: list[dict[str, Any]]) -> None:
    """Write ``{"replicas": [...]}`` atomically (temporary file + rename)."""
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump({"replicas": replicas}, fh)
    os.replace(tmp, path)


async def _serve(config: EmulatorConfig) -> int:
    emulator = Emulator(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    try:
        await emulator.start()
    except (OSError, PublisherError, ConfigError) as exc:
        logger.error("emulator failed to start: %s", exc)
        await emulator.stop()
        return 1
    # The block pools (num_gpu_blocks objects per replica) live as long as the process: keep
    # the cyclic garbage collector from walking them in every full collection.
    gc.collect()
    gc.freeze()
    await stop.wait()
    logger.info("emulator shutting down")
    await emulator.stop()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``prefix-worker emulate``; returns the exit code."""
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        config = from_args(argv)
    except (ConfigError, HashConfigError) as exc:
        print(f"prefix-worker emulate: error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=config.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    profile_path = os.environ.get("PREFIX_EMULATOR_PROFILE")
    if profile_path:
        # A deterministic CPU profile of the emulator's event loop, written at shutdown; for
        # finding the emulator's own costs (wall-clock samplers mislead on a busy machine).
        import cProfile

        profiler = cProfile.Profile(time.thread_time)  # CPU of the event-loop thread
        profiler.enable()
        try:
            return _run(config)
        finally:
            profiler.disable()
            profiler.dump_stats(profile_path)
    return _run(config)


def _run(config: EmulatorConfig) -> int:
    try:
        import uvloop

        return uvloop.run(_serve(config))
    except ImportError:
        return asyncio.run(_serve(config))
