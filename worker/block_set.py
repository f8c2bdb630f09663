"""Reference-counted set of the block keys resident on one replica. Pure: no I/O.

vLLM 0.33 ``BlockHashToBlockMap`` can hold several physical blocks with the same
hash, and ``block_pool`` emits one ``BlockStored`` per commit and one
``BlockRemoved`` per evicted physical block, without de-duplication. A consumer
must therefore count: a key is resident while at least one copy is. This class
keeps those counts and reports only the transitions the outside world sees
(0 -> 1 on store, 1 -> 0 on remove), which is all Redis needs.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from router.shared.contract import BlockKey


class BlockSet:
    """Block keys (64-bit ints) with reference counts.

    Invariant: every stored count is >= 1; a key with no copies is absent.
    Removing a key that is not resident is ignored (the removal of a block the
    worker never saw, e.g. stored before it started) and counted in
    ``num_unknown_removals``.
    """

    __slots__ = ("_counts", "num_unknown_removals")

    def __init__(self, keys: Iterable[BlockKey] = ()) -> None:
        self._counts: dict[BlockKey, int] = {}  # {block_key: number of resident copies}
        self.num_unknown_removals = 0
        self.load(keys)

    def load(self, keys: Iterable[BlockKey]) -> None:
        """Replace the contents with ``keys``, one copy each (a snapshot read back from Redis)."""
        self._counts = dict.fromkeys(keys, 1)

    def store(self, keys: Iterable[BlockKey]) -> list[BlockKey]:
        """Add one copy of each key; return the keys that became resident (0 -> 1), in order."""
        counts = self._counts
        added: list[BlockKey] = []
        for key in keys:
            count = counts.get(key)
            if count is None:
                counts[key] = 1
                added.append(key)
            else:
                counts[key] = count + 1
        return added

    def remove(self, keys: Iterable[BlockKey]) -> list[BlockKey]:
        """Drop one copy of each key; return the keys that stopped being resident (1 -> 0), in order."""
        counts = self._counts
        gone: list[BlockKey] = []
        for key in keys:
            count = counts.get(key)
            if count is None:
                self.num_unknown_removals += 1
            elif count == 1:
                del counts[key]
                gone.append(key)
            else:
                counts[key] = count - 1
        return gone

    def discard(self, keys: Iterable[BlockKey]) -> list[BlockKey]:
        """``remove`` for keys that may never have entered the set (the coarse index's
        non-anchors): an absent key is skipped, not counted as an unknown removal."""
        counts = self._counts
        gone: list[BlockKey] = []
        for key in keys:
            count = counts.get(key)
            if count == 1:
                del counts[key]
                gone.append(key)
            elif count is not None:
                counts[key] = count - 1
        return gone

    def clear(self) -> list[BlockKey]:
        """Drop everything (vLLM ``AllBlocksCleared``); return the keys that were resident."""
        gone = list(self._counts)
        self._counts = {}
        return gone

    def count(self, key: BlockKey) -> int:
        """Number of resident copies of ``key`` (0 when absent)."""
        return self._counts.get(key, 0)

    def keys(self) -> list[BlockKey]:
        """Snapshot of the resident keys."""
        return list(self._counts)

    def __contains__(self, key: object) -> bool:
        return key in self._counts

    def __len__(self) -> int:
        return len(self._counts)

    def __iter__(self) -> Iterator[BlockKey]:
        return iter(self._counts)
