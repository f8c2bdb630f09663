"""The Redis contract between worker (writer) and router (reader). Pure: no I/O.

One namespace prefix per fleet (default ``pr``). For replica ``r`` (contract version 3: the
per-replica keys carry the hash tag ``{r}``, so on a Redis Cluster they share one hash slot):

* ``{prefix}:{r}:replica``: hash, refreshed by the worker every heartbeat with a TTL of a few
  heartbeats; fields are the ``F_*`` names below. A missing key means the replica is out of
  rotation. The router discovers replicas by ``SCAN``-ning for these keys (on every master of
  a cluster: redis-py's cluster ``scan_iter``), so there is no registry key to keep.
* ``{prefix}:{r}:blocks``: set of 8-byte big-endian block keys resident on ``r``'s GPU (the
  ``GPU`` tier); only the keys at *anchor positions* of their chain (``is_anchor``).
* ``{prefix}:{r}:blocks:CPU``: the same for the ``CPU`` tier (vLLM native KV offloading: host
  memory behind the GPU, KV events with ``medium`` ``"CPU"``). A block held by both tiers is in
  both sets (vLLM offloads write-through: the GPU copy and the host copy live side by side).
* ``{prefix}:events``: the fleet's one stream (approximately trimmed), one entry per worker
  flush with fields ``replica``, ``epoch``, ``entry_seq``, ``cleared`` (``"1"``: the replica's
  sets, every tier, were reset before this entry's keys), ``stored`` and ``removed`` (packed
  8-byte big-endian block keys of the GPU tier; one key is in at most one of them), and, when
  not empty, ``cpu_stored`` and ``cpu_removed`` (the same for the CPU tier).

**Tiers** (version 4). The worker keeps one resident set per (replica, tier): ``GPU`` and
``CPU`` (``TIERS``; heartbeat field ``kv_tiers`` lists the tiers it indexes, ``GPU`` alone when
its ``--kv-tiers`` hides the host tier). A router's hit depth per replica is per tier, as vLLM
looks blocks up: the GPU hit is the leading run of the chain in the GPU set
(``KVCacheManager.get_computed_blocks``), and the CPU-tier hit continues from there with the
blocks the host holds (``OffloadingConnectorScheduler.get_num_new_matched_tokens`` looks up the
blocks past the GPU hit), which are loaded over the host link instead of being recomputed.
vLLM's other offload medium, ``"STORAGE"`` (disk or remote), has no set: no router values it,
so its events are skipped by the worker (``worker_skipped_tier_events_total{medium}``).

**Atomicity and its check.** A flush is ONE single-slot Lua script on the replica's two keys
(the set change, and ``epoch``, ``seq`` and ``entry_seq`` in the heartbeat hash), THEN the
stream entry (``XADD``, after the script returned). The stream is not in the replica's slot,
so the entry is not in the same transaction: ``entry_seq`` (the replica's count of stream
entries, +1 per entry, never reset by the worker) lets a router check it instead. Per replica a
router applies entry ``entry_seq = n`` only right after ``n - 1`` in the same epoch (or an
entry of a newer epoch that is ``cleared``: a full rewrite); an entry at or below what it
holds is a duplicate (already in the snapshot it loaded) and skipped; anything else is a gap
and the router reloads that replica's set and ``epoch``/``entry_seq`` together (one
single-slot transaction). Because the script commits before the entry is written, a router
that remembered the stream's last id before loading a snapshot never misses an entry the
snapshot lacks. An entry is applied whole (one entry is one flush) or not at all.

Why one shared stream and not one per replica (``loadtest/bench/streams.py``): on a cluster a
multi-key ``XREAD`` must stay in one slot, so per-replica streams need one ``XREAD`` per
replica per read, and cannot block: at 64 replicas and 1,000 flushes/s that cost a router
about 0.5 of a core against 0.07 to 0.08 for the one blocking ``XREAD`` of one stream, at 3 to
5 times the index lag. The shared stream holds only the change entries (trimmed); the
per-replica data (sets, heartbeats, and the set writes) spread over the masters.

Contract version 4 (``CONTRACT_VERSION``; heartbeat field ``contract``): per-tier sets and
stream fields (above). Version 3: hash-tagged keys and ``entry_seq``; a version 3 worker folds
the CPU tier into its one set, so a version 4 router reports it as ``config_mismatch``
(no prefix-hit credit, its entries dropped, no traffic while a matched replica serves the model), as it does older versions. Version 2 added the coarse index and the one-entry-per-flush stream format.
Entries without ``entry_seq`` (version 2, and version 1: ``op`` = ``stored``/``removed``/
``cleared`` and ``keys``) are still parsed, unchecked; but a version 1/2 worker writes its keys
without hash tags (``{prefix}:replica:{r}``), which a version 3 router reads only to report it
(``config_mismatch``: no prefix-hit credit, its entries dropped, no traffic while a matched
replica serves the model). Upgrade routers first,
then workers: an older router does not see version 3 workers at all.

**Coarse index.** ``index_stride`` (N, heartbeat field ``index_stride``; the same
one setting for workers and routers) selects the chain positions (0-based block
depth ``d``) that carry a key: every ``d`` with ``(d + 1) % N == 0``, plus the
positions ``d + 1 = 1, 2, 4, ... < N`` so short prompts keep a fine-grained hit.
N = 1 makes every block an anchor (the exact index). Workers publish only anchor
keys (N times fewer keys written, stored and applied); a router reads a hit
depth as ``anchor depth + 1`` of the deepest leading anchor a replica holds, so
hit depths are exact at anchors and under-estimate by fewer than N blocks
between them. A replica that evicted a block inside a span whose anchor it
still holds is over-estimated (vLLM frees a chain's tail first, so this is
rare; ``loadtest/replay/replayer.py`` measures it against the engine's cached tokens). A
replica whose ``index_stride`` or ``contract`` differs from the router's gets
no prefix-hit credit (reported on ``/ready`` and ``router_replica_config_mismatch``).

**Data-parallel engines.** A vLLM engine with ``--data-parallel-size N`` runs N engine cores
(each its own KV block pool and KV event stream) behind one URL. Each rank is a replica of its
own here: the worker publishes rank ``r`` of engine ``name`` as replica ``name#r`` with
``url`` = the engine's URL and ``dp_rank`` = ``r`` (its load, block set, health and epoch are
the rank's). A router sends that replica's requests to ``url`` with the header
``X-data-parallel-rank: r`` (vLLM's API server then skips its own DP load balancing) and drops
that header from clients. ``dp_rank`` is a field that came within contract version 3 (kept in
4): a router that does not know it ignores it and sends a rank's requests without the header (they still run; vLLM
balances them itself, so the rank's hit credit may be wrong).

The worker is the only writer for its replica. Routers remember the stream's last id, load
the snapshot sets, then read the stream from the remembered id. An entry whose ``epoch`` is
newer than the router's view of the replica resets that replica first.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from enum import StrEnum
from typing import Final, NewType

BlockKey = NewType("BlockKey", int)
"""A block's 64-bit key: the low 8 bytes of vLLM's block hash (what KV events carry as an
int, ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``), as the index, the stream and the workers
use it. Distinct from a token id (both are ints; mypy keeps them apart)."""

CONTRACT_VERSION: Final = 4  # heartbeat field ``contract``; absent: 1 (3 in a tagged key)
TAGGED_KEYS_VERSION: Final = 3  # first version with hash-tagged keys (a tagged key: at least 3)
DEFAULT_REDIS_PREFIX: Final = "pr"
DEFAULT_INDEX_STRIDE: Final = 16  # blocks between anchors (N); 1 = exact index (docs/router.md)
HEARTBEAT_INTERVAL_S: Final = 1.0  # worker refresh period
HEARTBEAT_TTL_S: Final = 3.0  # about 3 heartbeats; expiry takes the replica out
# seconds a replica's block sets outlive its last heartbeat (their TTL, refreshed by every
# heartbeat and flush): a scaled-down replica's state expires then (worker --state-ttl-s)
DEFAULT_STATE_TTL_S: Final = 600.0
EVENTS_STREAM_MAXLEN: Final = 200_000  # approximate MAXLEN for {prefix}:events

TIER_GPU: Final = "GPU"  # vLLM KV event ``medium`` of the GPU's own pool
TIER_CPU: Final = "CPU"  # vLLM native KV offloading (host memory), ``medium`` "CPU"
TIERS: Final = (TIER_GPU, TIER_CPU)

OP_STORED: Final = "stored"
OP_REMOVED: Final = "removed"
OP_CLEARED: Final = "cleared"
OPS: Final = (OP_STORED, OP_REMOVED, OP_CLEARED)

# Heartbeat hash fields ({prefix}:{r}:replica); values are strings in Redis.
F_REPLICA_ID: Final = "replica_id"
F_URL: Final = "url"  # advertised base URL, e.g. http://10.0.0.5:8000
# the engine's data-parallel rank this replica is ("" or absent: no data parallelism); requests
# go to F_URL with DP_RANK_HEADER set to it
F_DP_RANK: Final = "dp_rank"
RANK_SEPARATOR: Final = "#"  # the replica id of rank r of a data-parallel engine is ``name#r``
DP_RANK_HEADER: Final = "X-data-parallel-rank"  # vLLM serving engine _get_data_parallel_rank
F_MODELS: Final = "models"  # JSON list of served model names (base models)
F_LORA_ADAPTERS: Final = "lora_adapters"  # JSON {lora_name: lora_path}
F_BLOCK_SIZE: Final = "block_size"  # tokens
F_HASH_ALGO: Final = "hash_algo"
F_SEED_FINGERPRINT: Final = "seed_fingerprint"  # BlockHasher.seed_fingerprint of the worker's config
F_HASH_VERIFIED: Final = "hash_verified"  # a HashVerified value
F_KEY_MODE: Final = "key_mode"  # "engine" (event hashes) or "recomputed" (from token_ids)
KEY_MODE_RECOMPUTED: Final = "recomputed"  # keys are the routers' hashes of BlockStored.token_ids
F_CONTRACT: Final = "contract"  # CONTRACT_VERSION of the worker ("" or absent: 1)
F_INDEX_STRIDE: Final = "index_stride"  # N of the coarse index ("" or absent: 1)
F_KV_TIERS: Final = "kv_tiers"  # tiers the worker indexes, comma-separated ("GPU" or "GPU,CPU")
F_EPOCH: Final = "epoch"  # int, bumped on engine restart / cache clear / resync
F_SEQ: Final = "seq"  # last KV event batch sequence number applied
F_ENTRY_SEQ: Final = "entry_seq"  # stream entries written so far (the last one's E_ENTRY_SEQ)
F_NUM_RUNNING: Final = "num_running"
F_NUM_WAITING: Final = "num_waiting"
F_KV_USAGE: Final = "kv_usage"  # 0..1
F_PREFIX_CACHE_QUERIES: Final = "prefix_cache_queries"  # tokens, counter
F_PREFIX_CACHE_HITS: Final = "prefix_cache_hits"  # tokens, counter
F_NUM_BLOCKS: Final = "num_blocks"  # resident block keys
F_NUM_GPU_BLOCKS: Final = "num_gpu_blocks"  # pool capacity
F_HEARTBEAT_TS: Final = "heartbeat_ts"  # unix seconds, float
# "1" while Redis refuses the worker's writes for lack of memory (maxmemory reached under
# noeviction): its changes are held, so routers' view of this replica lags; "" or absent: no
F_REDIS_OOM: Final = "redis_oom"
# the engine's vllm:lora_requests_info (router.apis.lora_load): adapter names of its running and
# waiting requests (comma-separated, as vLLM's labels) and max_lora; all "" or absent: no LoRA
# state reported (LoRA off, or an older worker)
F_LORA_RUNNING: Final = "lora_running"
F_LORA_WAITING: Final = "lora_waiting"
F_MAX_LORA: Final = "max_lora"


class HashVerified(StrEnum):
    """The ``F_HASH_VERIFIED`` field: whether the worker's probe found the engine's block hashes
    equal to its own (``"1"``), different (``"0"``: the replica gets no prefix-hit credit unless
    its keys are recomputed), or has not probed yet (``""``). A ``str``, so it is written and
    compared as the field's text."""

    VERIFIED = "1"
    MISMATCH = "0"
    UNKNOWN = ""

    @classmethod
    def parse(cls, text: str) -> HashVerified:
        """The value of the field's ``text``; anything else (a newer worker's value) is
        ``UNKNOWN``."""
        try:
            return cls(text)
        except ValueError:
            return cls.UNKNOWN

