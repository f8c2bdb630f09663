"""One replica's block set (GPU and CPU tier) read from Redis into the fleet's index, with the
``epoch`` and ``entry_seq`` it is at, and whether Redis is out of memory (``RedisOom``). Does
I/O; ``router.edges.fleet_sync.FleetReader`` decides when a set is (re)loaded.
"""

from __future__ import annotations

import logging
import time
from typing import Any, cast

from router.decision.fleet import Fleet
from router.decision.replica import int_field
from router.observability.metrics import RouterMetrics
from router.shared import contract as c
from router.shared.logs import IntervalLog

logger = logging.getLogger(__name__)

OOM_READ_HOLD_S = 10.0  # a read refused for lack of memory keeps ``RedisOom.oom`` this long
LOAD_ATTEMPTS = 5  # unchecked (non-MULTI) reads of a replica's set before giving up for now


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class RedisOom:
    """Whether Redis refuses writes for lack of memory (``oom``, gauge ``router_redis_oom``): a
    worker says so in its heartbeat, or a read of this router was refused in the last
    ``OOM_READ_HOLD_S``."""

    def __init__(self, fleet: Fleet, metrics: RouterMetrics) -> None:
        self.fleet = fleet
        self.metrics = metrics
        self.oom = False
        self._read_until = 0.0  # monotonic: a read of this router was refused until then
        self._log = IntervalLog(logger, OOM_READ_HOLD_S)

    def read_refused(self, replica_id: str) -> None:
        """A MULTI reading ``replica_id``'s set was refused for lack of memory."""
        self._read_until = time.monotonic() + OOM_READ_HOLD_S
        self.update()
        self._log.warning("Redis is out of memory (maxmemory reached): reading replica %s's "
                          "block set without MULTI", replica_id)

    def update(self) -> None:
        """``oom`` and its gauge from the replicas' heartbeats and this router's reads."""
        oom = (time.monotonic() < self._read_until
               or any(r.redis_oom for r in self.fleet.replicas.values()))
        if oom != self.oom:
            logger.warning("Redis %s", "is out of memory (maxmemory reached): the workers hold "
                           "their changes, the index lags until it ends" if oom else
                           "accepts writes again: the index follows the stream")
        self.oom = oom
        self.metrics.redis_oom.set(1 if oom else 0)


class BlockSetLoader:
    """Loads a replica's sets into ``fleet.index`` and its ``epoch``/``entry_seq`` into the
    replica: entries up to that ``entry_seq`` are in them."""

    def __init__(self, fleet: Fleet, prefix: str, oom: RedisOom) -> None:
        self.fleet = fleet
        self.prefix = prefix
        self.oom = oom

    async def load(self, client: Any, replica_id: str) -> None:
        """Load a replica's sets (GPU and CPU tier) with the ``epoch``/``entry_seq`` they are at
        (one transaction in the replica's hash slot)."""
        from redis.exceptions import OutOfMemoryError

        try:
            read = await self._read(client, replica_id, transaction=True)
        except OutOfMemoryError:
            # Redis refuses every command queued in a MULTI once out of memory (even reads,
            # ``processCommand``), but not the reads themselves: read without MULTI, the sets
            # between two reads of epoch/entry_seq that agree (the worker changes sets and
            # hash in one script, so equal values before and after mean the sets match them)
            self.oom.read_refused(replica_id)
            for _ in range(LOAD_ATTEMPTS):
                read = await self._read(client, replica_id, transaction=False)
                if read is not None:
                    break
            else:
                logger.warning("replica %s: its block set kept changing while read; index "
                               "kept as it is until the next reload", replica_id)
                return
        assert read is not None
        (epoch_raw, entry_seq_raw), members, cpu_members = read
        keys = cast(list[c.BlockKey], [int.from_bytes(m, "big") for m in members if len(m) == 8])
        cpu_keys = cast(list[c.BlockKey],
                        [int.from_bytes(m, "big") for m in cpu_members if len(m) == 8])
        replica = self.fleet.replicas.get(replica_id)
        if replica is None:
            return
        epoch = int_field(_text(epoch_raw), None) if epoch_raw else None
        entry_seq = int_field(_text(entry_seq_raw), None) if entry_seq_raw else None
        replica.epoch = max(replica.epoch, epoch or 0)
        replica.entry_seq = -1 if entry_seq is None else entry_seq
        self.fleet.index.replace(replica_id, keys, epoch=replica.epoch, cpu_keys=cpu_keys)
        logger.info("replica %s: loaded %d block keys, %d on the CPU tier (epoch %d, entry %d)",
                    replica_id, len(keys), len(cpu_keys), replica.epoch, replica.entry_seq)

    async def _read(self, client: Any, replica_id: str, *, transaction: bool,
                    ) -> tuple[Any, Any, Any] | None:
        """``((epoch, entry_seq), GPU members, CPU members)`` of a replica, in one MULTI
        (``transaction``), or in a plain pipeline that reads epoch/entry_seq before and after
        the sets: None when they differ (the sets changed meanwhile). Raises ``RedisError``."""
        hmget = ("HMGET", c.replica_key(self.prefix, replica_id), c.F_EPOCH, c.F_ENTRY_SEQ)
        async with client.pipeline(transaction=transaction) as pipe:
            # raw commands: redis-py 8.1's cluster MULTI passes the ``keys`` keyword of
            # ``hmget``/``smembers`` to their reply callbacks, which raise TypeError
            pipe.execute_command(*hmget)
            pipe.execute_command("SMEMBERS", c.blocks_key(self.prefix, replica_id))
            pipe.execute_command("SMEMBERS", c.blocks_key(self.prefix, replica_id, c.TIER_CPU))
            if not transaction:
                pipe.execute_command(*hmget)
            replies = await pipe.execute()
        if not transaction and replies[0] != replies[3]:
            return None
        return replies[0], replies[1], replies[2]
