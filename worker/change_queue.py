"""The changes one replica's writer has yet to write (pure but for two asyncio events): what the
subscriber queues (``enqueue``, ``advance``), what the flush loop takes (``take``) and, when an
out-of-memory Redis refused them, puts back (``put_back``).
"""

from __future__ import annotations

import asyncio

from router.shared.contract import OP_CLEARED
from worker.replica_view import Change


class ChangeQueue:
    """Queued changes in order (``pending``; a ``cleared`` change supersedes what came before it)
    and the position of the last batch applied but not committed (``position``)."""

    def __init__(self) -> None:
        self.pending: list[Change] = []
        self.position: tuple[int, int] | None = None  # (epoch, seq) applied but not committed
        self.wake = asyncio.Event()  # something to write
        self.idle = asyncio.Event()  # everything queued so far is written (or dropped)
        self.idle.set()

    def enqueue(self, change: Change) -> None:
        """Queue a change; a ``cleared`` change supersedes everything queued before it."""
        if change.op == OP_CLEARED:
            self.pending = [change]
        else:
            self.pending.append(change)
        self.busy()

    def advance(self, epoch: int, seq: int) -> None:
        """Record that batch ``seq`` was applied (even with no visible change) so Redis gets its seq.

        A restarted worker replays from the committed seq + 1; a stale seq would
        re-apply batches and corrupt reference counts.
        """
        self.position = (epoch, seq)
        self.busy()

    def busy(self) -> None:
        """Something is to be written: not idle, and the flush loop wakes."""
        self.idle.clear()
        self.wake.set()

    def holding(self) -> bool:
        """Changes or a position wait to be written."""
        return bool(self.pending) or self.position is not None

    def take(self) -> tuple[list[Change], tuple[int, int] | None]:
        """Everything queued (changes, position), leaving the queue empty."""
        changes, self.pending = self.pending, []
        position, self.position = self.position, None
        return changes, position

    def put_back(self, changes: list[Change], position: tuple[int, int] | None) -> None:
        """What ``take`` returned, not written: queued again ahead of what came since (unless a
        ``cleared`` change came since, which supersedes it)."""
        if not any(change.op == OP_CLEARED for change in self.pending):
            self.pending = changes + self.pending
        if self.position is None:
            self.position = position
