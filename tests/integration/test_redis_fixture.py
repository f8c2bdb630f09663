"""Proves the real-Redis fixture: data round-trips through a live redis-server on loopback."""

from __future__ import annotations

import redis.asyncio as aioredis

from router.shared.contract import blocks_key, events_key, pack_keys, unpack_key, unpack_keys


async def test_round_trip_through_real_redis(redis_url: str) -> None:
    client = aioredis.Redis.from_url(redis_url)
    try:
        assert await client.ping()
        keys = [0, 1, 2**64 - 1, 3262291359910021016]
        async with client.pipeline(transaction=True) as pipe:
            pipe.sadd(blocks_key("pr", "r0"), *[k.to_bytes(8, "big") for k in keys])
            pipe.xadd(events_key("pr"), {"replica": "r0", "epoch": 1, "op": "stored", "keys": pack_keys(keys)})
            await pipe.execute()
        members = await client.smembers(blocks_key("pr", "r0"))
        assert sorted(unpack_key(m) for m in members) == sorted(keys)
        entries = await client.xrange(events_key("pr"))
        assert len(entries) == 1
        fields = entries[0][1]
        assert fields[b"op"] == b"stored"
        assert list(unpack_keys(fields[b"keys"])) == keys
        info = await client.info("server")
        assert info["tcp_port"] == int(redis_url.rsplit(":", 1)[1].split("/")[0])
    finally:
        await client.aclose()
