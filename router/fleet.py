"""The router's view of the fleet: replicas, their health and load, and the block index.

``Fleet`` is the in-memory state (pure). ``FleetReader`` is the Redis edge: it
follows the worker-written contract in ``router.contract`` (remember the
stream's last id, load heartbeats and block-set snapshots, then read the
change stream with ``XREAD BLOCK``), survives Redis outages with backoff and
resynchronises when Redis returns or when the stream was trimmed past its
position, and reloads one replica whose ``entry_seq`` skips (entries lost, either way:
``router_event_stream_gaps_total``). The same code runs on one Redis, a Sentinel-managed
master and a Redis Cluster (every command it sends stays in one hash slot). ``StaticProber`` is the HTTP edge for static
``--replica`` URLs: it probes ``/health`` and reads ``/v1/models``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast
from urllib.parse import urlsplit

import aiohttp

from router import contract as c
from router.config import RouterConfig
from router.errors import ModelNotFound, NoRoutableReplica
from router.hashing import BlockHasher
from router.health import HealthParams, ReplicaHealth
from router.index import BlockIndex, SpeculativePlacements
from router.metrics import RouterMetrics
from router.ring import HashRing

logger = logging.getLogger(__name__)

SUSPECT_S = 5.0  # seconds a replica is skipped after a connection failure
STREAM_READ_INTERVAL_S = 0.01  # minimum gap between two stream reads that returned entries: at
# 1,000 flushes/s a read carries ~10 of them, for at most 10 ms more index lag
_BACKOFF_MAX_S = 5.0


def static_replica_id(url: str) -> str:
    """Id of a static replica: ``host:port`` of its URL (default ports filled in)."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"{parts.hostname}:{port}"


@dataclass(slots=True)
class Replica:
    """One replica as the router sees it (mutable; owned by ``Fleet``)."""

    replica_id: str
    url: str
    static: bool = False
    models: frozenset[str] | None = None  # served base models; None = unknown, accept any
    lora_adapters: dict[str, str] = field(default_factory=dict)  # {lora_name: lora_path}
    block_size: int | None = None
    hash_algo: str | None = None
    seed_fingerprint: str | None = None
    hash_verified: str = ""  # "1" verified, "0" mismatch, "" not probed yet
    key_mode: str = ""  # "engine" (event hashes) or "recomputed" (the router's own hashes)
    contract: int = c.CONTRACT_VERSION  # the worker's Redis contract version (absent: 3, untagged key: 1)
    entry_seq: int = -1  # E_ENTRY_SEQ of the last stream entry applied (loaded set: its F_ENTRY_SEQ)
    index_stride: int = 1  # the worker's coarse-index stride (absent field: 1, the exact index)
    epoch: int = 0
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    num_gpu_blocks: int = 0  # KV capacity in blocks from the heartbeat; 0 = not reported
    healthy: bool = True
    heartbeat_ts: float = 0.0
    suspect_until: float = 0.0  # monotonic time until which connection failures bench it
    # known only from fallback_replicas or the fleet cache file (Redis gave no fleet yet): probed
    # like a static replica, no affinity, replaced by its worker's report once Redis answers
    fallback: bool = False
    probe_failures: int = 0  # consecutive failed /health probes (static and fallback replicas)
    probed_ok: bool = False  # a /health probe has succeeded once
    model_cards: list[dict[str, Any]] = field(default_factory=list)  # from /v1/models (static)

    def serves(self, model: str | None) -> bool:
        if model is None or self.models is None:
            return True
        return model in self.models or model in self.lora_adapters


