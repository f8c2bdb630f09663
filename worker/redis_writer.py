"""Writes one replica's block-set changes and heartbeat to Redis. Does I/O (redis.asyncio).

Per ``router/contract.py`` (version 4): the sets ``{prefix}:{r}:blocks`` (GPU tier) and
``{prefix}:{r}:blocks:CPU`` (CPU tier) of 8-byte keys, changed by ONE single-slot Lua script
call per flush (``_FLUSH``, on the replica's three hash-tagged keys, so it runs on a Redis
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
import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import NoScriptError, OutOfMemoryError, ResponseError

from router.shared import contract
from router.shared.contract import OP_CLEARED, OP_STORED, TIER_CPU, TIER_GPU, BlockKey
from router.shared.logs import IntervalLog
from router.shared.redis_client import reconnect_retry, redis_errors
from worker.replica_view import NO_SEQ, Change

logger = logging.getLogger(__name__)

# what a retry loop catches: Redis failed or unreachable (a cluster's seeds too)
REDIS_ERRORS: Final = redis_errors()
OOM_BACKOFF_BASE_S: Final = 0.5  # first wait after Redis refused a write for lack of memory
OOM_BACKOFF_CAP_S: Final = 10.0  # longest wait between two write attempts under OOM
OOM_LOG_INTERVAL_S: Final = 10.0  # one OOM warning line per this many seconds
MAX_HELD_CHANGES: Final = 10_000  # queued changes under OOM before they collapse into a rewrite
DEFAULT_STATE_TTL_S: Final = contract.DEFAULT_STATE_TTL_S

# One flush: the replica's three keys, one hash slot (tag {r}). KEYS: GPU-tier blocks set,
# heartbeat hash, CPU-tier blocks set.
# ARGV: 1 epoch, 2 seq, 3 cleared ("1"/"0": both sets), 4 packed stored keys, 5 packed removed
# keys, 6 entry_seq (of the stream entry that follows, or the last one), 7 heartbeat TTL in ms
# ("" = no heartbeat: record epoch/seq/entry_seq only if the hash exists), 8 packed CPU-tier
# stored keys, 9 packed CPU-tier removed keys, 10 the block sets' TTL in ms (state TTL),
# 11.. heartbeat field/value pairs.
# Returns 1 when the heartbeat hash exists (or was written), 0 when it is gone.
# Members are split off the packed strings in chunks below Lua's unpack() limit (LUAI_MAXCSTACK).
_FLUSH: Final = """
if redis.replicate_commands then pcall(redis.replicate_commands) end
local function apply(cmd, blob, key)
  local n = #blob
  local i = 1
  while i <= n do
    local members = {}
    local m = 0
    while i <= n and m < 4000 do
      m = m + 1
      members[m] = string.sub(blob, i, i + 7)
      i = i + 8
    end
    redis.call(cmd, key, unpack(members))
  end
end
if ARGV[3] == '1' then redis.call('DEL', KEYS[1], KEYS[3]) end
apply('SREM', ARGV[5], KEYS[1])
apply('SADD', ARGV[4], KEYS[1])
apply('SREM', ARGV[9], KEYS[3])
apply('SADD', ARGV[8], KEYS[3])
redis.call('PEXPIRE', KEYS[1], ARGV[10])
redis.call('PEXPIRE', KEYS[3], ARGV[10])
if ARGV[7] ~= '' then
  redis.call('HSET', KEYS[2], 'epoch', ARGV[1], 'seq', ARGV[2], 'entry_seq', ARGV[6],
             unpack(ARGV, 11))
  redis.call('PEXPIRE', KEYS[2], ARGV[7])
  return 1
end
if redis.call('EXISTS', KEYS[2]) == 1 then
  redis.call('HSET', KEYS[2], 'epoch', ARGV[1], 'seq', ARGV[2], 'entry_seq', ARGV[6])
  return 1
