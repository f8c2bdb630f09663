"""The worker's RedisWriter against a real Redis: each flush is its set change, then one stream
entry with the next entry_seq (contract version 3), also after Redis lost the flush script."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from router.shared import contract as c
from router.shared.redis_client import redis_client
from worker.redis_writer import RedisWriter
from worker.replica_view import Change

pytestmark = pytest.mark.timeout(60)


def test_flushes_write_the_set_then_consecutive_entries_even_after_script_flush(
        redis_url: str) -> None:
    async def scenario() -> tuple[Any, ...]:
        client = redis_client(redis_url, None, socket_timeout=5.0)
        try:
            writer = RedisWriter(client, "pr", "r0",
                                 on_recovered=lambda: Change(c.OP_CLEARED, [], 1, 0))
            await writer.read_state()
            await writer.write_heartbeat({c.F_URL: "http://127.0.0.1:9"}, 30.0)
            for seq, keys in enumerate(([1, 2], [3]), start=1):
                writer.enqueue(Change(c.OP_STORED, keys, 1, seq))
                await writer.flush()
            await client.script_flush()  # as after a restart or a failover to a fresh replica
            writer.enqueue(Change(c.OP_REMOVED, [1], 1, 3))
            await writer.flush()
            writer.advance(1, 4)  # a batch with no visible change: no entry
            await writer.flush()
            members = await client.smembers(c.blocks_key("pr", "r0"))
            heartbeat = await client.hgetall(c.replica_key("pr", "r0"))
            entries = await client.xrange(c.events_key("pr"))
            return members, heartbeat, entries, writer.stats.num_rewrites, writer.connected
        finally:
            await client.aclose()

    members, heartbeat, entries, rewrites, connected = asyncio.run(scenario())
    assert {c.unpack_key(m) for m in members} == {2, 3}
    assert (heartbeat[b"entry_seq"], heartbeat[b"seq"]) == (b"3", b"4")
    seqs = [int(f[b"entry_seq"]) for _, f in entries]
    # the entry sent with the lost script went out once more with it: a copy routers skip
    assert seqs == [1, 2, 3, 3]
    assert [c.unpack_keys(f[b"removed"]) for _, f in entries[2:]] == [(1,), (1,)]
    assert rewrites == 0 and connected
