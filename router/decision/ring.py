"""Consistent-hash ring of replicas with virtual nodes. Pure: no I/O.

Each replica owns ``vnodes`` points on a 64-bit ring at ``xxh64("{replica_id}#{i}")``.
A key's preference order is the sequence of distinct replicas met walking
clockwise from the key's position. Every router instance with the same replica
set computes the same order without coordination; adding or removing one of R
replicas moves about 1/R of the keys (only keys whose first point belonged to
the changed replica).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable

import xxhash

_MASK64 = (1 << 64) - 1


def mix64(key: int) -> int:
    """splitmix64 finaliser: spreads any 64-bit integer uniformly over the ring."""
    z = (key + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def text_key(text: str) -> int:
    """64-bit ring key of a text (used when no tokenizer is available)."""
    return int(xxhash.xxh64_intdigest(text.encode("utf-8", "surrogatepass")))


class HashRing:
    """Immutable ring over ``replica_ids`` (distinct strings) with ``vnodes`` points each.

    Raises ``ValueError`` for ``vnodes < 1``. An empty ring returns empty orders.
    """

    __slots__ = ("_order_cache", "_owners", "_points", "replica_ids", "vnodes")

    def __init__(self, replica_ids: Iterable[str], vnodes: int = 128) -> None:
        if vnodes < 1:
            raise ValueError(f"vnodes must be >= 1, got {vnodes}")
        self.replica_ids: tuple[str, ...] = tuple(sorted(set(replica_ids)))
        self.vnodes = vnodes
        points = sorted(
            (xxhash.xxh64_intdigest(f"{rid}#{i}".encode()), rid)
            for rid in self.replica_ids
            for i in range(vnodes)
        )
        self._points: list[int] = [p for p, _ in points]
        self._owners: list[str] = [rid for _, rid in points]
        self._order_cache: dict[int, tuple[str, ...]] = {}  # {point index: distinct owners clockwise}

    def __len__(self) -> int:
        return len(self.replica_ids)

    def _order_from(self, index: int) -> tuple[str, ...]:
        cached = self._order_cache.get(index)
        if cached is not None:
            return cached
        seen: dict[str, None] = {}
        owners, n, want = self._owners, len(self._owners), len(self.replica_ids)
        for step in range(n):
            seen.setdefault(owners[(index + step) % n], None)
            if len(seen) == want:
                break
        order = tuple(seen)
        self._order_cache[index] = order
        return order

    def order(self, key: int) -> tuple[str, ...]:
        """All replicas in preference order for ``key`` (a 64-bit int, mixed with ``mix64``)."""
        if not self._points:
            return ()
        index = bisect.bisect_left(self._points, mix64(key)) % len(self._points)
        return self._order_from(index)

    def home(self, key: int) -> str | None:
        """The first replica for ``key``, or ``None`` on an empty ring."""
        order = self.order(key)
        return order[0] if order else None
