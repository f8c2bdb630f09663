"""Data shipped with the load tests: a slice of the Mooncake conversation trace and the arrival
times of a slice of the Azure LLM conversation trace (see docs/benchmarks.md, "Trace replay").
No I/O at import."""

from __future__ import annotations

from pathlib import Path

PACKAGED_TRACE_NAME = "mooncake_conversation_first3000.jsonl"
PACKAGED_ARRIVALS = {"azure-conv": "azure_llm_conv_first3000.csv"}  # {name: file here}


def packaged_trace_path() -> Path:
    """Path of the packaged Mooncake slice (first 3,000 requests of the conversation trace)."""
    return Path(__file__).resolve().parent / PACKAGED_TRACE_NAME


def packaged_arrivals_path(name: str) -> Path:
    """Path of a packaged arrival schedule by name (``PACKAGED_ARRIVALS``); ``ValueError`` for an
    unknown name."""
    if name not in PACKAGED_ARRIVALS:
        raise ValueError(f"unknown arrivals {name!r}; packaged: {', '.join(PACKAGED_ARRIVALS)}")
    return Path(__file__).resolve().parent / PACKAGED_ARRIVALS[name]
