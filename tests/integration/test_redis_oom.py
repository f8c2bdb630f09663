"""Redis out of memory (``maxmemory`` reached under ``noeviction``) through real processes: a
Redis of its own (its ``maxmemory`` is changed), one emulator replica, its worker and routers.

Redis refuses ``XADD``/``SADD``/``HSET`` and every command queued in a ``MULTI`` then: requests
must all be answered, the replica must stay in rotation (its heartbeat still goes through), a
router started meanwhile must load the replica's set without MULTI, the worker must hold its
changes without a new epoch, both must say "out of memory" (``/ready``, metrics) in at most one
warning line per 10 s, and once memory frees the index must follow the stream again.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from loadtest.harness.redis_server import RedisServer
from router.shared import contract
from router.shared.redis_client import redis_client
from tests.helpers import wait_for
from tests.integration.test_router_fleet import Router, prometheus_value
from tests.integration.test_router_tenants import MODEL, OneReplica
from worker.redis_writer import RedisOutOfMemory, RedisWriter
from worker.replica_view import Change

pytestmark = pytest.mark.timeout(240)

MAXMEMORY = 20 * 1024 * 1024  # bytes: the 20 MB
FILLER_BYTES = 100_000


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


def fill_to_oom(client: redis.Redis) -> int:
    """Filler keys until Redis uses more than ``MAXMEMORY``, then that limit under
    ``noeviction``: Redis now refuses writes. Returns how many filler keys."""
    count = 0
    while client.info("memory")["used_memory"] <= MAXMEMORY + 1_000_000:
        client.set(f"filler:{count}", b"x" * FILLER_BYTES)
        count += 1
    client.config_set("maxmemory-policy", "noeviction")
    client.config_set("maxmemory", str(MAXMEMORY))
    return count


def complete(router: Router, prompt: list[int]) -> int:
    status, _, _ = router.post("/v1/completions", {"model": MODEL, "prompt": prompt,
                                                   "max_tokens": 2})
    return status


def warnings_in(output: str) -> list[str]:
    return [line for line in output.splitlines() if " WARNING " in line or " ERROR " in line]


def test_redis_out_of_memory_is_a_reported_state(own_redis: RedisServer, tmp_path: Path) -> None:
    client = redis.Redis.from_url(own_redis.url)
    rng = random.Random(29)
    replica = OneReplica(tmp_path, own_redis.url)
    routers: list[Router] = []
    try:
        router = Router(tmp_path, ["--redis-url", own_redis.url, "--hash-seed", "0",
                                   "--index-stride", "1"])
        routers.append(router)
        wait_for(lambda: any(r["routable"] and r["affinity"] for r in router.ready()["replicas"]),
                 60, message="replica routable with affinity")
        assert complete(router, [rng.randrange(1000, 30000) for _ in range(96)]) == 200
        wait_for(lambda: router.ready()["index_blocks"] > 0, 30, message="blocks indexed")
        epoch_before = int(client.hget(contract.replica_key("pr", "replica-0"),
                                       contract.F_EPOCH) or 0)

        num_fillers = fill_to_oom(client)
        oom_started = time.monotonic()
        statuses = [complete(router, [rng.randrange(1000, 30000) for _ in range(96)])
                    for _ in range(8)]
        assert statuses == [200] * 8
        wait_for(lambda: router.ready()["redis"]["oom"], 30, message="router reports OOM")
        assert prometheus_value(router.metrics(), "router_redis_oom") == 1
        # a router started now must load the replica's set: its MULTI is refused
        late = Router(tmp_path, ["--redis-url", own_redis.url, "--hash-seed", "0",
                                 "--index-stride", "1"], name="late")
        routers.append(late)
        wait_for(lambda: late.ready()["index_blocks"] > 0 and late.ready()["redis"]["connected"],
                 30, message="late router loaded the set under OOM")
        assert any(r["routable"] for r in late.ready()["replicas"])
        time.sleep(max(0.0, 12.0 - (time.monotonic() - oom_started)))  # > one log interval
        oom_s = time.monotonic() - oom_started

        client.delete(*(f"filler:{i}" for i in range(num_fillers)))
        client.config_set("maxmemory", "0")
        wait_for(lambda: not router.ready()["redis"]["oom"], 30, message="OOM over")
        # the index follows the stream again: a repeat of a new prompt hits through both routers
        prompt = [rng.randrange(1000, 30000) for _ in range(96)]
        before = router.ready()["index_blocks"]
        assert complete(router, prompt) == 200
        wait_for(lambda: router.ready()["index_blocks"] > before
                 and late.ready()["index_blocks"] >= router.ready()["index_blocks"], 30,
                 message="index follows the stream after OOM")
        # no rewrite loop: the worker kept its epoch through the whole episode
        assert int(client.hget(contract.replica_key("pr", "replica-0"),
                               contract.F_EPOCH) or 0) == epoch_before
    finally:
        router_outputs = [r.stop() for r in routers]
        worker_output = replica.stop()
        client.config_set("maxmemory", "0")
    budget = int(oom_s // 10) + 2  # one line per 10 s, plus the first and the "over" line
    worker_warnings = [w for w in warnings_in(worker_output) if "worker" in w]
    assert 0 < len([w for w in worker_warnings if "out of memory" in w]) <= budget, worker_output
    assert "rewriting the replica's full block set" not in worker_output
    for output in router_outputs:
        assert len(warnings_in(output)) <= budget + 1, output
        assert "redis connection lost" not in output, output


def test_a_heartbeat_passing_near_the_limit_does_not_end_the_oom_state(
        own_redis: RedisServer, caplog: pytest.LogCaptureFixture) -> None:
    """Redis hovering at its limit: a heartbeat's small HSET goes through while the held flush is
    still refused (the memory dips and grows with the fleet's traffic; here ``maxmemory`` is set
    to 50 KB under the memory used, then lifted, in turn). The worker stays out of memory (its
    heartbeat still says so) until the held changes flush: one "out of memory" line and no
    "accepts writes again" over five such rounds, then one recovery line when the flush goes
    through. (Before the fix: each passing heartbeat ended the state, 6 OOM and 5 recovery lines.)
    A RedisWriter in-process, so that a round is a heartbeat then a flush, in that order."""

    async def scenario() -> tuple[list[str], list[bool], list[Any], bool, set[int]]:
        client = redis_client(own_redis.url, None, socket_timeout=5.0)
        admin = redis.Redis.from_url(own_redis.url)
        try:
            writer = RedisWriter(client, "pr", "r0",
                                 on_recovered=lambda: Change(contract.OP_CLEARED, [], 1, 0))
            await writer.read_state()
            await writer.write_heartbeat({contract.F_URL: "http://127.0.0.1:9"}, 30.0)
            writer.enqueue(Change(contract.OP_STORED, [contract.BlockKey(1)], 1, 1))
            await writer.flush()
            admin.config_set("maxmemory-policy", "noeviction")

            def limit_under_use() -> None:
                admin.config_set("maxmemory", str(admin.info("memory")["used_memory"] - 50_000))

            writer.enqueue(Change(contract.OP_STORED, [contract.BlockKey(2)], 1, 2))
            limit_under_use()
            with pytest.raises(RedisOutOfMemory):
                await writer.flush()
            oom_states: list[bool] = []
            flags: list[Any] = []
            for beat in range(5):
                admin.config_set("maxmemory", "0")  # the small write passes
                await writer.write_heartbeat({contract.F_URL: "http://127.0.0.1:9",
                                              "probe": str(beat)}, 30.0)
                oom_states.append(writer.oom)
                flags.append(admin.hget(contract.replica_key("pr", "r0"), contract.F_REDIS_OOM))
                limit_under_use()  # the flush that follows is refused
                with pytest.raises(RedisOutOfMemory):
                    await writer.flush()
            messages = [r.getMessage() for r in caplog.records]
            admin.config_set("maxmemory", "0")  # memory frees: the held change goes through
            await writer.flush()
            members = await client.smembers(contract.blocks_key("pr", "r0"))
            return messages, oom_states, flags, writer.oom, {contract.unpack_key(m) for m in members}
        finally:
            admin.config_set("maxmemory", "0")
            await client.aclose()

    with caplog.at_level(logging.WARNING, logger="worker.redis_writer"):
        during, oom_states, flags, oom_after, members = asyncio.run(scenario())
        after = [r.getMessage() for r in caplog.records][len(during):]
    assert oom_states == [True] * 5
    assert flags == [b"1"] * 5  # routers keep seeing the worker out of memory
    assert len([m for m in during if "out of memory (maxmemory" in m]) == 1, during
    assert not [m for m in during if "accepts writes again" in m], during
    assert len([m for m in after if "accepts writes again" in m]) == 1, after
    assert not oom_after and members == {1, 2}
