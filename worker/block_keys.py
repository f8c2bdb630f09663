"""Turning the hashes in KV events into the project's 64-bit block keys. Pure: no I/O.

Two modes, named by the heartbeat field ``key_mode``:

* ``engine``: the key is the event's hash itself (``event_hash_key``). Right
  whenever the engine hashes the way the routers do (the probe verifies this).
* ``recomputed``: the engine's hashes disagree with the routers' (another
  ``PYTHONHASHSEED``, algorithm or block size), so each ``BlockStored`` is
  re-hashed from its ``token_ids`` and extra keys with the routers' settings,
  following ``parent_block_hash`` through a map {engine key: our digest}. A
  ``BlockRemoved`` maps the engine's hash back through the same map.

Offload tiers (``tier`` ``"CPU"``): vLLM's offloading connector publishes a host store
without parent and token ids (``OffloadingConnectorScheduler.take_events``), so in
``recomputed`` mode it cannot be re-hashed; it is keyed by the digest the GPU store of the
same engine hash already gave (write-through: that store comes first), kept in a map of the
tier's own so the key outlives the GPU copy (a GPU eviction of an offloaded block is no
removal from the host). A host store of a hash the worker never saw stored is not placed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, Protocol

from router.shared.contract import KEY_MODE_RECOMPUTED as _RECOMPUTED
from router.shared.contract import TIER_GPU, BlockKey
from router.shared.hashing import BlockHasher, block_key
from router.shared.kv_events import (
    BlockRemoved,
    BlockStored,
    ExternalBlockHash,
    KVEventDecodeError,
    event_hash_key,
    from_event_extra_keys,
    stored_extra_keys,
    stored_token_ids,
)

KEY_MODE_ENGINE: Final = "engine"
KEY_MODE_RECOMPUTED: Final = _RECOMPUTED  # the contract value routers trust


class UnresolvableEvent(KVEventDecodeError):
    """An event whose keys cannot be computed (unknown parent, unknown LoRA path, wrong block size)."""


class KeyMapper(Protocol):
    """Engine event of one ``tier`` (``router.shared.contract.TIERS``) -> block keys.

    ``stored``/``removed`` raise ``KVEventDecodeError`` on bad input; ``placeable`` returns
    the hashes of an offload-tier store whose keys ``stored`` can compute (all of them when
    keys are the engine's own). ``num_unknown_removals``: removed hashes it could not map
    back (never seen stored on their tier).
    """

    mode: str
    num_unknown_removals: int

    def stored(self, event: BlockStored, tier: str = TIER_GPU) -> list[BlockKey]: ...

    def removed(self, event: BlockRemoved, tier: str = TIER_GPU) -> list[BlockKey]: ...

    def placeable(self, event: BlockStored) -> list[ExternalBlockHash]: ...

    def clear(self) -> None: ...


class EngineKeys:
    """``key_mode=engine``: block key = the event's own hash (64-bit int, or a raw digest reduced)."""

    mode = KEY_MODE_ENGINE
    num_unknown_removals = 0  # (the block sets count a key that is not resident)

    def stored(self, event: BlockStored, tier: str = TIER_GPU) -> list[BlockKey]:
        return [event_hash_key(h) for h in event.block_hashes]

    def removed(self, event: BlockRemoved, tier: str = TIER_GPU) -> list[BlockKey]:
        return [event_hash_key(h) for h in event.block_hashes]

    def placeable(self, event: BlockStored) -> list[ExternalBlockHash]:
        return event.block_hashes

    def clear(self) -> None:
        return None


@dataclass(slots=True)
class _Mapped:
    digest: bytes  # our raw digest of the block
    copies: int  # engine copies stored and not yet removed


class RecomputedKeys:
    """``key_mode=recomputed``: re-hash ``BlockStored.token_ids`` with the routers' ``hasher``.

    ``lora_path(name)`` returns the adapter path the engine registered (``root``
    of its ``/v1/models`` card) or None. Keeps {engine key: (our digest, copies)}
    per tier for every block it has seen stored there and not yet removed as often, so
    memory is bounded by the replica's resident blocks. Source of the rule being
    re-applied: vLLM 0.33 ``hash_block_tokens`` and ``to_event_extra_keys``. An
    offload-tier store (no tokens, no parent) takes the digest of the same engine hash from
    either map (``placeable`` says which hashes have one).
    """

    mode = KEY_MODE_RECOMPUTED

    def __init__(self, hasher: BlockHasher, lora_path: Callable[[str], str | None]) -> None:
        self.hasher = hasher
        self._lora_path = lora_path
        self._engine_to_ours: dict[int, _Mapped] = {}  # {engine key: our digest and copies}, GPU
        self._offloaded: dict[int, _Mapped] = {}  # the same for the offload (CPU) tier
        self.num_unknown_removals = 0  # removed hashes never seen stored on their tier

    def __len__(self) -> int:
        return len(self._engine_to_ours) + len(self._offloaded)

    def _digest(self, engine_key: int) -> bytes | None:
        entry = self._engine_to_ours.get(engine_key) or self._offloaded.get(engine_key)
        return entry.digest if entry is not None else None

    def placeable(self, event: BlockStored) -> list[ExternalBlockHash]:
        return [h for h in event.block_hashes if self._digest(event_hash_key(h)) is not None]

    def stored(self, event: BlockStored, tier: str = TIER_GPU) -> list[BlockKey]:
        if tier != TIER_GPU:
            return self._stored_offload(event)
        size = self.hasher.block_size
        num_blocks = len(event.block_hashes)
        if event.block_size != size:
            raise UnresolvableEvent(
                f"event block size {event.block_size} differs from the routers' {size}"
            )
        token_ids = stored_token_ids(event)  # (decoded only here: ``LazyBlockStored``)
        if len(token_ids) != size * num_blocks:
            raise UnresolvableEvent(
                f"{len(token_ids)} token ids for {num_blocks} blocks of {size}"
            )
        parent: bytes | None = None
        first_index = 0
        if event.parent_block_hash is not None:
            # (a parent only the host tier still holds chains the same: one hash, one digest)
            parent = self._digest(event_hash_key(event.parent_block_hash))
            if parent is None:
                raise UnresolvableEvent("parent block unknown (stored before this worker saw it)")
            first_index = 1  # any block after block 0; only "is it block 0" matters (cache_salt)
        lora_path = self._lora_path(event.lora_name) if event.lora_name else None
        extra_keys = stored_extra_keys(event) or [None] * num_blocks
        out: list[BlockKey] = []
        for i, engine_hash in enumerate(event.block_hashes):
            extra = from_event_extra_keys(
                extra_keys[i] if i < len(extra_keys) else None,
                block_index=first_index + i,
                lora_name=event.lora_name,
                lora_path=lora_path,
            )
            parent = self.hasher.hash_block(parent, token_ids[i * size : (i + 1) * size], extra)
            _count(self._engine_to_ours, event_hash_key(engine_hash), parent)
            out.append(block_key(parent))
        return out

    def _stored_offload(self, event: BlockStored) -> list[BlockKey]:
        """Keys of a host store, every hash of which is ``placeable``; raises
        ``UnresolvableEvent`` otherwise (the view passes the placeable hashes only)."""
        engine_keys = [event_hash_key(h) for h in event.block_hashes]
        digests = [d for d in map(self._digest, engine_keys) if d is not None]
        if len(digests) != len(engine_keys):
            raise UnresolvableEvent("offloaded block never stored on the GPU while this worker "
                                    "listened: no tokens to re-hash")
        for engine_key, digest in zip(engine_keys, digests, strict=True):
            _count(self._offloaded, engine_key, digest)
        return [block_key(d) for d in digests]

    def removed(self, event: BlockRemoved, tier: str = TIER_GPU) -> list[BlockKey]:
        out: list[BlockKey] = []
        table = self._engine_to_ours if tier == TIER_GPU else self._offloaded
        for engine_hash in event.block_hashes:
            engine_key = event_hash_key(engine_hash)
            entry = table.get(engine_key)
            if entry is None:  # never seen stored: nothing of ours to remove
                self.num_unknown_removals += 1
                continue
            out.append(block_key(entry.digest))
            if entry.copies == 1:
                del table[engine_key]
            else:
                entry.copies -= 1
        return out

    def clear(self) -> None:
        self._engine_to_ours.clear()
        self._offloaded.clear()


def _count(table: dict[int, _Mapped], engine_key: int, digest: bytes) -> None:
    """One more copy of ``engine_key`` (mapped to ``digest``) in ``table``."""
    entry = table.get(engine_key)
    if entry is None:
        table[engine_key] = _Mapped(digest, 1)
    else:
        entry.copies += 1