# Stream entry fields ({prefix}:events).
E_REPLICA: Final = "replica"
E_EPOCH: Final = "epoch"
E_ENTRY_SEQ: Final = "entry_seq"  # the replica's entry count: +1 per entry (version 3)
E_CLEARED: Final = "cleared"  # "1": reset the replica's set before applying this entry
E_STORED: Final = "stored"  # packed keys that became resident
E_REMOVED: Final = "removed"  # packed keys that stopped being resident
E_CPU_STORED: Final = "cpu_stored"  # packed CPU-tier keys that became resident (version 4)
E_CPU_REMOVED: Final = "cpu_removed"  # packed CPU-tier keys that stopped being resident
E_OP: Final = "op"  # version 1 entries only
E_KEYS: Final = "keys"  # version 1 entries only

_KEY = struct.Struct(">Q")


def _check_replica_id(replica_id: str) -> str:
    if not replica_id:
        raise ValueError("replica id must not be empty (an empty hash tag hashes the whole key)")
    return replica_id


def check_configured_replica_id(replica_id: str) -> str:
    """``replica_id`` as an operator may name a replica (the worker's ``--replica-id``); raises
    ``ValueError`` when it is empty (an empty hash tag hashes the whole key) or holds
    ``RANK_SEPARATOR`` (``#``), which names the data-parallel ranks of one engine
    (``name#rank``, heartbeat field ``F_DP_RANK``): a configured ``a#1`` would be taken for
    rank 1 of engine ``a``. Braces are allowed: every key of a replica shares its hash tag
    whatever braces the id holds (``replica_key``)."""
    _check_replica_id(replica_id)
    if RANK_SEPARATOR in replica_id:
        raise ValueError(f"replica id {replica_id!r} must not contain {RANK_SEPARATOR!r}: it "
                         f"separates an engine's data-parallel ranks (name{RANK_SEPARATOR}rank)")
    return replica_id


