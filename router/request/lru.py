"""One thread-safe LRU for the router's prompt caches, bounded by entries and by bytes. Pure.

The chain cache (``router.request.chain_cache``), the chunk-token cache and the rendered-chat cache
(``router.request.prompts``) keep pieces of client prompts; a count bound alone lets a few multi-MB
prompts hold hundreds of MB (issue 15: 220 -> 487 MB of router RSS after 24 prompts of 2 MB,
never given back). Every entry is charged its estimated size in bytes, at least
``max_bytes / max_entries``, so one budget bounds both the memory and the number of entries.
The LRU itself is ``cachetools.LRUCache``; this class adds the lock, the size floor and the
hit/miss counters the metrics read.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

import cachetools

V = TypeVar("V")


class SizedLRU(Generic[V]):
    """LRU of ``{key: value}`` holding at most ``max_entries`` entries and ``max_bytes`` bytes.

    ``sizeof(key, value)`` estimates an entry's memory in bytes (key included). An entry
    larger than ``max_bytes`` is not kept. ``max_entries`` or ``max_bytes`` of 0 disables
    the cache (``get`` always misses, ``put`` keeps nothing). Thread-safe. Raises
    ``ValueError`` for negative bounds.
    """

    def __init__(self, max_entries: int, max_bytes: int,
                 sizeof: Callable[[Hashable, V], int]) -> None:
        if max_entries < 0 or max_bytes < 0:
            raise ValueError(f"bounds must be >= 0, got {max_entries} entries, {max_bytes} bytes")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._floor = max_bytes // max_entries if max_entries else 0
        self._sizeof = sizeof
        # values are (value, charged bytes): cachetools sizes an entry by its value alone
        self._data: cachetools.LRUCache[Hashable, tuple[V, int]] = cachetools.LRUCache(
            maxsize=max(max_bytes, 1), getsizeof=_charged)
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, key: Hashable) -> V | None:
        """The value for ``key`` (now the most recently used), or ``None``."""
        with self._lock:
            item = self._data.get(key)
            if item is None:
                self.misses += 1
                return None
            self.hits += 1
            return item[0]

    def put(self, key: Hashable, value: V) -> None:
        """Keep ``value`` under ``key``, evicting the least recently used entries as needed."""
        if not self._floor:
            return
        charged = max(self._sizeof(key, value), self._floor)
        if charged > self.max_bytes:
            return
        with self._lock:
            self._data[key] = (value, charged)

    @property
    def num_bytes(self) -> int:
        """Bytes charged for the entries held (estimates, see ``sizeof``)."""
        return int(self._data.currsize) if self._floor else 0

    def __len__(self) -> int:
        return len(self._data)


def _charged(item: tuple[object, int]) -> int:
    return item[1]
