"""The coarse index end to end (contract version 2, index_stride 16, the default): emulated
replicas, real workers, Redis and routers. Workers publish only anchor keys, routers read hit
depths at anchors without over-estimating the engine, and a router whose stride differs from the
workers' says so and gives no prefix credit instead of mis-routing."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest

from router.shared import contract as c
from router.shared.hashing import BlockHasher
from tests.helpers import wait_for
from tests.integration.test_router_fleet import (
    Fleet,
    complete,
    prometheus_value,
    start_router,
    tokens,
)

pytestmark = pytest.mark.timeout(180)
STRIDE = 16


@pytest.fixture(scope="module")
def fleet(redis_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    import redis

    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    client.close()
    f = Fleet(tmp_path_factory.mktemp("coarse"), redis_server.url, time_scale=20.0,
              index_stride=STRIDE)
    try:
        yield f
    finally:
        f.stop()


def published(fleet: Fleet, replica_id: str) -> set[int]:
    import redis

    client = redis.Redis.from_url(fleet.redis_url)
    try:
        members = cast("set[bytes]", client.smembers(c.blocks_key("pr", replica_id)))
    finally:
        client.close()
    return {c.unpack_key(m) for m in members}


def test_workers_publish_anchors_and_hits_are_read_at_anchors(fleet: Fleet, tmp_path: Path) -> None:
    router = start_router(fleet, tmp_path)
    try:
        prompt = tokens(random.Random(21), 801)  # 50 full blocks; anchors 0, 1, 3, 7, 15, 31, 47
        status, headers, _ = complete(router, prompt)
        assert status == 200
        home = headers["x-prefix-router-replica"]
        keys = BlockHasher(16, "sha256", "0").keys(prompt)
        assert len(keys) == 50
        anchors = set(c.anchor_keys(keys, STRIDE))
        wait_for(lambda: anchors <= published(fleet, home), 15, message="anchor keys in Redis")
        assert not (set(keys) - anchors) & published(fleet, home)  # no other key is written

        def confirmed() -> dict[str, Any] | None:
            d = json.loads(router.post("/debug/route", {"prompt": [*prompt, 7]})[2])
            return d if d["replicas"][home]["confirmed_hit_blocks"] else None

        debug = wait_for(confirmed, 15, message="anchors confirmed in the router's index")
        assert debug["replica"] == home and debug["reason"] == "prefix_hit", debug
        assert debug["replicas"][home]["confirmed_hit_blocks"] == 48  # after anchor 47
        status, headers, body = complete(router, [*prompt, 7])
        assert headers["x-prefix-router-replica"] == home
        assert headers["x-prefix-router-confirmed-hit-tokens"] == str(48 * 16)
        # the engine holds all 50 blocks: the coarse index under-estimates, never over-estimates
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 50 * 16
        assert router.ready()["index_stride"] == STRIDE
    finally:
        router.stop()


def test_a_router_with_another_stride_reports_the_mismatch_and_gives_no_credit(
        fleet: Fleet, tmp_path: Path) -> None:
    router = start_router(fleet, tmp_path, "--index-stride", "4", affinity=False)
    try:
        ready = router.ready()
        assert ready["ready"] is True  # routing goes on, on the ring
        assert sorted(ready["config_mismatches"]) == sorted(r["replica_id"] for r in ready["replicas"])
        reasons = {r["no_affinity_reason"] for r in ready["replicas"]}
        assert reasons == {f"index_stride {STRIDE} != router's 4 (set one value for workers and "
                           "routers)"}, reasons
        prompt = tokens(random.Random(22), 640)
        assert complete(router, prompt)[0] == 200
        wait_for(lambda: prometheus_value(router.metrics(), "router_replica_config_mismatch")
                 == len(ready["replicas"]), 5, message="mismatch gauge")
        for _ in range(2):
            status, headers, _ = complete(router, prompt)
            assert status == 200
            assert headers["x-prefix-router-reason"] not in ("prefix_hit",), headers
            assert headers["x-prefix-router-confirmed-hit-tokens"] == "0"
    finally:
        router.stop()
