"""One replica as the router sees it (``Replica``), read from its worker's heartbeat, its fleet
cache entry or its ``/v1/models``, and the checks that compare its report with this router's
settings. Pure; ``router.decision.fleet`` owns the replicas.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from router.shared import contract as c
from router.shared.hashing import BlockHasher
from router.shared.lora_state import LoraLoad, split_names

logger = logging.getLogger(__name__)


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

    def down_problem(self, now: float) -> str | None:
        """Why this replica is down (probes, heartbeat, connection failures), or ``None``."""
        if not self.healthy:
            return "unhealthy (health probe failed or heartbeat stale)"
        if self.rank_problem is not None:
            return self.rank_problem
        if self.suspect_until > now:
            return "recent connection failure"
        return None

    def routed_in_panic(self) -> bool:
        """Whether panic mode routes to this replica. Panic ignores the health signals, which
        many replicas can show at once without being down (a stale heartbeat, failed
        ``/health`` probes, an open circuit, a failed or timed-out connection: an overloaded
        router or network, a burst of connects), as Envoy's does; not a data-parallel rank the
        engine lacks (a configuration error) or a static replica never seen up (nothing says
        it ever was). A request sent to a replica that is down is retried on the next one."""
        if self.rank_problem is not None:
            return False
        return self.probed_ok or not (self.static or self.fallback)

    def apply_heartbeat(self, fields: Mapping[str, str], wall_now: float, contract: int,
                        ttl_ms: int) -> None:
        """Take a worker's heartbeat ``fields`` (all but the epoch, which ``Fleet`` compares);
        ``contract``, ``ttl_ms`` and freshness as ``Fleet.apply_heartbeat`` states them."""
        self.url = fields.get(c.F_URL, self.url).rstrip("/")
        dp_rank = int_field(fields.get(c.F_DP_RANK), None)
        self.dp_rank = dp_rank if dp_rank is not None and dp_rank >= 0 else None
        self.fallback = False
        try:
            models = json.loads(fields.get(c.F_MODELS) or "null")
            self.models = frozenset(models) if isinstance(models, list) else None
            adapters = json.loads(fields.get(c.F_LORA_ADAPTERS) or "{}")
            self.lora_adapters = dict(adapters) if isinstance(adapters, dict) else {}
        except json.JSONDecodeError:
            logger.warning("replica %s: malformed models/lora_adapters in heartbeat",
                           self.replica_id)
        self.block_size = int_field(fields.get(c.F_BLOCK_SIZE), None)
        self.hash_algo = fields.get(c.F_HASH_ALGO) or None
        self.seed_fingerprint = fields.get(c.F_SEED_FINGERPRINT) or None
        self.hash_verified = c.HashVerified.parse(fields.get(c.F_HASH_VERIFIED, ""))
        self.key_mode = fields.get(c.F_KEY_MODE, "")
        self.contract = int_field(fields.get(c.F_CONTRACT), contract) or contract
        self.index_stride = int_field(fields.get(c.F_INDEX_STRIDE), 1) or 1
        tiers = fields.get(c.F_KV_TIERS)
        if tiers is not None:
            self.kv_tiers = tuple(t for t in c.TIERS if t in tiers.split(","))
        self.num_running = int_field(fields.get(c.F_NUM_RUNNING), 0) or 0
        self.num_waiting = int_field(fields.get(c.F_NUM_WAITING), 0) or 0
        self.kv_usage = float_field(fields.get(c.F_KV_USAGE), 0.0)
        self.num_gpu_blocks = max(int_field(fields.get(c.F_NUM_GPU_BLOCKS), 0) or 0, 0)
        self.redis_oom = fields.get(c.F_REDIS_OOM) == "1"
        self.lora = lora_from_fields(fields)
        self.heartbeat_ts = float_field(fields.get(c.F_HEARTBEAT_TS), wall_now)
        age_s = wall_now - self.heartbeat_ts
        healthy = ttl_ms >= 0 or age_s <= c.HEARTBEAT_TTL_S + 0.5
        if self.healthy and not healthy:
            logger.warning("replica %s: heartbeat %.1f s old and its key has no expiry; out of "
                           "rotation", self.replica_id, age_s)
        self.healthy = healthy

    def snapshot(self) -> dict[str, Any]:
        """This replica as the fleet cache file holds it (``from_snapshot`` reads it back)."""
        return {"replica_id": self.replica_id, "url": self.url, "dp_rank": self.dp_rank,
                "models": sorted(self.models) if self.models is not None else None,
                "lora_adapters": dict(sorted(self.lora_adapters.items()))}

    @classmethod
    def from_snapshot(cls, entry: Mapping[str, Any]) -> Replica | None:
        """A fallback replica from a fleet-cache entry (``snapshot``) or a ``fallback_replicas``
        URL's fields; ``None`` without an id or an http(s) URL."""
        rid, url = str(entry.get("replica_id") or ""), str(entry.get("url") or "")
        if not rid or not url.startswith(("http://", "https://")):
            return None
        models = entry.get("models")
        adapters = entry.get("lora_adapters")
        dp_rank = entry.get("dp_rank")
        return cls(
            rid, url.rstrip("/"), fallback=True,
            dp_rank=dp_rank if type(dp_rank) is int and dp_rank >= 0 else None,
            models=frozenset(map(str, models)) if isinstance(models, list) else None,
            lora_adapters=dict(adapters) if isinstance(adapters, dict) else {})


def config_mismatch(replica: Replica, hasher: BlockHasher, index_stride: int) -> str | None:
    """How a worker-reported replica's Redis contract, index stride or hash settings (block
    size, hash algorithm, seed) differ from this router's (``hasher``, ``index_stride``), or
    ``None``: see ``Fleet.config_mismatch``."""
    if replica.static:
        return None
    if replica.contract != c.CONTRACT_VERSION:
        # versions 1 and 2 keep their keys untagged: read only to report the replica here
        age = "newer" if replica.contract > c.CONTRACT_VERSION else "older"
        return (f"Redis contract version {replica.contract} is {age} than router's "
                f"{c.CONTRACT_VERSION}")
    if replica.index_stride != index_stride:
        return (f"index_stride {replica.index_stride} != router's {index_stride} "
                "(set one value for workers and routers)")
    if replica.block_size is not None and replica.block_size != hasher.block_size:
        return f"block_size {replica.block_size} != router's {hasher.block_size}"
    if replica.hash_algo and replica.hash_algo != hasher.hash_algo:
        return f"hash_algo {replica.hash_algo} != router's {hasher.hash_algo}"
    if replica.seed_fingerprint and replica.seed_fingerprint != hasher.seed_fingerprint:
        return "seed fingerprint differs (PYTHONHASHSEED / --hash-seed mismatch)"
    return None


def model_cards(replicas: list[Replica]) -> list[dict[str, Any]]:
    """Union of the model cards of ``replicas``, by id (``GET /v1/models``): a static
    replica's from its ``/v1/models``, a worker-reported one's made from its models and LoRA
    adapters."""
    cards: dict[str, dict[str, Any]] = {}
    for r in replicas:
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