def replica_key(prefix: str, replica_id: str) -> str:
    """Redis key of a replica's heartbeat hash: ``{prefix}:{r}:replica`` (hash tag ``{r}``).

    Every key of one replica starts with ``{prefix}:{r}``, so Redis Cluster's hash tag (the
    text between the first ``{`` and the next ``}``) is the same for all of them, whatever
    braces ``r`` itself holds. Raises ``ValueError`` for an empty ``replica_id``.
    """
    return f"{prefix}:{{{_check_replica_id(replica_id)}}}:replica"


def replica_pattern(prefix: str) -> str:
    """SCAN pattern matching every heartbeat key of the fleet (version 3 and the untagged
    version 1/2 form): ``{prefix}:*``, classified by ``replica_id_from_key``."""
    return f"{prefix}:*"


def replica_id_from_key(prefix: str, key: str | bytes) -> tuple[str, bool]:
    """``(replica_id, tagged)`` of a heartbeat key: tagged ``{prefix}:{r}:replica`` (version 3,
    ``tagged`` True) or untagged ``{prefix}:replica:{r}`` (versions 1 and 2). Raises
    ``ValueError`` for a key of another shape (a block set, the stream)."""
    text = key.decode() if isinstance(key, bytes) else key
    head, tail = f"{prefix}:{{", "}:replica"
    if text.startswith(head) and text.endswith(tail) and len(text) > len(head) + len(tail):
        return text[len(head) : -len(tail)], True
    legacy = f"{prefix}:replica:"
    if text.startswith(legacy) and len(text) > len(legacy):
        return text[len(legacy) :], False
    raise ValueError(f"not a replica key: {text!r}")


