"""``prefix-worker report``: the sidecar that publishes one replica's KV cache to Redis. Does I/O (wiring).

Wires the pieces together on one asyncio (uvloop) loop:
``KVEventSubscriber`` (ZMQ) -> ``ReplicaView`` (pure) -> ``RedisWriter`` (Redis),
plus the ``Heartbeat`` (engine HTTP -> Redis), the hash agreement probe and
the metrics endpoint. A data-parallel engine (vLLM ``--data-parallel-size`` N) gets one
``Worker`` per rank in this process (``serve``): each subscribes to its rank's stream, keeps its
own view and publishes the rank as replica ``{replica_id}#{rank}``
(``router.shared.kv_event_sources``). On start it reads back what a previous worker of the
same replica left in Redis (block set, epoch, seq) and continues from the
last sequence number through the engine's replay socket. When Redis loses the
replica's state (outage, restart, failover, FLUSHALL, expired heartbeat) the
writer republishes the full set under a new epoch (``RedisWriter``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import signal
import sys
import time
from collections.abc import Awaitable, Sequence
from typing import Final, TypeVar

import aiohttp
import redis.asyncio as aioredis

from router.shared.contract import HEARTBEAT_TTL_S, OP_CLEARED, TIERS, HashVerified
from router.shared.hashing import BlockHasher, HashConfigError
from router.shared.kv_event_sources import (
    AUTO_ENDPOINT,
    RANK_SEPARATOR,
    RankSource,
    offset_sources,
    parse_kv_event_sources,
)
from router.shared.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockShape,
    BlockStored,
    KVEventBatch,
    count_blocks,
)
from router.shared.logs import IntervalLog, configure_logging
from router.shared.process import loop_factory
from router.shared.redis_client import reconnect_retry, redis_client
from router.shared.settings import StartupError
from worker.block_keys import KEY_MODE_RECOMPUTED, EngineKeys, RecomputedKeys
from worker.event_filter import EventFilter, parse_kv_tiers
from worker.heartbeat import EngineClient, EngineLoad, EngineModels, EngineUnreachable, Heartbeat
from worker.metrics import WorkerSnapshot, make_registry, start_metrics_server
from worker.probe import PROBE_TIMEOUT_S, ProbeCatcher, judge, probe_tokens
from worker.redis_writer import REDIS_ERRORS, RedisWriter, StoredState
from worker.replica_view import NO_SEQ, Change, ReplicaView
from worker.report_config import ConfigError, WorkerConfig, load_config
from worker.subscriber import BatchRefused, KVEventSubscriber, max_message_bytes

logger = logging.getLogger(__name__)

SOURCES_RETRY_MAX_S: Final = 5.0  # longest wait between asks of an engine still starting
ENGINE_WAIT_S: Final = 10.0  # wait this long for the engine's cache config before subscribing
PROBE_RETRY_S: Final = 2.0
SHUTDOWN_FLUSH_S: Final = 2.0
DEREGISTER_TIMEOUT_S: Final = 2.0  # a Redis that does not answer at shutdown: expiry does it

T = TypeVar("T")



def resident_after(num_resident: int, events: Sequence[object]) -> int:
    """GPU-tier blocks resident after ``events``, from ``num_resident`` before them: a store adds
    its blocks, an eviction takes them off, an ``AllBlocksCleared`` empties the cache (vLLM
    publishes it with the next step's batch, so the stores after it in the same batch start
    from nothing). Counts blocks, not distinct keys: a real engine's count never exceeds its
    ``num_gpu_blocks``, and the view's distinct keys never exceed the engine's count."""
    num = num_resident
    for event in events:
        if isinstance(event, AllBlocksCleared):
            num = 0
        elif isinstance(event, BlockStored) and event.medium in (None, "GPU"):
            num += len(event.block_hashes)
        elif isinstance(event, BlockRemoved) and event.medium in (None, "GPU"):
            num -= len(event.block_hashes)
    return num

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


# payload bytes from which a batch's blocks are counted before it is decoded: a legitimate
# step's batch is tens of KB (8,192 tokens of 16-token blocks: about 40 KB) and a smaller one
# builds at most a few MB of hashes before ``_check_capacity`` refuses it (the count costs about
# as much as the lazy decode, so the usual batch skips it)
PRECHECK_MIN_BYTES: Final = 256 * 1024


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
        self.hash_verified = HashVerified.UNKNOWN
        self.num_probes = 0
        self.engine_block_size: int | None = None
        self.engine_hash_algo: str | None = None
        self.lora_paths: dict[str, str] = {}  # {lora_name: lora_path} from the engine's /v1/models
        self.event_lag_s = 0.0
        self.engine_known = asyncio.Event()
        self._probe_wanted = asyncio.Event()
        self._catcher: ProbeCatcher | None = None
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
        self._check_capacity(batch)
        for change in self.view.apply_batch(seq, batch):
            self.writer.enqueue(change)
        self.writer.advance(self.view.epoch, seq)
        self.event_lag_s = max(0.0, time.time() - batch.ts)
        catcher = self._catcher
        if catcher is not None:
            for event in batch.events:
                if isinstance(event, BlockStored):
                    catcher.observe(event)
        if self.view.epoch != epoch:
            self._epoch_changed()

    def precheck(self, payload: bytes) -> None:
        """Raise ``BatchRefused`` for a batch payload whose GPU-tier stores net of its GPU-tier
        evictions exceed the engine's whole KV capacity (``num_gpu_blocks``): impossible from
        any state, so refused before the decode, its block hashes and token ids never built
        (a 2,000,000-block batch fits under a 500,000-block engine's ``MAXMSGSIZE``). Counted
        from the msgpack array headers (``count_blocks``), over the events ``filtered`` keeps;
        the state-dependent ``_check_capacity`` follows the decode."""
        capacity = self._capacity()
        # every block hash takes a byte at least: a payload this small cannot be impossible;
        # below PRECHECK_MIN_BYTES the decode is cheap and ``_check_capacity`` refuses it after
        if not capacity or len(payload) <= max(capacity, PRECHECK_MIN_BYTES):
            return
        # the stores first (cheap: removals skipped), the removals only when they matter
        delta = self._gpu_delta(count_blocks(payload, removals=False))
        if delta > capacity:
            delta = self._gpu_delta(count_blocks(payload))
        if delta > capacity:
            raise BatchRefused(f"{delta:+d} resident blocks exceed the engine's whole KV "
                               f"capacity of {capacity} blocks (refused before decoding)")

    def _gpu_delta(self, counted: tuple[int | None, dict[BlockShape, int]] | None) -> int:
        """GPU-tier blocks stored minus removed by the events ``filtered`` would keep (0 for a
        payload that is not a batch: the decode counts it as malformed)."""
        if counted is None:
            return 0
        rank, counts = counted
        event_filter = self.event_filter
        event_filter.block_size = self.config.block_size or self.engine_block_size
        delta = 0
        for (stored, block_size, medium, group_idx), num_blocks in counts.items():
            if (medium or "GPU") == "GPU" and event_filter.skip_reason(
                    stored, medium, group_idx, block_size, rank) is None:
                delta += num_blocks if stored else -num_blocks
        return delta

    def _capacity(self) -> int | None:
        """The engine's ``num_gpu_blocks`` (None: not known yet)."""
        load = self.heartbeat.load
        return load.num_gpu_blocks if load is not None else None

    def _check_capacity(self, batch: KVEventBatch) -> None:
        """Raise ``BatchRefused`` when ``batch`` would leave more GPU-tier blocks resident than
        the engine has (``num_gpu_blocks`` of ``vllm:cache_config_info``): vLLM's ``BlockPool``
        cannot hold more, so such a batch is not the engine's (a rogue or broken publisher) and
        none of it may reach Redis. A store counts each block, an eviction takes one off; the
        view holds at most as many distinct keys as the engine holds blocks."""
        capacity = self._capacity()
        if not capacity:
            return
        num_after = resident_after(len(self.view.blocks), batch.events)
        if num_after > capacity:
            raise BatchRefused(f"{len(self.view.blocks)} resident blocks would become "
                               f"{num_after}, over the engine's KV capacity of {capacity} blocks")

    def filtered(self, batch: KVEventBatch) -> KVEventBatch:
        """``batch`` without the events the index cannot use (other tiers, block sizes, ...; ``EventFilter``)."""
        event_filter = self.event_filter
        event_filter.block_size = self.config.block_size or self.engine_block_size
        return event_filter.apply(batch)

    def resync(self, reason: str) -> None:
        self.writer.enqueue(self.view.reset(reason))
        self._epoch_changed()

    def _epoch_changed(self) -> None:
        self._probe_wanted.set()
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
            "hash_verified": self.hash_verified,
            "key_mode": self.view.key_mode,
            "num_blocks": len(self.view.blocks),
            "index_stride": self.view.index_stride,
            "kv_tiers": ",".join(t for t in TIERS if t in self.event_filter.tiers),
        }

    # -- probe ---------------------------------------------------------------------

    async def probe_loop(self) -> None:
        """Probe at start and after every epoch change; retry while the engine is away."""
        self._probe_wanted.set()
        while True:
            await self._probe_wanted.wait()
            self._probe_wanted.clear()
            try:
                await self.engine_known.wait()
                await self.probe_once()
            except asyncio.CancelledError:
                raise
            except EngineUnreachable as exc:
                logger.warning("hash probe failed (%s); retrying in %.0fs", exc, PROBE_RETRY_S)
                await asyncio.sleep(PROBE_RETRY_S)
                self._probe_wanted.set()
            except Exception:
                logger.exception("hash probe failed unexpectedly")
            finally:
                self._catcher = None

    async def probe_once(self) -> None:
        """Send the probe completion, catch its ``BlockStored``, publish the verdict."""
        try:
            hasher = self.hasher()
        except HashConfigError as exc:
            logger.error("cannot reproduce the engine's block hashes: %s", exc)
            self.hash_verified = HashVerified.MISMATCH
            return
        models = self.heartbeat.models
        if models is None or not models.models:
            raise EngineUnreachable("engine serves no models yet")
        tokens = probe_tokens(self.engine_block_size or hasher.block_size)
        catcher = ProbeCatcher(tokens, self.engine_block_size or hasher.block_size)
        self._catcher = catcher
        await self.engine.complete(models.models[0], tokens, PROBE_TIMEOUT_S)
        try:
            await asyncio.wait_for(catcher.done.wait(), PROBE_TIMEOUT_S)
        except TimeoutError:
            logger.error("hash probe: no BlockStored for the probe prompt within %.0fs (are KV "
                         "events enabled on the engine, and does it bind its endpoint, e.g. "
                         "tcp://*:5557? vLLM connects instead for a concrete host, and so does "
                         "this worker, so no events flow)", PROBE_TIMEOUT_S)
            return
        verdict = judge(catcher, hasher)
        self.num_probes += 1
        self.hash_verified = HashVerified.VERIFIED if verdict.verified else HashVerified.MISMATCH
        if verdict.verified:
            # what was checked: the engine's hashes against this worker's hasher, whose
            # settings are the routers' only where they are configured here
            given = [name for name, value in (("block size", self.config.block_size),
                                              ("hash algo", self.config.hash_algo),
                                              ("hash seed", self.config.hash_seed)) if value]
            logger.info("hash probe: engine block hashes match this worker's hasher (%s, block "
                        "size %d, seed fingerprint %s; %s); routers with other settings report "
                        "this replica as config_mismatch", hasher.hash_algo, hasher.block_size,
                        hasher.seed_fingerprint,
                        f"{', '.join(given)} set for this worker" if given else
                        "the engine's own settings: none of block size, hash algo, hash seed "
                        "set for this worker")
            if self.view.key_mode != EngineKeys.mode:
                await self._switch(EngineKeys(), "engine hashes verified: back to key_mode=engine")
        else:
            logger.error("hash probe: engine block hashes DIFFER from the routers' (likely cause: %s); "
                         "re-computing keys from token_ids (key_mode=recomputed)", verdict.cause)
            current = self.view.mapper
            same = (isinstance(current, RecomputedKeys)
                    and (current.hasher.block_size, current.hasher.hash_algo, current.hasher.seed)
                    == (hasher.block_size, hasher.hash_algo, hasher.seed))
            if not same:
                await self._switch(RecomputedKeys(hasher, self.lora_paths.get),
                             f"hash mismatch ({verdict.cause}): key_mode=recomputed")
        self.heartbeat.wake.set()

    async def _switch(self, mapper: EngineKeys | RecomputedKeys, reason: str) -> None:
        """Re-key the replica's set under ``mapper`` from the engine's replay buffer.

        The engine keeps its cached blocks across the switch, so the set is rebuilt from
        the history the engine still buffers and published whole under the next epoch
        (one Redis change) rather than emptied. A mode switch needs no new probe.
        """
        fresh = self.view.rekeyed(mapper, reason)

        def swap(covered: bool) -> None:
            if not covered:
                logger.warning("key mode switch: the engine's replay did not complete; %d "
                               "blocks re-keyed, the rest appears as the engine stores it again",
                               len(fresh.blocks))
            self.view = fresh
            self.writer.enqueue(fresh.publish_whole())

        if self.subscriber is None:
            swap(True)
        else:
            await self.subscriber.rebuild(_Rekeying(self, fresh), f"key mode switch: {reason}", swap)
        self.heartbeat.wake.set()

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
            logger.info("no previous state for replica %s (first start, or its heartbeat "
                        "expired over %.0f s ago): starting at epoch %d", self.config.replica_id,
                        HEARTBEAT_TTL_S, epoch)
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
        sub = self.subscriber.stats if self.subscriber is not None else None
        stats, wstats = self.view.stats, self.writer.stats
        return WorkerSnapshot(
            events=dict(stats.events),
            events_by_medium=dict(stats.events_by_tier),
            skipped_events={reason: count + stats.skipped[reason]
                            for reason, count in self.event_filter.skipped_by_reason()},
            skipped_tier_events=dict(self.event_filter.skipped_tiers),
            num_messages=sub.num_messages if sub else 0,
            num_malformed=sub.num_malformed if sub else 0,
            num_refused_batches=sub.num_refused if sub else 0,
            num_publisher_disconnects=sub.num_disconnects if sub else 0,
            redis_oom=int(self.writer.oom),
            num_bad_events=stats.num_bad_events,
            num_seq_gaps=sub.num_gaps if sub else 0,
            num_replays=sub.num_replays if sub else 0,
            num_replay_failures=sub.num_replay_failures if sub else 0,
            num_engine_restarts=sub.num_restarts if sub else 0,
            num_epoch_resets=stats.num_epoch_resets,
            num_redis_errors=wstats.num_errors + self.heartbeat.num_redis_errors,
            num_redis_transactions=wstats.num_transactions,
            num_redis_rewrites=wstats.num_rewrites,
            num_keys_written=wstats.num_keys,
            num_heartbeats=self.heartbeat.num_beats,
            num_engine_errors=self.heartbeat.num_engine_errors,
            num_unknown_removals=self.view.num_unknown_removals,
            num_unknown_depth_blocks=stats.num_unknown_depth_blocks,
            num_probes=self.num_probes,
            resident_blocks=len(self.view.blocks),
            resident_cpu_blocks=len(self.view.cpu_blocks),
            pending_changes=self.writer.num_pending,
            epoch=self.view.epoch,
            seq=self.view.seq,
            hash_verified={HashVerified.VERIFIED: 1, HashVerified.MISMATCH: 0}.get(self.hash_verified, -1),
            key_mode_recomputed=int(self.view.key_mode == KEY_MODE_RECOMPUTED),
            engine_up=int(self.heartbeat.engine_up),
            redis_up=int(self.writer.connected),
            event_lag_s=self.event_lag_s,
        )

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
        self._heartbeat_task = asyncio.create_task(self.heartbeat.run())
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
        self._writer_task = asyncio.create_task(self.writer.run())
        self._subscriber_task = asyncio.create_task(self.subscriber.run())
        self._probe_task = asyncio.create_task(self.probe_loop())
        self.starting = ""


class _Rekeying:
    """The subscriber's sink while a key-mode switch replays the engine's history into a
    fresh view: changes stay in the view (published whole at the end), nothing reaches Redis."""

    def __init__(self, worker: Worker, view: ReplicaView) -> None:
        self.worker = worker
        self.view = view

    def apply(self, seq: int, batch: KVEventBatch) -> None:
        self.view.apply_batch(seq, self.worker.filtered(batch))

    def resync(self, reason: str) -> None:
        self.view.reset(reason)


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
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        try:
            runner.run(serve(config))
        except StartupError as exc:
            print(f"prefix-worker report: error: {exc}", file=sys.stderr, flush=True)
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
