"""Generation behind an emulated replica's OpenAI front end: picks the data-parallel rank,
submits the prompts to its :class:`EmulatedEngine` and relays the engine's outputs as vLLM
0.33's JSON bodies or SSE streams (completions, chat completions, and one-sequence answers for
the Responses and Messages APIs). Does I/O (aiohttp responses); the engine does no HTTP.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, Final, Protocol

import msgspec
from aiohttp import web

from worker.emulator.api_formats import (
    MessagesAnswer,
    ResponsesAnswer,
    anthropic_usage,
    responses_usage,
)
from worker.emulator.config import EmulatorConfig
from worker.emulator.engine import EmulatedEngine, SubmittedPrompt
from worker.emulator.http_checks import GenerationParams, bad_request, check_length
from worker.emulator.outputs import OutputCollector
from worker.emulator.scheduler import FinishReason, Request

OUTPUT_WORDS: Final = (" the", " quick", " brown", " fox", " jumps", " over", " a", " lazy",
                       " dog", ".")  # text of generated token i is OUTPUT_WORDS[i % 10]
DP_RANK_HEADER: Final = "X-data-parallel-rank"  # vLLM serving engine _get_data_parallel_rank
_SSE_HEADERS: Final = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}

_json_encode = msgspec.json.encode

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


@dataclass(slots=True)
class Sequence_:
    """One generated sequence of an HTTP request (a choice)."""

    index: int
    request: Request
    num_output: int = 0
    finish: FinishReason | None = None


def cached_tokens(seq: Sequence_) -> int:
    return max(seq.request.num_cached_tokens, 0)


class ApiAnswer(Protocol):
    """How a one-sequence answer (Responses or Messages) is written, whole or streamed."""

    def whole(self, text: str, seq: Sequence_, prompt_len: int) -> dict[str, Any]: ...
    def start(self, seq: Sequence_, prompt_len: int) -> bytes: ...
    def delta(self, text: str) -> bytes: ...
    def end(self, seq: Sequence_, prompt_len: int) -> bytes: ...


class ResponsesOut:
    """A Responses answer's usage from the sequence (cached tokens always reported)."""

    def __init__(self, answer: ResponsesAnswer) -> None:
        self.answer = answer
        self.usage: dict[str, Any] | None = None  # the finished answer's (the stored response's)

    def _usage(self, seq: Sequence_, prompt_len: int) -> dict[str, Any]:
        self.usage = responses_usage(prompt_len, seq.num_output, cached_tokens(seq))
        return self.usage

    def whole(self, text: str, seq: Sequence_, prompt_len: int) -> dict[str, Any]:
        return self.answer.body(text, self._usage(seq, prompt_len))

    def start(self, seq: Sequence_, prompt_len: int) -> bytes:
        return self.answer.start()

    def delta(self, text: str) -> bytes:
        return self.answer.delta(text)

    def end(self, seq: Sequence_, prompt_len: int) -> bytes:
        return self.answer.end(self._usage(seq, prompt_len))


class MessagesOut:
    """A Messages answer's usage (cache reads only with prompt-token details on, as vLLM)."""

    def __init__(self, answer: MessagesAnswer, prompt_tokens_details: bool) -> None:
        self.answer = answer
        self.prompt_tokens_details = prompt_tokens_details

    def _usage(self, seq: Sequence_, prompt_len: int) -> dict[str, Any]:
        return anthropic_usage(prompt_len, seq.num_output,
                               cached_tokens(seq) if self.prompt_tokens_details else None)

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


@dataclass(slots=True)
class _Completion:
    """One completions or chat completions request in flight: its id, sequences and shape."""

    rid: str
    created: int
    model: str
    chat: bool
    seqs: list[Sequence_]
    prompt_lens: list[int]  # one per prompt: usage counts each once
    params: GenerationParams

    @property
    def by_index(self) -> dict[int, Sequence_]:
        return {s.index: s for s in self.seqs}


