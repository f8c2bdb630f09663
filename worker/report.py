"""``prefix-worker report``: the sidecar that publishes one replica's KV cache to Redis. Does I/O (wiring).

Wires the pieces together on one asyncio (uvloop) loop:
``KVEventSubscriber`` (ZMQ) -> ``ReplicaView`` (pure) -> ``RedisWriter`` (Redis),
plus the ``Heartbeat`` (engine HTTP -> Redis), the hash agreement probe and
the metrics endpoint. A data-parallel engine (vLLM ``--data-parallel-size`` N) gets one
``Worker`` per rank in this process (``serve``): each subscribes to its rank's stream, keeps its
own view and publishes the rank as replica ``{replica_id}#{rank}``
(``router.shared.kv_event_sources``). On start it reads back what a previous worker of the
same replica left in Redis (block set, epoch, seq: a worker that crashed within the heartbeat's
TTL) and continues from the last sequence number through the engine's replay socket; a worker
stopped by SIGTERM or SIGINT deregistered and left nothing, so the next one starts afresh under a
new epoch. When Redis loses the
replica's state (outage, restart, failover, FLUSHALL, expired heartbeat) the
writer republishes the full set under a new epoch (``RedisWriter``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import sys
import time
from collections.abc import Awaitable, Sequence
from typing import Final, TypeVar

import aiohttp
import redis.asyncio as aioredis

from router.shared.contract import HEARTBEAT_TTL_S, OP_CLEARED, TIERS
from router.shared.hashing import BlockHasher, HashConfigError
from router.shared.kv_event_sources import (
    AUTO_ENDPOINT,
    RANK_SEPARATOR,
    RankSource,
    offset_sources,
    parse_kv_event_sources,
)
from router.shared.kv_events import KVEventBatch
from router.shared.logs import IntervalLog, configure_logging
from router.shared.process import loop_factory
from router.shared.redis_client import reconnect_retry, redis_client
from router.shared.settings import StartupError
from worker.block_keys import KEY_MODE_RECOMPUTED, RecomputedKeys
from worker.capacity_guard import check_capacity, precheck
from worker.event_filter import EventFilter, parse_kv_tiers
from worker.hash_check import HashCheck
from worker.heartbeat import EngineClient, EngineLoad, EngineModels, EngineUnreachable, Heartbeat
from worker.metrics import WorkerSnapshot, make_registry, start_metrics_server, worker_snapshot
from worker.redis_writer import REDIS_ERRORS, RedisWriter
from worker.replica_store import StoredState
from worker.replica_view import NO_SEQ, Change, ReplicaView
from worker.report_config import SETTINGS, ConfigError, WorkerConfig, load_config
from worker.subscriber import KVEventSubscriber, max_message_bytes

logger = logging.getLogger(__name__)

SOURCES_RETRY_MAX_S: Final = 5.0  # longest wait between asks of an engine still starting
ENGINE_WAIT_S: Final = 10.0  # wait this long for the engine's cache config before subscribing
SHUTDOWN_FLUSH_S: Final = 2.0
DEREGISTER_TIMEOUT_S: Final = 2.0  # a Redis that does not answer at shutdown: expiry does it

T = TypeVar("T")



class Stopped(Exception):
    """The stop signal arrived before the awaited start-up step finished."""


async def unless_stopped(awaitable: Awaitable[T], stop: asyncio.Event) -> T:
    """``awaitable``'s result, unless ``stop`` is set first: then it is cancelled (a redis-py
    ``Retry`` loop or an HTTP request in flight ends there) and ``Stopped`` is raised."""
    task = asyncio.ensure_future(awaitable)
    stopping = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait((task, stopping), return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopping.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise Stopped
    return task.result()


class Worker:
    """One replica's sidecar. ``apply``/``resync`` are the subscriber's sink (synchronous, cheap)."""

    def __init__(self, config: WorkerConfig, client: aioredis.Redis,
                 session: aiohttp.ClientSession, dp_rank: int | None = None) -> None:
        self.config = config
        self.client = client
        self.view = ReplicaView(index_stride=config.index_stride)
        self.event_filter = EventFilter(tiers=parse_kv_tiers(config.kv_tiers), dp_rank=dp_rank)
        self.writer = RedisWriter(client, config.redis_prefix, config.replica_id,
                                  on_recovered=self._on_redis_recovered,
                                  state_ttl_s=config.state_ttl_s)
        self.engine = EngineClient(session, config.engine_url, dp_rank)
        self.heartbeat = Heartbeat(self.engine, self.writer, replica_id=config.replica_id,
                                   url=config.url, fields=self._heartbeat_fields,
                                   on_engine=self._on_engine)
        self.subscriber: KVEventSubscriber | None = None
        self.hash_check = HashCheck(self, config.probe_timeout_s)
        self.engine_block_size: int | None = None
        self.engine_hash_algo: str | None = None
        self.lora_paths: dict[str, str] = {}  # {lora_name: lora_path} from the engine's /v1/models
        self.event_lag_s = 0.0
        self.engine_known = asyncio.Event()
        self._writer_task: asyncio.Task[None] | None = None
        self._heartbeat_task: asyncio.Task[None] | None = None
        self._subscriber_task: asyncio.Task[None] | None = None
        self._probe_task: asyncio.Task[None] | None = None
        self.starting = ""  # the start-up step under way ("" once running)
        self.stopped_while = ""  # the step a stop signal interrupted ("": none)
        self._unreachable_log = IntervalLog(logger)  # one line per interval, not per retry

    # -- subscriber sink ---------------------------------------------------------

    def apply(self, seq: int, batch: KVEventBatch) -> None:
        """Apply batch ``seq``. Raises ``BatchRefused`` (nothing applied) for a batch that
        would leave more GPU blocks resident than the engine's KV cache holds."""
        epoch = self.view.epoch
        batch = self.filtered(batch)
        check_capacity(len(self.view.blocks), batch.events, self._capacity())
        for change in self.view.apply_batch(seq, batch):
            self.writer.enqueue(change)
        self.writer.advance(self.view.epoch, seq)
        self.event_lag_s = max(0.0, time.time() - batch.ts)
        self.hash_check.observe(batch)
        if self.view.epoch != epoch:
            self._epoch_changed()

    def precheck(self, payload: bytes) -> None:
        """The subscriber's check before a payload is decoded (``capacity_guard.precheck``)."""
        self._set_block_size()
        precheck(payload, self._capacity(), self.event_filter)

    def _capacity(self) -> int | None:
        """The engine's ``num_gpu_blocks`` (None: not known yet)."""
        load = self.heartbeat.load
        return load.num_gpu_blocks if load is not None else None

    def _set_block_size(self) -> None:
        self.event_filter.block_size = self.config.block_size or self.engine_block_size

    def filtered(self, batch: KVEventBatch) -> KVEventBatch:
        """``batch`` without the events the index cannot use (other tiers, block sizes, ...; ``EventFilter``)."""
        self._set_block_size()
        return self.event_filter.apply(batch)

    def resync(self, reason: str) -> None:
        self.writer.enqueue(self.view.reset(reason))
        self._epoch_changed()

    def _epoch_changed(self) -> None:
        self.hash_check.want()
        self.heartbeat.wake.set()

    def _on_redis_recovered(self) -> Change:
        # after an outage, or when Redis came back without this replica's keys
        change = self.view.rewrite("Redis connection restored or Redis lost the replica's state")
        self._epoch_changed()
        return change

    # -- engine info -------------------------------------------------------------

    def _on_engine(self, models: EngineModels, load: EngineLoad) -> None:
        previous = self.heartbeat.previous_load
        restarted = None
        if previous is not None and load.prefix_cache_queries < previous.prefix_cache_queries:
            restarted = "its prefix cache counters went backwards"
        elif (previous is not None and previous.counters_created is not None
              and load.counters_created is not None
              and load.counters_created != previous.counters_created):
            restarted = "its prefix cache counters were created anew"
        if restarted:
            # vLLM counters only go down (or are re-created) when the engine restarted; its KV
            # events may not have told us yet (the new engine's first batches can be lost before
            # the SUB socket reconnects), so resync now and fetch the new engine's history.
            self.resync(f"engine restarted: {restarted}")
            if self.subscriber is not None:
                self.subscriber.restart_from_scratch()
        self.lora_paths = dict(models.lora_adapters)
        if load.block_size is not None:
            self.engine_block_size = load.block_size
        if load.hash_algo is not None:
            self.engine_hash_algo = load.hash_algo
        self.engine_known.set()

    def hasher(self) -> BlockHasher:
        """The routers' hasher for this engine. Raises ``HashConfigError``."""
        block_size = self.config.block_size or self.engine_block_size or 16
        algo = self.config.hash_algo or self.engine_hash_algo or "sha256"
        return BlockHasher(block_size, algo, self.config.hash_seed)

    def _heartbeat_fields(self) -> dict[str, str | int]:
        try:
            fingerprint = self.hasher().seed_fingerprint
        except HashConfigError:
            fingerprint = ""
        return {
            "seed_fingerprint": fingerprint,
            "hash_verified": self.hash_check.hash_verified,
            "key_mode": self.view.key_mode,
            "num_blocks": len(self.view.blocks),
            "index_stride": self.view.index_stride,
            "kv_tiers": ",".join(t for t in TIERS if t in self.event_filter.tiers),
        }

    # -- life cycle ----------------------------------------------------------------

    async def read_state(self) -> StoredState:
        """What a previous worker of this replica left in Redis (retries until Redis answers).

        Without a heartbeat (routers have dropped the replica) the stale set is
        deleted at once under an epoch newer than any before (a ms clock), so a
        heartbeat never advertises it.
        """
        return await reconnect_retry().call_with_retry(self._read_state_once, self._unreachable)

    async def _read_state_once(self) -> StoredState:
        state = await self.writer.read_state()
        if state.epoch is None:
            epoch = int(time.time() * 1000)
            self.view = ReplicaView(epoch=epoch, index_stride=self.config.index_stride)
            self.writer.enqueue(Change(OP_CLEARED, [], epoch, NO_SEQ))
            await self.writer.flush()
            logger.info("no previous state for replica %s (first start, a previous worker "
                        "deregistered on shutdown, or its heartbeat expired over %.0f s ago): "
                        "starting at epoch %d", self.config.replica_id, HEARTBEAT_TTL_S, epoch)
        else:
            self.writer.committed_epoch = state.epoch
            self.writer.committed_seq = state.seq
        return state

    async def _unreachable(self, exc: Exception) -> None:
        self._unreachable_log(logging.WARNING, "Redis not reachable yet (%s); retrying", exc)

    def restore(self, state: StoredState) -> bool:
        """Continue from ``state``. Returns True when continuing from its seq (no reset)."""
        if state.epoch is None:
            return False
        stride = self.config.index_stride
        lost = ("key_mode=recomputed" if state.key_mode == KEY_MODE_RECOMPUTED
                else f"index_stride {stride} (block depths are not in Redis)" if stride > 1
                else f"index_stride 1 after {state.index_stride}" if state.index_stride != 1
                else None)
        if lost is not None:
            # What the previous worker knew beyond Redis (the {engine hash: key} map, the chain
            # depth of every resident block) or its stride differs: rebuild from replay.
            self.view = ReplicaView(epoch=state.epoch, index_stride=stride)
            if state.key_mode == KEY_MODE_RECOMPUTED:
                try:
                    self.view.mapper = RecomputedKeys(self.hasher(), self.lora_paths.get)
                except HashConfigError:
                    pass
            self.writer.enqueue(self.view.reset(f"restarted with {lost}"))
            return False
        self.view = ReplicaView(epoch=state.epoch, seq=state.seq, keys=state.keys,
                                cpu_keys=state.cpu_keys)
        logger.info("restored replica %s: epoch %d, seq %d, %d blocks (%d on the CPU tier)",
                    self.config.replica_id, state.epoch, state.seq, len(state.keys),
                    len(state.cpu_keys))
        return True

    def snapshot(self) -> WorkerSnapshot:
        return worker_snapshot(self)

    async def run(self, stop: asyncio.Event) -> None:
        """Run until ``stop`` is set; then flush what is queued and return. A stop during
        start-up (Redis or the engine not answering yet) ends the wait at once and returns
        with ``stopped_while`` naming what the worker was waiting for."""
        config = self.config
        try:
            runner, _ = await start_metrics_server(make_registry(self.snapshot),
                                                   config.metrics_host, config.metrics_port)
        except OSError as exc:  # port in use, unknown host
            raise StartupError(f"cannot serve metrics on {config.metrics_host}:"
                               f"{config.metrics_port}: {exc}") from exc
        try:
            await unless_stopped(self._start(), stop)
            await stop.wait()
        except Stopped:
            self.stopped_while = self.starting
        finally:
            for task in (self._subscriber_task, self._probe_task):
                if task is not None:
                    task.cancel()
            if self._writer_task is not None:
                with contextlib.suppress(TimeoutError):
                    await self.writer.wait_idle(SHUTDOWN_FLUSH_S)
            tasks = [t for t in (self._writer_task, self._heartbeat_task, self._subscriber_task,
                                 self._probe_task) if t is not None]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if self._heartbeat_task is not None:
                await self._deregister()
            await runner.cleanup()

    async def _deregister(self) -> None:
        """Leave the fleet on a stop signal: the replica's heartbeat and sets are deleted, so
        routers stop sending it requests at once (not after the heartbeat's TTL); a worker
        started later begins afresh from the engine's replay buffer."""
        failure = None
        try:
            await asyncio.wait_for(self.writer.deregister(), DEREGISTER_TIMEOUT_S)
        except TimeoutError:
            failure = f"Redis did not answer within {DEREGISTER_TIMEOUT_S:.0f} s"
        except REDIS_ERRORS as exc:
            failure = str(exc)
        if failure is not None:
            logger.warning("could not deregister replica %s (%s): routers drop it when its "
                           "heartbeat expires (%.0f s)", self.config.replica_id, failure,
                           HEARTBEAT_TTL_S)
            return
        logger.info("deregistered replica %s: its heartbeat and block sets are deleted from "
                    "Redis, routers take it out of rotation at their next refresh",
                    self.config.replica_id)

    async def _start(self) -> None:
        """Every start-up step up to running: the stored state (retried until Redis answers),
        the engine's cache config (up to ``ENGINE_WAIT_S``), then the subscriber, writer and
        probe tasks. ``starting`` names the step under way."""
        config = self.config
        self.starting = "Redis (the replica's stored state)"
        state = await self.read_state()
        self._heartbeat_task = asyncio.create_task(self.heartbeat.run(), name="heartbeat")
        self.starting = "the engine's cache config"
        try:
            await asyncio.wait_for(self.engine_known.wait(), ENGINE_WAIT_S)
        except TimeoutError:
            logger.warning("engine %s not answering yet; subscribing anyway", config.engine_url)
        replay_from_state = self.restore(state)
        self.subscriber = KVEventSubscriber(
            config.kv_events_endpoint, self, replay_endpoint=config.kv_replay_endpoint,
            topic=config.kv_events_topic, last_seq=self.view.seq,
            replay_timeout_s=config.replay_timeout_s, event_window_s=config.event_window_s,
            max_message_bytes=max_message_bytes(
                self.heartbeat.load.num_gpu_blocks if self.heartbeat.load else None,
                self.engine_block_size), precheck=self.precheck)
        logger.info("worker for replica %s: engine %s, events %s, redis %s (%s)", config.replica_id,
                    config.engine_url, config.kv_events_endpoint, config.redis_url,
                    f"continuing from seq {self.view.seq}" if replay_from_state else "fresh start")
        self._writer_task = asyncio.create_task(self.writer.run(), name="Redis writer")
        self._subscriber_task = asyncio.create_task(self.subscriber.run(),
                                                    name="KV event subscriber")
        self._probe_task = asyncio.create_task(self.hash_check.run(), name="hash probe")
        for task in (self._heartbeat_task, self._writer_task, self._subscriber_task,
                     self._probe_task):
            if task is not None:
                task.add_done_callback(_log_failure)
        self.starting = ""


