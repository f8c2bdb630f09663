"""The router's background loops: housekeeping once a second (speculative placements pruned,
idle client connections bounded, gauges refreshed, the heap trimmed), the stall watch (replicas
that stopped sending, missed first-byte deadlines) and the index sweeper. Each runs as one task
for the process's life; ``asyncio.CancelledError`` ends it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web

from router.decision.fleet import Fleet
from router.decision.health import HUNG, MISSED, ROUTER_LATE
from router.edges.client_connections import is_idle
from router.edges.first_byte_waits import GONE, FirstByteWaits
from router.observability.loop_lag import LoopLag
from router.observability.metrics import RouterMetrics
from router.service.config import RouterConfig
from router.service.heap import HeapTrimmer

logger = logging.getLogger(__name__)

SWEEP_KEYS_PER_STEP = 5_000  # index keys swept per event-loop turn (a short turn; benchmarks.md)


class BackgroundLoops:
    """``housekeeping``, ``stall_watch`` and ``sweeper``: coroutines to run as tasks.
    ``waits`` (the proxy's attempts waiting for a first byte) and ``web_server`` are set when the
    router starts (None until then: nothing of theirs to act on)."""

    def __init__(self, config: RouterConfig, fleet: Fleet, metrics: RouterMetrics,
                 loop_lag: LoopLag, heap: HeapTrimmer,
                 prompt_caches: Callable[[], list[tuple[str, Any]]]) -> None:
        self.config = config
        self.fleet = fleet
        self.metrics = metrics
        self.loop_lag = loop_lag
        self.heap = heap
        self.prompt_caches = prompt_caches  # [(name, cache with num_bytes and len)]
        self.waits: FirstByteWaits | None = None
        self.web_server: web.Server | None = None  # the listening server (client connections)

    def close_idle_connections(self) -> int:
        """Close the oldest idle client connections beyond ``max_idle_client_connections``.
        Returns how many were closed (aiohttp keeps no such bound); one on which a request head
        is arriving is not idle."""
        if self.web_server is None:
            return 0
        idle = [h for h in self.web_server.connections if is_idle(h)]
        surplus = len(idle) - self.config.max_idle_client_connections
        for handler in idle[:max(surplus, 0)]:  # oldest first
            handler.force_close()
        return max(surplus, 0)

    def _prompt_cache_gauges(self) -> None:
        for name, cache in self.prompt_caches():
            self.metrics.prompt_cache_bytes.labels(name).set(cache.num_bytes)
            self.metrics.prompt_cache_entries.labels(name).set(len(cache))

    async def housekeeping(self) -> None:
        """Prune expired speculative placements, bound idle client connections and refresh
        gauges once a second."""
        fleet, metrics = self.fleet, self.metrics
        while True:
            self.close_idle_connections()
            now = time.monotonic()
            fleet.speculative.prune(now)
            metrics.speculative_blocks.set(len(fleet.speculative))
            metrics.index_blocks.set(len(fleet.index))
            self._prompt_cache_gauges()
            metrics.fleet_panic.set(1 if fleet.panic(now)[0] else 0)
            if self.heap.due():  # a large prompt's freed memory back to the OS (service.heap)
                await asyncio.to_thread(self.heap.trim)
            for rid, replica in fleet.replicas.items():
                routable = fleet.routable_problem(replica, now) is None
                metrics.replica_routable.labels(rid).set(1 if routable else 0)
                metrics.set_replica_target(rid, replica.url, replica.dp_rank)
                affinity = fleet.affinity_problem(replica) is None
                metrics.replica_affinity.labels(rid).set(1 if affinity else 0)
                mismatch = fleet.config_mismatch(replica) is not None
                metrics.replica_config_mismatch.labels(rid).set(1 if mismatch else 0)
            await asyncio.sleep(1.0)

    async def stall_watch(self) -> None:
        """Bench replicas that stopped sending bytes while others did, or hung past a first-byte
        deadline, count missed deadlines (``router.decision.health``), and move requests that
        still wait for a first byte to the next replica. A replica's KV events count as its
        progress."""
        health = self.fleet.health
        cfg = self.config
        interval = min(1.0, cfg.stall_timeout_s / 4, cfg.first_byte_deadline_floor_s / 4)
        entries: dict[str, tuple[int, int]] = {}  # {replica_id: (epoch, entry_seq) last seen}
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic()
            for rid, replica in self.fleet.replicas.items():
                seen = entries.get(rid)
                entries[rid] = (replica.epoch, replica.entry_seq)
                # new stream entries: the engine stored or evicted blocks
                events = (seen is not None and seen[0] == replica.epoch
                          and seen[1] < replica.entry_seq)
                health.engine_report(rid, now, replica.num_running + replica.num_waiting > 0,
                                     events)
            for gone in entries.keys() - self.fleet.replicas.keys():
                del entries[gone]
            self._judge_overdue(now)
            self._bench_stalled(now)
            self._move_from_departed()

    def _move_from_departed(self) -> None:
        """Move the requests still waiting for a first byte on a replica that left the fleet
        (its heartbeat expired): its health record is gone, so no deadline of theirs is judged
        any more, and they would wait for ``first_byte_timeout_s``."""
        if self.waits is None:
            return
        for rid in self.waits.waiting_replicas() - self.fleet.replicas.keys():
            moved = self.waits.abort_waiting(rid, GONE)
            logger.warning("replica %s left the fleet: %d waiting requests moved", rid, moved)

    def _bench_stalled(self, now: float) -> None:
        """Bench the replicas that sent nothing for ``stall_timeout_s`` while others did."""
        health, metrics = self.fleet.health, self.metrics
        for rid in health.stalled(now):
            if self.loop_lag.late(now - self.config.stall_timeout_s, now):
                # its bytes may sit unread: the router was late, not the replica
                metrics.child(metrics.loop_late, "stalled").inc()
                continue
            health.trip(rid, now, "stalled")
            metrics.child(metrics.upstream_errors, rid, "stalled").inc()
            moved = self.waits.abort_waiting(rid) if self.waits is not None else 0
            logger.warning("replica %s sent nothing for %.0f s while others did: benched; "
                           "%d waiting requests moved", rid, self.config.stall_timeout_s, moved)

    def _judge_overdue(self, now: float) -> None:
        """Act on the attempts past their first-byte deadline (``ReplicaHealth.overdue``)."""
        health, metrics = self.fleet.health, self.metrics
        for overdue in health.overdue(now, self.loop_lag.late):
            rid = overdue.replica_id
            if overdue.verdict == ROUTER_LATE:
                metrics.child(metrics.loop_late, MISSED).inc()
                continue
            metrics.child(metrics.upstream_errors, rid, overdue.verdict).inc()
            if overdue.verdict == HUNG:
                health.trip(rid, now, HUNG)
                moved = self.waits.abort_waiting(rid, HUNG) if self.waits is not None else 0
                logger.warning("replica %s sent nothing past a first-byte deadline while others "
                               "progressed: benched; %d waiting requests moved", rid, moved)
                continue
            if health.record_failure(rid, now, MISSED):
                logger.warning("replica %s: circuit opened after %s", rid, MISSED)
            if overdue.fallback and self.waits is not None:
                self.waits.abort_attempt(overdue.token, MISSED)

    async def sweeper(self) -> None:
        """Sweep retired index slots (replica cleared or dropped) in steps that yield to the
        loop."""
        while True:
            if self.fleet.index.sweep_pending:
                self.fleet.sweep_index(SWEEP_KEYS_PER_STEP)
                await asyncio.sleep(0)
            else:
                await asyncio.sleep(0.05)
