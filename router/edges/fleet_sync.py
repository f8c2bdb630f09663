"""Keeping ``router.decision.fleet.Fleet`` current: the Redis edge (``FleetReader``) and the HTTP edge
for static replicas (``StaticProber``), plus the local fleet cache file. Does I/O. A replica's
block set is read by ``router.edges.block_sets``.

``FleetReader`` follows the worker-written contract in ``router.shared.contract``; ``StaticProber``
probes ``/health`` and reads ``/v1/models`` of static ``--replica`` URLs.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import time
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from router.decision.fleet import Dropped, Fleet
from router.decision.replica import Replica
from router.edges.block_sets import OOM_READ_HOLD_S, BlockSetLoader, RedisOom
from router.observability.metrics import RouterMetrics
from router.service.config import DEFAULT_STREAM_READ_INTERVAL_S, RouterConfig
from router.shared import contract as c
from router.shared.logs import IntervalLog
from router.shared.process import write_json_atomic

logger = logging.getLogger(__name__)

# minimum gap between two stream reads that returned entries: a busy stream's entries gather
# into fewer reads, for at most this much more index lag (``RouterConfig.stream_read_interval_s``)
STREAM_READ_INTERVAL_S = DEFAULT_STREAM_READ_INTERVAL_S

_ENTRY_FIELDS = (c.E_REPLICA, c.E_EPOCH, c.E_ENTRY_SEQ, c.E_CLEARED, c.E_STORED, c.E_REMOVED,
                 c.E_CPU_STORED, c.E_CPU_REMOVED, c.E_OP, c.E_KEYS)
_BYTES_FIELDS: dict[str, Any] = {name: name.encode() for name in _ENTRY_FIELDS}  # {field: reply key}
_TEXT_FIELDS: dict[str, Any] = {name: name for name in _ENTRY_FIELDS}


def read_fleet_cache(path: str | None) -> list[dict[str, Any]]:
    """The replicas in a fleet cache file; ``[]`` when there is none or it does not parse."""
    if not path:
        return []
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        if not isinstance(exc, FileNotFoundError):
            logger.warning("ignoring fleet cache %s: %s", path, exc)
        return []
    replicas = data.get("replicas") if isinstance(data, dict) else None
    return [r for r in replicas if isinstance(r, dict)] if isinstance(replicas, list) else []


class _StreamGap(Exception):
    """Entries of the events stream were trimmed before this router read them."""


def _stream_id(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _bytes(value: Any) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode("latin-1")


class FleetReader:
    """Follows the fleet's Redis keys and stream into a ``Fleet``. Redis edge.

    ``run()`` loops until cancelled: connect, resync (remember the stream's last
    id, load every heartbeat and block set), then ``XREAD BLOCK`` the stream and
    refresh heartbeats every ``HEARTBEAT_INTERVAL_S``. On connection loss it waits 0.1 s,
    reconnects, and backs off (redis-py's ``Retry`` with ``ExponentialBackoff``: 0.1 s doubling
    to 5 s) until a resync goes through; routing goes on meanwhile.
    """

    def __init__(self, fleet: Fleet, config: RouterConfig, metrics: RouterMetrics) -> None:
        self.fleet = fleet
        self.config = config
        self.metrics = metrics
        self.prefix = config.redis_prefix
        self.connected = False
        self.last_id = "0-0"
        self.synced = asyncio.Event()
        self.attempted = asyncio.Event()  # the first connection attempt succeeded or failed
        self._cached_fleet: list[dict[str, Any]] | None = None  # last written to fleet_cache_file
        # after a reconnect or a cluster failover, replicas whose heartbeat is missing stay until
        # then (monotonic): a Redis that restarted empty, or a master that came back through its
        # replica without the heartbeats (expired while it was down), gets one heartbeat TTL for
        # the workers to re-register
        self._keep_missing_until = 0.0
        self._masters: frozenset[str] | None = None  # a cluster's masters at the last refresh
        self.redis_oom = RedisOom(fleet, metrics)
        self.block_sets = BlockSetLoader(fleet, self.prefix, self.redis_oom)
        self._bad_log = IntervalLog(logger, OOM_READ_HOLD_S)  # malformed stream entries
        self._unreachable = IntervalLog(logger)  # connection lost / still unreachable

    async def run(self) -> None:
        from router.shared.redis_client import FIRST_RECONNECT_WAIT_S, reconnect_retry, redis_errors

        unreachable = redis_errors()

        retry = reconnect_retry()
        while True:
            try:
                # connect and resync, retried by redis-py's Retry (0.1 s doubling to 5 s) ...
                client = await retry.call_with_retry(self._connect, self._lost)
            except _StreamGap as exc:
                logger.warning("%s; full resync", exc)
                self.metrics.stream_gaps.inc()
                continue
            try:
                await self._follow(client)
            except _StreamGap as exc:
                logger.warning("%s; full resync", exc)
                self.metrics.stream_gaps.inc()
            except unreachable as exc:  # ... and a connection that worked was lost:
                await self._lost(exc)  # the backoff starts afresh after the first step's wait,
                await asyncio.sleep(FIRST_RECONNECT_WAIT_S)  # so a failing XREAD cannot spin
            finally:
                await client.aclose()

    async def _connect(self) -> Any:
        """A client whose resync went through (the reader is connected); raises ``RedisError``
        or ``OSError`` (the client closed) when Redis does not answer."""
        from router.shared.redis_client import redis_client

        client = redis_client(self.config.redis_url or "", self.config.redis_password,
                              socket_connect_timeout=2.0, socket_timeout=5.0)
        try:
            await self._resync(client)
        except BaseException:
            await client.aclose()
            raise
        self._set_connected(True)
        self._unreachable.reset()
        return client

    async def _lost(self, exc: Exception) -> None:
        self.attempted.set()
        if self.connected:
            self._unreachable.reset()
            self._unreachable(logging.WARNING, "redis connection lost (%s); routing continues "
                              "on ring and speculative state", exc)
        else:  # one line per interval while it stays so (was silent: only /ready said it)
            self._unreachable(logging.WARNING, "redis not reachable (%s); retrying, routing on "
                              "ring and speculative state", exc)
        self._set_connected(False)

    def _set_connected(self, value: bool) -> None:
        self.connected = value
        self.metrics.redis_connected.set(1 if value else 0)

    async def _resync(self, client: Any) -> None:
        last = await client.xrevrange(c.events_key(self.prefix), count=1)
        self.last_id = _text(last[0][0]) if last else "0-0"
        if self.synced.is_set():
            self._keep_missing_until = time.monotonic() + c.HEARTBEAT_TTL_S
        await self._refresh_heartbeats(client, force_reload=True)
        self.metrics.redis_resyncs.inc()
        self.synced.set()
        self.attempted.set()

    async def _refresh_heartbeats(self, client: Any, force_reload: bool = False) -> None:
        # {replica_id: (heartbeat key, tagged)}: one SCAN (every master of a cluster); a
        # replica with both forms (its worker just upgraded) is read from the tagged key
        found: dict[str, tuple[Any, bool]] = {}
        async for key in client.scan_iter(match=c.replica_pattern(self.prefix), count=1000):
            try:
                rid, tagged = c.replica_id_from_key(self.prefix, _text(key))
            except ValueError:
                continue
            if tagged or rid not in found:
                found[rid] = (key, tagged)
        # each hash with its key's PTTL (Redis's own clock says whether it is fresh), and the
        # wall clock read before the round trip: a busy event loop that gets to the reply
        # seconds late must not age every heartbeat at once (issue 29: all four replicas of a
        # healthy fleet "stale" under 1,000 streams)
        pipe = client.pipeline(transaction=False)
        for key, _ in found.values():
            pipe.hgetall(key)
            pipe.pttl(key)
        wall_now = time.time()
        results = await pipe.execute() if found else []
        self._note_failover(client)
        seen: set[str] = set()
        for (rid, (_, tagged)), raw, ttl_ms in zip(found.items(), results[::2], results[1::2],
                                                    strict=True):
            if not raw:
                continue
            fields = {_text(k): _text(v) for k, v in raw.items()}
            seen.add(rid)
            reload = self.fleet.apply_heartbeat(rid, fields, wall_now,
                                                c.CONTRACT_VERSION if tagged else 1, int(ttl_ms))
            if (reload or force_reload) and tagged:
                await self.block_sets.load(client, rid)
        keep_missing = time.monotonic() < self._keep_missing_until
        for rid, replica in list(self.fleet.replicas.items()):
            if not replica.static and rid not in seen and not keep_missing:
                logger.info("replica %s %s; out of rotation", rid, "not in Redis" if
                            replica.fallback else "heartbeat gone (expired, or its worker "
                            "deregistered)")
                self.fleet.drop_replica(rid)
                self.metrics.forget_replica(rid)
        self._update_gauges()
        self._write_fleet_cache()
        self.redis_oom.update()

    def _note_failover(self, client: Any) -> None:
        """A Redis Cluster whose masters changed since the last refresh failed over: the
        heartbeats of the replicas whose keys the failed master held may be gone (the promoted
        replica expires them when the outage outlasted their TTL, the cluster's
        ``cluster-node-timeout`` plus an election), and this router may have seen no error (its
        read waited in redis-py's retries until the replica took over). Their workers
        re-register at their next heartbeat; until then (one heartbeat TTL) they stay, as after a
        reconnect. Logged and counted (``router_redis_cluster_failovers_total``)."""
        from router.shared.redis_client import cluster_masters

        masters = cluster_masters(client)
        previous, self._masters = self._masters, masters
        if previous is None or masters is None or masters == previous:
            return
        self.metrics.redis_cluster_failovers.inc()
        self._keep_missing_until = max(self._keep_missing_until,
                                       time.monotonic() + c.HEARTBEAT_TTL_S)
        logger.warning("Redis Cluster masters changed (gone: %s; new: %s): a failover; replicas "
                       "whose heartbeat is missing stay %.0f s for their workers to re-register",
                       ", ".join(sorted(previous - masters)) or "none",
                       ", ".join(sorted(masters - previous)) or "none", c.HEARTBEAT_TTL_S)

    @property
    def oom(self) -> bool:
        """Redis refuses writes for lack of memory (a worker says so, or a read)."""
        return self.redis_oom.oom

    def _write_fleet_cache(self) -> None:
        """Keep the fleet seen in Redis in ``fleet_cache_file`` (rewritten when it changes), so
        a router started while Redis is down still has replicas to route to."""
        path = self.config.fleet_cache_file
        snapshot = self.fleet.fleet_snapshot()
        if not path or not snapshot or snapshot == self._cached_fleet:
            return
        try:
            write_json_atomic(path, {"replicas": snapshot})
            self._cached_fleet = snapshot
        except OSError as exc:
            logger.warning("cannot write fleet cache %s: %s", path, exc)

    async def _follow(self, client: Any) -> None:
        stream = c.events_key(self.prefix)
        next_refresh = time.monotonic() + c.HEARTBEAT_INTERVAL_S
        block_ms = int(c.HEARTBEAT_INTERVAL_S * 250)
        count = 1000
        while True:
            read_from = self.last_id
            reply = await client.xread({stream: self.last_id}, count=count, block=block_ms)
            for _, entries in reply or ():
                # Trimming (MAXLEN ~ EVENTS_STREAM_MAXLEN, far above ``count``) can only have
                # dropped unread entries when more than ``count`` of them were waiting, so only a
                # full batch needs the (costly: XINFO returns whole entries) gap check.
                if len(entries) >= count and read_from != "0-0":
                    await self._check_gap(client, stream, read_from, _text(entries[0][0]))
                gaps: set[str] = set()  # {replica_id} whose entry_seq skipped in this batch
                for entry_id, fields in entries:
                    self.last_id = _text(entry_id)
                    self._apply(fields, gaps)
                for rid in sorted(gaps):
                    # what the missing entries held is in the replica's set (the worker writes
                    # the set before the entry), and so is every later entry of this batch
                    logger.warning("replica %s: stream entry missing (entry_seq gap); reloading "
                                   "its block set", rid)
                    self.metrics.stream_gaps.inc()
                    await self.block_sets.load(client, rid)
                if entries:
                    ms = int(self.last_id.split("-", 1)[0])
                    self.metrics.event_lag.set(max(0.0, time.time() - ms / 1000.0))
                if 0 < len(entries) < count:
                    # a trickle of entries would cost one XREAD round trip (Python CPU, see
                    # docs/benchmarks.md) each: let them gather for a moment instead
                    await asyncio.sleep(self.config.stream_read_interval_s)
            if time.monotonic() >= next_refresh:
                await self._refresh_heartbeats(client)
                next_refresh = time.monotonic() + c.HEARTBEAT_INTERVAL_S

    async def _check_gap(self, client: Any, stream: str, read_from: str, first_read: str) -> None:
        """Raise ``_StreamGap`` if entries after ``read_from`` were trimmed before we read them.

        Trimming (``MAXLEN``) moves the stream's first entry: if it now starts after
        ``read_from``, everything up to its first entry was trimmed, which (unless that is
        exactly our next entry, the rare false positive that costs one resync) loses
        entries. Redis 7 and Valkey also report ``max-deleted-entry-id``, which only
        ``XDEL`` moves (not trimming: Valkey 9 reports ``0-0`` after an ``XTRIM``): a
        deleted id above ``read_from`` and below the first entry returned is a lost entry.
        """
        info = await client.xinfo_stream(stream)
        info = {_text(k): v for k, v in info.items()}
        after, before = _stream_id(read_from), _stream_id(first_read)
        deleted = info.get("max-deleted-entry-id")
        if deleted is not None and after < _stream_id(_text(deleted)) < before:
            raise _StreamGap(f"events stream entry {_text(deleted)} deleted before this router "
                             f"read it (last read {read_from})")
        first = info.get("first-entry")
        if first and _stream_id(_text(first[0])) > after and _stream_id(_text(first[0])) >= before:
            raise _StreamGap(f"events stream trimmed past this router (it starts at "
                             f"{_text(first[0])}, last read {read_from})")

    def _apply(self, fields: Mapping[Any, Any], gaps: set[str]) -> None:
        """Apply one stream entry; a replica whose ``entry_seq`` skipped is added to ``gaps``."""
        try:
            names: Mapping[str, Any] = _TEXT_FIELDS
            if b"replica" in fields:  # the client's usual bytes form: no re-keyed copy per entry
                data: Mapping[Any, Any] = fields
                names = _BYTES_FIELDS
            else:
                data = {_text(k): v for k, v in fields.items()}
            get = names.__getitem__
            rid = _text(data[get(c.E_REPLICA)])
            epoch = int(data[get(c.E_EPOCH)])
            if get(c.E_OP) in data:  # contract version 1: one op per entry
                op = _text(data[get(c.E_OP)])
                keys = c.unpack_keys(_bytes(data.get(get(c.E_KEYS), b"")))
                dropped = self.fleet.apply_event(rid, epoch, op, keys)
                ops = [op]
            else:
                cleared = _text(data.get(get(c.E_CLEARED), b"0")) == "1"
                stored = c.unpack_keys(_bytes(data.get(get(c.E_STORED), b"")))
                removed = c.unpack_keys(_bytes(data.get(get(c.E_REMOVED), b"")))
                cpu_stored = c.unpack_keys(_bytes(data.get(get(c.E_CPU_STORED), b"")))
                cpu_removed = c.unpack_keys(_bytes(data.get(get(c.E_CPU_REMOVED), b"")))
                raw_seq = data.get(get(c.E_ENTRY_SEQ))
                entry_seq = int(raw_seq) if raw_seq is not None else None  # None: version 1/2
                dropped = self.fleet.apply_changes(rid, epoch, cleared, stored, removed, entry_seq,
                                                   cpu_stored, cpu_removed)
                stored = stored or cpu_stored
                removed = removed or cpu_removed
                ops = [op for op, present in ((c.OP_CLEARED, cleared), (c.OP_STORED, stored),
                                              (c.OP_REMOVED, removed)) if present]
        except (KeyError, ValueError, UnicodeDecodeError) as exc:
            self._bad_log.warning("dropping malformed stream entry: %s", exc)
            self.metrics.event_errors.labels("malformed").inc()
            return
        if dropped == Dropped.GAP:
            gaps.add(rid)
        elif dropped == Dropped.DUPLICATE:
            pass  # already in the set loaded after this entry was written
        elif dropped is not None:
            self.metrics.child(self.metrics.event_errors, dropped).inc()
        else:
            for op in ops:
                self.metrics.child(self.metrics.events, op).inc()

    def _update_gauges(self) -> None:
        index = self.fleet.index
        self.metrics.index_blocks.set(len(index))
        for rid in index.replicas():
            self.metrics.replica_blocks.labels(rid).set(index.num_blocks(rid))
            self.metrics.replica_cpu_blocks.labels(rid).set(index.num_blocks(rid, c.TIER_CPU))


class StaticProber:
    """Probes static ``--replica`` URLs: ``GET /health`` for health, ``GET /v1/models`` for models.

    A replica is down after ``failures`` failed probes in a row (the first one if it was never
    up) and up again after one good probe. Each probe is a blocking HTTP call in a worker
    thread, timed by the kernel's socket timeout there, not by this process's event loop: a
    loop busy with a thousand streams answers late, and a probe timed on it would fail every
    replica at once (issue 29) though none was slow."""

    def __init__(self, fleet: Fleet, interval_s: float, failures: int = 3) -> None:
        self.fleet = fleet
        self.interval_s = interval_s
        self.failures = failures  # consecutive failed probes before a replica is down
        self.probed = asyncio.Event()

    async def probe_once(self) -> None:
        replicas = [r for r in self.fleet.replicas.values() if r.static or r.fallback]
        await asyncio.gather(*(self._probe(r) for r in replicas))
        self.probed.set()

    async def _probe(self, replica: Replica) -> None:
        healthy, cards = await asyncio.to_thread(probe_replica, replica.url,
                                                 not replica.model_cards, PROBE_TIMEOUT_S)
        if cards is not None:
            replica.model_cards = cards
            bases = {str(k["id"]) for k in cards if not k.get("parent")}
            loras = {str(k["id"]): str(k.get("root", "")) for k in cards if k.get("parent")}
            if self.fleet.config.model:
                bases.add(self.fleet.config.model)
            replica.models = frozenset(bases) if bases else replica.models
            replica.lora_adapters = loras
        # one slow or failed probe of a busy replica is not an outage: down after
        # ``health_failures`` in a row (or the first, for a replica never seen up)
        replica.probe_failures = 0 if healthy else replica.probe_failures + 1
        replica.probed_ok = replica.probed_ok or healthy
        if healthy:  # it answers on its port: /ready no longer says it refuses connections
            self.fleet.health.listening(replica.replica_id)
        if not healthy and replica.probed_ok and replica.probe_failures < self.failures:
            healthy = True
        if healthy != replica.healthy:
            logger.info("static replica %s is %s", replica.replica_id,
                        "healthy" if healthy else "unhealthy")
        replica.healthy = healthy

    async def run(self) -> None:
        while True:
            await self.probe_once()
            await asyncio.sleep(self.interval_s)


PROBE_TIMEOUT_S = 2.0  # seconds a probe waits to connect and for each read of the answer
# no proxy from the environment: a replica URL is a pod address, as with the aiohttp session
_PROBE_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def probe_replica(url: str, want_models: bool,
                  timeout_s: float) -> tuple[bool, list[dict[str, Any]] | None]:
    """Blocking: ``GET {url}/health`` and, when healthy and ``want_models``, ``GET
    {url}/v1/models``. Returns ``(healthy, model cards or None)``; never raises."""
    # urllib's HTTPError (a non-2xx answer) and URLError are OSErrors, an answer that is not
    # HTTP an HTTPException; a body that is not a JSON object: ValueError / AttributeError
    try:
        with _PROBE_OPENER.open(f"{url}/health", timeout=timeout_s) as resp:
            healthy = resp.status == 200
            resp.read()
    except (OSError, http.client.HTTPException):
        return False, None
    if not healthy or not want_models:
        return healthy, None
    try:  # health is /health's answer alone: no model list yet is no outage
        with _PROBE_OPENER.open(f"{url}/v1/models", timeout=timeout_s) as resp:
            data = json.loads(resp.read())
        return True, [card for card in data.get("data", []) if isinstance(card, dict)]
    except (OSError, http.client.HTTPException, ValueError, AttributeError):
        return True, None