def _log_failure(task: asyncio.Task[None]) -> None:
    """Log a worker task that died of an exception: its loop is meant to run until the worker
    stops, and nothing else would say that the replica's events, probe or writes stopped."""
    if not task.cancelled() and (exc := task.exception()) is not None:
        logger.error("the worker's %s task died; the replica is no longer kept up to date",
                     task.get_name(), exc_info=exc)


async def discover_sources(engine: EngineClient) -> list[RankSource]:
    """The engine's KV event sources from ``GET /kv_event_sources``, retried (the engine may
    not be up yet, or list no ready rank) until it answers; ``unless_stopped`` ends it."""
    backoff = 0.2
    while True:
        try:
            sources = parse_kv_event_sources(await engine.kv_event_sources(), engine.engine_url)
            if sources:
                return sources
            problem = "no rank publishes KV events (is --kv-events-config enabled?)"
        except (EngineUnreachable, ValueError) as exc:
            problem = str(exc)
        logger.warning("KV event sources of %s not known yet: %s; retrying", engine.engine_url,
                       problem)
        await asyncio.sleep(backoff)
        backoff = min(backoff * 2, SOURCES_RETRY_MAX_S)


def is_data_parallel(sources: list[RankSource]) -> bool:
    """True when the engine has several ranks (or lists one rank other than 0)."""
    return len(sources) > 1 or sources[0].dp_rank > 0


