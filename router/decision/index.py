"""In-memory block index: which replicas hold which block keys. Pure: no I/O.

``BlockIndex`` maps each resident 64-bit block key to a bitmask of the replicas
that hold it (``{block_key: replica bitmask}``; bit ``i`` is the replica in slot
``i``). Equal masks are interned so a key held by one replica costs one dict
entry plus its key int (about 100 bytes, see ``loadtest/bench/index.py``).
Forgetting a replica's keys is O(1) (a fresh bit slot; the old one is swept
away incrementally, see ``BlockIndex``). A chain lookup walks the prompt's
block keys from the front, ANDing masks with the candidates' slots, and
records the depth at which each replica drops out: the number of leading keys of
the chain the replica holds, which is exactly vLLM's prefix-hit rule (longest
run of consecutive matching block hashes from block 0,
``KVCacheManager.get_computed_blocks``).

Tiers (``router.shared.contract.TIERS``): the table above is the GPU tier's; a second table of the same
shape holds the CPU tier's keys (vLLM native offloading: host memory), with the same slot per
replica, so clearing or dropping a replica forgets both at once. ``tier_depths`` continues a
replica's GPU hit with the blocks its CPU tier holds, as vLLM looks them up (the offloading
connector is asked for the blocks past the GPU hit).

``SpeculativePlacements`` holds the router's own recent placements (keys it sent
to a replica in the last ``ttl_s`` seconds) so a burst of one new prefix sticks
to one replica before the engine's KV events arrive. Time is an argument, so
both classes are deterministic.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence

from router.decision.slot_sweep import SlotSweep
from router.shared.contract import TIER_CPU, TIER_GPU, BlockKey, anchor_positions

_MAX_INTERNED_MASKS = 1 << 16


def _bits(mask: int) -> Iterable[int]:
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


class BlockIndex:
    """Block keys resident per replica, with per-replica epochs.

    Each replica owns one bit *slot* at a time. Forgetting all of a replica's
    keys (``clear``: AllBlocksCleared, an epoch reset; ``drop``: heartbeat
    expiry) is O(1): the replica moves to a fresh slot and the old slot is
    retired. Lookups only look at the candidates' current slots, so retired
    bits are invisible at once; ``sweep_step`` removes them from the table
    incrementally (``router.decision.slot_sweep``: a bounded number of keys per
    call, so the event loop is never blocked for long) and then frees the slots
    for reuse.

    With ``stride`` N > 1 the table holds only the keys at the anchor positions of
    their chains (``router.shared.contract.is_anchor``), as workers publish them.

    Invariants: no key maps to mask 0; ``num_blocks(r)`` equals the number of
    keys whose mask has ``r``'s current slot bit; a retired slot is reused only
    after a sweep removed it from every key; ``len()`` may count keys held only
    by retired slots until they are swept.
    """

    __slots__ = ("_bit_to_id", "_cpu_key_to_mask", "_free_bits", "_id_to_bit", "_interned",
                 "_key_to_mask", "_num_blocks", "_num_cpu_blocks", "_sweep", "epochs", "stride")

    def __init__(self, stride: int = 1) -> None:
        if stride < 1:
            raise ValueError(f"stride must be >= 1, got {stride}")
        self.stride = stride  # blocks between the anchors the table holds (router.shared.contract)
        self._key_to_mask: dict[int, int] = {}  # {block_key: slot bitmask}, GPU tier
        self._cpu_key_to_mask: dict[int, int] = {}  # {block_key: slot bitmask}, CPU tier
        self._id_to_bit: dict[str, int] = {}  # {replica_id: current slot index}
        self._bit_to_id: dict[int, str] = {}  # {current slot index: replica_id}
        self._free_bits: list[int] = []  # swept slot indexes, reused lowest first
        self._sweep = SlotSweep()  # retired slots, and the sweep that frees them
        self._num_blocks: dict[str, int] = {}  # {replica_id: resident keys}, GPU tier
        self._num_cpu_blocks: dict[str, int] = {}  # {replica_id: resident keys}, CPU tier
        self._interned: dict[int, int] = {}  # {mask: the shared int object for it}
        self.epochs: dict[str, int] = {}  # {replica_id: epoch the index reflects}

    # -- replicas -----------------------------------------------------------------

    def _new_slot(self) -> int:
        if self._free_bits:
            self._free_bits.sort()
            return self._free_bits.pop(0)
        # no free slot: every slot below the highest is current, retired or being swept
        return max((*self._bit_to_id, self._sweep.busy.bit_length() - 1),
                   default=-1) + 1

    def slot_of(self, replica_id: str) -> int | None:
        """The replica's current slot index, or None if it has none (never seen, or left)."""
        return self._id_to_bit.get(replica_id)

    def bit(self, replica_id: str) -> int:
        """The replica's current slot index, assigning a free one on first use."""
        bit = self._id_to_bit.get(replica_id)
        if bit is None:
            bit = self._new_slot()
            self._id_to_bit[replica_id] = bit
            self._bit_to_id[bit] = replica_id
            self._num_blocks[replica_id] = 0
            self._num_cpu_blocks[replica_id] = 0
        return bit

    def mask_of(self, replica_ids: Iterable[str]) -> int:
        """Bitmask of the given replicas' current slots (assigning slots as needed)."""
        mask = 0
        for rid in replica_ids:
            mask |= 1 << self.bit(rid)
        return mask

    def replica_of_bit(self, bit: int) -> str:
        return self._bit_to_id[bit]

    def replicas(self) -> list[str]:
        return sorted(self._id_to_bit)

    def num_blocks(self, replica_id: str, tier: str = TIER_GPU) -> int:
        """Resident keys recorded for ``replica_id`` in ``tier`` (0 if unknown)."""
        counts = self._num_blocks if tier == TIER_GPU else self._num_cpu_blocks
        return counts.get(replica_id, 0)

    def __len__(self) -> int:
        """Distinct GPU-tier keys in the table (including ones held only by retired slots,
        until swept)."""
        return len(self._key_to_mask)

    @property
    def num_cpu_keys(self) -> int:
        """Distinct CPU-tier keys (as ``len()`` for the GPU tier)."""
        return len(self._cpu_key_to_mask)

    # -- updates --------------------------------------------------------------------

    def _intern(self, mask: int) -> int:
        shared = self._interned.get(mask)
        if shared is None:
            if len(self._interned) >= _MAX_INTERNED_MASKS:
                self._interned.clear()
            self._interned[mask] = shared = mask
        return shared

    def _table(self, tier: str) -> tuple[dict[int, int], dict[str, int]]:
        if tier == TIER_GPU:
            return self._key_to_mask, self._num_blocks
        return self._cpu_key_to_mask, self._num_cpu_blocks

    def add(self, replica_id: str, keys: Iterable[BlockKey], tier: str = TIER_GPU) -> None:
        """Record ``keys`` as resident on the replica's ``tier`` (idempotent: set semantics)."""
        bit = 1 << self.bit(replica_id)
        (table, counts), intern = self._table(tier), self._intern
        added = 0
        for key in keys:
            mask = table.get(key, 0)
            if not mask & bit:
                table[key] = intern(mask | bit)
                added += 1
        counts[replica_id] += added

    def remove(self, replica_id: str, keys: Iterable[BlockKey], tier: str = TIER_GPU) -> None:
        """Forget ``keys`` on the replica's ``tier``; unknown keys are ignored."""
        index = self._id_to_bit.get(replica_id)
        if index is None:
            return
        bit = 1 << index
        (table, counts), intern = self._table(tier), self._intern
        removed = 0
        for key in keys:
            mask = table.get(key, 0)
            if mask & bit:
                removed += 1
                mask ^= bit
                if mask:
                    table[key] = intern(mask)
                else:
                    del table[key]
        counts[replica_id] -= removed

    def _retire(self, replica_id: str) -> None:
        slot = self._id_to_bit.pop(replica_id)
        del self._bit_to_id[slot]
        self._sweep.retire(slot)

    def clear(self, replica_id: str) -> None:
        """Forget every key of the replica, every tier (vLLM AllBlocksCleared, epoch reset). O(1).

        The replica gets a fresh slot; the old one is swept by ``sweep_step``.
        """
        if not self._num_blocks.get(replica_id) and not self._num_cpu_blocks.get(replica_id):
            return
        self._retire(replica_id)
        slot = self._new_slot()
        self._id_to_bit[replica_id] = slot
        self._bit_to_id[slot] = replica_id
        self._num_blocks[replica_id] = 0
        self._num_cpu_blocks[replica_id] = 0

    def replace(self, replica_id: str, keys: Iterable[BlockKey], epoch: int | None = None,
                cpu_keys: Iterable[BlockKey] = ()) -> None:
        """Load a snapshot: clear the replica, add ``keys`` (GPU tier) and ``cpu_keys`` (CPU
        tier), set its epoch if given."""
        self.clear(replica_id)
        self.add(replica_id, keys)
        self.add(replica_id, cpu_keys, TIER_CPU)
        if epoch is not None:
            self.epochs[replica_id] = epoch

    def drop(self, replica_id: str) -> None:
        """Remove the replica entirely (heartbeat expired). O(1); its slot is swept later."""
        if replica_id not in self._id_to_bit:
            return
        self._retire(replica_id)
        del self._num_blocks[replica_id]
        del self._num_cpu_blocks[replica_id]
        self.epochs.pop(replica_id, None)

    @property
    def sweep_pending(self) -> bool:
        """True while retired slots still have to be removed from the table."""
        return self._sweep.pending

    def sweep_step(self, max_keys: int = 20_000) -> list[int]:
        """Remove retired slots from at most ``max_keys`` keys; returns the slots freed now.

        A pass walks a snapshot of the table's keys over several calls (``SlotSweep.step``);
        when it is through, its slots become free for reuse and are returned (the caller drops
        them from ``SpeculativePlacements`` too).
        """
        freed = list(_bits(self._sweep.step(max_keys, self._key_to_mask,
                                             self._cpu_key_to_mask, self._intern)))
        self._free_bits.extend(freed)
        return freed

    def sweep_all(self) -> list[int]:
        """Run sweeps until nothing is retired (tests, benchmarks). Returns the freed slots."""
        freed: list[int] = []
        while self.sweep_pending:
            freed.extend(self.sweep_step(1 << 62))
        return freed

    def holds(self, key: int) -> bool:
        """True if some slot (current or retired, not yet swept) holds ``key`` in any tier."""
        return key in self._key_to_mask or key in self._cpu_key_to_mask

    # -- lookups --------------------------------------------------------------------

    def hit_depths(
        self,
        chain: Sequence[int],
        candidates: int,
        speculative: SpeculativePlacements | None = None,
        now: float = 0.0,
    ) -> tuple[dict[str, int], dict[str, int]]:
        """Leading keys of ``chain`` held per candidate replica.

        ``candidates`` is a bitmask (``mask_of``). Returns ``(confirmed, combined)``
        dicts ``{replica_id: depth in blocks}`` for every candidate: ``confirmed``
        counts engine-reported keys only, ``combined`` also counts the router's
        unexpired speculative placements at time ``now``. With ``stride`` > 1 only
        the anchor positions of ``chain`` are looked up (``router.shared.contract.is_anchor``)
        and a depth is the position after the deepest leading anchor held.
        """
        confirmed: dict[int, int] = {}
        combined: dict[int, int] = {}
        conf_alive = comb_alive = candidates
        get = self._key_to_mask.get
        spec_get = speculative._entries.get if speculative is not None and speculative._entries else None
        depth = 0  # blocks covered by the anchors walked so far
        for pos in anchor_positions(len(chain), self.stride):
            key = chain[pos]
            mask = get(key, 0)
            if conf_alive:
                kept = mask & conf_alive
                if kept != conf_alive:
                    for b in _bits(conf_alive ^ kept):
                        confirmed[b] = depth
                    conf_alive = kept
            if spec_get is not None:
                entry = spec_get(key)
                if entry is not None and entry[1] > now:
                    mask |= entry[0]
            kept = mask & comb_alive
            if kept != comb_alive:
                for b in _bits(comb_alive ^ kept):
                    combined[b] = depth
                comb_alive = kept
                if not comb_alive:
                    break
            depth = pos + 1
        for b in _bits(conf_alive):
            confirmed[b] = depth
        for b in _bits(comb_alive):
            combined[b] = depth
        names = self._bit_to_id
        return ({names[b]: d for b, d in confirmed.items()},
                {names[b]: d for b, d in combined.items()})

    def tier_depths(self, chain: Sequence[int], gpu_depths: dict[str, int]) -> dict[str, int]:
        """Each replica's hit depth in blocks when its CPU tier continues its GPU hit.

        ``gpu_depths``: ``{replica_id: GPU hit depth in blocks}`` (``hit_depths``); a replica
        joins the walk at its GPU depth and goes on while its CPU tier holds the chain's next
        anchor (vLLM: the offloading connector looks up the blocks past the GPU hit,
        ``OffloadingConnectorScheduler.get_num_new_matched_tokens``, and only a consecutive run
        is loaded). Returns ``{replica_id: depth}`` >= the GPU depth; the CPU-tier hit is the
        difference. Replicas unknown to the index keep their GPU depth.
        """
        out = dict(gpu_depths)
        cpu = self._cpu_key_to_mask
        if not cpu or not chain:
            return out
        ids = self._id_to_bit
        joins = sorted((d, 1 << ids[rid]) for rid, d in gpu_depths.items() if rid in ids)
        get = cpu.get
        alive = 0
        nxt = 0
        depth = 0  # blocks covered by the anchors walked so far
        reached: dict[int, int] = {}  # {slot: depth}
        for pos in anchor_positions(len(chain), self.stride):
            while nxt < len(joins) and joins[nxt][0] <= pos:
                alive |= joins[nxt][1]
                nxt += 1
            if alive:
                kept = get(chain[pos], 0) & alive
                if kept != alive:
                    for b in _bits(alive ^ kept):
                        reached[b] = depth
                    alive = kept
            elif nxt == len(joins):
                break
            depth = pos + 1
        for b in _bits(alive):
            reached[b] = depth
        names = self._bit_to_id
        for b, d in reached.items():
            rid = names[b]
            out[rid] = max(out[rid], d)
        return out


