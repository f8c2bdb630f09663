"""The ``data:`` payloads of an OpenAI-style SSE stream, for the load generators that read one
(``replayer``, ``locustfile``). Pure."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Final

DONE: Final = b"[DONE]"  # the payload that ends an OpenAI stream


def sse_payloads(lines: Iterable[bytes]) -> Iterator[bytes]:
    """The payload (after ``data:``, stripped) of each line of ``lines`` that starts with
    ``data:``, in order, ``DONE`` included; other lines (events, comments, blanks) are skipped."""
    for line in lines:
        if line.startswith(b"data:"):
            yield line[5:].strip()
