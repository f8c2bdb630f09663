"""The OpenAI front end of one emulated replica: vLLM 0.33's HTTP surface
(``../shared/vllm-spec.md`` §4) in front of an :class:`EmulatedEngine`. Validates requests as
vLLM's serving code does, submits them, and relays the engine's outputs as JSON or SSE.
Does I/O (aiohttp); the engine does no HTTP.
"""

from __future__ import annotations

import functools
import os
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Annotated, Any, Final

import msgspec
from aiohttp import web

from router.shared.chat_messages import template_kwargs
from router.shared.messages_chat import check_messages_body, merges_inline_system, messages_to_chat
from router.shared.responses_chat import check_responses_body, input_messages, responses_chat
from worker.emulator import pooling
from worker.emulator.api_formats import (
    MessagesAnswer,
    ResponsesAnswer,
    anthropic_usage,
    responses_usage,
)
from worker.emulator.config import VLLM_VERSION, EmulatorConfig
from worker.emulator.engine import EmulatedEngine, OutputCollector, SubmittedPrompt
from worker.emulator.metrics import EnginesExposition
from worker.emulator.scheduler import FinishReason, Request
from worker.emulator.tokenizer import SharedTokenizer, TokenizerError

MAX_CACHE_SALT_CHARS: Final = 128  # vLLM validate_cache_salt
FORBIDDEN_SALT_CHARS: Final = ("@", "/", "\\", "\x00")
OUTPUT_WORDS: Final = (" the", " quick", " brown", " fox", " jumps", " over", " a", " lazy",
                       " dog", ".")  # text of generated token i is OUTPUT_WORDS[i % 10]
MAX_BODY_BYTES: Final = 64 * 1024 * 1024
UVICORN_BACKLOG: Final = 2048  # listen backlog; uvicorn Config default, which vLLM's server keeps
# vLLM keeps Responses answers for ``previous_response_id`` only with this set to 1 (and never
# drops them); the emulator keeps the last MAX_STORED_RESPONSES
RESPONSES_STORE_ENV: Final = "VLLM_ENABLE_RESPONSES_API_STORE"
MAX_STORED_RESPONSES: Final = 10_000

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


_OUTPUT_CYCLE: Final = "".join(OUTPUT_WORDS)
_WORD_STARTS: Final = tuple(sum(len(w) for w in OUTPUT_WORDS[:k]) for k in range(11))


