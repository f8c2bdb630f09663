"""Writes one replica's block-set changes and heartbeat to Redis. Does I/O (redis.asyncio).

Per ``router/contract.py`` (version 4): the sets ``{prefix}:{r}:blocks`` (GPU tier) and
``{prefix}:{r}:blocks:CPU`` (CPU tier) of 8-byte keys, changed by ONE single-slot Lua script
call per flush (``_FLUSH`` in ``worker/replica_store.py``, on the replica's three hash-tagged keys, so it runs on a Redis
Cluster too), then one ``{prefix}:events`` stream entry (``replica``, ``epoch``,
``entry_seq``, ``cleared``, packed ``stored`` and ``removed`` keys, and ``cpu_stored`` /
``cpu_removed`` when the CPU tier changed), sent after the script (in the same pipeline on one server or Sentinel, where
one connection runs them in order; once the script returned on a cluster, where the stream is
in another slot). The changes queued since the last flush are merged into their net effect
(the last change of a key wins; a ``cleared`` supersedes what came before it), sent as two
packed byte strings, and split into set members inside Redis, so the worker packs two
arguments per flush instead of one per key.
The script records the committed ``epoch``/``seq``/``entry_seq`` in the heartbeat hash
(only if it exists, so a dead replica is never resurrected), so a restarted worker reads
back a set and sequence numbers that agree; routers check ``entry_seq`` to apply each
entry exactly after the one before it (a missing entry, such as one whose ``XADD`` failed
after its script, makes them reload the replica's set).

Redis outage or lost state: the failed changes are dropped (the in-memory
view is the buffer) and the writer marks itself disconnected, whether a change
transaction or a heartbeat failed. It retries with exponential backoff (redis-py's ``Retry``) and, once
Redis answers, asks ``on_recovered`` for a full rewrite under a new epoch. Redis
can also come back EMPTY without this worker seeing an error (a restart between
two writes, a failover to an empty replica, FLUSHALL, or the heartbeat hash
expiring while the engine was away): after this worker's first heartbeat, a
heartbeat or change transaction that finds the heartbeat hash gone is treated
the same way. A rewrite found by a heartbeat is written in the SAME transaction
as the heartbeat that re-creates the hash, so a router sees the replica
(re)appear, or its epoch change, only with its complete set in place
(``router/fleet.py`` ``apply_heartbeat`` reloads the set then).

Redis out of memory (``maxmemory`` reached under ``noeviction``) is no lost connection: Redis
refuses the commands that may grow memory (``XADD``, ``SADD``, ``HSET``, and every command
queued in a ``MULTI``) and answers the rest. A flush it refuses keeps its changes queued (the
flush script fails before its first write, so nothing was applied) and a stream entry whose
``XADD`` it refused after the script went through is kept and sent first once Redis accepts
writes again, so routers get every entry in order and no epoch changes (no rewrite loop). The
writer backs off (0.5 s doubling to ``OOM_BACKOFF_CAP_S``), logs one line per
``OOM_LOG_INTERVAL_S`` and says so in the heartbeat (``F_REDIS_OOM``), which it keeps writing.
The state ends only when the held changes flush (or, with nothing held, when a heartbeat's HSET
goes through): a heartbeat's small write can pass while Redis hovers at its limit and still
refuses the flush, and ending the state on it made the worker alternate "out of memory" and
"accepts writes again" every second; the recovery line is written only for an episode whose
start was. The heartbeat:
its script refreshes the TTL first, and Redis lets a script that has already written go on
("we can't stop in the middle", ``scriptVerifyOOM``), so the small, fixed-size hash is
refreshed while the block sets wait. A set whose script found removals to make first goes
through the same way (removals free memory; the stores with them are the engine's churn).

Stale state: the block sets get a TTL of ``state_ttl_s`` (refreshed by every heartbeat and
flush), so the sets of a replica whose worker is gone for good (scaled down) expire from Redis
that long after its last heartbeat.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Final

import redis.asyncio as aioredis

from router.shared import contract
from router.shared.redis_client import reconnect_retry
from worker.change_queue import ChangeQueue
from worker.flush_batch import flush_batch, heartbeat_args
from worker.oom_state import OomState, is_oom
from worker.replica_store import REDIS_ERRORS, ReplicaStore, StoredState
from worker.replica_view import NO_SEQ, Change

logger = logging.getLogger(__name__)

MAX_HELD_CHANGES: Final = 10_000  # queued changes under OOM before they collapse into a rewrite
DEFAULT_STATE_TTL_S: Final = contract.DEFAULT_STATE_TTL_S

_BACK: Final = "Redis is back"

class RedisOutOfMemory(Exception):
    """Redis refused a write for lack of memory; the writer kept what it could not write."""


_LOST: Final = ("Redis lost the replica's state (its heartbeat hash is gone: Redis restarted, "
                "failed over, was flushed, or the heartbeat expired)")


@dataclass(slots=True)
class WriterStats:
    """Cumulative counters read by the metrics collector."""

    num_transactions: int = 0
    num_entries: int = 0
    num_keys: int = 0
    num_errors: int = 0
    num_rewrites: int = 0
    num_oom_refusals: int = 0  # writes Redis refused for lack of memory


class RedisWriter:
    """The single writer of replica ``replica_id``'s Redis state.

    ``enqueue`` is synchronous and cheap; ``run`` flushes in the background.
    ``committed_epoch``/``committed_seq`` describe what Redis holds.
    """

    def __init__(self, client: aioredis.Redis, prefix: str, replica_id: str, *,
                 on_recovered: Callable[[], Change],  # a ``cleared`` change: every tier's set
                 stream_maxlen: int = contract.EVENTS_STREAM_MAXLEN,
                 state_ttl_s: float = DEFAULT_STATE_TTL_S) -> None:
        self.client = client
        self.replica_id = replica_id
        self.store = ReplicaStore(client, prefix, replica_id, stream_maxlen=stream_maxlen)
        self.blocks_key, self.replica_key, self.cpu_blocks_key = self.store.keys
        self.state_ttl_ms = int(state_ttl_s * 1000)
        self.on_recovered = on_recovered
        self.stats = WriterStats()
        self.committed_epoch = 0
        self.committed_seq = NO_SEQ
        self.entry_seq = 0  # E_ENTRY_SEQ of the last stream entry written (read back at start)
        self.connected = True
        # True once this replica's heartbeat hash is known to exist (read back at start or
        # written by this worker): finding it gone afterwards means Redis lost our state.
        self.hash_expected = False
        self._back_reason = _BACK  # logged when the rewrite after a disconnect starts
        self._queue = ChangeQueue()
        self._lock = asyncio.Lock()  # one Redis write of this replica at a time
        self._sent: dict[Any, Any] = {}  # heartbeat fields as last written by the fast path
        self._oom = OomState(replica_id)  # Redis refuses our writes for lack of memory
        # a stream entry whose script went through but whose XADD Redis refused (OOM): sent
        # before anything else, so routers see every entry in order
        self._unsent: dict[Any, Any] | None = None

    @property
    def oom(self) -> bool:
        """Redis refused a write for lack of memory (until a write goes through)."""
        return self._oom.active

    # -- producer side -------------------------------------------------------

    def enqueue(self, change: Change) -> None:
        """Queue a change; a ``cleared`` change supersedes everything queued before it."""
        self._queue.enqueue(change)

    def advance(self, epoch: int, seq: int) -> None:
        """Record that batch ``seq`` was applied (even with no visible change) so Redis gets its
        seq (``ChangeQueue.advance``)."""
        self._queue.advance(epoch, seq)

    @property
    def num_pending(self) -> int:
        return len(self._queue.pending)

    @property
    def _pending(self) -> list[Change]:
        """The queued changes (tests reach in)."""
        return self._queue.pending

    async def wait_idle(self, timeout_s: float | None = None) -> None:
        """Wait until everything queued so far is committed (or dropped by an outage)."""
        await asyncio.wait_for(self._queue.idle.wait(), timeout_s)

    # -- start-up --------------------------------------------------------------

    async def read_state(self) -> StoredState:
        """Read back the replica's heartbeat epoch/seq/key_mode and block set (one transaction in
        the replica's hash slot). Continues ``entry_seq`` from the stored one. Raises ``RedisError``."""
        state = await self.store.read()
        self.hash_expected = state.epoch is not None
        self.entry_seq = max(self.entry_seq, state.entry_seq)
        return dataclasses.replace(state, entry_seq=self.entry_seq)

    async def deregister(self) -> None:
        """Delete the replica's heartbeat hash and block sets (one ``DEL``, one hash slot):
        routers take it out of rotation at their next heartbeat refresh instead of waiting
        for the heartbeat to expire, and nothing of it stays in Redis. Raises ``RedisError``."""
        async with self._lock:
            await self.store.delete()
            self.hash_expected = False

    # -- heartbeat ---------------------------------------------------------------

    async def write_heartbeat(self, fields: Mapping[str, Any], ttl_s: float) -> None:
        """HSET the heartbeat hash (plus the committed epoch/seq) and refresh its TTL.

        Serialised with change transactions so the published seq never runs ahead
        of the set. When the hash is gone although it existed before (Redis lost
        the replica's state), or the writer is disconnected and Redis answers
        again, the full set is rewritten under a new epoch (``on_recovered``) in
        the same transaction that re-creates the hash. A failure marks the writer
        disconnected (the flush loop then retries the rewrite). Raises ``RedisError``, or
        ``RedisOutOfMemory`` when Redis refused even the out-of-memory form of the heartbeat.

        Out of memory: the heartbeat still goes through (written after its PEXPIRE, which
        Redis allows), with ``F_REDIS_OOM`` "1"; every heartbeat first tries the plain form,
        whose success wakes the flush loop, and ends the out-of-memory state only when no
        change is held (the held ones end it when they flush: ``_accepted``).
        """
        async with self._lock:
            ttl_ms = int(ttl_s * 1000)
            with self._write_failures():
                if self.connected:
                    try:
                        found = await self._beat(fields, ttl_ms, oom_form=False)
                    except REDIS_ERRORS as exc:
                        if not is_oom(exc):
                            raise
                        self._refused(exc)
                        found = await self._beat(fields, ttl_ms, oom_form=True)
                    else:
                        if self._oom.probe_passed(self._holding(), self.stats.num_oom_refusals):
                            self._queue.wake.set()  # the flush loop retries at once
                    if int(found) >= 0:
                        return
                    self._lose_state()
                else:
                    await self.client.ping()
                mapping: dict[Any, Any] = dict(fields)
                mapping[contract.F_REDIS_OOM] = "1" if self.oom else ""
                await self._commit(heartbeat=(mapping, ttl_ms))

    async def _beat(self, fields: Mapping[str, Any], ttl_ms: int, *, oom_form: bool) -> Any:
        """One heartbeat script call: the fields that changed since the last one written, the
        committed epoch/seq/entry_seq and ``F_REDIS_OOM``. Returns the script's result (-1:
        the hash is gone). Raises ``RedisError``."""
        mapping: dict[Any, Any] = dict(fields)
        mapping[contract.F_EPOCH] = self.committed_epoch
        mapping[contract.F_SEQ] = self.committed_seq
        mapping[contract.F_ENTRY_SEQ] = self.entry_seq
        # the plain form: OOM is over unless changes are still held (they may be refused yet)
        mapping[contract.F_REDIS_OOM] = "1" if oom_form or (self.oom and self._holding()) else ""
        found = await self.store.beat(heartbeat_args(
            mapping, self._sent, ttl_ms, self.state_ttl_ms, hash_expected=self.hash_expected,
            oom_form=oom_form))
        if int(found) >= 0:
            self.hash_expected = True
            self._sent = mapping
        return found

    # -- flushing ----------------------------------------------------------------

    async def run(self) -> None:
        """Flush queued changes until cancelled; survive Redis outages (redis-py's ``Retry``
        with exponential backoff, ``router.shared.redis_client.reconnect_retry``: 0.1 s doubling to
        5 s, reset by a flush that went through)."""
        retry = reconnect_retry()
        while True:
            await self._queue.wake.wait()
            self._queue.wake.clear()
            while self._holding() or not self.connected:
                try:
                    await retry.call_with_retry(self._flush_reconnecting, self._flush_failed)
                except RedisOutOfMemory:
                    await self._oom.back_off()  # nothing lost: the changes stay queued
                    continue
                self._oom.reset_backoff()
            self._queue.idle.set()

    async def _flush_reconnecting(self) -> None:
        if not self.connected:
            await self.client.ping()
        await self.flush()

    async def _flush_failed(self, exc: Exception) -> None:
        self.stats.num_errors += 1
        self._disconnect(exc)

    def _disconnect(self, exc: BaseException) -> None:
        """A write failed: what Redis holds is unknown, rewrite everything once it answers."""
        if self.connected:
            logger.error("Redis write failed (%s); buffering and retrying", exc)
        self._rewrite_later(_BACK)

    def _refused(self, exc: BaseException) -> None:
        """Redis refused a write for lack of memory: counted, one warning per interval."""
        self.stats.num_errors += 1
        self.stats.num_oom_refusals += 1
        self._oom.refused(exc)

    def _holding(self) -> bool:
        """Changes (or a stream entry) wait to be written."""
        return self._queue.holding() or self._unsent is not None

    def _accepted(self) -> None:
        """A write went through with nothing left held: the out-of-memory state is over."""
        if self._oom.over(self.stats.num_oom_refusals):
            self._queue.wake.set()

    def _lose_state(self) -> None:
        """The heartbeat hash is gone although it existed: Redis lost this replica's state."""
        logger.warning("%s", _LOST)
        self._rewrite_later(_LOST)
        self.hash_expected = False

    def _rewrite_later(self, reason: str) -> None:
        """Disconnected: the next write rewrites the full set under a new epoch, ``reason``
        logged when it starts."""
        self.connected = False
        self._sent = {}
        self._back_reason = reason
        self._queue.busy()

    async def flush(self) -> None:
        """Write everything queued: one flush script, then its stream entry (a full rewrite first
        if the writer is disconnected). Raises ``RedisError``.

        On failure the queued changes are dropped and the writer is disconnected:
        the next flush rewrites the set.
        """
        async with self._lock:
            with self._write_failures():
                await self._commit()

    @contextlib.contextmanager
    def _write_failures(self) -> Iterator[None]:
        """Around a write (``heartbeat``, ``flush``): Redis refusing it for lack of memory
        becomes ``RedisOutOfMemory`` (counted, the changes held); any other Redis error
        disconnects the writer (the next write rewrites the set) and goes on up."""
        try:
            yield
        except REDIS_ERRORS as exc:
            if is_oom(exc):
                self._refused(exc)
                raise RedisOutOfMemory(str(exc)) from exc
            self._disconnect(exc)
            raise

    def _rewrite_if_due(self) -> None:
        """Disconnected, or more than ``MAX_HELD_CHANGES`` held under OOM: the queue becomes one
        full rewrite (``on_recovered``)."""
        if not self.connected or (self.oom and len(self._queue.pending) > MAX_HELD_CHANGES):
            if not self.connected:
                logger.warning("%s; rewriting the replica's full block set", self._back_reason)
            self.stats.num_rewrites += 1
            self._queue.pending = [self.on_recovered()]
            self._queue.position = None

    async def _commit(self, heartbeat: tuple[dict[Any, Any], int] | None = None) -> None:
        """The script and stream entry of ``flush`` (``heartbeat`` None) or of a rewriting
        heartbeat (``(fields, ttl_ms)``: HSET + PEXPIRE after the set, in the script). Call with
        ``_lock`` held.

        The entry is written after the script returned, never before: a router that loads the
        replica's set (and ``entry_seq``) after remembering the stream's end then finds every
        change the set lacks in the stream. A failed ``XADD`` leaves ``entry_seq`` in the hash
        one ahead of the stream, which routers see as a gap at the next entry (and the writer,
        disconnected, rewrites the set under a new epoch)."""
        if self._unsent is not None:
            # the entry of a script that went through, refused by an out-of-memory Redis: it
            # goes first (raises while Redis still refuses it; nothing else is touched)
            await self.store.add_entry(self._unsent)
            self._unsent = None
        recovering = not self.connected
        self._rewrite_if_due()
        changes, taken_position = self._queue.take()
        position = taken_position
        if changes:
            position = max(position or (0, NO_SEQ), (changes[-1].epoch, changes[-1].seq))
        if position is None:
            if heartbeat is None:
                return
            position = (self.committed_epoch, self.committed_seq)
        batch = flush_batch(changes, position, self.entry_seq, self.replica_id,
                            self.state_ttl_ms, heartbeat)
        try:
            found, refused = await self.store.flush(
                batch.args, batch.entry, one_trip=not self.oom,
                entry_committed=lambda: setattr(self, "entry_seq", batch.entry_seq))
        except REDIS_ERRORS as exc:
            if is_oom(exc):
                # the script failed at its first write: nothing applied, nothing lost
                self.connected = True  # Redis answers: a queued rewrite is not made again
                self._queue.put_back(changes, taken_position)
            raise
        if refused is not None:
            self._unsent = batch.entry
        self.entry_seq = batch.entry_seq
        self.connected = True
        self.committed_epoch, self.committed_seq = batch.epoch, batch.seq
        self.stats.num_transactions += 1
        self.stats.num_entries += int(batch.entry is not None)
        self.stats.num_keys += batch.num_keys
        if heartbeat is not None:
            self.hash_expected = True
        elif not int(found):
            if recovering or not self.hash_expected:
                # the set is complete under the new epoch; the next heartbeat re-creates the hash
                self.hash_expected = False
            else:
                self._lose_state()
        if refused is not None:
            raise refused
        self._accepted()