class Fleet:
    """Replicas, block index and speculative placements of one router process."""

    def __init__(self, config: RouterConfig, hasher: BlockHasher) -> None:
        self.config = config
        self.hasher = hasher
        self.replicas: dict[str, Replica] = {}  # {replica_id: Replica}
        self.index = BlockIndex(config.index_stride)
        self.speculative = SpeculativePlacements(config.speculative_ttl_s)
        self._ring: HashRing | None = None
        self._ring_ids: tuple[str, ...] = ()
        self.health = ReplicaHealth(HealthParams(
            failure_threshold=config.circuit_failures, failure_window_s=config.circuit_window_s,
            ejection_s=config.circuit_ejection_s, max_ejection_s=config.circuit_max_ejection_s,
            stall_timeout_s=config.stall_timeout_s))
        for url in config.replicas:
            rid = static_replica_id(url)
            self.replicas[rid] = Replica(
                rid, url.rstrip("/"), static=True,
                models=frozenset([config.model]) if config.model else None)

    # -- views ------------------------------------------------------------------

    def config_mismatch(self, replica: Replica) -> str | None:
        """How a worker-reported replica's Redis contract or index stride differs from this
        router's (its keys would be read at the wrong positions), or ``None``."""
        if replica.static:
            return None
        if replica.contract != c.CONTRACT_VERSION:
            # versions 1 and 2 keep their keys untagged: read only to report the replica here
            age = "newer" if replica.contract > c.CONTRACT_VERSION else "older"
            return (f"Redis contract version {replica.contract} is {age} than router's "
                    f"{c.CONTRACT_VERSION}")
        if replica.index_stride != self.index.stride:
            return (f"index_stride {replica.index_stride} != router's {self.index.stride} "
                    "(set one value for workers and routers)")
        return None

    def affinity_problem(self, replica: Replica) -> str | None:
        """Why a replica gets no prefix-hit credit, or ``None`` if it does."""
        if replica.static:
            return "static replica: no KV events"
        if replica.fallback:
            return "fallback replica: no worker report yet (Redis unreachable)"
        mismatch = self.config_mismatch(replica)
        if mismatch is not None:
            return mismatch
        if replica.hash_verified == "0" and replica.key_mode != c.KEY_MODE_RECOMPUTED:
            # recomputed keys are this router's own hashes of the events' token ids: trusted
            return "hash_verified=0: the worker's probe hashes differ from the engine's"
        if replica.block_size is not None and replica.block_size != self.hasher.block_size:
            return f"block_size {replica.block_size} != router's {self.hasher.block_size}"
        if replica.hash_algo and replica.hash_algo != self.hasher.hash_algo:
            return f"hash_algo {replica.hash_algo} != router's {self.hasher.hash_algo}"
        if replica.seed_fingerprint and replica.seed_fingerprint != self.hasher.seed_fingerprint:
            return "seed fingerprint differs (PYTHONHASHSEED / --hash-seed mismatch)"
        return None

    def routable_problem(self, replica: Replica, now: float) -> str | None:
        """Why a replica takes no traffic now, or ``None``."""
        return self._down_problem(replica, now) or self.health.problem(replica.replica_id, now)

    def _down_problem(self, replica: Replica, now: float) -> str | None:
        """Why a replica is down (probes, heartbeat, connection failures), or ``None``."""
        if not replica.healthy:
            return "unhealthy (health probe failed or heartbeat stale)"
        if replica.suspect_until > now:
            return "recent connection failure"
        return None

    def routable(self, now: float) -> list[Replica]:
        return [r for r in self.replicas.values() if self.routable_problem(r, now) is None]

    def ring(self, replicas: list[Replica]) -> HashRing:
        """Ring over the given (routable) replicas; rebuilt only when the set changes."""
        ids = tuple(sorted(r.replica_id for r in replicas))
        if self._ring is None or ids != self._ring_ids:
            self._ring = HashRing(ids, self.config.vnodes)
            self._ring_ids = ids
        return self._ring

    def eligible(self, model: str | None, now: float) -> tuple[list[Replica], tuple[str, str] | None]:
        """Routable replicas serving ``model`` and the LoRA (name, path) it names, if any.

        Raises ``ModelNotFound`` when no known replica serves the model and
        ``NoRoutableReplica`` when some do but none is routable.
        """
        serving = [r for r in self.replicas.values() if r.serves(model)]
        if not serving:
            if not self.replicas:
                raise NoRoutableReplica("no replica is known to the router yet")
            raise ModelNotFound(f"The model `{model}` does not exist.")
        ready = [r for r in serving if self.routable_problem(r, now) is None]
        if not ready:
            # every replica that is up has its circuit open: route to them anyway (Envoy's panic
            # mode) rather than refuse everything on request errors alone
            ready = [r for r in serving if self._down_problem(r, now) is None]
        if not ready:
            raise NoRoutableReplica(f"no routable replica serves model {model!r}")
        lora = None
        if model is not None:
            for r in ready:
                if model in r.lora_adapters and not (r.models and model in r.models):
                    lora = (model, r.lora_adapters[model])
                    break
        return ready, lora

    def mark_failed(self, replica_id: str, now: float) -> None:
        """Passive health: skip a replica for ``SUSPECT_S`` after a connection failure."""
        replica = self.replicas.get(replica_id)
        if replica is not None:
            replica.suspect_until = now + SUSPECT_S

    def model_cards(self, now: float) -> list[dict[str, Any]]:
        """Union of model cards over routable replicas, by id (``GET /v1/models``)."""
        cards: dict[str, dict[str, Any]] = {}
        for r in self.routable(now):
            if r.model_cards:
                for card in r.model_cards:
                    cards.setdefault(str(card.get("id")), card)
                continue
            for name in sorted(r.models or ()):
                cards.setdefault(name, {"id": name, "object": "model", "created": 0,
                                        "owned_by": "vllm", "root": name, "parent": None})
            for name, path in sorted(r.lora_adapters.items()):
                base = sorted(r.models)[0] if r.models else None
                cards.setdefault(name, {"id": name, "object": "model", "created": 0,
                                        "owned_by": "vllm", "root": path, "parent": base})
        return [cards[k] for k in sorted(cards)]

    def add_fallbacks(self, cached: list[dict[str, Any]], urls: tuple[str, ...]) -> int:
        """Replicas to route to until Redis gives the fleet: the last fleet seen (``cached``,
        ``read_fleet_cache``) and ``fallback_replicas`` URLs (id ``host:port``). Returns how many
        were added."""
        added = 0
        entries = [*cached, *({"replica_id": static_replica_id(u), "url": u} for u in urls)]
        for entry in entries:
            rid, url = str(entry.get("replica_id") or ""), str(entry.get("url") or "")
            if not rid or not url.startswith(("http://", "https://")) or rid in self.replicas:
                continue
            models = entry.get("models")
            adapters = entry.get("lora_adapters")
            self.replicas[rid] = Replica(
                rid, url.rstrip("/"), fallback=True,
                models=frozenset(map(str, models)) if isinstance(models, list) else None,
                lora_adapters=dict(adapters) if isinstance(adapters, dict) else {})
            added += 1
        return added

    def fleet_snapshot(self) -> list[dict[str, Any]]:
        """The worker-reported replicas, as ``add_fallbacks`` reads them back (fleet cache)."""
        return [{"replica_id": r.replica_id, "url": r.url,
                 "models": sorted(r.models) if r.models is not None else None,
                 "lora_adapters": dict(sorted(r.lora_adapters.items()))}
                for rid, r in sorted(self.replicas.items()) if not r.static and not r.fallback]

    # -- updates from Redis -----------------------------------------------------

    def apply_heartbeat(self, replica_id: str, fields: Mapping[str, str], wall_now: float,
                        contract: int = c.CONTRACT_VERSION) -> bool:
        """Create or refresh a worker-reported replica. Returns True if its block set must be
        (re)loaded: new replica or a newer epoch. ``contract``: the version a heartbeat
        without a ``contract`` field is taken to have (the reader passes 1 for an untagged,
        version 1/2 key; a hash-tagged key is version 3 at least)."""
        replica = self.replicas.get(replica_id)
        is_new = replica is None
        if replica is None:
            replica = self.replicas[replica_id] = Replica(replica_id, fields.get(c.F_URL, ""))
        replica.url = fields.get(c.F_URL, replica.url).rstrip("/")
        replica.fallback = False
        try:
            models = json.loads(fields.get(c.F_MODELS) or "null")
            replica.models = frozenset(models) if isinstance(models, list) else None
            adapters = json.loads(fields.get(c.F_LORA_ADAPTERS) or "{}")
            replica.lora_adapters = dict(adapters) if isinstance(adapters, dict) else {}
        except json.JSONDecodeError:
            logger.warning("replica %s: malformed models/lora_adapters in heartbeat", replica_id)
        replica.block_size = _int(fields.get(c.F_BLOCK_SIZE), None)
        replica.hash_algo = fields.get(c.F_HASH_ALGO) or None
        replica.seed_fingerprint = fields.get(c.F_SEED_FINGERPRINT) or None
        replica.hash_verified = fields.get(c.F_HASH_VERIFIED, "")
        replica.key_mode = fields.get(c.F_KEY_MODE, "")
        replica.contract = _int(fields.get(c.F_CONTRACT), contract) or contract
        replica.index_stride = _int(fields.get(c.F_INDEX_STRIDE), 1) or 1
        replica.num_running = _int(fields.get(c.F_NUM_RUNNING), 0) or 0
        replica.num_waiting = _int(fields.get(c.F_NUM_WAITING), 0) or 0
        replica.kv_usage = _float(fields.get(c.F_KV_USAGE), 0.0)
        replica.num_gpu_blocks = max(_int(fields.get(c.F_NUM_GPU_BLOCKS), 0) or 0, 0)
        replica.heartbeat_ts = _float(fields.get(c.F_HEARTBEAT_TS), wall_now)
        replica.healthy = wall_now - replica.heartbeat_ts <= c.HEARTBEAT_TTL_S + 0.5
        epoch = _int(fields.get(c.F_EPOCH), 0) or 0
        reload = is_new or epoch > replica.epoch
        replica.epoch = max(epoch, replica.epoch)
        return reload

    def holds_key(self, key: int) -> bool:
        """True if any replica holds ``key`` or was recently sent it (speculative, any age)."""
        return self.index.holds(key) or key in self.speculative

    def sweep_index(self, max_keys: int) -> bool:
        """One bounded step of the index's retired-slot sweep; True while more remains.

        Slots the sweep frees are dropped from the speculative placements too,
        before any replica can be given them again.
        """
        for slot in self.index.sweep_step(max_keys):
            self.speculative.forget_bit(slot)
        return self.index.sweep_pending

    def drop_replica(self, replica_id: str) -> None:
        """A worker-reported replica's heartbeat expired: out of rotation, blocks forgotten."""
        if replica_id in self.replicas and not self.replicas[replica_id].static:
            del self.replicas[replica_id]
            self.health.forget(replica_id)
        # O(1): the replica's slot is retired; sweep_index later removes it from the index and
        # the speculative placements before the slot is reused
        self.index.drop(replica_id)

    def apply_changes(self, replica_id: str, epoch: int, cleared: bool, stored: Any,
                      removed: Any, entry_seq: int | None = None) -> str | None:
        """Apply one change-stream entry: reset the replica's keys if ``cleared``, then add
        ``stored`` and forget ``removed`` (disjoint). Returns ``None`` or why it was dropped.

        ``entry_seq`` (contract version 3; ``None``: unchecked) must follow the replica's last
        one in the same epoch, or open a newer epoch with ``cleared``. At or below the last one:
        ``"duplicate"`` (already in the loaded set; not an error). Otherwise ``"gap"``: an
        entry is missing, nothing is applied, and the caller must reload the replica's set
        (``FleetReader`` does).
        """
        replica = self.replicas.get(replica_id)
        if replica is None or replica.static:
            return "unknown_replica"
        if replica.contract != c.CONTRACT_VERSION:
            return "config_mismatch"
        known = self.index.epochs.get(replica_id, replica.epoch)
        if epoch < known:
            return "stale_epoch"
        if entry_seq is not None:
            if epoch == known and entry_seq <= replica.entry_seq:
                return "duplicate"
            # a baseline of -1: the loaded set came without an entry_seq (nothing to check)
            in_order = (cleared if epoch > known else
                        replica.entry_seq < 0 or entry_seq == replica.entry_seq + 1)
            if not in_order:
                return "gap"
            replica.entry_seq = entry_seq
        if epoch > known:
            self.index.clear(replica_id)
            self.index.epochs[replica_id] = epoch
            replica.epoch = max(replica.epoch, epoch)
        if cleared:
            self.index.clear(replica_id)
        if removed:
            self.index.remove(replica_id, removed)
        if stored:
            self.index.add(replica_id, stored)
        return None

    def apply_event(self, replica_id: str, epoch: int, op: str, keys: Any) -> str | None:
        """Apply one contract-version-1 entry (``op`` with its ``keys``); see ``apply_changes``."""
        if op == c.OP_STORED:
            return self.apply_changes(replica_id, epoch, False, keys, ())
        if op == c.OP_REMOVED:
            return self.apply_changes(replica_id, epoch, False, (), keys)
        if op == c.OP_CLEARED:
            return self.apply_changes(replica_id, epoch, True, (), ())
        return "bad_op"


