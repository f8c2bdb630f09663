"""Trace replayer: sends a Mooncake trace slice to an OpenAI-compatible endpoint on the trace's
schedule and records per-request latency, cache and routing facts. Does network I/O (aiohttp).

Each request is a streamed ``POST /v1/completions`` with a token-id prompt (see
``router.tools.trace_format.TokenMapper``), ``max_tokens`` = the trace's output length, ``ignore_eos`` and
``stream_options.include_usage`` (or, with ``prompt_format="text"``, text of exactly the same token
count, for routers that accept only text; see ``loadtest.replay.text``). Send times follow ``loadtest.replay.trace.schedule_offsets``: the
trace's ~3 s timestamp steps are spread evenly over their step (``spread=True``, the default) or
sent as one burst, divided by ``speedup``. A request whose slot comes while ``max_concurrency``
requests are in flight waits for a free slot; its ``send_s`` then lags its ``scheduled_s``.

Per request (``RequestRecord``): scheduled and actual send time (s after the replay started),
TTFT (until the first SSE chunk that carries generated text), end-to-end latency, prompt, cached
(``usage.prompt_tokens_details.cached_tokens``, present when the engine runs with
``--enable-prompt-tokens-details``) and completion tokens, the replica that served it (response
header ``x-prefix-router-replica``, set by prefix-router) and the decision's reason
(``x-prefix-router-reason``), HTTP status and error text.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import numpy as np

from loadtest.data import PACKAGED_ARRIVALS, packaged_arrivals_path
from loadtest.replay.sse import DONE, sse_payloads
from loadtest.replay.trace import arrival_offsets, read_arrival_times, schedule_offsets
from router.tools.trace_format import TokenMapper, TraceRequest

logger = logging.getLogger(__name__)

REPLICA_HEADER = "x-prefix-router-replica"  # set by prefix-router on every proxied response
REASON_HEADER = "x-prefix-router-reason"  # the routing decision's reason label (prefix-router)
HIT_HEADER = "x-prefix-router-confirmed-hit-tokens"  # the index's engine-confirmed hit there
DEFAULT_MODEL = "emulated-llm"  # the emulator's default served model name
DEFAULT_MAX_CONCURRENCY = 512  # requests in flight
DEFAULT_REQUEST_TIMEOUT_S = 600.0  # per request, end to end
DEFAULT_PROGRESS_INTERVAL_S = 10.0
PROMPT_FORMATS = ("token_ids", "text")


@dataclass(frozen=True)
class ReplayConfig:
    """How to replay. ``target`` is the base URL (``http://127.0.0.1:8000``); ``max_duration_s``
    stops sending new requests after that many seconds and cancels what is still in flight
    ``drain_timeout_s`` later; ``max_output_tokens`` caps the trace's output lengths (None: no cap);
    ``keepalive`` reuses client connections (False: one fresh TCP connection per request);
    ``arrivals`` sends the requests on another trace's arrival times instead of their own (a
    packaged name such as ``azure-conv``, or an Azure-format CSV path; ``spread`` then does not
    apply)."""

    target: str
    model: str = DEFAULT_MODEL
    speedup: float = 1.0
    spread: bool = True
    max_concurrency: int = DEFAULT_MAX_CONCURRENCY
    max_duration_s: float | None = None
    drain_timeout_s: float = 120.0
    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S
    max_output_tokens: int | None = None
    token_seed: int = 0
    keepalive: bool = True
    prompt_format: str = "token_ids"  # or "text": words of exactly the same token count
    progress_interval_s: float = DEFAULT_PROGRESS_INTERVAL_S
    extra_headers: dict[str, str] = field(default_factory=dict)
    arrivals: str | None = None

    def __post_init__(self) -> None:
        if self.speedup <= 0:
            raise ValueError("speedup must be positive")
        if self.max_concurrency < 1:
            raise ValueError("max_concurrency must be at least 1")
        if self.prompt_format not in PROMPT_FORMATS:
            raise ValueError(f"prompt_format must be one of {PROMPT_FORMATS}")
        if self.max_output_tokens is not None and self.max_output_tokens < 1:
            raise ValueError("max_output_tokens must be at least 1")


@dataclass
class RequestRecord:
    """What happened to one replayed request. Times in seconds; ``send_s``/``scheduled_s`` are
    offsets from the replay start, ``ttft_s``/``e2e_s`` durations from ``send_s``. ``status`` is
    the HTTP status (0 when no response arrived); ``error`` is None on success."""

    seq: int  # position in the replayed slice
    trace_index: int  # line in the trace file
    scheduled_s: float
    send_s: float | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    input_length: int = 0  # from the trace
    max_tokens: int = 0
    prompt_tokens: int | None = None  # from usage
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens
    completion_tokens: int | None = None
    replica: str | None = None
    reason: str | None = None  # prefix-router's decision reason (None behind other routers)
    confirmed_hit_tokens: int | None = None  # prefix-router's index prediction on that replica
    status: int = 0
    error: str | None = None
    retry_after: str | None = None  # a refusal's Retry-After header, as sent

    @property
    def ok(self) -> bool:
        return self.error is None and self.status == 200


_decoder = msgspec.json.Decoder()
_encoder = msgspec.json.Encoder()


SSE_TAIL_BYTES = 8192  # enough for the usage chunk and [DONE]


def _handle_event(event: bytes, record: RequestRecord, start: float) -> bool:
    """Apply one SSE event to ``record``; True for the ``[DONE]`` marker."""
    found_done = False
    for payload in sse_payloads(line.strip() for line in event.split(b"\n")):
        if payload == DONE:
            found_done = True
            continue
        try:
            chunk = _decoder.decode(payload)
        except msgspec.DecodeError:
            record.error = f"bad SSE chunk: {payload[:200]!r}"
            continue
        if not isinstance(chunk, dict):
            continue
        if chunk.get("error"):
            record.error = f"stream error: {json.dumps(chunk['error'])[:300]}"
            continue
        if record.ttft_s is None and _chunk_has_text(chunk):
            record.ttft_s = time.perf_counter() - start
        usage = chunk.get("usage")
        if usage:
            record.prompt_tokens = usage.get("prompt_tokens")
            record.completion_tokens = usage.get("completion_tokens")
            details = usage.get("prompt_tokens_details") or {}
            record.cached_tokens = details.get("cached_tokens")
    return found_done


def _chunk_has_text(chunk: dict[str, Any]) -> bool:
    for choice in chunk.get("choices") or ():
        if choice.get("text") or (choice.get("delta") or {}).get("content"):
            return True
    return False


async def send_one(session: aiohttp.ClientSession, url: str, body: bytes, record: RequestRecord,
                   t0: float, headers: dict[str, str], timeout_s: float) -> None:
    """POST one streamed completion and fill ``record`` in place (never raises except
    ``CancelledError``). ``t0`` is the replay's ``time.perf_counter()`` origin."""
    start = time.perf_counter()
    record.send_s = start - t0
    try:
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with session.post(url, data=body, headers=headers, timeout=timeout) as resp:
            record.status = resp.status
            record.replica = resp.headers.get(REPLICA_HEADER)
            record.reason = resp.headers.get(REASON_HEADER)
            hit = resp.headers.get(HIT_HEADER)
            record.confirmed_hit_tokens = int(hit) if hit and hit.isdigit() else None
            if resp.status != 200:
                record.retry_after = resp.headers.get("Retry-After")
                text = await resp.text()
                record.error = f"HTTP {resp.status}: {text[:300]}"
                record.e2e_s = time.perf_counter() - start
                return
            # Parse events only until the first token; after it keep just the stream's tail (the
            # usage chunk and [DONE] come last) so hundreds of token events cost no parsing.
            buf = b""
            tail = b""
            done = False
            async for data in resp.content.iter_any():
                if record.ttft_s is None:
                    buf += data
                    events = buf.split(b"\n\n")
                    buf = events.pop()
                    for event in events:
                        done = _handle_event(event, record, start) or done
                    if record.ttft_s is not None:
                        tail = buf
                else:
                    tail = (tail + data)[-SSE_TAIL_BYTES:]
                    if b'"error"' in data:
                        record.error = record.error or "stream error (see response)"
            if record.ttft_s is not None:
                for event in tail.split(b"\n\n"):
                    if b"[DONE]" in event or b"prompt_tokens" in event or b'"error"' in event:
                        done = _handle_event(event, record, start) or done
            else:
                done = _handle_event(buf, record, start) or done
            record.e2e_s = time.perf_counter() - start
            if not done and record.error is None:
                record.error = "stream ended without [DONE]"
    except asyncio.CancelledError:
        record.error = "cancelled"
        raise
    except TimeoutError:
        record.error = f"timeout after {timeout_s} s"
    except aiohttp.ClientError as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    if record.e2e_s is None:
        record.e2e_s = time.perf_counter() - start


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100, linear interpolation), None for no values."""
    if not values:
        return None
    return float(np.percentile(np.asarray(values, dtype=float), q))


def progress_line(records: Sequence[RequestRecord], elapsed_s: float, total: int) -> str:
    sent = sum(1 for r in records if r.send_s is not None)
    done = [r for r in records if r.e2e_s is not None]
    errors = sum(1 for r in done if not r.ok)
    ttfts = [r.ttft_s for r in done if r.ttft_s is not None]
    p50 = percentile(ttfts, 50)
    p50_text = f"{p50:.3f} s" if p50 is not None else "-"
    return (f"{elapsed_s:6.1f} s: sent {sent}/{total}, done {len(done)}, "
            f"in flight {sent - len(done)}, errors {errors}, TTFT p50 {p50_text}")


def send_offsets(requests: Sequence[TraceRequest], config: ReplayConfig) -> list[float]:
    """Each request's send time (seconds after the start): the trace's own schedule, or the
    ``config.arrivals`` times (``ValueError`` if there are fewer of them than requests)."""
    if config.arrivals is None:
        return schedule_offsets(requests, config.speedup, config.spread)
    path = (packaged_arrivals_path(config.arrivals) if config.arrivals in PACKAGED_ARRIVALS
            else config.arrivals)
    return arrival_offsets(len(requests), read_arrival_times(path), config.speedup)


async def replay(requests: Sequence[TraceRequest], config: ReplayConfig,
                 progress: Callable[[str], None] | None = None) -> list[RequestRecord]:
    """Replay ``requests`` against ``config.target`` and return one record per request, in slice
    order (requests never sent because ``max_duration_s`` ran out carry ``error='not sent'``).
    ``progress`` receives a status line every ``progress_interval_s``."""
    offsets = send_offsets(requests, config)
    make_prompt = _prompt_maker(config)
    records = [RequestRecord(seq=i, trace_index=r.index, scheduled_s=off, input_length=r.input_length)
               for i, (r, off) in enumerate(zip(requests, offsets, strict=True))]
    url = config.target.rstrip("/") + "/v1/completions"
    headers = {"content-type": "application/json", **config.extra_headers}
    connector = aiohttp.TCPConnector(limit=config.max_concurrency, force_close=not config.keepalive)
    semaphore = asyncio.Semaphore(config.max_concurrency)
    tasks: set[asyncio.Task[None]] = set()
    t0 = time.perf_counter()

    async def report() -> None:
        while True:
            await asyncio.sleep(config.progress_interval_s)
            if progress is not None:
                progress(progress_line(records, time.perf_counter() - t0, len(records)))

    async def run(session: aiohttp.ClientSession, body: bytes, record: RequestRecord) -> None:
        try:
            await send_one(session, url, body, record, t0, headers, config.request_timeout_s)
        finally:
            semaphore.release()

    reporter = asyncio.create_task(report())
    async with aiohttp.ClientSession(connector=connector) as session:
        try:
            for req, record in zip(requests, records, strict=True):
                now = time.perf_counter() - t0
                if config.max_duration_s is not None and record.scheduled_s > config.max_duration_s:
                    break
                if record.scheduled_s > now:
                    await asyncio.sleep(record.scheduled_s - now)
                await semaphore.acquire()
                body = _request_body(req, record, config, make_prompt)
                task = asyncio.create_task(run(session, body, record))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            await _drain(tasks, config.drain_timeout_s)
        finally:
            for task in list(tasks):
                task.cancel()
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)
            reporter.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reporter
    for record in records:
        if record.send_s is None and record.error is None:
            record.error = "not sent"
    if progress is not None:
        progress(progress_line(records, time.perf_counter() - t0, len(records)))
    return records


def _prompt_maker(config: ReplayConfig) -> Callable[[TraceRequest], list[int] | str]:
    """A trace request's prompt in ``config.prompt_format``: token ids (``TokenMapper``), or
    text of exactly those Qwen3 token counts (``loadtest.replay.text.TextMapper``)."""
    mapper = TokenMapper(seed=config.token_seed)
    if config.prompt_format != "text":
        return mapper.request_prompt
    from loadtest.replay.text import TextMapper, default_vocabulary

    text_mapper = TextMapper(mapper, default_vocabulary())
    return lambda r: text_mapper.prompt(r.hash_ids, r.input_length)


def _request_body(req: TraceRequest, record: RequestRecord, config: ReplayConfig,
                  make_prompt: Callable[[TraceRequest], list[int] | str]) -> bytes:
    """The streamed completion request for ``req``: its output length (at least 1, capped at
    ``config.max_output_tokens``) as ``max_tokens``, noted in ``record``."""
    max_tokens = max(1, req.output_length)
    if config.max_output_tokens is not None:
        max_tokens = min(max_tokens, config.max_output_tokens)
    record.max_tokens = max_tokens
    return _encoder.encode({
        "model": config.model,
        "prompt": make_prompt(req),
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    })


async def _drain(tasks: set[asyncio.Task[None]], timeout_s: float) -> None:
    """Wait up to ``timeout_s`` for the requests in flight, then cancel the rest."""
    if not tasks:
        return
    _, pending = await asyncio.wait(set(tasks), timeout=timeout_s)
    for task in pending:
        task.cancel()
    if pending:
        await asyncio.gather(*pending, return_exceptions=True)


def write_records(records: Sequence[RequestRecord], path: str | Path) -> None:
    """Write records as JSON Lines (does I/O)."""
    with open(path, "w", encoding="utf-8") as fh:
        for record in records:
            fh.write(json.dumps(asdict(record)) + "\n")


def read_records(path: str | Path) -> list[RequestRecord]:
    """Read records written by ``write_records`` (does I/O)."""
    with open(path, encoding="utf-8") as fh:
        return [RequestRecord(**json.loads(line)) for line in fh if line.strip()]


ERROR_REASON_CHARS = 80


def error_reason(record: RequestRecord) -> str:
    """A failed request's reason in a few words, the same for every request that failed the same
    way: an OpenAI-shaped error body's ``error.message``, else the error text, cut at
    ``ERROR_REASON_CHARS``."""
    text = record.error or f"HTTP {record.status}"
    head = f"HTTP {record.status}: "
    if record.status and text.startswith(head):
        text = text[len(head):]
        with contextlib.suppress(ValueError, TypeError, AttributeError):
            text = str(json.loads(text)["error"]["message"])
    return text.strip()[:ERROR_REASON_CHARS] or "no reason given"


def error_kinds(records: Sequence[RequestRecord]) -> list[dict[str, Any]]:
    """Every failed request counted by kind: ``[{"status", "reason", "count", "first_s",
    "last_s"}]``, most frequent first; ``status`` the HTTP status (0: no response), ``reason``
    from ``error_reason``, ``first_s``/``last_s`` the first and last send time (seconds from
    the replay's start; the schedule's time for a request never sent)."""
    kinds: dict[tuple[int, str], dict[str, Any]] = {}
    for r in records:
        if r.ok:
            continue
        at = round(r.send_s if r.send_s is not None else r.scheduled_s, 2)
        kind = kinds.setdefault((r.status, error_reason(r)), {
            "status": r.status, "reason": error_reason(r), "count": 0,
            "first_s": at, "last_s": at})
        kind["count"] += 1
        kind["first_s"] = min(kind["first_s"], at)
        kind["last_s"] = max(kind["last_s"], at)
    return sorted(kinds.values(), key=lambda k: (-k["count"], k["first_s"]))


def summarize(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """Client-side summary: counts, TTFT/e2e percentiles (s), throughput (completed requests per
    second between the first send and the last completion), token hit rate from usage (sum of
    cached over sum of prompt tokens, None without prompt_tokens_details) and requests per replica
    (from the router's header)."""
    sent = [r for r in records if r.send_s is not None]
    ok = [r for r in sent if r.ok]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    e2es = [r.e2e_s for r in ok if r.e2e_s is not None]
    span = 0.0
    if ok:
        first = min(r.send_s for r in sent if r.send_s is not None)
        last = max((r.send_s or 0.0) + (r.e2e_s or 0.0) for r in ok)
        span = last - first
    prompt = sum(r.prompt_tokens or 0 for r in ok)
    cached_known = [r for r in ok if r.cached_tokens is not None]
    cached = sum(r.cached_tokens or 0 for r in cached_known)
    # the index's prediction against what the engine found: an over-estimate is a confirmed hit
    # the engine no longer had (evicted inside a held span, or between routing and scheduling)
    judged = [r for r in cached_known if r.confirmed_hit_tokens is not None]
    predicted = sum(r.confirmed_hit_tokens or 0 for r in judged)
    over = [r for r in judged if (r.confirmed_hit_tokens or 0) > (r.cached_tokens or 0)]
    over_tokens = sum((r.confirmed_hit_tokens or 0) - (r.cached_tokens or 0) for r in over)
    per_replica: dict[str, int] = {}
    for r in sent:
        if r.replica is not None:
            per_replica[r.replica] = per_replica.get(r.replica, 0) + 1
    return {
        "num_requests": len(records),
        "num_sent": len(sent),
        "num_ok": len(ok),
        "num_errors": len(records) - len(ok),
        "errors_by_kind": error_kinds(records),
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p90_s": percentile(ttfts, 90),
        "ttft_p99_s": percentile(ttfts, 99),
        "e2e_p50_s": percentile(e2es, 50),
        "e2e_p99_s": percentile(e2es, 99),
        "throughput_rps": (len(ok) / span) if span > 0 else None,
        "client_token_hit_rate": (cached / prompt) if cached_known and prompt else None,
        "predicted_hit_tokens": predicted if judged else None,
        "overestimated_requests": len(over) if judged else None,
        "overestimate_request_rate": (len(over) / len(judged)) if judged else None,
        "overestimated_token_share": (over_tokens / predicted) if predicted else None,
        "max_send_lag_s": max(((r.send_s or 0.0) - r.scheduled_s for r in sent), default=0.0),
        "requests_per_replica_header": dict(sorted(per_replica.items())),
    }