def blocks_key(prefix: str, replica_id: str, tier: str = TIER_GPU) -> str:
    """Redis key of a replica's resident block set of ``tier``: ``{prefix}:{r}:blocks`` (GPU)
    or ``{prefix}:{r}:blocks:{tier}`` (hash tag ``{r}``, the slot of ``replica_key``). Raises
    ``ValueError`` for an empty ``replica_id`` or a tier not in ``TIERS``."""
    if tier not in TIERS:
        raise ValueError(f"unknown tier {tier!r}; known: {', '.join(TIERS)}")
    suffix = "" if tier == TIER_GPU else f":{tier}"
    return f"{prefix}:{{{_check_replica_id(replica_id)}}}:blocks{suffix}"


def events_key(prefix: str) -> str:
    """Redis key of the fleet's change stream (one key, read with one blocking ``XREAD``)."""
    return f"{prefix}:events"


def key_slot(key: str | bytes) -> int:
    """Redis Cluster hash slot of ``key`` (0..16383): CRC16/XMODEM of its hash tag (the text
    between the first ``{`` and the next ``}``, if non-empty) or of the whole key, mod 16384.
    Redis Cluster specification, "Hash tags"; what ``CLUSTER KEYSLOT`` answers."""
    data = key.encode() if isinstance(key, str) else key
    start = data.find(b"{")
    if start >= 0:
        end = data.find(b"}", start + 1)
        if end > start + 1:
            data = data[start + 1 : end]
    crc = 0
    for byte in data:
        crc ^= byte << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021) if crc & 0x8000 else crc << 1
            crc &= 0xFFFF
    return crc % 16384


