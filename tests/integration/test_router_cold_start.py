"""A router started while Redis is down still routes: the last fleet it saw (a local cache
file) or the configured fallback replicas; once Redis answers, the worker reports take over.

Real Redis (stopped and restarted), an emulator process (2 replicas), a worker each, routers.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from loadtest.harness.redis_server import RedisServer
from tests.helpers import stop_process, wait_for
from tests.integration.test_router_failover import _emulated_fleet
from tests.integration.test_router_fleet import Router, read_json_file

pytestmark = pytest.mark.timeout(150)


def first_answer(router: Router, timeout_s: float = 20.0) -> float:
    """Seconds until the router answers a completion with 200."""
    started = time.monotonic()
    wait_for(lambda: router.post("/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 1})[0]
             == 200, timeout_s, message="a 200 from the cold router")
    return time.monotonic() - started


def test_a_router_started_during_a_redis_outage_routes(tmp_path: Path) -> None:
    redis = RedisServer().start()
    procs: list[Any] = []
    routers: list[Router] = []
    cache = tmp_path / "fleet.json"
    try:
        procs = _emulated_fleet(redis.url, tmp_path, 2)
        warm = Router(tmp_path, ["--redis-url", redis.url, "--hash-seed", "0",
                                 "--fleet-cache-file", str(cache)])
        routers.append(warm)
        # the baseline, on this machine now: how long a router with Redis up takes to answer;
        # a cold one must not wait on Redis beyond that (5 s plus 3 baselines: a busy machine
        # slows both alike, a router waiting on Redis would pass any such bound)
        limit_s = 5.0 + 3 * first_answer(warm)
        wait_for(lambda: len((read_json_file(cache) or {}).get("replicas", [])) == 2, 30,
                 message="fleet cache written")
        urls = sorted(r["url"] for r in read_json_file(cache)["replicas"])
        redis.stop()

        cold = Router(tmp_path, ["--redis-url", redis.url, "--hash-seed", "0",
                                 "--fleet-cache-file", str(cache)], name="cold")
        routers.append(cold)
        assert first_answer(cold, 60) < limit_s
        ready = cold.ready()
        assert ready["ready"] and ready["redis"]["connected"] is False
        assert sorted(r["url"] for r in ready["replicas"]) == urls
        assert all(r["routable"] and not r["affinity"] for r in ready["replicas"])

        # no cache, only a static fallback URL
        static = Router(tmp_path, ["--redis-url", redis.url, "--fallback-replica", urls[0]],
                        name="fallback")
        routers.append(static)
        assert first_answer(static, 60) < limit_s
        status, headers, _ = static.post("/v1/completions", {"prompt": [1, 2], "max_tokens": 1})
        assert status == 200 and urls[0].endswith(headers["x-prefix-router-replica"])

        # Redis back: the worker-reported fleet replaces the fallbacks (with affinity)
        redis = RedisServer(port=redis.port).start()
        wait_for(lambda: {r["replica_id"] for r in static.ready()["replicas"]}
                 == {"replica-0", "replica-1"}, 30, message="worker-reported fleet")
        wait_for(lambda: all(r["affinity"] for r in cold.ready()["replicas"]), 30,
                 message="affinity after Redis returned")
        assert json.loads(cache.read_text())["replicas"]  # kept for the next cold start
    finally:
        for router in routers:
            print(router.stop()[-2000:])
        for proc in reversed(procs):
            stop_process(proc)
        redis.stop()