_ENTRY_FIELDS = (c.E_REPLICA, c.E_EPOCH, c.E_ENTRY_SEQ, c.E_CLEARED, c.E_STORED, c.E_REMOVED,
                 c.E_OP, c.E_KEYS)
_BYTES_FIELDS: dict[str, Any] = {name: name.encode() for name in _ENTRY_FIELDS}  # {field: reply key}
_TEXT_FIELDS: dict[str, Any] = {name: name for name in _ENTRY_FIELDS}


def write_fleet_cache(path: str, snapshot: list[dict[str, Any]]) -> None:
    """Write ``Fleet.fleet_snapshot()`` to ``path`` atomically (JSON). Raises ``OSError``."""
    target = Path(path)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(json.dumps({"replicas": snapshot}))
    os.replace(tmp, target)


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


def _int(value: str | None, default: int | None) -> int | None:
    try:
        return int(value) if value not in (None, "") else default
    except ValueError:
        return default


def _float(value: str | None, default: float) -> float:
    try:
        return float(value) if value not in (None, "") else default
    except ValueError:
        return default


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _bytes(value: Any) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode("latin-1")


class FleetReader:
    """Follows the fleet's Redis keys and stream into a ``Fleet``. Redis edge.

    ``run()`` loops until cancelled: connect, resync (remember the stream's last
    id, load every heartbeat and block set), then ``XREAD BLOCK`` the stream and
    refresh heartbeats every ``HEARTBEAT_INTERVAL_S``. On connection loss it
    backs off (0.1 s doubling to 5 s) and resyncs; routing goes on meanwhile.
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
        # after a reconnect, replicas whose heartbeat is missing stay until then (monotonic):
        # a Redis that restarted empty gets one heartbeat TTL for the workers to re-register
        self._keep_missing_until = 0.0

    async def run(self) -> None:
        from redis.exceptions import RedisError

        from router.redis_client import redis_client

        backoff = 0.1
        while True:
            client = redis_client(self.config.redis_url or "", self.config.redis_password,
                                  socket_connect_timeout=2.0, socket_timeout=5.0)
            try:
                await self._resync(client)
                self._set_connected(True)
                backoff = 0.1
                await self._follow(client)
            except _StreamGap as exc:
                logger.warning("%s; full resync", exc)
                self.metrics.stream_gaps.inc()
            except (RedisError, OSError) as exc:
                self.attempted.set()
                if self.connected:
                    logger.warning("redis connection lost (%s); routing continues on ring and "
                                   "speculative state", exc)
                self._set_connected(False)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, _BACKOFF_MAX_S)
            finally:
                await client.aclose()

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
        pipe = client.pipeline(transaction=False)
        for key, _ in found.values():
            pipe.hgetall(key)
        results = await pipe.execute() if found else []
        wall_now = time.time()
        seen: set[str] = set()
        for (rid, (_, tagged)), raw in zip(found.items(), results, strict=True):
            if not raw:
                continue
            fields = {_text(k): _text(v) for k, v in raw.items()}
            seen.add(rid)
            reload = self.fleet.apply_heartbeat(rid, fields, wall_now,
                                                c.CONTRACT_VERSION if tagged else 1)
            if (reload or force_reload) and tagged:
                await self._load_blocks(client, rid)
        keep_missing = time.monotonic() < self._keep_missing_until
        for rid, replica in list(self.fleet.replicas.items()):
            if not replica.static and rid not in seen and not keep_missing:
                logger.info("replica %s %s; out of rotation", rid, "not in Redis" if
                            replica.fallback else "heartbeat expired")
                self.fleet.drop_replica(rid)
                self.metrics.forget_replica(rid)
        self._update_gauges()
        self._write_fleet_cache()

    def _write_fleet_cache(self) -> None:
        """Keep the fleet seen in Redis in ``fleet_cache_file`` (rewritten when it changes), so
        a router started while Redis is down still has replicas to route to."""
        path = self.config.fleet_cache_file
        snapshot = self.fleet.fleet_snapshot()
        if not path or not snapshot or snapshot == self._cached_fleet:
            return
        try:
            write_fleet_cache(path, snapshot)
            self._cached_fleet = snapshot
        except OSError as exc:
            logger.warning("cannot write fleet cache %s: %s", path, exc)

    async def _load_blocks(self, client: Any, replica_id: str) -> None:
        """Load a replica's set with the ``epoch``/``entry_seq`` it is at (one transaction in
        the replica's hash slot): entries up to that ``entry_seq`` are in the set."""
        async with client.pipeline(transaction=True) as pipe:
            # raw commands: redis-py 8.1's cluster MULTI passes the ``keys`` keyword of
            # ``hmget``/``smembers`` to their reply callbacks, which raise TypeError
            pipe.execute_command("HMGET", c.replica_key(self.prefix, replica_id), c.F_EPOCH,
                                 c.F_ENTRY_SEQ)
            pipe.execute_command("SMEMBERS", c.blocks_key(self.prefix, replica_id))
            (epoch_raw, entry_seq_raw), members = await pipe.execute()
        keys = cast(list[c.BlockKey], [int.from_bytes(m, "big") for m in members if len(m) == 8])
        replica = self.fleet.replicas.get(replica_id)
        if replica is None:
            return
        epoch = _int(_text(epoch_raw), None) if epoch_raw else None
        entry_seq = _int(_text(entry_seq_raw), None) if entry_seq_raw else None
        replica.epoch = max(replica.epoch, epoch or 0)
        replica.entry_seq = -1 if entry_seq is None else entry_seq
        self.fleet.index.replace(replica_id, keys, epoch=replica.epoch)
        logger.info("replica %s: loaded %d block keys (epoch %d, entry %d)", replica_id, len(keys),
                    replica.epoch, replica.entry_seq)

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
                    await self._load_blocks(client, rid)
                if entries:
                    ms = int(self.last_id.split("-", 1)[0])
                    self.metrics.event_lag.set(max(0.0, time.time() - ms / 1000.0))
                if 0 < len(entries) < count:
                    # a trickle of entries would cost one XREAD round trip (~0.1 ms of Python)
                    # each: let them gather for a moment instead
                    await asyncio.sleep(STREAM_READ_INTERVAL_S)
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
                raw_seq = data.get(get(c.E_ENTRY_SEQ))
                entry_seq = int(raw_seq) if raw_seq is not None else None  # None: version 1/2
                dropped = self.fleet.apply_changes(rid, epoch, cleared, stored, removed, entry_seq)
                ops = [op for op, present in ((c.OP_CLEARED, cleared), (c.OP_STORED, stored),
                                              (c.OP_REMOVED, removed)) if present]
        except (KeyError, ValueError, UnicodeDecodeError) as exc:
            logger.warning("dropping malformed stream entry: %s", exc)
            self.metrics.event_errors.labels("malformed").inc()
            return
        if dropped == "gap":
            gaps.add(rid)
        elif dropped == "duplicate":
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