class Generation:
    """Runs requests on a replica's engines (its data-parallel ranks, in rank order) and counts
    the requests in flight (``num_inflight``: vLLM's ``/load`` ``server_load``)."""

    def __init__(self, engines: list[EmulatedEngine], config: EmulatorConfig) -> None:
        self.engines = engines
        self.config = config
        self.num_inflight = 0

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

    def submit(self, engine: EmulatedEngine, prompts: list[list[int]], params: GenerationParams,
               lora: str | None, request_id: str) -> tuple[OutputCollector, list[Sequence_]]:
        """Check each prompt's length, then hand the prompts to ``engine``."""
        submitted = [SubmittedPrompt(p, check_length(self.config, len(p), params.max_tokens))
                     for p in prompts]
        reason = (FinishReason.LENGTH if params.max_tokens is not None or params.ignore_eos
                  else FinishReason.STOP)
        collector, requests = engine.submit(
            submitted, n=params.n, finish_at_limit=reason, lora=lora,
            cache_salt=params.cache_salt, request_id=request_id)
        return collector, [Sequence_(i, r) for i, r in enumerate(requests)]

    def usage(self, seqs: list[Sequence_], prompt_lens: list[int]) -> dict[str, Any]:
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
            cached = sum(cached_tokens(s) for s in seqs if s.index % n == 0)
            usage["prompt_tokens_details"] = {"cached_tokens": cached}
        return usage

    async def generate(self, request: web.Request, prompts: list[list[int]],
                       params: GenerationParams, model: str, lora: str | None,
                       chat: bool) -> web.StreamResponse:
        """Run a completions (``chat`` False) or chat completions request and answer it whole or
        streamed; the engine's requests are aborted when the handler ends (or is cancelled by a
        client that went away), as vLLM aborts them."""
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        engine = self.select_engine(request)
        collector, seqs = self.submit(engine, prompts, params, lora, rid)
        run = _Completion(rid, created, model, chat, seqs, [len(p) for p in prompts], params)
        self.num_inflight += 1
        try:
            if params.stream:
                return await self._stream(request, collector, run)
            return await self._whole(collector, run)
        finally:
            self.num_inflight -= 1
            engine.abort([s.request for s in seqs])

    async def _whole(self, collector: OutputCollector, run: _Completion) -> web.Response:
        by_index = run.by_index
        remaining = len(run.seqs)
        while remaining:
            index, n_new, finished = await collector.queue.get()
            seq = by_index[index]
            seq.num_output += n_new
            if finished is not None:
                seq.finish = finished
                remaining -= 1
        choices = []
        for seq in run.seqs:
            text = output_text(0, seq.num_output)
            reason = seq.finish.value if seq.finish else None
            if run.chat:
                choices.append({"index": seq.index, "message": {
                    "role": "assistant", "content": text, "refusal": None,
                    "annotations": None, "audio": None, "function_call": None,
                    "tool_calls": [], "reasoning_content": None},
                    "logprobs": None, "finish_reason": reason, "stop_reason": None})
            else:
                choices.append({"index": seq.index, "text": text, "logprobs": None,
                                "finish_reason": reason, "stop_reason": None,
                                "prompt_logprobs": None})
        body = {"id": run.rid, "object": "chat.completion" if run.chat else "text_completion",
                "created": run.created, "model": run.model, "choices": choices,
                "usage": self.usage(run.seqs, run.prompt_lens), "system_fingerprint": None,
                "kv_transfer_params": None}
        if run.chat:
            body["prompt_logprobs"] = None
        return web.Response(body=_json_encode(body), content_type="application/json")

    async def _stream(self, request: web.Request, collector: OutputCollector,
                      run: _Completion) -> web.StreamResponse:
        resp = web.StreamResponse(headers=_SSE_HEADERS)
        await resp.prepare(request)
        obj = "chat.completion.chunk" if run.chat else "text_completion"

        def chunk(choices: list[dict[str, Any]], usage: Any = None) -> bytes:
            body: dict[str, Any] = {"id": run.rid, "object": obj, "created": run.created,
                                    "model": run.model, "choices": choices}
            if usage is not None:
                body["usage"] = usage
            return b"data: " + _json_encode(body) + b"\n\n"

        if run.chat:
            first = [{"index": s.index, "delta": {"role": "assistant", "content": ""},
                      "logprobs": None, "finish_reason": None} for s in run.seqs]
            await resp.write(chunk(first))
        by_index = run.by_index
        remaining = len(run.seqs)
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
                if run.chat:
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
        if run.params.include_usage:
            tail = chunk([], self.usage(run.seqs, run.prompt_lens))
        await resp.write(tail + b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def answer_api(self, request: web.Request, prompt: list[int], params: GenerationParams,
                         lora: str | None, rid: str,
                         answer: ApiAnswer) -> tuple[web.StreamResponse, str]:
        """Generate one sequence and answer it through ``answer`` (``ResponsesOut`` or
        ``MessagesOut``), whole or streamed. Returns the response and the generated text."""
        engine = self.select_engine(request)
        collector, seqs = self.submit(engine, [prompt], params, lora, rid)
        seq = seqs[0]
        self.num_inflight += 1
        try:
            if not params.stream:
                while seq.finish is None:
                    _, n_new, finished = await collector.queue.get()
                    seq.num_output += n_new
                    seq.finish = finished
                text = output_text(0, seq.num_output)
                return web.Response(body=_json_encode(answer.whole(text, seq, len(prompt))),
                                    content_type="application/json"), text
            resp = web.StreamResponse(headers=_SSE_HEADERS)
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
            self.num_inflight -= 1
            engine.abort([seq.request])