def output_text(start: int, count: int) -> str:
    """The text of generated tokens ``start .. start + count - 1`` (token i is
    ``OUTPUT_WORDS[i % 10]``): a slice of the repeated ten-word cycle, so a stream's writes cost
    no per-token Python work."""
    if count <= 0:
        return ""
    first = _WORD_STARTS[start % 10]
    end_token = start % 10 + count  # in cycle positions from the cycle holding ``start``
    length = (end_token // 10) * len(_OUTPUT_CYCLE) + _WORD_STARTS[end_token % 10] - first
    repeats = -(-(first + length) // len(_OUTPUT_CYCLE))
    return (_OUTPUT_CYCLE * repeats)[first:first + length]


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
class GenerationParams:
    max_tokens: int | None
    ignore_eos: bool
    stream: bool
    include_usage: bool
    cache_salt: str | None
    n: int



DP_RANK_HEADER: Final = "X-data-parallel-rank"  # vLLM serving engine _get_data_parallel_rank


class ReplicaServer:
    """The HTTP application of one replica; ``start(port)`` listens, ``stop()`` shuts down
    (the engines too).

    ``engines`` are the replica's data-parallel ranks in rank order (one without
    ``--data-parallel-size``), as vLLM's API server fronts one EngineCore per DP rank; a
    request goes to the rank ``select_engine`` picks.
    """

    def __init__(self, engines: list[EmulatedEngine], tokenizer: SharedTokenizer) -> None:
        if not engines:
            raise ValueError("a replica needs at least one engine")
        self.engines = engines
        self.engine = engines[0]  # the rank answering what every rank shares (LoRA adapters)
        self.config: EmulatorConfig = self.engine.config
        self.index = self.engine.index
        self.tokenizer = tokenizer
        self.metrics = EnginesExposition([e.metrics for e in engines])
        self._num_inflight = 0
        self.url = ""
        self.app = self._build_app()
        self._runner: web.AppRunner | None = None
        self.store_responses = os.environ.get(RESPONSES_STORE_ENV) == "1"
        # {response id: (its chat messages, its output text)}, oldest first
        self.responses: dict[str, tuple[list[dict[str, Any]], str]] = {}
        self._merge_inline_system: bool | None = None  # from the chat template, on first use

    # ---------------------------------------------------------------- lifecycle

    async def start(self, port: int) -> None:
        for engine in self.engines:
            engine.start()
        # handler_cancellation: a client that goes away cancels its handler (aiohttp >= 3.9
        # defaults to not cancelling), so _generate's finally aborts the request as vLLM does.
        self._runner = web.AppRunner(self.app, access_log=None, handle_signals=False,
                                     handler_cancellation=True)
        await self._runner.setup()
        # uvicorn's (vLLM's server's) listen backlog, not aiohttp's 128: a burst of 1,000 streams
        # overflowed 128 and its connects waited out SYN retries past the router's connect
        # timeout, benching every replica at once (issue 29)
        site = web.TCPSite(self._runner, self.config.host, port, reuse_address=True,
                           backlog=UVICORN_BACKLOG)
        await site.start()
        server = site._server
        sockets = getattr(server, "sockets", None) or []
        bound_port = sockets[0].getsockname()[1] if sockets else port
        host = self.config.host
        url_host = f"[{host}]" if ":" in host else host
        self.url = f"http://{url_host}:{bound_port}"

    async def stop(self) -> None:
        for engine in self.engines:
            await engine.stop()
        if self._runner is not None:
            await self._runner.cleanup()

    def describe(self) -> dict[str, Any]:
        """``kv_events_endpoint``/``kv_replay_endpoint`` are rank 0's; ``ranks`` lists every
        rank's (``data_parallel_rank``, ``kv_events_endpoint``, ``kv_replay_endpoint``)."""
        ranks = [{"data_parallel_rank": e.dp_rank,
                  "kv_events_endpoint": e.publisher.endpoint if e.publisher else None,
                  "kv_replay_endpoint": e.publisher.replay_endpoint if e.publisher else None}
                 for e in self.engines]
        return {
            "index": self.index,
            "url": self.url,
            "kv_events_endpoint": ranks[0]["kv_events_endpoint"],
            "kv_replay_endpoint": ranks[0]["kv_replay_endpoint"],
            "data_parallel_size": len(self.engines),
            "ranks": ranks,
        }

    def select_engine(self, request: web.Request) -> EmulatedEngine:
        """The DP rank a request runs on, as vLLM picks it.

        The ``X-data-parallel-rank`` header names it (vLLM serving engine
        ``_get_data_parallel_rank``: a value that is not an int is ignored); a rank outside
        ``[0, data_parallel_size)`` is a 400 (vLLM's input processor rejects it). Without one,
        vLLM's internal load balancing (``DPLBAsyncMPClient.get_core_engine_for_request``): the
        lowest ``waiting * 4 + running``, the first rank on ties. vLLM reads those counts from
        the coordinator every 100 ms and counts its own sends in between; the emulator reads the
        engines' live queues, which is what that bookkeeping approximates.
        """
        engines = self.engines
        text = request.headers.get(DP_RANK_HEADER)
        rank: int | None = None
        if text is not None:
            try:
                rank = int(text)
            except ValueError:
                rank = None
        if rank is not None:
            if not 0 <= rank < len(engines):
                raise bad_request(f"data_parallel_rank {rank} is out of range "
                                  f"[0, {len(engines)}).")
            return engines[rank]
        if len(engines) == 1:
            return engines[0]
        return min(engines, key=lambda e: (e.num_waiting() * 4 + e.num_running(), e.dp_rank))

    # ---------------------------------------------------------------- HTTP

    def _build_app(self) -> web.Application:
        app = web.Application(middlewares=[_error_middleware], client_max_size=MAX_BODY_BYTES)
        r = app.router
        r.add_post("/v1/completions", self.handle_completions)
        r.add_post("/v1/chat/completions", self.handle_chat)
        r.add_post("/v1/responses", self.handle_responses)
        r.add_post("/v1/messages", self.handle_messages)
        r.add_post("/v1/completions/render", self.handle_completions_render)
        r.add_post("/v1/chat/completions/render", self.handle_chat_render)
        r.add_get("/v1/models", self.handle_models)
        r.add_get("/health", self.handle_health)
        r.add_get("/version", self.handle_version)
        r.add_get("/load", self.handle_load)
        r.add_get("/metrics", self.handle_metrics)
        for path in ("/v1/embeddings", "/pooling"):
            r.add_post(path, self.handle_vectors)
        for path in ("/score", "/v1/score"):  # vLLM 0.32 serves both
            r.add_post(path, self.handle_score)
        for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
            r.add_post(path, self.handle_rerank)
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
        if model in self.engine.lora_paths:
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

    async def _completion_prompts(self, data: dict[str, Any],
                                  field: str = "prompt") -> list[list[int]]:
        """``data[field]`` (a completions ``prompt``; ``input`` of the pooling paths) as token-id
        lists; the errors name ``field``, the field the client sent."""
        if data.get(field) is None:
            raise bad_request(f"{field} is required", field)
        prompt = data[field]
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
            raise bad_request(f"{field} must be a string, a list of token ids, or a non-empty list "
                              "of either", field)
        out: list[list[int]] = []
        vocab_size: int | None = None
        for item in items:
            if isinstance(item, str):
                out.append(await self._encode(item, bool(add_special)))
            elif isinstance(item, list) and all(type(t) is int for t in item):
                if any(t < 0 for t in item):
                    raise bad_request("token ids must be non-negative integers", field)
                if item:
                    if vocab_size is None:
                        vocab_size = await self._vocab_size()
                    check_vocab(item, vocab_size)
                out.append(item)
            else:
                raise bad_request(f"each item of {field} must be a string or a list of token ids",
                                  field)
            if not out[-1]:
                raise bad_request("The decoder prompt cannot be empty", field)
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

    def _submit(self, engine: EmulatedEngine, prompts: list[list[int]], params: GenerationParams,
                lora: str | None, request_id: str) -> tuple[OutputCollector, list[Sequence_]]:
        """Check each prompt's length, then hand the prompts to ``engine``."""
        submitted = [SubmittedPrompt(p, self._check_length(len(p), params.max_tokens))
                     for p in prompts]
        reason = (FinishReason.LENGTH if params.max_tokens is not None or params.ignore_eos
                  else FinishReason.STOP)
        collector, requests = engine.submit(
            submitted, n=params.n, finish_at_limit=reason, lora=lora,
            cache_salt=params.cache_salt, request_id=request_id)
        return collector, [Sequence_(i, r) for i, r in enumerate(requests)]

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
        engine = self.select_engine(request)
        collector, seqs = self._submit(engine, prompts, params, lora, rid)
        prompt_lens = [len(p) for p in prompts]  # one per prompt: usage counts each once
        by_index = {s.index: s for s in seqs}
        self._num_inflight += 1
        try:
            if params.stream:
                return await self._stream(request, collector, seqs, by_index, prompt_lens, params,
                                          rid, created, model, chat)
            remaining = len(seqs)
            while remaining:
                index, n_new, finished = await collector.queue.get()
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
            engine.abort([s.request for s in seqs])

    async def _stream(self, request: web.Request, collector: OutputCollector, seqs: list[Sequence_],
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
            items = [await collector.queue.get()]
            while not collector.queue.empty():
                items.append(collector.queue.get_nowait())
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

    # ------------------------------------------------- Responses and Anthropic Messages

    async def _api_prompt(self, messages: list[dict[str, Any]], options: dict[str, Any]) -> list[int]:
        """The prompt ids of a Responses or Messages request (its chat ``messages`` and
        ``options`` from ``router.shared``: vLLM's own conversion) through the chat template."""
        kwargs = template_kwargs(options)
        add_generation_prompt = kwargs.pop("add_generation_prompt")
        continue_final = kwargs.pop("continue_final_message")
        try:
            ids = await self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final, tools=options.get("tool_dicts"),
                chat_template_kwargs=kwargs, add_special_tokens=False)
        except TokenizerError as exc:
            raise bad_request(str(exc), "messages") from exc
        if not ids:
            raise bad_request("The decoder prompt cannot be empty", "messages")
        return ids

    def _api_params(self, data: dict[str, Any], field: str) -> GenerationParams:
        """The generation parameters of a Responses or Messages body whose token limit is
        ``data[field]`` (``max_output_tokens`` / ``max_tokens``: its errors name it)."""
        max_tokens = data.get(field)
        if max_tokens is not None and (type(max_tokens) is not int or max_tokens < 1):
            raise bad_request(f"{field} must be a positive integer, got {max_tokens!r}", field)
        stream, salt = bool(data.get("stream")), data.get("cache_salt")
        return GenerationParams(max_tokens=max_tokens, ignore_eos=False, stream=stream,
                                include_usage=True, cache_salt=validate_cache_salt(salt), n=1)

    async def _answer_api(self, request: web.Request, prompt: list[int], params: GenerationParams,
                          lora: str | None, rid: str, answer: Any) -> tuple[web.StreamResponse, str]:
        """Generate one sequence and answer it through ``answer`` (``_ResponsesOut`` or
        ``_MessagesOut``), whole or streamed. Returns the response and the generated text."""
        engine = self.select_engine(request)
        collector, seqs = self._submit(engine, [prompt], params, lora, rid)
        seq = seqs[0]
        self._num_inflight += 1
        try:
            if not params.stream:
                while seq.finish is None:
                    _, n_new, finished = await collector.queue.get()
                    seq.num_output += n_new
                    seq.finish = finished
                text = output_text(0, seq.num_output)
                return web.Response(body=_json_encode(answer.whole(text, seq, len(prompt))),
                                    content_type="application/json"), text
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache"})
            await resp.prepare(request)
            await resp.write(answer.start(seq, len(prompt)))
            pieces = []
            while seq.finish is None:
                _, n_new, finished = await collector.queue.get()
                piece = output_text(seq.num_output, n_new)
                seq.num_output += n_new
                seq.finish = finished
                if piece:
                    pieces.append(piece)
                    await resp.write(answer.delta(piece))
            await resp.write(answer.end(seq, len(prompt)))
            await resp.write_eof()
            return resp, "".join(pieces)
        finally:
            self._num_inflight -= 1
            engine.abort([seq.request])

    def _cached(self, seq: Sequence_) -> int:
        return max(seq.request.num_cached_tokens, 0)

    async def handle_responses(self, request: web.Request) -> web.StreamResponse:
        """vLLM's ``/v1/responses`` for text answers; with ``VLLM_ENABLE_RESPONSES_API_STORE=1``
        answers are kept for ``previous_response_id`` (an unknown id is a 404, as in vLLM)."""
        data = await self._body(request)
        model, lora = self._resolve_model(data)
        try:
            chat = responses_chat(check_responses_body(data))
        except ValueError as exc:
            raise bad_request(str(exc), "input") from exc
        messages = chat["messages"]
        previous = data.get("previous_response_id")
        if previous is not None:  # vLLM construct_input_messages with the stored turn
            stored = self.responses.get(previous)
            if stored is None:
                raise ApiError(404, f"Response with id '{previous}' not found.",
                               "invalid_request_error", "response_id")
            history = [m for m in stored[0] if m.get("role") != "system"]
            history.append({"role": "assistant", "content": stored[1]})
            new = input_messages(data)
            system = new[:1] if data.get("instructions") else []
            messages = system + history + new[len(system):]
        params = self._api_params(data, "max_output_tokens")
        prompt = await self._api_prompt(messages, chat["options"])
        answer = _ResponsesOut(self, ResponsesAnswer(data, model, int(time.time()),
                                                     self._check_length(len(prompt),
                                                                        params.max_tokens)))
        response, text = await self._answer_api(request, prompt, params, lora,
                                                answer.answer.id, answer)
        if self.store_responses and data.get("store") is not False:
            self.responses[answer.answer.id] = (messages, text)
            while len(self.responses) > MAX_STORED_RESPONSES:
                del self.responses[next(iter(self.responses))]
        return response

    async def handle_messages(self, request: web.Request) -> web.StreamResponse:
        """vLLM's ``/v1/messages`` (Anthropic Messages) for text answers."""
        data = await self._body(request)
        model, lora = self._resolve_model(data)
        if self._merge_inline_system is None:
            tok = await self.tokenizer.get()
            self._merge_inline_system = merges_inline_system(getattr(tok, "chat_template", None))
        try:
            chat = messages_to_chat(check_messages_body(data),
                                    merge_inline_system=self._merge_inline_system)
        except ValueError as exc:
            raise bad_request(str(exc), "messages") from exc
        options = {k: v for k, v in chat.items() if k != "messages"}
        if "tools" in options:
            options["tool_dicts"] = options.pop("tools")
        params = self._api_params(data, "max_tokens")
        prompt = await self._api_prompt(chat["messages"], options)
        answer = _MessagesOut(self, MessagesAnswer(model))
        response, _ = await self._answer_api(request, prompt, params, lora, answer.answer.id,
                                             answer)
        return response

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

    async def _texts_tokens(self, texts: list[str]) -> list[list[int]]:
        return [await self._encode(text, True) for text in texts]

    async def handle_vectors(self, request: web.Request) -> web.Response:
        """``/v1/embeddings`` and ``/pooling``: ``input`` as a completions ``prompt``
        (``worker.emulator.pooling``: made-up unit vectors in vLLM 0.32's shapes)."""
        data = await self._body(request)
        model, _ = self._resolve_model(data)
        dim = data.get("dimensions") or pooling.EMBED_DIM
        if type(dim) is not int or not 0 < dim <= pooling.MAX_EMBED_DIM:
            raise bad_request(f"dimensions must be 1..{pooling.MAX_EMBED_DIM}", "dimensions")
        prompts = await self._completion_prompts(data, "input")
        kind = "embeddings" if request.path == "/v1/embeddings" else "pooling"
        return web.json_response(pooling.vectors_body(kind, model, prompts, dim))

    async def handle_score(self, request: web.Request) -> web.Response:
        data = await self._body(request)
        model, _ = self._resolve_model(data)
        try:
            first, second = pooling.score_sides(data)
            body = pooling.score_body(model, await self._texts_tokens(first),
                                      await self._texts_tokens(second))
        except pooling.PoolingInputError as exc:
            raise bad_request(str(exc), exc.param) from exc
        return web.json_response(body)

    async def handle_rerank(self, request: web.Request) -> web.Response:
        data = await self._body(request)
        model, _ = self._resolve_model(data)
        top_n = data.get("top_n", 0)
        if type(top_n) is not int or top_n < 0:
            raise bad_request("top_n must be a non-negative integer", "top_n")
        try:
            query = pooling.texts_of(data.get("query"), "query")
            documents = pooling.texts_of(data.get("documents"), "documents")
        except pooling.PoolingInputError as exc:
            raise bad_request(str(exc), exc.param) from exc
        if len(query) != 1:
            raise bad_request("query must be one string", "query")
        query_tokens = (await self._texts_tokens(query))[0]
        return web.json_response(pooling.rerank_body(
            model, query_tokens, await self._texts_tokens(documents), documents, top_n))

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
        """vLLM 0.33: a bare JSON array, one entry per DP rank (rank order) with the resolved
        endpoints (vllm/entrypoints/serve/kv_events/api_router.py)."""
        return web.json_response([
            {"data_parallel_rank": e.dp_rank, "endpoint": e.publisher.endpoint,
             "replay_endpoint": e.publisher.replay_endpoint, "topic": self.config.kv_events.topic}
            for e in self.engines if e.publisher is not None])

    async def handle_reset_prefix_cache(self, request: web.Request) -> web.Response:
        # vLLM resets every engine's cache (a collective over the DP ranks)
        if not all([engine.reset_prefix_cache() for engine in self.engines]):
            raise ApiError(409, "Cannot reset the prefix cache while requests hold blocks.",
                           "ConflictError")
        return web.Response(status=200)



class _ResponsesOut:
    """A Responses answer's usage from the sequence (cached tokens always reported)."""

    def __init__(self, server: ReplicaServer, answer: ResponsesAnswer) -> None:
        self.server, self.answer = server, answer

    def _usage(self, seq: Sequence_, prompt_len: int) -> dict[str, Any]:
        return responses_usage(prompt_len, seq.num_output, self.server._cached(seq))

    def whole(self, text: str, seq: Sequence_, prompt_len: int) -> dict[str, Any]:
        return self.answer.body(text, self._usage(seq, prompt_len))

    def start(self, seq: Sequence_, prompt_len: int) -> bytes:
        return self.answer.start()

    def delta(self, text: str) -> bytes:
        return self.answer.delta(text)

    def end(self, seq: Sequence_, prompt_len: int) -> bytes:
        return self.answer.end(self._usage(seq, prompt_len))


class _MessagesOut:
    """A Messages answer's usage (cache reads only with prompt-token details on, as vLLM)."""

    def __init__(self, server: ReplicaServer, answer: MessagesAnswer) -> None:
        self.server, self.answer = server, answer

    def _usage(self, seq: Sequence_, prompt_len: int) -> dict[str, Any]:
        details = self.server.config.enable_prompt_tokens_details
        return anthropic_usage(prompt_len, seq.num_output,
                               self.server._cached(seq) if details else None)

    def whole(self, text: str, seq: Sequence_, prompt_len: int) -> dict[str, Any]:
        finish = seq.finish.value if seq.finish else None
        return self.answer.body(text, finish, self._usage(seq, prompt_len))

    def start(self, seq: Sequence_, prompt_len: int) -> bytes:
        return self.answer.start(anthropic_usage(prompt_len, 0, None))

    def delta(self, text: str) -> bytes:
        return self.answer.delta(text)

    def end(self, seq: Sequence_, prompt_len: int) -> bytes:
        finish = seq.finish.value if seq.finish else None
        return self.answer.end(finish, self._usage(seq, prompt_len))


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def _error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """The one place that turns errors into vLLM-shaped JSON bodies."""
    try:
        return await handler(request)
    except ApiError as exc:
        body = exc.body()
        if request.path == "/v1/messages":  # vLLM translate_error_response: Anthropic's shape
            body = {"type": "error", "error": {"type": exc.err_type, "message": exc.message}}
        return web.Response(status=exc.status, body=_json_encode(body),
                            content_type="application/json")
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        err = ApiError(exc.status, exc.reason,
                       "NotFoundError" if exc.status == 404 else "BadRequestError")
        return web.Response(status=exc.status, body=_json_encode(err.body()),
                            content_type="application/json")

