"""The worker's own Prometheus metrics (``worker_*``), served on ``--metrics-port``. Does I/O (HTTP server).

Values are read from the worker's counters at scrape time through one custom
collector, so the event path pays nothing per event for metrics.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from router.shared.contract import HashVerified
from worker.block_keys import KEY_MODE_RECOMPUTED
from worker.event_filter import KNOWN_MEDIUMS, MEDIUM_GPU, OTHER_MEDIUM

if TYPE_CHECKING:
    from worker.report import Worker

logger = logging.getLogger(__name__)

# the labels of worker_skipped_tier_events_total: every medium but GPU (always indexed)
SKIPPABLE_MEDIUMS = (*(m for m in KNOWN_MEDIUMS if m != MEDIUM_GPU), OTHER_MEDIUM)


@dataclass(frozen=True, slots=True)
class WorkerSnapshot:
    """Everything the metrics report, read at scrape time."""

    events: Mapping[str, int] = field(default_factory=dict)  # {event type: events applied}
    events_by_medium: Mapping[str, int] = field(default_factory=dict)  # {medium: events applied}
    skipped_events: Mapping[str, int] = field(default_factory=dict)  # {reason: events skipped}
    skipped_tier_events: Mapping[str, int] = field(default_factory=dict)  # {medium: of "tier"}
    num_messages: int = 0
    num_malformed: int = 0
    num_refused_batches: int = 0
    num_publisher_disconnects: int = 0
    redis_oom: int = 0
    num_bad_events: int = 0
    num_seq_gaps: int = 0
    num_replays: int = 0
    num_replay_failures: int = 0
    num_engine_restarts: int = 0
    num_epoch_resets: int = 0
    num_redis_errors: int = 0
    num_redis_transactions: int = 0
    num_redis_rewrites: int = 0
    num_keys_written: int = 0
    num_heartbeats: int = 0
    num_engine_errors: int = 0
    num_unknown_removals: int = 0
    num_unknown_depth_blocks: int = 0
    num_probes: int = 0
    num_probe_misses: int = 0
    probe_retrying: int = 0
    resident_blocks: int = 0
    resident_cpu_blocks: int = 0
    pending_changes: int = 0
    epoch: int = 0
    seq: int = -1
    hash_verified: int = -1  # 1 verified, 0 mismatch, -1 not yet probed
    key_mode_recomputed: int = 0
    engine_up: int = 0
    redis_up: int = 0
    event_lag_s: float = 0.0


_COUNTERS: tuple[tuple[str, str, str], ...] = (
    ("worker_kv_messages", "num_messages", "KV event messages received live."),
    ("worker_malformed_messages", "num_malformed", "KV event messages dropped as malformed."),
    ("worker_refused_batches", "num_refused_batches", "Well-formed KV event batches refused as "
     "impossible for the engine (more GPU blocks than its KV cache holds); none reach Redis."),
    ("worker_publisher_disconnects", "num_publisher_disconnects", "Times the KV event "
     "publisher's connection dropped: a message over the size limit (refused unread) or the "
     "publisher went away."),
    ("worker_bad_events", "num_bad_events", "Events whose block keys could not be computed."),
    ("worker_seq_gaps", "num_seq_gaps", "KV event sequence gaps seen."),
    ("worker_replays", "num_replays", "Replay requests sent to the engine."),
    ("worker_replay_failures", "num_replay_failures", "Gaps the replay could not cover."),
    ("worker_engine_restarts", "num_engine_restarts", "Engine restarts detected (seq backwards)."),
    ("worker_epoch_resets", "num_epoch_resets", "Epoch bumps (restart, clear, resync, rewrite)."),
    ("worker_redis_errors", "num_redis_errors", "Failed Redis writes."),
    ("worker_redis_transactions", "num_redis_transactions", "Committed Redis transactions."),
    ("worker_redis_rewrites", "num_redis_rewrites", "Full set rewrites after a Redis outage."),
    ("worker_keys_written", "num_keys_written", "Block keys written to Redis (set changes)."),
    ("worker_heartbeats", "num_heartbeats", "Heartbeats written."),
    ("worker_engine_errors", "num_engine_errors", "Failed engine polls."),
    ("worker_unknown_removals", "num_unknown_removals", "Removed blocks not resident on their tier (GPU or CPU)."),
    ("worker_unknown_depth_blocks", "num_unknown_depth_blocks",
     "Stored blocks not placed in their chain (parent never seen, or a host store of a hash "
     "never seen stored on the GPU); not published."),
    ("worker_probes", "num_probes", "Hash agreement probes completed."),
    ("worker_probe_misses", "num_probe_misses", "Hash agreement probes that missed: the event "
     "socket was not subscribed, or the probe's BlockStored did not arrive, in time (each is "
     "sent again, up to the attempts an epoch gets)."),
)
_GAUGES: tuple[tuple[str, str, str], ...] = (
    ("worker_resident_blocks", "resident_blocks", "Block keys resident on the replica's GPU."),
    ("worker_resident_cpu_blocks", "resident_cpu_blocks",
     "Block keys resident in the replica's CPU tier (host memory, vLLM native offloading)."),
    ("worker_pending_changes", "pending_changes", "Changes queued for Redis."),
    ("worker_epoch", "epoch", "Current epoch of the replica's view."),
    ("worker_last_seq", "seq", "Last KV event batch sequence number applied."),
    ("worker_hash_verified", "hash_verified", "1 engine hashes verified, 0 mismatch, -1 unknown."),
    ("worker_probe_retrying", "probe_retrying", "1 while a hash probe missed and the next one "
     "waits (the verdict is not refreshed yet)."),
    ("worker_key_mode_recomputed", "key_mode_recomputed", "1 when keys are re-computed."),
    ("worker_engine_up", "engine_up", "1 when the engine answered the last poll."),
    ("worker_redis_up", "redis_up", "1 when the last Redis write succeeded."),
    ("worker_redis_oom", "redis_oom", "1 while Redis refuses this worker's writes for lack of "
     "memory (maxmemory reached under noeviction): its changes are held and retried."),
    ("worker_event_lag_seconds", "event_lag_s", "Wall time minus engine ts of the last batch."),
)


class WorkerCollector(Collector):
    """Turns a ``WorkerSnapshot`` into metric families at scrape time."""

    def __init__(self, snapshot: Callable[[], WorkerSnapshot]) -> None:
        self.snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        snap = self.snapshot()
        events = CounterMetricFamily("worker_events", "KV events applied, by type.", labels=["type"])
        for kind in ("BlockStored", "BlockRemoved", "AllBlocksCleared"):
            events.add_metric([kind], snap.events.get(kind, 0))
        yield events
        mediums = CounterMetricFamily("worker_tier_events", "KV events indexed, by medium (tier).",
                                      labels=["medium"])
        for medium, count in sorted(snap.events_by_medium.items()):
            mediums.add_metric([medium], count)
        yield mediums
        skipped = CounterMetricFamily(
            "worker_skipped_events", "KV events the index cannot use, skipped, by reason.",
            labels=["reason"])
        for reason, count in snap.skipped_events.items():
            skipped.add_metric([reason], count)
        yield skipped
        skipped_tiers = CounterMetricFamily(
            "worker_skipped_tier_events",
            "KV events of a medium (tier) the worker does not index, skipped, by medium "
            "(\"other\": one vLLM does not name).", labels=["medium"])
        for medium in SKIPPABLE_MEDIUMS:
            skipped_tiers.add_metric([medium], snap.skipped_tier_events.get(medium, 0))
        yield skipped_tiers
        for name, attr, doc in _COUNTERS:
            yield CounterMetricFamily(name, doc, value=getattr(snap, attr))
        for name, attr, doc in _GAUGES:
            yield GaugeMetricFamily(name, doc, value=getattr(snap, attr))


def worker_snapshot(worker: Worker) -> WorkerSnapshot:
    """The counters of ``worker`` (its subscriber, view, writer, heartbeat, event filter and
    hash check) as the metrics report them, read at scrape time."""
    sub = worker.subscriber.stats if worker.subscriber is not None else None
    stats, wstats = worker.view.stats, worker.writer.stats
    return WorkerSnapshot(
        events=dict(stats.events),
        events_by_medium=dict(stats.events_by_tier),
        skipped_events={reason: count + stats.skipped[reason]
                        for reason, count in worker.event_filter.skipped_by_reason()},
        skipped_tier_events=dict(worker.event_filter.skipped_tiers),
        num_messages=sub.num_messages if sub else 0,
        num_malformed=sub.num_malformed if sub else 0,
        num_refused_batches=sub.num_refused if sub else 0,
        num_publisher_disconnects=sub.num_disconnects if sub else 0,
        redis_oom=int(worker.writer.oom),
        num_bad_events=stats.num_bad_events,
        num_seq_gaps=sub.num_gaps if sub else 0,
        num_replays=sub.num_replays if sub else 0,
        num_replay_failures=sub.num_replay_failures if sub else 0,
        num_engine_restarts=sub.num_restarts if sub else 0,
        num_epoch_resets=stats.num_epoch_resets,
        num_redis_errors=wstats.num_errors + worker.heartbeat.num_redis_errors,
        num_redis_transactions=wstats.num_transactions,
        num_redis_rewrites=wstats.num_rewrites,
        num_keys_written=wstats.num_keys,
        num_heartbeats=worker.heartbeat.num_beats,
        num_engine_errors=worker.heartbeat.num_engine_errors,
        num_unknown_removals=worker.view.num_unknown_removals,
        num_unknown_depth_blocks=stats.num_unknown_depth_blocks,
        num_probes=worker.hash_check.num_probes,
        num_probe_misses=worker.hash_check.num_misses,
        probe_retrying=int(worker.hash_check.retrying),
        resident_blocks=len(worker.view.blocks),
        resident_cpu_blocks=len(worker.view.cpu_blocks),
        pending_changes=worker.writer.num_pending,
        epoch=worker.view.epoch,
        seq=worker.view.seq,
        hash_verified={HashVerified.VERIFIED: 1, HashVerified.MISMATCH: 0}.get(
            worker.hash_check.hash_verified, -1),
        key_mode_recomputed=int(worker.view.key_mode == KEY_MODE_RECOMPUTED),
        engine_up=int(worker.heartbeat.engine_up),
        redis_up=int(worker.writer.connected),
        event_lag_s=worker.event_lag_s,
    )


def make_registry(snapshot: Callable[[], WorkerSnapshot]) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(WorkerCollector(snapshot))
    return registry


async def start_metrics_server(registry: CollectorRegistry, host: str, port: int) -> tuple[web.AppRunner, int]:
    """Serve ``GET /metrics`` on ``host:port`` (0 = ephemeral). Returns the runner and the bound port."""

    async def metrics(_: web.Request) -> web.Response:
        body = generate_latest(registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = port
    server = site._server
    sockets = getattr(server, "sockets", None) or ()
    if sockets:
        bound = int(sockets[0].getsockname()[1])
    logger.info("worker metrics on http://%s:%d/metrics", host, bound)
    return runner, bound
