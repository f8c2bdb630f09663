"""Reading the engine's cached_tokens and completion_tokens from the end of an answer
(router/usage.py)."""

from __future__ import annotations

import json

from router.request.usage import (
    TAIL_BYTES,
    cached_tokens_from_sse_tail,
    completion_tokens_from_tail,
    keep_tail,
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
    tail = b""
    for _ in range(200):
        tail = keep_tail(tail, sse({"choices": [{"text": "y" * 50}]})[:-14])
    tail = keep_tail(tail, sse(usage))
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