class SpeculativePlacements:
    """Keys the router recently sent to replicas: ``{block_key: (replica bitmask, expires_at)}``.

    A key placed on several replicas keeps the union of their bits and the latest
    expiry (a slight over-extension for the earlier replica, accepted for
    compactness). Expired entries are pruned by ``prune(now)`` in insertion order.
    """

    __slots__ = ("_entries", "_expiry_queue", "ttl_s")

    def __init__(self, ttl_s: float) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        self.ttl_s = ttl_s
        self._entries: dict[int, tuple[int, float]] = {}  # {block_key: (replica bitmask, expires_at)}
        self._expiry_queue: deque[tuple[float, Sequence[int]]] = deque()  # (expires_at, keys)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: int) -> bool:
        return key in self._entries

    def place(self, bit: int, keys: Sequence[BlockKey], now: float) -> None:
        """Record that ``keys`` were routed to the replica with bit index ``bit`` at ``now``."""
        if not keys:
            return
        expires = now + self.ttl_s
        flag = 1 << bit
        entries = self._entries
        for key in keys:
            entry = entries.get(key)
            if entry is None or entry[1] <= now:
                entries[key] = (flag, expires)
            else:
                entries[key] = (entry[0] | flag, expires)
        self._expiry_queue.append((expires, keys))

    def withdraw(self, bit: int, keys: Sequence[BlockKey]) -> None:
        """Undo ``place(bit, keys, ...)``: the replica refused the request, so it holds nothing
        new (another placement of the same keys there since is withdrawn too)."""
        flag = 1 << bit
        entries = self._entries
        for key in keys:
            entry = entries.get(key)
            if entry is not None and entry[0] & flag:
                if entry[0] ^ flag:
                    entries[key] = (entry[0] ^ flag, entry[1])
                else:
                    del entries[key]

    def forget_bit(self, bit: int) -> None:
        """Drop a replica's bit from every entry (replica left the fleet)."""
        flag = 1 << bit
        for key, (mask, expires) in list(self._entries.items()):
            if mask & flag:
                if mask ^ flag:
                    self._entries[key] = (mask ^ flag, expires)
                else:
                    del self._entries[key]

    def prune(self, now: float) -> int:
        """Delete entries expired at ``now``; returns how many were deleted."""
        queue, entries = self._expiry_queue, self._entries
        deleted = 0
        while queue and queue[0][0] <= now:
            _, keys = queue.popleft()
            for key in keys:
                entry = entries.get(key)
                if entry is not None and entry[1] <= now:
                    del entries[key]
                    deleted += 1
        return deleted
