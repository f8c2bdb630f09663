"""Mooncake trace reading and the replay schedule. Pure except ``read_trace`` and
``read_arrival_times``.

The format itself (``TraceRequest``, ``parse_trace_line``, the hash-id -> token-id
``TokenMapper``) is ``router.tools.trace_format``.
"""

from __future__ import annotations

import csv
import itertools
from collections.abc import Iterable, Iterator, Sequence
from datetime import datetime
from pathlib import Path

import numpy as np

from router.tools.trace_format import TraceFormatError, TraceRequest, parse_trace_line


def select_requests(requests: Iterable[TraceRequest], start: int = 0, limit: int | None = None,
                    window_s: float | None = None) -> list[TraceRequest]:
    """The slice a replay uses: requests from line ``start`` on, at most ``limit`` of them, and only
    those that arrive within ``window_s`` seconds of the first selected request. Raises ``ValueError``
    on a negative start, limit or window."""
    if start < 0 or (limit is not None and limit < 0) or (window_s is not None and window_s < 0):
        raise ValueError("start, limit and window must not be negative")
    out: list[TraceRequest] = []
    first_ms: int | None = None
    for req in requests:
        if req.index < start:
            continue
        if limit is not None and len(out) >= limit:
            break
        if first_ms is None:
            first_ms = req.timestamp_ms
        if window_s is not None and req.timestamp_ms - first_ms > window_s * 1000.0:
            break
        out.append(req)
    return out


def iter_trace(path: str | Path) -> Iterator[TraceRequest]:
    """Stream a Mooncake JSONL file (does I/O). Blank lines are skipped; indexes count lines read."""
    with open(path, encoding="utf-8") as fh:
        index = 0
        for line in fh:
            if not line.strip():
                continue
            yield parse_trace_line(line, index)
            index += 1


def read_trace(path: str | Path, start: int = 0, limit: int | None = None,
               window_s: float | None = None) -> list[TraceRequest]:
    """Read a slice of a Mooncake JSONL file (does I/O); see ``select_requests`` for the slice."""
    return select_requests(iter_trace(path), start=start, limit=limit, window_s=window_s)


def schedule_offsets(requests: Sequence[TraceRequest], speedup: float = 1.0,
                     spread: bool = True) -> list[float]:
    """Send time of each request in seconds after the replay starts, in input order.

    The trace's timestamps come in coarse steps (about 3 s in the conversation trace), so many
    requests share one. With ``spread`` the k-th of the n requests of a step is placed at
    ``t + k * (t_next - t) / n`` (``t_next`` is the next distinct timestamp; for the last step the
    median step length of the slice, or nothing when the slice has only one step); without it the
    step is sent as one burst at ``t``. All times are shifted so the first request goes at 0 and
    divided by ``speedup``. Deterministic; requests keep trace order within a step. Raises
    ``ValueError`` for a non-positive speedup or timestamps that go backwards.
    """
    if speedup <= 0:
        raise ValueError("speedup must be positive")
    if not requests:
        return []
    stamps = [r.timestamp_ms for r in requests]
    if any(b < a for a, b in itertools.pairwise(stamps)):
        raise ValueError("trace timestamps go backwards")
    distinct = sorted(set(stamps))
    steps = [b - a for a, b in itertools.pairwise(distinct)]
    last_step = float(np.median(steps)) if steps else 0.0
    next_stamp = {a: float(b) for a, b in itertools.pairwise(distinct)}
    next_stamp[distinct[-1]] = distinct[-1] + last_step
    count: dict[int, int] = {}
    for stamp in stamps:
        count[stamp] = count.get(stamp, 0) + 1
    seen: dict[int, int] = {}
    t0 = stamps[0]
    offsets: list[float] = []
    for stamp in stamps:
        k = seen.get(stamp, 0)
        seen[stamp] = k + 1
        t = float(stamp)
        if spread:
            t += k * (next_stamp[stamp] - stamp) / count[stamp]
        offsets.append((t - t0) / 1000.0 / speedup)
    return offsets


def read_arrival_times(path: str | Path) -> list[float]:
    """Arrival times (seconds after the first row) of an Azure LLM inference trace CSV
    (``TIMESTAMP,ContextTokens,GeneratedTokens``, a UTF-8 BOM, wall-clock timestamps with 7
    fractional digits, sorted; Patel et al., ISCA 2024). Only the timestamps are used: the Azure
    traces carry no prefix information. Raises ``TraceFormatError`` for a bad row or a timestamp
    that goes backwards."""
    times: list[float] = []
    with open(path, encoding="utf-8-sig", newline="") as f:
        for line_no, row in enumerate(csv.reader(f), start=1):
            if line_no == 1 or not row:
                continue  # the header
            try:
                times.append(datetime.fromisoformat(row[0]).timestamp())
            except ValueError as exc:
                raise TraceFormatError(f"{path}:{line_no}: bad TIMESTAMP {row[0]!r}") from exc
            if len(times) > 1 and times[-1] < times[-2]:
                raise TraceFormatError(f"{path}:{line_no}: timestamp goes backwards")
    return [t - times[0] for t in times] if times else []


def arrival_offsets(num_requests: int, arrival_s: Sequence[float],
                    speedup: float = 1.0) -> list[float]:
    """Send times for ``num_requests`` requests on another trace's arrival times: the first
    ``num_requests`` of ``arrival_s`` (seconds, non-decreasing), shifted to start at 0 and divided
    by ``speedup``. The i-th request of the slice goes at the i-th arrival, so the prompts keep
    their order and only the timing (with its bursts and lulls) is borrowed. Raises
    ``ValueError`` for a non-positive speedup or fewer arrivals than requests."""
    if speedup <= 0:
        raise ValueError("speedup must be positive")
    if num_requests > len(arrival_s):
        raise ValueError(f"{num_requests} requests but only {len(arrival_s)} arrival times")
    if num_requests == 0:
        return []
    t0 = arrival_s[0]
    return [(t - t0) / speedup for t in arrival_s[:num_requests]]