def pack_key(key: int) -> bytes:
    """One 64-bit block key as 8 big-endian bytes (set member form)."""
    return _KEY.pack(key)


def unpack_key(data: bytes) -> BlockKey:
    """Inverse of ``pack_key``. Raises ``ValueError`` unless ``data`` is 8 bytes."""
    if len(data) != 8:
        raise ValueError(f"block key must be 8 bytes, got {len(data)}")
    return BlockKey(_KEY.unpack(data)[0])


def pack_keys(keys: Iterable[BlockKey]) -> bytes:
    """Block keys concatenated as 8-byte big-endian words (stream ``keys`` field)."""
    keys = list(keys)
    return struct.pack(f">{len(keys)}Q", *keys)


def unpack_keys(data: bytes) -> Sequence[BlockKey]:
    """Inverse of ``pack_keys``. Raises ``ValueError`` if the length is not a multiple of 8."""
    if len(data) % 8:
        raise ValueError(f"packed keys length {len(data)} is not a multiple of 8")
    return struct.unpack(f">{len(data) // 8}Q", data)


def is_anchor(depth: int, stride: int) -> bool:
    """True if the block at 0-based chain position ``depth`` carries a key in the index.

    ``(depth + 1) % stride == 0``, or ``depth + 1`` a power of two below ``stride``.
    ``stride`` 1: every block.
    """
    n = depth + 1
    return n % stride == 0 or (n < stride and n & (n - 1) == 0)


def anchor_positions(num_blocks: int, stride: int) -> range | list[int]:
    """The anchor positions (``is_anchor``) of a chain of ``num_blocks`` blocks, ascending."""
    if stride == 1:
        return range(num_blocks)
    head = []
    n = 1
    while n < stride and n <= num_blocks:
        head.append(n - 1)
        n *= 2
    return head + list(range(stride - 1, num_blocks, stride))


def anchor_positions_between(start: int, stop: int, stride: int) -> list[int]:
    """The anchor positions ``p`` with ``start <= p < stop``, ascending (O(anchors), not O(blocks))."""
    head = []
    n = 1
    while n < stride and n <= stop:
        if n > start:
            head.append(n - 1)
        n *= 2
    first = max(stride - 1, start + (stride - 1 - start) % stride)
    return head + list(range(first, stop, stride))


def anchor_keys(chain: Sequence[BlockKey], stride: int, start: int = 0) -> list[BlockKey]:
    """The keys of ``chain`` (block 0 first) at anchor positions ``>= start``."""
    if stride == 1:
        return list(chain[start:])
    return [chain[p] for p in anchor_positions(len(chain), stride) if p >= start]
