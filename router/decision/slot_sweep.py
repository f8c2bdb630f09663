"""The block index's incremental sweep of retired replica slots. Pure: no I/O.

``BlockIndex`` forgets a replica's keys in O(1) by retiring its bit slot; ``SlotSweep`` then
removes the retired bits from the index's tables a bounded number of keys per call, so the
event loop is never blocked for long, and hands the slots back for reuse when it is through.
"""

from __future__ import annotations

from collections.abc import Callable


class SlotSweep:
    """Retired slots and the running sweep pass over the index's tables.

    Invariants: a slot is in ``retired`` (waiting for the next pass) or in the running pass's
    mask until that pass has removed it from every key it snapshotted; only then does ``step``
    return it (free for reuse) in the mask of freed slots. Keys added after a pass's snapshot never carry a retired slot.
    """

    __slots__ = ("_cpu_keys", "_keys", "_mask", "_pos", "_retired")

    def __init__(self) -> None:
        self._retired = 0  # bitmask of retired slots not yet being swept
        self._mask = 0  # bitmask of retired slots the running sweep removes
        self._keys: list[int] = []  # snapshot of the GPU table's keys for the running sweep
        self._cpu_keys: list[int] = []  # the CPU tier table's, swept after it
        self._pos = 0

    def retire(self, slot: int) -> None:
        self._retired |= 1 << slot

    @property
    def busy(self) -> int:
        """Bitmask of the slots retired or being swept: none of them may be reused yet."""
        return self._retired | self._mask

    @property
    def pending(self) -> bool:
        """True while retired slots still have to be removed from the tables."""
        return bool(self._retired or self._mask)

    def step(self, max_keys: int, gpu: dict[int, int], cpu: dict[int, int],
             intern: Callable[[int], int]) -> int:
        """Remove retired slots from at most ``max_keys`` keys of ``gpu`` and ``cpu`` (the
        index's ``{block_key: slot bitmask}`` tables; ``intern`` shares equal masks); returns
        the bitmask of the slots freed now (0: none).

        A sweep pass first snapshots the tables' keys (that call does nothing else; keys added
        later can never carry a retired slot), then walks them over further calls; when it is
        through, its slots become free for reuse and are returned.
        """
        if not self._mask:
            if not self._retired:
                return 0
            self._mask, self._retired = self._retired, 0
            self._keys = list(gpu)  # C speed (docs/benchmarks.md)
            self._cpu_keys = list(cpu)
            self._pos = 0
            return 0
        dead, keep = self._mask, ~self._mask
        # one position over both snapshots: the GPU table's keys, then the CPU table's
        num_gpu = len(self._keys)
        total = num_gpu + len(self._cpu_keys)
        end = min(self._pos + max_keys, total)
        for table, keys in ((gpu, self._keys[self._pos:end]),
                            (cpu, self._cpu_keys[max(self._pos - num_gpu, 0):
                                                 max(end - num_gpu, 0)])):
            for key in keys:
                mask = table.get(key, 0)
                if mask & dead:
                    mask &= keep
                    if mask:
                        table[key] = intern(mask)
                    else:
                        del table[key]
        self._pos = end
        if end < total:
            return 0
        self._mask = 0
        self._keys = []
        self._cpu_keys = []
        return dead
