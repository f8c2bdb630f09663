"""The Redis keys of one replica and the two scripts that write them (``_FLUSH``,
``_HEARTBEAT``): read back, delete, one heartbeat script call, one flush (script, then its
stream entry). Does I/O (redis.asyncio). Holds the keys and nothing else: the state a write
leaves (connected, out of memory, changes held) is the writer's (``worker/redis_writer.py``,
whose module docstring states the contract these scripts follow).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import NoScriptError

from router.shared import contract
from router.shared.contract import TIER_CPU, BlockKey
from router.shared.redis_client import redis_errors
from worker.oom_state import is_oom
from worker.replica_view import NO_SEQ

# what a retry loop catches: Redis failed or unreachable (a cluster's seeds too)
REDIS_ERRORS: Final = redis_errors()

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


class ReplicaStore:
    """Replica ``replica_id``'s heartbeat hash, its two block sets and the events stream."""

    def __init__(self, client: aioredis.Redis, prefix: str, replica_id: str, *,
                 stream_maxlen: int) -> None:
        self.client = client
        self.blocks_key = contract.blocks_key(prefix, replica_id)
        self.cpu_blocks_key = contract.blocks_key(prefix, replica_id, TIER_CPU)
        self.replica_key = contract.replica_key(prefix, replica_id)
        # the flush script's KEYS, in its order (one hash slot: tag {replica_id})
        self.keys: list[Any] = [self.blocks_key, self.replica_key, self.cpu_blocks_key]
        self.events_key = contract.events_key(prefix)
        self.stream_maxlen = stream_maxlen
        self._flush_script = client.register_script(_FLUSH)  # EVALSHA, loaded again if Redis lost it
        self._heartbeat_script = client.register_script(_HEARTBEAT)
        self._cluster = isinstance(client, RedisCluster)  # the stream is in another slot's node

    async def read(self) -> StoredState:
        """The heartbeat's epoch/seq/key_mode/entry_seq and both block sets (one transaction in
        the replica's hash slot); loads the flush script. Raises ``RedisError``."""
        async with self.client.pipeline(transaction=True) as pipe:
            # raw commands: redis-py 8.1's cluster MULTI passes the ``keys`` keyword of
            # ``hmget``/``smembers`` to their reply callbacks, which raise TypeError
            pipe.execute_command("HMGET", self.replica_key, contract.F_EPOCH, contract.F_SEQ,
                                 contract.F_KEY_MODE, contract.F_INDEX_STRIDE, contract.F_ENTRY_SEQ)
            pipe.execute_command("SMEMBERS", self.blocks_key)
            pipe.execute_command("SMEMBERS", self.cpu_blocks_key)
            (epoch, seq, mode, stride, entry_seq), members, cpu_members = await pipe.execute()
        await self.client.script_load(_FLUSH)  # the flush pipeline sends EVALSHA alone
        return StoredState(
            epoch=int(epoch) if epoch not in (None, b"") else None,
            seq=int(seq) if seq not in (None, b"") else NO_SEQ,
            key_mode=mode.decode() if mode else None,
            keys=[contract.unpack_key(m) for m in members if len(m) == 8],
            index_stride=int(stride) if stride not in (None, b"") else 1,
            entry_seq=int(entry_seq) if entry_seq not in (None, b"") else 0,
            cpu_keys=[contract.unpack_key(m) for m in cpu_members if len(m) == 8],
        )

    async def delete(self) -> None:
        """Delete the heartbeat hash and both block sets (one ``DEL``, one hash slot)."""
        await self.client.delete(self.replica_key, self.blocks_key, self.cpu_blocks_key)

    async def beat(self, args: list[Any]) -> Any:
        """One heartbeat script call (``args`` its ARGV); returns its result (-1: the hash must
        exist and is gone). Raises ``RedisError``."""
        return await self._heartbeat_script(
            keys=[self.replica_key, self.blocks_key, self.cpu_blocks_key], args=args)

    async def add_entry(self, entry: dict[Any, Any]) -> None:
        """XADD one stream entry (approximately trimmed). Raises ``RedisError``."""
        await self.client.xadd(self.events_key, entry, maxlen=self.stream_maxlen,
                               approximate=True)

    async def flush(self, args: list[Any], entry: dict[Any, Any] | None, *, one_trip: bool,
                    entry_committed: Callable[[], None]) -> tuple[Any, BaseException | None]:
        """Run the flush script (``args`` its ARGV), then XADD ``entry`` (None: no entry), in one
        round trip if ``one_trip`` and Redis is no cluster. Returns the script's result and the
        XADD's out-of-memory refusal (None: added). Calls ``entry_committed`` once the entry's
        ``entry_seq`` is in the hash or the entry in the stream, also when it then raises.
        Raises ``RedisError``: the script's (an OOM refusal of the script means nothing was
        applied)."""
        keys = self.keys
        found: Any = None
        if entry is not None and not self._cluster and one_trip:
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
                    entry_committed()
                raise found
            elif isinstance(added, Exception):
                if is_oom(added):
                    return found, added
                entry_committed()  # in the hash
                raise added
        if found is None:
            found = await self._flush_script(keys=keys, args=args)
            if entry is not None:
                entry_committed()  # in the hash even if the XADD fails
                try:
                    await self.add_entry(entry)
                except REDIS_ERRORS as exc:
                    if not is_oom(exc):
                        raise
                    return found, exc
        return found, None
