"""Data shipped with the load tests: a slice of the Mooncake conversation trace (see README.md).
No I/O at import."""

from __future__ import annotations

from pathlib import Path

PACKAGED_TRACE_NAME = "mooncake_conversation_first3000.jsonl"


def packaged_trace_path() -> Path:
    """Path of the packaged Mooncake slice (first 3,000 requests of the conversation trace)."""
    return Path(__file__).resolve().parent / PACKAGED_TRACE_NAME
