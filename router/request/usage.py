"""What the engine itself reported about a request's prefix hit, read from the end of its answer. Pure.

vLLM reports ``usage.prompt_tokens_details.cached_tokens`` (local plus external
prefix-cache hit tokens, set when the request was scheduled) only when the
server runs with ``--enable-prompt-tokens-details``; a stream carries usage only
in its last data event, and only with ``stream_options.include_usage`` (or the
server's ``--enable-force-include-usage``). The proxy keeps the last
``TAIL_BYTES`` of a relayed stream; ``cached_tokens_from_sse_tail`` finds the
usage event in them. (vLLM 0.33 ``protocol.UsageInfo``, ``PromptTokenUsageInfo``.)
"""

from __future__ import annotations

import re
from typing import Final

import msgspec

TAIL_BYTES: Final = 4096  # bytes of a stream's end kept: room for the usage event (benchmarks.md)
TAIL_CHUNKS: Final = 32  # chunks a relay holds before it trims them to the tail (trim_tail)

_DECODER: Final = msgspec.json.Decoder()
_MARKER: Final = b'"prompt_tokens_details"'


def cached_tokens_from_sse_tail(tail: bytes) -> int | None:
    """``cached_tokens`` of the last SSE data event in ``tail`` that carries usage, or ``None``
    when no event in it reports them (no usage, ``prompt_tokens_details`` null, or the event
    cut off by the tail's start)."""
    at = tail.rfind(_MARKER)
    while at >= 0:
        start = tail.rfind(b"data:", 0, at)
        end = tail.find(b"\n", at)
        if start >= 0:
            event = tail[start + 5: end if end >= 0 else len(tail)]
            try:
                data = _DECODER.decode(event)
            except msgspec.DecodeError:
                data = None
            found = _cached_tokens(data)
            if found is not None:
                return found
        at = tail.rfind(_MARKER, 0, start if start >= 0 else at)
    return None


_JSON_DETAILS: Final = re.compile(
    rb'"prompt_tokens_details"\s*:\s*\{[^{}]*?"cached_tokens"\s*:\s*(\d+)')


def cached_tokens_from_tail(tail: bytes) -> int | None:
    """``cached_tokens`` from the end of an answer: an SSE stream's last usage event, or a JSON
    body's ``usage.prompt_tokens_details`` (the last one in ``tail``; a JSON string cannot hold
    the unescaped quotes the pattern needs, so generated text never matches)."""
    found = cached_tokens_from_sse_tail(tail)
    if found is not None or tail.lstrip().startswith(b"data:"):
        return found
    matches = list(_JSON_DETAILS.finditer(tail))
    return int(matches[-1].group(1)) if matches else None


def _cached_tokens(data: object) -> int | None:
    if not isinstance(data, dict):
        return None
    usage = data.get("usage")
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    if isinstance(cached, int) and not isinstance(cached, bool) and cached >= 0:
        return cached
    return None


_JSON_COMPLETION: Final = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')


def completion_tokens_from_tail(tail: bytes) -> int | None:
    """``usage.completion_tokens`` (tokens generated) from the end of an answer: the last one in
    ``tail`` (an SSE stream's usage event or a JSON body's usage; a JSON string cannot hold the
    unescaped quotes the pattern needs, so generated text never matches), or ``None``."""
    matches = list(_JSON_COMPLETION.finditer(tail))
    return int(matches[-1].group(1)) if matches else None


def trim_tail(chunks: list[bytes]) -> None:
    """Drop from ``chunks`` (in place, oldest first) every chunk not needed for the last
    ``TAIL_BYTES`` of their concatenation. A relay appends each chunk and trims once every
    ``TAIL_CHUNKS``: no bytes are copied per chunk."""
    kept = 0
    for i in range(len(chunks) - 1, 0, -1):
        kept += len(chunks[i])
        if kept >= TAIL_BYTES:
            del chunks[:i]
            return


def joined_tail(chunks: list[bytes]) -> bytes:
    """The last ``TAIL_BYTES`` of the concatenation of ``chunks`` (which it trims)."""
    trim_tail(chunks)
    joined = b"".join(chunks)
    return joined[-TAIL_BYTES:] if len(joined) > TAIL_BYTES else joined