end
return 0
"""

# One heartbeat: KEYS the heartbeat hash and the two block sets; ARGV[1] TTL in ms, ARGV[2] "1"
# if the hash must already exist, ARGV[3] the block sets' TTL in ms, ARGV[4] "1" to HSET before
# the PEXPIREs (refused by an out-of-memory Redis: the probe of whether it still is) or "0" to
# HSET after them (once a script has written, Redis lets its HSET through under OOM, see the
# module docstring), then field/value pairs. Returns -1 (and writes nothing) when the hash must
# exist but is gone, else 0.
_HEARTBEAT: Final = (
    "if ARGV[2] == '1' and redis.call('EXISTS', KEYS[1]) == 0 then return -1 end "
    "if ARGV[4] == '1' and #ARGV > 4 then redis.call('HSET', KEYS[1], unpack(ARGV, 5)) end "
    "redis.call('PEXPIRE', KEYS[1], ARGV[1]) "
    "redis.call('PEXPIRE', KEYS[2], ARGV[3]) redis.call('PEXPIRE', KEYS[3], ARGV[3]) "
    "if ARGV[4] ~= '1' and #ARGV > 4 then redis.call('HSET', KEYS[1], unpack(ARGV, 5)) end "
    "return 0"
)

_BACK: Final = "Redis is back"
_OOM_MARK: Final = "OOM command not allowed"  # Redis's error, also inside a script's error


def is_oom(exc: BaseException) -> bool:
    """True when Redis refused a command for lack of memory (``maxmemory`` reached, policy
    ``noeviction``): redis-py's ``OutOfMemoryError``, or a script's error wrapping Redis's
    ``-OOM`` reply (a ``ResponseError`` naming it)."""
    return isinstance(exc, OutOfMemoryError) or (
        isinstance(exc, ResponseError) and _OOM_MARK in str(exc))


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


@dataclass(frozen=True, slots=True)
class StoredState:
    """What a previous worker left in Redis for this replica."""

    epoch: int | None  # None when the heartbeat hash is gone
    seq: int
    key_mode: str | None
    keys: list[BlockKey]  # the GPU tier's
    index_stride: int = 1  # the stride the keys were published with (absent field: 1)
    cpu_keys: list[BlockKey] = field(default_factory=list)  # the CPU tier's
    entry_seq: int = 0  # stream entries the replica has written (absent field: 0)


def net_changes(changes: list[Change], tier: str = TIER_GPU,
                ) -> tuple[bool, list[BlockKey], list[BlockKey]]:
    """Net effect of queued changes on ``tier``'s set: ``(cleared, stored, removed)``; a key's
    last change wins.

    ``cleared``: some change reset the sets (it and what follows are kept, what came before
    it is superseded). Every key is in at most one of ``stored`` and ``removed``.
    """
    cleared = False
    last: dict[BlockKey, bool] = {}  # {block key: True if its last change stored it}
    for change in changes:
        if change.op == OP_CLEARED:
            cleared = True
            last = dict.fromkeys(change.keys if tier == TIER_GPU else change.cpu_keys, True)
        elif change.tier != tier:
            continue
        elif change.op == OP_STORED:
            last.update(dict.fromkeys(change.keys, True))
        else:
            last.update(dict.fromkeys(change.keys, False))
    stored = [k for k, v in last.items() if v]
    removed = [] if cleared else [k for k, v in last.items() if not v]
    return cleared, stored, removed


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
        self.blocks_key = contract.blocks_key(prefix, replica_id)
        self.cpu_blocks_key = contract.blocks_key(prefix, replica_id, TIER_CPU)
        self.events_key = contract.events_key(prefix)
        self.replica_key = contract.replica_key(prefix, replica_id)
        self.stream_maxlen = stream_maxlen
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
        self._pending: list[Change] = []
        self._position: tuple[int, int] | None = None  # (epoch, seq) applied but not committed
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._lock = asyncio.Lock()  # one Redis write of this replica at a time
        self._flush_script = client.register_script(_FLUSH)  # EVALSHA, loaded again if Redis lost it
        self._heartbeat_script = client.register_script(_HEARTBEAT)
        self._cluster = isinstance(client, RedisCluster)  # the stream is in another slot's node
        self._sent: dict[Any, Any] = {}  # heartbeat fields as last written by the fast path
        # Redis refused a write for lack of memory (until a write goes through)
        self.oom = False
        self._oom_log = IntervalLog(logger, OOM_LOG_INTERVAL_S)
        self._oom_logged = False  # this episode's start was logged: so will its end be
        # a stream entry whose script went through but whose XADD Redis refused (OOM): sent
        # before anything else, so routers see every entry in order
        self._unsent: dict[Any, Any] | None = None
        self._writable = asyncio.Event()  # set when Redis accepts writes again after OOM

    # -- producer side -------------------------------------------------------

    def enqueue(self, change: Change) -> None:
        """Queue a change; a ``cleared`` change supersedes everything queued before it."""
        if change.op == OP_CLEARED:
            self._pending = [change]
        else:
            self._pending.append(change)
        self._idle.clear()
        self._wake.set()

    def advance(self, epoch: int, seq: int) -> None:
        """Record that batch ``seq`` was applied (even with no visible change) so Redis gets its seq.

        A restarted worker replays from the committed seq + 1; a stale seq would
        re-apply batches and corrupt reference counts.
        """
        self._position = (epoch, seq)
        self._idle.clear()
        self._wake.set()

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    async def wait_idle(self, timeout_s: float | None = None) -> None:
        """Wait until everything queued so far is committed (or dropped by an outage)."""
        await asyncio.wait_for(self._idle.wait(), timeout_s)

    # -- start-up --------------------------------------------------------------

    async def read_state(self) -> StoredState:
        """Read back the replica's heartbeat epoch/seq/key_mode and block set (one transaction in
        the replica's hash slot). Continues ``entry_seq`` from the stored one. Raises ``RedisError``."""
        async with self.client.pipeline(transaction=True) as pipe:
            # raw commands: redis-py 8.1's cluster MULTI passes the ``keys`` keyword of
            # ``hmget``/``smembers`` to their reply callbacks, which raise TypeError
            pipe.execute_command("HMGET", self.replica_key, contract.F_EPOCH, contract.F_SEQ,
                                 contract.F_KEY_MODE, contract.F_INDEX_STRIDE, contract.F_ENTRY_SEQ)
            pipe.execute_command("SMEMBERS", self.blocks_key)
            pipe.execute_command("SMEMBERS", self.cpu_blocks_key)
            (epoch, seq, mode, stride, entry_seq), members, cpu_members = await pipe.execute()
        keys = [contract.unpack_key(m) for m in members if len(m) == 8]
        cpu_keys = [contract.unpack_key(m) for m in cpu_members if len(m) == 8]
        await self.client.script_load(_FLUSH)  # the flush pipeline sends EVALSHA alone
        self.hash_expected = epoch not in (None, b"")
        self.entry_seq = max(self.entry_seq, int(entry_seq) if entry_seq not in (None, b"") else 0)
        return StoredState(
            epoch=int(epoch) if epoch not in (None, b"") else None,
            seq=int(seq) if seq not in (None, b"") else NO_SEQ,
            key_mode=mode.decode() if mode else None,
            keys=keys,
            index_stride=int(stride) if stride not in (None, b"") else 1,
            entry_seq=self.entry_seq,
            cpu_keys=cpu_keys,
        )

    async def deregister(self) -> None:
        """Delete the replica's heartbeat hash and block sets (one ``DEL``, one hash slot):
        routers take it out of rotation at their next heartbeat refresh instead of waiting
        for the heartbeat to expire, and nothing of it stays in Redis. Raises ``RedisError``."""
        async with self._lock:
            await self.client.delete(self.replica_key, self.blocks_key, self.cpu_blocks_key)
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
                        self._probe_passed()
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
        # only fields that changed since the last heartbeat this writer wrote: the hash keeps
        # the others (a lost hash is detected and rewritten in full)
        sent = self._sent if self.hash_expected else {}
        args: list[Any] = [ttl_ms, "1" if self.hash_expected else "0", self.state_ttl_ms,
                           "1" if not oom_form else "0"]
        for name, value in mapping.items():
            if sent.get(name) != value:
                args += [name, value]
        found = await self._heartbeat_script(
            keys=[self.replica_key, self.blocks_key, self.cpu_blocks_key], args=args)
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
        oom_wait_s = OOM_BACKOFF_BASE_S
        while True:
            await self._wake.wait()
            self._wake.clear()
            while (self._pending or self._position is not None or not self.connected
                   or self._unsent is not None):
                try:
                    await retry.call_with_retry(self._flush_reconnecting, self._flush_failed)
                except RedisOutOfMemory:
                    # nothing lost: the changes stay queued; a heartbeat that Redis accepted
                    # in its plain form ends the wait early
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._writable.wait(), oom_wait_s)
                    oom_wait_s = min(oom_wait_s * 2, OOM_BACKOFF_CAP_S)
                    continue
                oom_wait_s = OOM_BACKOFF_BASE_S
            self._idle.set()

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
        self.connected = False
        self._sent = {}
        self._back_reason = _BACK
        self._idle.clear()
        self._wake.set()

    def _refused(self, exc: BaseException) -> None:
        """Redis refused a write for lack of memory: counted, one warning per interval."""
        self.stats.num_errors += 1
        self.stats.num_oom_refusals += 1
        self.oom = True
        self._writable.clear()
        # no reset per episode: episodes that follow within the interval share its one line
        self._oom_logged |= self._oom_log.warning("Redis is out of memory (maxmemory reached; run maxmemory-policy "
                              "noeviction with room for the fleet, see docs/worker.md): writes of "
                              "replica %s refused, its changes held and retried (%s)",
                              self.replica_id, exc)

    def _holding(self) -> bool:
        """Changes (or a stream entry) wait to be written."""
        return bool(self._pending) or self._position is not None or self._unsent is not None

    def _probe_passed(self) -> None:
        """A heartbeat's plain form went through: the flush loop retries at once; the
        out-of-memory state ends here only if nothing is held (else when the held changes
        flush: Redis near its limit may accept the small HSET and still refuse them)."""
        if not self.oom:
            return
        if self._holding():
            self._writable.set()
            self._wake.set()
        else:
            self._accepted()

    def _accepted(self) -> None:
        """A write went through with nothing left held: the out-of-memory state is over."""
        if self.oom:
            if self._oom_logged:
                logger.warning("Redis accepts writes again after being out of memory (%d "
                               "writes refused so far); replica %s's held changes sent",
                               self.stats.num_oom_refusals, self.replica_id)
            self._oom_logged = False
            self._writable.set()
            self._wake.set()
        self.oom = False

    def _lose_state(self) -> None:
        """The heartbeat hash is gone although it existed: Redis lost this replica's state."""
        logger.warning("%s", _LOST)
        self._sent = {}
        self.connected = False
        self._back_reason = _LOST
        self.hash_expected = False
        self._idle.clear()
        self._wake.set()

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
            await self.client.xadd(self.events_key, self._unsent, maxlen=self.stream_maxlen,
                                   approximate=True)
            self._unsent = None
        recovering = not self.connected
        if recovering or (self.oom and len(self._pending) > MAX_HELD_CHANGES):
            if recovering:
                logger.warning("%s; rewriting the replica's full block set", self._back_reason)
            self.stats.num_rewrites += 1
            self._pending = [self.on_recovered()]
            self._position = None
        changes, self._pending = self._pending, []
        taken_position = position = self._position
        self._position = None
        if changes:
            position = max(position or (0, NO_SEQ), (changes[-1].epoch, changes[-1].seq))
        if position is None:
            if heartbeat is None:
                return
            position = (self.committed_epoch, self.committed_seq)
        cleared, stored, removed = net_changes(changes)
        _, cpu_stored, cpu_removed = net_changes(changes, TIER_CPU)
        epoch, seq = position
        has_entry = cleared or bool(stored or removed or cpu_stored or cpu_removed)
        entry_seq = self.entry_seq + 1 if has_entry else self.entry_seq
        packed_stored, packed_removed = contract.pack_keys(stored), contract.pack_keys(removed)
        packed_cpu_stored = contract.pack_keys(cpu_stored)
        packed_cpu_removed = contract.pack_keys(cpu_removed)
        args: list[Any] = [epoch, seq, "1" if cleared else "0", packed_stored, packed_removed,
                           entry_seq]
        if heartbeat is not None:
            mapping, ttl_ms = heartbeat
            for name in (contract.F_EPOCH, contract.F_SEQ, contract.F_ENTRY_SEQ):
                mapping.pop(name, None)
            args += [ttl_ms, packed_cpu_stored, packed_cpu_removed, self.state_ttl_ms]
            for name, value in mapping.items():
                args += [name, value]
        else:
            args += ["", packed_cpu_stored, packed_cpu_removed, self.state_ttl_ms]
        keys = [self.blocks_key, self.replica_key, self.cpu_blocks_key]
        entry: dict[Any, Any] = {
            contract.E_REPLICA: self.replica_id, contract.E_EPOCH: epoch,
            contract.E_ENTRY_SEQ: entry_seq, contract.E_CLEARED: "1" if cleared else "0",
            contract.E_STORED: packed_stored, contract.E_REMOVED: packed_removed}
        if cpu_stored:
            entry[contract.E_CPU_STORED] = packed_cpu_stored
        if cpu_removed:
            entry[contract.E_CPU_REMOVED] = packed_cpu_removed
        found: Any = None
        refused: BaseException | None = None  # the XADD's OOM refusal, raised once committed
        try:
            found, refused = await self._send(keys, args, entry if has_entry else None,
                                              entry_seq)
        except REDIS_ERRORS as exc:
            if is_oom(exc):
                # the script failed at its first write: nothing applied, nothing lost
                self.connected = True  # Redis answers: a queued rewrite is not made again
                if not any(change.op == OP_CLEARED for change in self._pending):
                    self._pending = changes + self._pending
                if self._position is None:
                    self._position = taken_position
            raise
        if refused is not None:
            self._unsent = entry
        self.entry_seq = entry_seq
        self.connected = True
        self.committed_epoch, self.committed_seq = epoch, seq
        self.stats.num_transactions += 1
        self.stats.num_entries += int(has_entry)
        self.stats.num_keys += len(stored) + len(removed) + len(cpu_stored) + len(cpu_removed)
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

    async def _send(self, keys: list[Any], args: list[Any], entry: dict[Any, Any] | None,
                    entry_seq: int) -> tuple[Any, BaseException | None]:
        """Run the flush script, then XADD ``entry`` (None: no entry). Returns the script's
        result and the XADD's out-of-memory refusal (None: added). Raises ``RedisError``: the
        script's (an OOM refusal of the script means nothing was applied)."""
        found: Any = None
        if entry is not None and not self._cluster and not self.oom:
            # one round trip: one connection runs the script before the XADD (a cluster
            # pipeline sends to the two slots' nodes at once, in no order: two round trips).
            # Raw EVALSHA: a pipeline given the Script object asks SCRIPT EXISTS every time.
            async with self.client.pipeline(transaction=False) as pipe:
                pipe.evalsha(self._flush_script.sha, len(keys), *keys, *args)
                pipe.xadd(self.events_key, entry, maxlen=self.stream_maxlen, approximate=True)
                found, added = await pipe.execute(raise_on_error=False)
            if isinstance(found, NoScriptError):
                # Redis lost the script (restart, failover): the entry went out without its
                # set change; run both again below (routers skip the second copy of entry_seq)
                found = None
            elif isinstance(found, Exception):
                if is_oom(found) and not isinstance(added, Exception):
                    # memory freed between the two: the entry is out without its set change;
                    # the retry sends the same changes again as the next entry (idempotent)
                    self.entry_seq = entry_seq
                raise found
            elif isinstance(added, Exception):
                if is_oom(added):
                    return found, added
                self.entry_seq = entry_seq  # committed in the hash
                raise added
        if found is None:
            found = await self._flush_script(keys=keys, args=args)
            if entry is not None:
                self.entry_seq = entry_seq  # committed in the hash even if the XADD fails
                try:
                    await self.client.xadd(self.events_key, entry, maxlen=self.stream_maxlen,
                                           approximate=True)
                except REDIS_ERRORS as exc:
                    if not is_oom(exc):
                        raise
                    return found, exc
        return found, None
