"""The router's view of the fleet: replicas, their health and load, and the block index. Pure.

``Fleet`` is the in-memory state; ``router.edges.fleet_sync`` keeps it current. Its ``FleetReader`` is the Redis edge: it
follows the worker-written contract in ``router.shared.contract`` (remember the
stream's last id, load heartbeats and block-set snapshots, then read the
change stream with ``XREAD BLOCK``), survives Redis outages with backoff and
resynchronises when Redis returns or when the stream was trimmed past its
position, and reloads one replica whose ``entry_seq`` skips (entries lost, either way:
``router_event_stream_gaps_total``). The same code runs on one Redis, a Sentinel-managed
master and a Redis Cluster (every command it sends stays in one hash slot). ``StaticProber`` is the HTTP edge for static
``--replica`` URLs: it probes ``/health`` and reads ``/v1/models``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from router.decision.health import HealthParams, ReplicaHealth
from router.decision.index import BlockIndex, SpeculativePlacements
from router.decision.ring import HashRing
from router.request.errors import ModelNotFound, NoRoutableReplica
from router.service.config import RouterConfig, split_replica_url, static_replica_id
from router.shared import contract as c
from router.shared.hashing import BlockHasher
from router.shared.lora_state import LoraLoad, split_names

logger = logging.getLogger(__name__)

SUSPECT_S = 5.0  # seconds a replica is skipped after a connection failure


class Dropped(StrEnum):
    """Why ``Fleet.apply_changes`` dropped a change-stream entry (the value is the
    ``router_event_errors_total`` label of the errors among them)."""

    UNKNOWN_REPLICA = "unknown_replica"  # no such replica, or a static one
    CONFIG_MISMATCH = "config_mismatch"  # the worker writes another contract version
    STALE_EPOCH = "stale_epoch"  # from an epoch older than the replica's
    DUPLICATE = "duplicate"  # already in the loaded set: not an error
    GAP = "gap"  # an entry is missing: the replica's set must be reloaded
    BAD_OP = "bad_op"  # a contract-version-1 entry of an unknown op


@dataclass(slots=True)
class Replica:
    """One replica as the router sees it (mutable; owned by ``Fleet``)."""

    replica_id: str
    url: str
    static: bool = False
    # the engine's data-parallel rank this replica is (heartbeat F_DP_RANK): requests go to
    # ``url`` with vLLM's X-data-parallel-rank header; None: no data parallelism, no header
    dp_rank: int | None = None
    models: frozenset[str] | None = None  # served base models; None = unknown, accept any
    lora_adapters: dict[str, str] = field(default_factory=dict)  # {lora_name: lora_path}
    block_size: int | None = None
    hash_algo: str | None = None
    seed_fingerprint: str | None = None
    hash_verified: c.HashVerified = c.HashVerified.UNKNOWN
    key_mode: str = ""  # "engine" (event hashes) or "recomputed" (the router's own hashes)
    contract: int = c.CONTRACT_VERSION  # the worker's Redis contract version (absent: 3, untagged key: 1)
    entry_seq: int = -1  # E_ENTRY_SEQ of the last stream entry applied (loaded set: its F_ENTRY_SEQ)
    index_stride: int = 1  # the worker's coarse-index stride (absent field: 1, the exact index)
    kv_tiers: tuple[str, ...] = (c.TIER_GPU,)  # tiers the worker indexes (heartbeat kv_tiers)
    epoch: int = 0
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    num_gpu_blocks: int = 0  # KV capacity in blocks from the heartbeat; 0 = not reported
    redis_oom: bool = False  # its worker reports Redis refusing its writes (out of memory)
    healthy: bool = True
    heartbeat_ts: float = 0.0
    suspect_until: float = 0.0  # monotonic time until which connection failures bench it
    # known only from fallback_replicas or the fleet cache file (Redis gave no fleet yet): probed
    # like a static replica, no affinity, replaced by its worker's report once Redis answers
    fallback: bool = False
    probe_failures: int = 0  # consecutive failed /health probes (static and fallback replicas)
    probed_ok: bool = False  # a /health probe has succeeded once
    # a static URL#RANK target whose engine does not list that rank (router.tools.rank_check): why it
    # takes no traffic (every request would be the engine's 400), or None
    rank_problem: str | None = None
    model_cards: list[dict[str, Any]] = field(default_factory=list)  # from /v1/models (static)
    lora: LoraLoad | None = None  # the engine's LoRA state (heartbeat F_LORA_*); None: unknown

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
        self.left: set[str] = set()  # worker-reported replicas dropped (expired, deregistered)
        self.health = ReplicaHealth(HealthParams(
            failure_threshold=config.circuit_failures, failure_window_s=config.circuit_window_s,
            ejection_s=config.circuit_ejection_s, max_ejection_s=config.circuit_max_ejection_s,
            stall_timeout_s=config.stall_timeout_s,
            deadline_factor=config.first_byte_deadline_factor,
            deadline_floor_s=config.first_byte_deadline_floor_s))
        for url in config.replicas:
            base, dp_rank = split_replica_url(url)
            rid = static_replica_id(url)
            self.replicas[rid] = Replica(
                rid, base, static=True, dp_rank=dp_rank,
                models=frozenset([config.model]) if config.model else None)

    # -- views ------------------------------------------------------------------

    def config_mismatch(self, replica: Replica) -> str | None:
        """How a worker-reported replica's Redis contract, index stride or hash settings
        (block size, hash algorithm, seed) differ from this router's, or ``None``: its keys
        are read at the wrong positions or are hashes of other blocks, so they can never
        match this router's. Such a replica takes traffic only when no replica without a
        mismatch serves the model (``eligible``)."""
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
        if replica.block_size is not None and replica.block_size != self.hasher.block_size:
            return f"block_size {replica.block_size} != router's {self.hasher.block_size}"
        if replica.hash_algo and replica.hash_algo != self.hasher.hash_algo:
            return f"hash_algo {replica.hash_algo} != router's {self.hasher.hash_algo}"
        if replica.seed_fingerprint and replica.seed_fingerprint != self.hasher.seed_fingerprint:
            return "seed fingerprint differs (PYTHONHASHSEED / --hash-seed mismatch)"
        return None

    def affinity_problem(self, replica: Replica) -> str | None:
        """Why a replica gets no prefix-hit credit, or ``None`` if it does.

        A static replica gets credit from this router's own placements only (no KV events
        confirm them, so its index slot holds nothing but the speculative placements of the
        last ``speculative_ttl_s``): a prefix repeated within that time goes back where it went.
        """
        if replica.static:
            return None
        if replica.fallback:
            return "fallback replica: no worker report yet (Redis unreachable)"
        mismatch = self.config_mismatch(replica)
        if mismatch is not None:
            return mismatch
        if replica.hash_verified == c.HashVerified.MISMATCH and replica.key_mode != c.KEY_MODE_RECOMPUTED:
            # recomputed keys are this router's own hashes of the events' token ids: trusted
            return "hash_verified=0: the worker's probe hashes differ from the engine's"
        return None

    def routable_problem(self, replica: Replica, now: float) -> str | None:
        """Why a replica takes no traffic now, or ``None``."""
        return self._down_problem(replica, now) or self.health.problem(replica.replica_id, now)

    def _down_problem(self, replica: Replica, now: float) -> str | None:
        """Why a replica is down (probes, heartbeat, connection failures), or ``None``."""
        if not replica.healthy:
            return "unhealthy (health probe failed or heartbeat stale)"
        if replica.rank_problem is not None:
            return replica.rank_problem
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

    def eligible(self, model: str | None,
                 now: float) -> tuple[list[Replica], tuple[str, str] | None, bool]:
        """Routable replicas serving ``model``, the LoRA (name, path) it names, if any, and
        whether they are chosen in panic mode.

        Panic mode (Envoy's panic threshold): when fewer than ``panic_threshold`` of the
        replicas serving ``model`` are routable, the health signals are taken to be wrong
        rather than most of the fleet down at once, and every replica ``eligible_in_panic``
        allows is used. Raises ``ModelNotFound`` when no known replica serves the model and
        ``NoRoutableReplica`` when some do but none is routable.
        """
        serving = [r for r in self.replicas.values() if r.serves(model)]
        if not serving:
            if not self.replicas:
                raise NoRoutableReplica(self.unknown_problem(model))
            raise ModelNotFound(f"The model `{model}` does not exist.")
        ready = [r for r in serving if self.routable_problem(r, now) is None]
        panic = self._panics(len(ready), len(serving))
        if panic:
            ready = self._answering([r for r in serving if self.eligible_in_panic(r, now)], now)
        elif not ready:
            # (panic_threshold 0) every replica that is up has its circuit open: route to them
            # anyway rather than refuse everything on request errors alone
            ready = self._answering(
                [r for r in serving if self._down_problem(r, now) is None], now)
        if not ready:
            raise NoRoutableReplica(f"no routable replica serves model {model!r}")
        # a config-mismatched replica's keys never match this router's: no traffic while a
        # replica that can hit serves the model; routed on load alone when none can
        matched = [r for r in ready if self.config_mismatch(r) is None]
        ready = matched or ready
        lora = None
        if model is not None:
            for r in ready:
                if model in r.lora_adapters and not (r.models and model in r.models):
                    lora = (model, r.lora_adapters[model])
                    break
        return ready, lora, panic

    def unknown_problem(self, model: str | None = None) -> str:
        """Why no replica is known: none registered yet, or every one known has left."""
        if not self.left:
            return "no replica is known to the router yet"
        of = f" of model {model!r}" if model is not None else ""
        return (f"no replica{of} is registered (all {len(self.left)} known replicas left: their "
                "heartbeats expired or they deregistered)")

    def _panics(self, num_routable: int, num_replicas: int) -> bool:
        """Envoy's panic threshold: fewer than ``panic_threshold`` of the replicas routable."""
        return num_routable < self.config.panic_threshold * num_replicas

    def eligible_in_panic(self, replica: Replica, now: float) -> bool:
        """Whether panic mode routes to ``replica``. Panic ignores the health signals, which
        many replicas can show at once without being down (a stale heartbeat, failed
        ``/health`` probes, an open circuit, a failed or timed-out connection: an overloaded
        router or network, a burst of connects), as Envoy's does; not a data-parallel rank the
        engine lacks (a configuration error) or a static replica never seen up (nothing says
        it ever was). A request sent to a replica that is down is retried on the next one."""
        if replica.rank_problem is not None:
            return False
        return replica.probed_ok or not (replica.static or replica.fallback)

    def _answering(self, replicas: list[Replica], now: float) -> list[Replica]:
        """``replicas`` less those that refused their last connection (``ReplicaHealth.refused``:
        nothing listens, direct evidence the replica is down, not a signal a busy router or
        network can fake), unless every one did."""
        return [r for r in replicas if not self.health.refused(r.replica_id, now)] or replicas

    def not_ready(self, now: float) -> str | None:
        """Why no replica can take a request now (``/ready`` answers 503), or ``None``: none is
        routed to (``routed``), or every one routed to refused its last connection."""
        routed = self.routed(now)
        if not routed:
            return self.unknown_problem() if not self.replicas else "no routable replica"
        if all(self.health.refused(r.replica_id, now) for r in routed):
            return (f"every replica routed to ({len(routed)}) refused its last connection "
                    "(nothing listens on its port) and has not answered since")
        return None

    def panic(self, now: float) -> tuple[bool, int, int]:
        """``(in panic, routable replicas, replicas)`` over the whole fleet (every model):
        ``router_fleet_panic`` and ``/ready``."""
        num_routable = len(self.routable(now))
        return self._panics(num_routable, len(self.replicas)), num_routable, len(self.replicas)

    def mark_failed(self, replica_id: str, now: float) -> None:
        """Passive health: skip a replica for ``SUSPECT_S`` after a connection failure."""
        replica = self.replicas.get(replica_id)
        if replica is not None:
            replica.suspect_until = now + SUSPECT_S

    def routed(self, now: float) -> list[Replica]:
        """The replicas requests go to now: the routable ones, or in panic mode (``panic``)
        every one ``eligible_in_panic`` allows."""
        if not self.panic(now)[0]:
            return self.routable(now)
        return self._answering([r for r in self.replicas.values() if self.routable_problem(
            r, now) is None or self.eligible_in_panic(r, now)], now)

    def model_cards(self, now: float) -> list[dict[str, Any]]:
        """Union of model cards over the replicas routed to (``routed``), by id
        (``GET /v1/models``)."""
        cards: dict[str, dict[str, Any]] = {}
        for r in self.routed(now):
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
        ``read_fleet_cache``) and ``fallback_replicas`` URLs (id ``host:port``, ``#RANK`` for a
        data-parallel rank). Returns how many were added."""
        added = 0
        entries = [*cached, *({"replica_id": static_replica_id(u), "url": split_replica_url(u)[0],
                               "dp_rank": split_replica_url(u)[1]} for u in urls)]
        for entry in entries:
            rid, url = str(entry.get("replica_id") or ""), str(entry.get("url") or "")
            if not rid or not url.startswith(("http://", "https://")) or rid in self.replicas:
                continue
            models = entry.get("models")
            adapters = entry.get("lora_adapters")
            dp_rank = entry.get("dp_rank")
            self.replicas[rid] = Replica(
                rid, url.rstrip("/"), fallback=True,
                dp_rank=dp_rank if type(dp_rank) is int and dp_rank >= 0 else None,
                models=frozenset(map(str, models)) if isinstance(models, list) else None,
                lora_adapters=dict(adapters) if isinstance(adapters, dict) else {})
            added += 1
        return added

    def fleet_snapshot(self) -> list[dict[str, Any]]:
        """The worker-reported replicas, as ``add_fallbacks`` reads them back (fleet cache)."""
        return [{"replica_id": r.replica_id, "url": r.url, "dp_rank": r.dp_rank,
                 "models": sorted(r.models) if r.models is not None else None,
                 "lora_adapters": dict(sorted(r.lora_adapters.items()))}
                for rid, r in sorted(self.replicas.items()) if not r.static and not r.fallback]

    # -- updates from Redis -----------------------------------------------------

    def apply_heartbeat(self, replica_id: str, fields: Mapping[str, str], wall_now: float,
                        contract: int = c.CONTRACT_VERSION, ttl_ms: int = -1) -> bool:
        """Create or refresh a worker-reported replica. Returns True if its block set must be
        (re)loaded: new replica or a newer epoch. ``contract``: the version a heartbeat
        without a ``contract`` field is taken to have (the reader passes 1 for an untagged,
        version 1/2 key; a hash-tagged key is version 3 at least).

        Freshness: ``ttl_ms`` is the key's ``PTTL`` read with the hash. A key Redis holds with
        an expiry is fresh by Redis's own clock (the worker sets ``HEARTBEAT_TTL_S`` at every
        write; Redis deletes the key when it lapses), whatever this router's clock or how late
        its event loop got to the reply. A key without one (-1: written by hand or by a test)
        is fresh while ``wall_now`` (unix s, read before the read was sent) is at most
        ``HEARTBEAT_TTL_S`` + 0.5 s past its ``heartbeat_ts``."""
        replica = self.replicas.get(replica_id)
        is_new = replica is None
        if replica is None:
            replica = self.replicas[replica_id] = Replica(replica_id, fields.get(c.F_URL, ""))
            self.left.discard(replica_id)
        replica.url = fields.get(c.F_URL, replica.url).rstrip("/")
        dp_rank = int_field(fields.get(c.F_DP_RANK), None)
        replica.dp_rank = dp_rank if dp_rank is not None and dp_rank >= 0 else None
        replica.fallback = False
        try:
            models = json.loads(fields.get(c.F_MODELS) or "null")
            replica.models = frozenset(models) if isinstance(models, list) else None
            adapters = json.loads(fields.get(c.F_LORA_ADAPTERS) or "{}")
            replica.lora_adapters = dict(adapters) if isinstance(adapters, dict) else {}
        except json.JSONDecodeError:
            logger.warning("replica %s: malformed models/lora_adapters in heartbeat", replica_id)
        replica.block_size = int_field(fields.get(c.F_BLOCK_SIZE), None)
        replica.hash_algo = fields.get(c.F_HASH_ALGO) or None
        replica.seed_fingerprint = fields.get(c.F_SEED_FINGERPRINT) or None
        replica.hash_verified = c.HashVerified.parse(fields.get(c.F_HASH_VERIFIED, ""))
        replica.key_mode = fields.get(c.F_KEY_MODE, "")
        replica.contract = int_field(fields.get(c.F_CONTRACT), contract) or contract
        replica.index_stride = int_field(fields.get(c.F_INDEX_STRIDE), 1) or 1
        tiers = fields.get(c.F_KV_TIERS)
        if tiers is not None:
            replica.kv_tiers = tuple(t for t in c.TIERS if t in tiers.split(","))
        replica.num_running = int_field(fields.get(c.F_NUM_RUNNING), 0) or 0
        replica.num_waiting = int_field(fields.get(c.F_NUM_WAITING), 0) or 0
        replica.kv_usage = float_field(fields.get(c.F_KV_USAGE), 0.0)
        replica.num_gpu_blocks = max(int_field(fields.get(c.F_NUM_GPU_BLOCKS), 0) or 0, 0)
        replica.redis_oom = fields.get(c.F_REDIS_OOM) == "1"
        replica.lora = lora_from_fields(fields)
        replica.heartbeat_ts = float_field(fields.get(c.F_HEARTBEAT_TS), wall_now)
        age_s = wall_now - replica.heartbeat_ts
        healthy = ttl_ms >= 0 or age_s <= c.HEARTBEAT_TTL_S + 0.5
        if replica.healthy and not healthy:
            logger.warning("replica %s: heartbeat %.1f s old and its key has no expiry; out of "
                           "rotation", replica_id, age_s)
        replica.healthy = healthy
        epoch = int_field(fields.get(c.F_EPOCH), 0) or 0
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
            self.left.add(replica_id)
        # O(1): the replica's slot is retired; sweep_index later removes it from the index and
        # the speculative placements before the slot is reused
        self.index.drop(replica_id)

    def apply_changes(self, replica_id: str, epoch: int, cleared: bool, stored: Any,
                      removed: Any, entry_seq: int | None = None, cpu_stored: Any = (),
                      cpu_removed: Any = ()) -> Dropped | None:
        """Apply one change-stream entry: reset the replica's keys (every tier) if ``cleared``,
        then add ``stored`` and forget ``removed`` (disjoint; the GPU tier), and the same with
        ``cpu_stored`` and ``cpu_removed`` on the CPU tier. Returns ``None`` or why it was
        dropped.

        ``entry_seq`` (contract version 3; ``None``: unchecked) must follow the replica's last
        one in the same epoch, or open a newer epoch with ``cleared``. At or below the last one:
        ``Dropped.DUPLICATE`` (already in the loaded set; not an error). Otherwise ``Dropped.GAP``: an
        entry is missing, nothing is applied, and the caller must reload the replica's set
        (``FleetReader`` does).
        """
        replica = self.replicas.get(replica_id)
        if replica is None or replica.static:
            return Dropped.UNKNOWN_REPLICA
        if replica.contract != c.CONTRACT_VERSION:
            return Dropped.CONFIG_MISMATCH
        known = self.index.epochs.get(replica_id, replica.epoch)
        if epoch < known:
            return Dropped.STALE_EPOCH
        if entry_seq is not None:
            if epoch == known and entry_seq <= replica.entry_seq:
                return Dropped.DUPLICATE
            # a baseline of -1: the loaded set came without an entry_seq (nothing to check)
            in_order = (cleared if epoch > known else
                        replica.entry_seq < 0 or entry_seq == replica.entry_seq + 1)
            if not in_order:
                return Dropped.GAP
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
        if cpu_removed:
            self.index.remove(replica_id, cpu_removed, c.TIER_CPU)
        if cpu_stored:
            self.index.add(replica_id, cpu_stored, c.TIER_CPU)
        return None

    def apply_event(self, replica_id: str, epoch: int, op: str, keys: Any) -> Dropped | None:
        """Apply one contract-version-1 entry (``op`` with its ``keys``); see ``apply_changes``."""
        if op == c.OP_STORED:
            return self.apply_changes(replica_id, epoch, False, keys, ())
        if op == c.OP_REMOVED:
            return self.apply_changes(replica_id, epoch, False, (), keys)
        if op == c.OP_CLEARED:
            return self.apply_changes(replica_id, epoch, True, (), ())
        return Dropped.BAD_OP


def lora_from_fields(fields: Mapping[str, str]) -> LoraLoad | None:
    """A heartbeat's LoRA state (``F_LORA_RUNNING``, ``F_LORA_WAITING``, ``F_MAX_LORA``), or
    ``None`` when it reports none (all absent or empty)."""
    running = fields.get(c.F_LORA_RUNNING) or ""
    waiting = fields.get(c.F_LORA_WAITING) or ""
    max_lora = int_field(fields.get(c.F_MAX_LORA), None)
    if not running and not waiting and max_lora is None:
        return None
    return LoraLoad(split_names(running), split_names(waiting), max_lora)


def int_field(value: str | None, default: int | None) -> int | None:
    """A heartbeat field as an int; ``default`` when it is absent or malformed."""
    try:
        return int(value) if value not in (None, "") else default
    except ValueError:
        return default


def float_field(value: str | None, default: float) -> float:
    """A heartbeat field as a float; ``default`` when it is absent or malformed."""
    try:
        return float(value) if value not in (None, "") else default
    except ValueError:
        return default
