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

from collections.abc import Mapping
from enum import StrEnum
from typing import Any

from router.decision.health import HealthParams, ReplicaHealth
from router.decision.index import BlockIndex, SpeculativePlacements
from router.decision.replica import Replica, config_mismatch, int_field, model_cards
from router.decision.ring import HashRing
from router.request.errors import ModelNotFound, NoRoutableReplica
from router.service.config import RouterConfig, split_replica_url, static_replica_id
from router.shared import contract as c
from router.shared.hashing import BlockHasher

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
        return config_mismatch(replica, self.hasher, self.index.stride)

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
        return replica.down_problem(now) or self.health.problem(replica.replica_id, now)

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
                [r for r in serving if r.down_problem(now) is None], now)
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
        """Whether panic mode routes to ``replica`` (``Replica.routed_in_panic``)."""
        return replica.routed_in_panic()

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
        return model_cards(self.routed(now))

    def add_fallbacks(self, cached: list[dict[str, Any]], urls: tuple[str, ...]) -> int:
        """Replicas to route to until Redis gives the fleet: the last fleet seen (``cached``,
        ``read_fleet_cache``) and ``fallback_replicas`` URLs (id ``host:port``, ``#RANK`` for a
        data-parallel rank). Returns how many were added."""
        added = 0
        entries = [*cached, *({"replica_id": static_replica_id(u), "url": split_replica_url(u)[0],
                               "dp_rank": split_replica_url(u)[1]} for u in urls)]
        for entry in entries:
            replica = Replica.from_snapshot(entry)
            if replica is not None and replica.replica_id not in self.replicas:
                self.replicas[replica.replica_id] = replica
                added += 1
        return added

    def fleet_snapshot(self) -> list[dict[str, Any]]:
        """The worker-reported replicas, as ``add_fallbacks`` reads them back (fleet cache)."""
        return [r.snapshot() for _, r in sorted(self.replicas.items())
                if not r.static and not r.fallback]

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
        replica.apply_heartbeat(fields, wall_now, contract, ttl_ms)
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
