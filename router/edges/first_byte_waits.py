"""The proxy's attempts waiting for a replica's first byte, and the moving of them elsewhere.
No I/O (asyncio timeouts only).

The proxy (``router.edges.proxy``) registers each attempt here while it waits for the first byte;
the stall watch (``router.service.background``) asks which replicas are waited on and aborts the
waits on a replica found stalled, hung or gone, or one attempt past its first-byte deadline. An
aborted wait's timeout expires now, and the attempt, reading the cause here, is retried on the
next replica rather than answered 504.
"""

from __future__ import annotations

import asyncio
from typing import Final

# the replica left the fleet (its heartbeat expired) while requests waited there for a first
# byte: nothing judges its deadlines any more, so the health watcher moves them
GONE: Final = "replica_gone"


class FirstByteWaits:
    """The attempts waiting for a first byte, by token (``ReplicaHealth.attempt_started``: one
    per attempt), each with its replica and its first-byte timeout."""

    __slots__ = ("_aborted", "_waiting")

    def __init__(self) -> None:
        # {token: (replica_id, first-byte timeout)} of the attempts waiting for a first byte
        self._waiting: dict[int, tuple[str, asyncio.Timeout]] = {}
        self._aborted: dict[int, str] = {}  # {token of an aborted wait: cause}

    def start(self, token: int, replica_id: str, timeout: asyncio.Timeout) -> None:
        """The attempt ``token`` waits for ``replica_id``'s first byte under ``timeout``."""
        self._waiting[token] = (replica_id, timeout)

    def end(self, token: int) -> None:
        """The attempt ``token`` waits no more (its first byte came, or it failed)."""
        self._waiting.pop(token, None)
        self._aborted.pop(token, None)

    def aborted(self, token: int) -> str | None:
        """Why the attempt ``token``'s wait was aborted (its timeout expired early), or None:
        it was not (it timed out)."""
        return self._aborted.get(token)

    def waiting_replicas(self) -> set[str]:
        """The replicas that requests are waiting on for a first byte now."""
        return {rid for rid, _ in self._waiting.values()}

    def abort_waiting(self, replica_id: str, cause: str = "stalled") -> int:
        """Make the attempts waiting for a first byte from ``replica_id`` give up now and go to
        their next replica (a stalled or hung replica). Returns how many there were."""
        tokens = [t for t, (rid, _) in self._waiting.items() if rid == replica_id]
        for token in tokens:
            self.abort_attempt(token, cause)
        return len(tokens)

    def abort_attempt(self, token: int, cause: str) -> bool:
        """Make the attempt ``token`` (``ReplicaHealth.attempt_started``) give up waiting for its
        first byte now and go to its next replica. False if it no longer waits."""
        waiting = self._waiting.get(token)
        if waiting is None:
            return False
        self._aborted[token] = cause
        waiting[1].reschedule(asyncio.get_running_loop().time())
        return True
