"""The fleet's Redis URL forms (one server, Cluster seeds, Sentinel set) and the client built
from each (redis-py builds clients without connecting, so no server is needed here)."""

from __future__ import annotations

import pytest
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.sentinel import SentinelConnectionPool

from router.shared.redis_client import (
    RedisTarget,
    RedisUrlError,
    cluster_masters,
    parse_redis_url,
    redis_client,
)


@pytest.mark.parametrize(("url", "want"), [
    ("redis://r.example:6380/2", RedisTarget("single", "redis://r.example:6380/2",
                                             (("r.example", 6380),), False, 2)),
    ("rediss://user@r:6390", RedisTarget("single", "rediss://user@r:6390", (("r", 6390),), True,
                                         0, username="user")),
    ("redis://r", RedisTarget("single", "redis://r", (("r", 6379),), False, 0)),
    ("unix:///run/redis.sock?db=3", RedisTarget("single", "unix:///run/redis.sock?db=3", (), False, 3)),
    ("redis+cluster://a:7000,b:7001,c", RedisTarget(
        "cluster", "redis+cluster://a:7000,b:7001,c", (("a", 7000), ("b", 7001), ("c", 6379)), False)),
    ("rediss+cluster://a:7000/?ssl_ca_certs=/ca.crt", RedisTarget(
        "cluster", "rediss+cluster://a:7000/?ssl_ca_certs=/ca.crt", (("a", 7000),), True,
        ssl_ca_certs="/ca.crt")),
    ("redis+cluster://[::1]:7000,10.0.0.1:7001/0", RedisTarget(
        "cluster", "redis+cluster://[::1]:7000,10.0.0.1:7001/0", (("::1", 7000), ("10.0.0.1", 7001)),
        False)),
    ("redis+sentinel://s1:26379,s2,s3:26380/mymaster", RedisTarget(
        "sentinel", "redis+sentinel://s1:26379,s2,s3:26380/mymaster",
        (("s1", 26379), ("s2", 26379), ("s3", 26380)), False, 0, "mymaster")),
    ("rediss+sentinel://app@s1/mymaster/4?ssl_ca_certs=/etc/ca.pem", RedisTarget(
        "sentinel", "rediss+sentinel://app@s1/mymaster/4?ssl_ca_certs=/etc/ca.pem",
        (("s1", 26379),), True, 4, "mymaster", "app", "/etc/ca.pem")),
])
def test_accepted_forms(url: str, want: RedisTarget) -> None:
    assert parse_redis_url(url) == want


@pytest.mark.parametrize(("url", "message"), [
    ("http://r:6379", "must start with"),
    ("redis+cluster://", "no host"),
    ("redis+cluster://a:7000/1", "database 0 only"),
    ("redis+cluster://h:7000,,h:7001", "empty host entry"),
    ("redis+cluster://h:7000,", "empty host entry"),
    ("redis+sentinel://s1, ,s2/m", "empty host entry"),
    ("redis+cluster://a:port", "bad port"),
    ("redis+cluster://a:70000", "out of range"),
    ("redis+sentinel://s1:26379", "needs /SERVICE"),
    ("redis+sentinel://s1/m/0/extra", "needs /SERVICE"),
    ("redis+sentinel://s1/m/x", "database must be an integer"),
    ("redis+sentinel://u:pw@s1/m", "password in a multi-host Redis URL"),
    ("redis+cluster://a?socket_timeout=1", "unknown Redis URL option(s) socket_timeout"),
    ("redis://r:6379/x", "database must be an integer"),
    ("unix://", "socket path"),
])
def test_rejected_forms_say_what_is_wrong(url: str, message: str) -> None:
    with pytest.raises(RedisUrlError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_redis_url(url)


async def test_single_server_client_keeps_redis_py_url_options() -> None:
    client = redis_client("redis://127.0.0.1:6390/3?health_check_interval=7", "pw",
                          socket_timeout=5.0)
    assert isinstance(client, Redis)
    kwargs = client.connection_pool.connection_kwargs
    assert (kwargs["host"], kwargs["port"], kwargs["db"], kwargs["password"]) == (
        "127.0.0.1", 6390, 3, "pw")
    assert kwargs["socket_timeout"] == 5.0 and kwargs["health_check_interval"] == 7
    await client.aclose()


async def test_cluster_client_gets_every_seed_tls_and_password() -> None:
    client = redis_client("rediss+cluster://127.0.0.1:7000,127.0.0.1:7001?ssl_ca_certs=/ca.crt",
                          "pw", socket_timeout=5.0)
    assert isinstance(client, RedisCluster)
    seeds = sorted((n.host, n.port) for n in client.nodes_manager.startup_nodes.values())
    assert seeds == [("127.0.0.1", 7000), ("127.0.0.1", 7001)]
    kwargs = client.nodes_manager.connection_kwargs
    assert kwargs["password"] == "pw" and kwargs["socket_timeout"] == 5.0
    assert kwargs["ssl_ca_certs"] == "/ca.crt"
    await client.aclose()


async def test_sentinel_client_follows_the_named_master() -> None:
    client = redis_client("redis+sentinel://127.0.0.1:26379,127.0.0.1:26380/mymaster/2", "pw",
                          socket_timeout=5.0)
    pool = client.connection_pool
    assert isinstance(pool, SentinelConnectionPool)
    assert pool.service_name == "mymaster" and pool.is_master
    assert pool.connection_kwargs["db"] == 2 and pool.connection_kwargs["password"] == "pw"
    sentinels = pool.sentinel_manager.sentinels
    assert [(s.connection_pool.connection_kwargs["host"], s.connection_pool.connection_kwargs["port"])
            for s in sentinels] == [("127.0.0.1", 26379), ("127.0.0.1", 26380)]
    # the data-node password is not sent to the sentinels (they usually have none)
    assert all(s.connection_pool.connection_kwargs.get("password") is None for s in sentinels)
    await client.aclose()


async def test_only_a_cluster_client_has_masters_to_compare() -> None:
    """``cluster_masters`` reads a cluster client's cached slot map (checked against a real
    cluster failing over in ``tests/integration/test_redis_topologies.py``); a client of one
    server or of a Sentinel set has none."""
    for url in ("redis://127.0.0.1:6390/0", "redis+sentinel://127.0.0.1:26379/mymaster"):
        client = redis_client(url)
        assert cluster_masters(client) is None
        await client.aclose()
    client = redis_client("redis+cluster://127.0.0.1:7000")
    assert cluster_masters(client) == frozenset()  # no slot map before the first command
    await client.aclose()


def test_router_config_refuses_an_empty_seed() -> None:
    """An empty entry in the seed list is a ConfigError at start, not silently dropped."""
    from router.service.config import load_config
    from router.shared.settings import ConfigError

    with pytest.raises(ConfigError, match="redis_url: empty host entry"):
        load_config(["--redis-url", "redis+cluster://h:7000,,h:7001"], env={})
