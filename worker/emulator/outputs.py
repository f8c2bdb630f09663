"""A step's outputs handed to the requests that wait on them, and counted in the engine's
metrics. No I/O: the HTTP handlers read the collectors' queues.

Outputs go to each request's :class:`OutputCollector` (vLLM ``RequestOutputCollector``), which
merges the tokens a slow reader has not taken yet.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field
from typing import Final

from worker.emulator.config import DEFAULT_STREAM_INTERVAL_S
from worker.emulator.kv_cache import KVCacheManager
from worker.emulator.metrics import ReplicaMetrics
from worker.emulator.scheduler import FinishReason, RequestOutput

STREAM_INTERVAL_S: Final = DEFAULT_STREAM_INTERVAL_S  # wall seconds between a stream's writes


@dataclass(slots=True)
class OutputCollector:
    """One HTTP request's outputs, shared by its sequences (vLLM ``RequestOutputCollector``):
    ``queue`` items are ``(choice index, new tokens, finish reason or None)``; ``arrival`` and
    ``first_token_at`` are loop-time seconds (engine clock)."""

    arrival: float
    queue: asyncio.Queue[tuple[int, int, FinishReason | None]] = field(
        default_factory=asyncio.Queue)
    first_token_at: dict[int, float] = field(default_factory=dict)


@dataclass(slots=True)
class Sink:
    """Where one sequence's outputs go: its request's collector and its choice index, with
    the tokens generated but not yet handed over (``pending``) and when it last got some."""

    collector: OutputCollector
    index: int
    pending: int = 0
    delivered_at: float = -math.inf  # loop time


class OutputDelivery:
    """Hands each step's outputs to their sinks and keeps the engine's request metrics (TTFT,
    end-to-end latency, tokens, prefix-cache queries and hits) in step with them."""

    def __init__(self, kv: KVCacheManager, metrics: ReplicaMetrics, time_scale: float) -> None:
        self.kv = kv
        self.metrics = metrics
        self.time_scale = time_scale
        self._last_queries = 0
        self._last_hits = 0

    def deliver(self, outputs: list[RequestOutput], now: float) -> None:
        """Hand each request its new tokens; ``now`` is the engine time (clock) of the step's
        end, so the engine's own latency metrics say what the emulated GPU would report."""
        stats = self.kv.stats
        metrics = self.metrics
        if stats.queries != self._last_queries:
            metrics.prefix_cache_queries.inc(stats.queries - self._last_queries)
            metrics.prefix_cache_hits.inc(stats.hits - self._last_hits)
            self._last_queries, self._last_hits = stats.queries, stats.hits
        scale = self.time_scale
        wall = asyncio.get_running_loop().time()
        generated = 0
        for out in outputs:
            sink: Sink = out.request.sink
            collector = sink.collector
            first = False
            if out.num_new_tokens:
                generated += out.num_new_tokens
                sink.pending += out.num_new_tokens
                if sink.index not in collector.first_token_at:
                    first = True
                    collector.first_token_at[sink.index] = now
                    metrics.ttft.observe((now - collector.arrival) * scale)
                    metrics.prompt_tokens.inc(out.request.num_prompt_tokens)
                    metrics.prompt_tokens_cached.inc(max(out.request.num_cached_tokens, 0))
            if out.finished is not None:
                metrics.request_success[out.finished.value].inc()
                metrics.e2e_latency.observe((now - collector.arrival) * scale)
            # The first token and the end go out at once; tokens in between at most once per
            # stream interval (wall time), several in one SSE write, as vLLM's output collector
            # merges the outputs a slow reader has not taken yet. 8 emulated GPUs at 10x speed
            # make 80x one GPU's steps per second: one write per step per request would cost
            # this process more than everything else it does.
            if first or out.finished is not None or (
                    sink.pending and wall - sink.delivered_at >= STREAM_INTERVAL_S):
                collector.queue.put_nowait((sink.index, sink.pending, out.finished))
                sink.pending = 0
                sink.delivered_at = wall
        if generated:
            metrics.generation_tokens.inc(generated)
