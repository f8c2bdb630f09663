"""Reading the engine's cached_tokens and completion_tokens from the end of an answer
(router/usage.py)."""

from __future__ import annotations

import json
import random

from router.request.usage import (
    TAIL_BYTES,
    cached_tokens_from_sse_tail,
    completion_tokens_from_tail,
    joined_tail,
    trim_tail,
)


def sse(*events: object) -> bytes:
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"


def test_usage_event_of_a_vllm_stream() -> None:
    chunk = {"id": "cmpl-1", "choices": [{"index": 0, "text": "x"}], "usage": None}
    usage = {"id": "cmpl-1", "choices": [], "usage": {
        "prompt_tokens": 200, "completion_tokens": 2, "total_tokens": 202,
        "prompt_tokens_details": {"cached_tokens": 192}}}
    assert cached_tokens_from_sse_tail(sse(chunk, chunk, usage)) == 192


def test_no_report_is_none() -> None:
    without_details = {"choices": [], "usage": {"prompt_tokens": 5, "prompt_tokens_details": None}}
    assert cached_tokens_from_sse_tail(sse(without_details)) is None
    assert cached_tokens_from_sse_tail(sse({"choices": [{"text": "a"}]})) is None
    assert cached_tokens_from_sse_tail(b"") is None
    # a text that merely mentions the field is not a report
    fake = {"choices": [{"text": '"prompt_tokens_details": {"cached_tokens": 7}'}]}
    assert cached_tokens_from_sse_tail(sse(fake)) is None


def test_tail_keeps_the_last_bytes_only() -> None:
    usage = {"choices": [], "usage": {"prompt_tokens_details": {"cached_tokens": 32}}}
    chunks: list[bytes] = []
    for _ in range(200):
        chunks.append(sse({"choices": [{"text": "y" * 50}]})[:-14])
        if len(chunks) >= 32:
            trim_tail(chunks)
    chunks.append(sse(usage))
    tail = joined_tail(chunks)
    assert len(tail) <= TAIL_BYTES
    assert cached_tokens_from_sse_tail(tail) == 32
    # the usage event cut off by the tail's start is no report
    assert cached_tokens_from_sse_tail(sse(usage)[20:]) is None


def test_completion_tokens_of_a_stream_and_of_a_json_body() -> None:
    usage = {"choices": [], "usage": {"prompt_tokens": 200, "completion_tokens": 37}}
    assert completion_tokens_from_tail(sse({"choices": [{"text": "x"}]}, usage)) == 37
    body = json.dumps({"choices": [{"text": "abc"}], "usage": {"completion_tokens": 5}}).encode()
    assert completion_tokens_from_tail(body) == 5
    # generated text that mentions the field is escaped inside its JSON string: no report
    fake = {"choices": [{"text": '"completion_tokens": 9'}]}
    assert completion_tokens_from_tail(sse(fake)) is None
    assert completion_tokens_from_tail(b"") is None


def test_joined_tail_is_the_streams_last_bytes_whatever_the_chunking() -> None:
    rng = random.Random(7)
    for _ in range(300):
        stream = bytes(rng.randrange(256) for _ in range(rng.randrange(0, 3 * TAIL_BYTES)))
        chunks: list[bytes] = []
        at = 0
        while at < len(stream):
            size = rng.choice((1, 7, 100, 1000, TAIL_BYTES, 2 * TAIL_BYTES))
            chunks.append(stream[at: at + size])
            at += size
            if rng.random() < 0.2:
                trim_tail(chunks)
        assert joined_tail(chunks) == stream[-TAIL_BYTES:]