class StaticProber:
    """Probes static ``--replica`` URLs: ``GET /health`` for health, ``GET /v1/models`` for models.

    A replica is down after ``failures`` failed probes in a row (the first one if it was never
    up) and up again after one good probe."""

    def __init__(self, fleet: Fleet, session: aiohttp.ClientSession, interval_s: float,
                 failures: int = 3) -> None:
        self.fleet = fleet
        self.session = session
        self.interval_s = interval_s
        self.failures = failures  # consecutive failed probes before a replica is down
        self.probed = asyncio.Event()

    async def probe_once(self) -> None:
        replicas = [r for r in self.fleet.replicas.values() if r.static or r.fallback]
        await asyncio.gather(*(self._probe(r) for r in replicas))
        self.probed.set()

    async def _probe(self, replica: Replica) -> None:
        timeout = aiohttp.ClientTimeout(total=2.0)
        try:
            async with self.session.get(f"{replica.url}/health", timeout=timeout) as resp:
                healthy = resp.status == 200
            if healthy and not replica.model_cards:
                async with self.session.get(f"{replica.url}/v1/models", timeout=timeout) as resp:
                    if resp.status == 200:
                        data = await resp.json()
                        cards = [card for card in data.get("data", []) if isinstance(card, dict)]
                        replica.model_cards = cards
                        bases = {str(k["id"]) for k in cards if not k.get("parent")}
                        loras = {str(k["id"]): str(k.get("root", "")) for k in cards if k.get("parent")}
                        if self.fleet.config.model:
                            bases.add(self.fleet.config.model)
                        replica.models = frozenset(bases) if bases else replica.models
                        replica.lora_adapters = loras
        except (aiohttp.ClientError, TimeoutError, ValueError):
            healthy = False
        # one slow or failed probe of a busy replica is not an outage: down after
        # ``health_failures`` in a row (or the first, for a replica never seen up)
        replica.probe_failures = 0 if healthy else replica.probe_failures + 1
        replica.probed_ok = replica.probed_ok or healthy
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
