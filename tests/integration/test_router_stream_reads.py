"""The router's KV-event stream reads against a real Redis: ``stream_read_interval_s`` spaces them.

After a read that returned less than a full batch the reader pauses for the interval, so a
trickle of entries is applied in fewer, larger reads (router CPU against index lag).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.helpers import ReplicaFeed, wait_for
from tests.integration.test_router_fleet import Router, prometheus_value

pytestmark = pytest.mark.timeout(60)


def _entries_read(router: Router) -> float:
    metrics = router.metrics()
    return (prometheus_value(metrics, "router_events_total")
            + prometheus_value(metrics, "router_event_errors_total"))


def test_entries_after_a_short_read_wait_for_the_read_interval(tmp_path: Path) -> None:
    import redis as redis_lib

    from loadtest.harness.redis_server import RedisServer

    with RedisServer() as server:
        client = redis_lib.Redis.from_url(server.url)
        feed = ReplicaFeed(client)
        feed.heartbeat()
        router = Router(tmp_path, ["--redis-url", server.url, "--stream-read-interval-s", "4"])
        try:
            wait_for(lambda: router.ready()["replicas"], 15, message="replica seen")
            feed.stored([1])  # read at once (the reader waits in XREAD BLOCK) ...
            wait_for(lambda: _entries_read(router) == 1, 15, message="first entry applied")
            first_read = time.monotonic()
            feed.stored([2])  # ... this one only after the pause that the short read started
            feed.heartbeat()
            time.sleep(1.0)
            assert _entries_read(router) == 1, "read again before the interval was over"
            wait_for(lambda: _entries_read(router) == 2, 15, message="second entry applied")
            assert time.monotonic() - first_read >= 3.0
        finally:
            print(router.stop()[-3000:])
            client.close()