def rank_configs(config: WorkerConfig, sources: list[RankSource]) -> list[WorkerConfig]:
    """One worker config per rank: its replica id (``name#rank`` for a data-parallel engine),
    its sockets, and its metrics port (the configured one + the rank unless 0)."""
    if not is_data_parallel(sources):
        source = sources[0]
        return [dataclasses.replace(config, kv_events_endpoint=source.endpoint,
                                    kv_replay_endpoint=source.replay_endpoint,
                                    kv_events_topic=source.topic)]
    return [dataclasses.replace(
        config, replica_id=f"{config.replica_id}{RANK_SEPARATOR}{s.dp_rank}",
        kv_events_endpoint=s.endpoint, kv_replay_endpoint=s.replay_endpoint,
        kv_events_topic=s.topic,
        metrics_port=config.metrics_port + s.dp_rank if config.metrics_port else 0)
        for s in sources]


async def serve(config: WorkerConfig) -> None:
    """Run the worker(s) of one engine until SIGINT/SIGTERM: one per data-parallel rank."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    client = redis_client(config.redis_url, config.redis_password,
                          socket_timeout=5.0, socket_connect_timeout=2.0)
    try:
        async with aiohttp.ClientSession() as session:
            if config.kv_events_endpoint == AUTO_ENDPOINT:
                try:
                    sources = await unless_stopped(
                        discover_sources(EngineClient(session, config.engine_url)), stop)
                except Stopped:
                    _log_stopped_during_start_up("the engine's KV event sources")
                    return
            else:
                sources = offset_sources(config.kv_events_endpoint, config.kv_replay_endpoint,
                                         config.kv_events_topic, config.data_parallel_size)
            ranked = is_data_parallel(sources)
            configs = rank_configs(config, sources)
            if ranked:
                logger.info("engine %s: %d data-parallel ranks, replicas %s", config.engine_url,
                            len(sources), ", ".join(c.replica_id for c in configs))
            workers = [Worker(rank_config, client, session, s.dp_rank if ranked else None)
                       for rank_config, s in zip(configs, sources, strict=True)]
            await asyncio.gather(*(worker.run(stop) for worker in workers))
            waits = sorted({w.stopped_while for w in workers if w.stopped_while})
            if waits:
                _log_stopped_during_start_up(" and ".join(waits))
    finally:
        await client.aclose()


def _log_stopped_during_start_up(waiting_for: str) -> None:
    logger.info("stop signal during start-up (waiting for %s): exiting", waiting_for)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``prefix-worker report``. Returns the exit code."""
    try:
        config = load_config(sys.argv[1:] if argv is None else argv)
    except ConfigError as exc:
        print(f"prefix-worker report: error: {exc}", file=sys.stderr)
        return 2
    configure_logging(config.log_level, config.log_format)
    for line in SETTINGS.misspelled_env(os.environ):
        logger.warning("%s", line)
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        try:
            runner.run(serve(config))
        except StartupError as exc:
            print(f"prefix-worker report: error: {exc}", file=sys.stderr, flush=True)
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
