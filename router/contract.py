"""The Redis contract between worker (writer) and router (reader). Pure: no I/O.

One namespace prefix per fleet (default ``pr``). For replica ``r``:

* ``{prefix}:replica:{r}``: hash, refreshed by the worker every heartbeat with a
  TTL of a few heartbeats; fields are the ``F_*`` names below. A missing key
  means the replica is out of rotation.
* ``{prefix}:blocks:{r}``: set of 8-byte big-endian block keys resident on ``r``;
  only the keys at *anchor positions* of their chain (``is_anchor``).
* ``{prefix}:events``: stream (approximately trimmed), one entry per worker flush
  with fields ``replica``, ``epoch``, ``cleared`` (``"1"``: the replica's set was
  reset before this entry's keys), ``stored`` and ``removed`` (packed 8-byte
  big-endian block keys; one key is in at most one of them).

Contract version 2 (``CONTRACT_VERSION``; heartbeat field ``contract``) added the
coarse index and the one-entry-per-flush stream format. Version 1 entries
(fields ``op`` = ``stored``/``removed``/``cleared`` and ``keys``) are still read.

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
rare; ``loadtest/replay.py`` measures it against the engine's cached tokens). A
replica whose ``index_stride`` or ``contract`` differs from the router's gets
no prefix-hit credit (reported on ``/ready`` and ``router_replica_config_mismatch``).

The worker is the only writer for its replica and writes the set change and the
stream entry atomically (one Lua script per flush). Routers remember the
stream's last id, load the snapshot sets, then read the stream from the
remembered id; re-applying an entry is harmless (set semantics). An entry whose
``epoch`` is newer than the router's view of the replica resets that replica
first.

Redis Cluster (not supported yet): the per-replica keys would take the hash tag
``{r}`` and the stream become one per replica, so each flush stays in one slot.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from typing import Final

CONTRACT_VERSION: Final = 2  # heartbeat field ``contract``; absent means version 1
DEFAULT_REDIS_PREFIX: Final = "pr"
DEFAULT_INDEX_STRIDE: Final = 16  # blocks between anchors (N); 1 = exact index. See README
HEARTBEAT_INTERVAL_S: Final = 1.0  # worker refresh period
HEARTBEAT_TTL_S: Final = 3.0  # about 3 heartbeats; expiry takes the replica out
EVENTS_STREAM_MAXLEN: Final = 200_000  # approximate MAXLEN for {prefix}:events

OP_STORED: Final = "stored"
OP_REMOVED: Final = "removed"
OP_CLEARED: Final = "cleared"
OPS: Final = (OP_STORED, OP_REMOVED, OP_CLEARED)

# Heartbeat hash fields ({prefix}:replica:{r}); values are strings in Redis.
F_REPLICA_ID: Final = "replica_id"
F_URL: Final = "url"  # advertised base URL, e.g. http://10.0.0.5:8000
F_MODELS: Final = "models"  # JSON list of served model names (base models)
F_LORA_ADAPTERS: Final = "lora_adapters"  # JSON {lora_name: lora_path}
F_BLOCK_SIZE: Final = "block_size"  # tokens
F_HASH_ALGO: Final = "hash_algo"
F_SEED_FINGERPRINT: Final = "seed_fingerprint"  # BlockHasher.seed_fingerprint of the worker's config
F_HASH_VERIFIED: Final = "hash_verified"  # "1" verified, "0" mismatch, "" not yet probed
F_KEY_MODE: Final = "key_mode"  # "engine" (event hashes) or "recomputed" (from token_ids)
KEY_MODE_RECOMPUTED: Final = "recomputed"  # keys are the routers' hashes of BlockStored.token_ids
F_CONTRACT: Final = "contract"  # CONTRACT_VERSION of the worker ("" or absent: 1)
F_INDEX_STRIDE: Final = "index_stride"  # N of the coarse index ("" or absent: 1)
F_EPOCH: Final = "epoch"  # int, bumped on engine restart / cache clear / resync
F_SEQ: Final = "seq"  # last KV event batch sequence number applied
F_NUM_RUNNING: Final = "num_running"
F_NUM_WAITING: Final = "num_waiting"
F_KV_USAGE: Final = "kv_usage"  # 0..1
F_PREFIX_CACHE_QUERIES: Final = "prefix_cache_queries"  # tokens, counter
F_PREFIX_CACHE_HITS: Final = "prefix_cache_hits"  # tokens, counter
F_NUM_BLOCKS: Final = "num_blocks"  # resident block keys
F_NUM_GPU_BLOCKS: Final = "num_gpu_blocks"  # pool capacity
F_HEARTBEAT_TS: Final = "heartbeat_ts"  # unix seconds, float

# Stream entry fields ({prefix}:events).
E_REPLICA: Final = "replica"
E_EPOCH: Final = "epoch"
E_CLEARED: Final = "cleared"  # "1": reset the replica's set before applying this entry
E_STORED: Final = "stored"  # packed keys that became resident
E_REMOVED: Final = "removed"  # packed keys that stopped being resident
E_OP: Final = "op"  # version 1 entries only
E_KEYS: Final = "keys"  # version 1 entries only

_KEY = struct.Struct(">Q")


def replica_key(prefix: str, replica_id: str) -> str:
    """Redis key of a replica's heartbeat hash."""
    return f"{prefix}:replica:{replica_id}"


def replica_pattern(prefix: str) -> str:
    """SCAN pattern matching every replica heartbeat key of the fleet."""
    return f"{prefix}:replica:*"


def replica_id_from_key(prefix: str, key: str | bytes) -> str:
    """Inverse of ``replica_key``. Raises ``ValueError`` for a key of another shape."""
    text = key.decode() if isinstance(key, bytes) else key
    head = f"{prefix}:replica:"
    if not text.startswith(head):
        raise ValueError(f"not a replica key: {text!r}")
    return text[len(head) :]


def blocks_key(prefix: str, replica_id: str) -> str:
    """Redis key of a replica's resident block set."""
    return f"{prefix}:blocks:{replica_id}"


def events_key(prefix: str) -> str:
    """Redis key of the fleet's change stream."""
    return f"{prefix}:events"


def pack_key(key: int) -> bytes:
    """One 64-bit block key as 8 big-endian bytes (set member form)."""
    return _KEY.pack(key)


def unpack_key(data: bytes) -> int:
    """Inverse of ``pack_key``. Raises ``ValueError`` unless ``data`` is 8 bytes."""
    if len(data) != 8:
        raise ValueError(f"block key must be 8 bytes, got {len(data)}")
    return int(_KEY.unpack(data)[0])


def pack_keys(keys: Iterable[int]) -> bytes:
    """Block keys concatenated as 8-byte big-endian words (stream ``keys`` field)."""
    keys = list(keys)
    return struct.pack(f">{len(keys)}Q", *keys)


def unpack_keys(data: bytes) -> Sequence[int]:
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


def anchor_keys(chain: Sequence[int], stride: int, start: int = 0) -> list[int]:
    """The keys of ``chain`` (block 0 first) at anchor positions ``>= start``."""
    if stride == 1:
        return list(chain[start:])
    return [chain[p] for p in anchor_positions(len(chain), stride) if p >= start]
