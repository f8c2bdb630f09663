"""The fleet's Redis: parse its URL (one server, Redis Cluster seeds or a Sentinel set) and build
the redis-py asyncio client for it. ``parse_redis_url`` is pure; ``redis_client`` imports
redis-py and builds a client, which connects lazily (no I/O here).

URL forms (``rediss`` instead of ``redis`` for TLS in every form):

* ``redis://[USER@]HOST[:PORT][/DB][?OPTIONS]`` and ``unix:///PATH[?db=N]``: one server, parsed
  by redis-py's own ``from_url`` (every redis-py query option works);
* ``redis+cluster://HOST:PORT[,HOST:PORT...]``: seeds of a Redis Cluster
  (``redis.asyncio.RedisCluster``, which discovers the other nodes and follows
  ``MOVED``/``ASK``); a cluster has database 0 only, so no ``/DB``;
* ``redis+sentinel://HOST:PORT[,HOST:PORT...]/SERVICE[/DB]``: a Sentinel set watching the
  master named ``SERVICE`` (``redis.asyncio.sentinel.Sentinel.master_for``, which asks the
  sentinels for the current master on every new connection, so a failover is followed).

Default ports: 6379 for servers and cluster seeds, 26379 for sentinels (Redis's own defaults).
The one query option of the multi-host forms is ``ssl_ca_certs=PATH`` (the CA bundle of a
``rediss+...`` server; what the Helm chart appends). The password is never taken from the URL's
user-info in the multi-host forms (it would show on a command line); it is passed separately
(``--redis-password-file``), and it authenticates to the data nodes, not to the sentinels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final, Literal
from urllib.parse import parse_qs, unquote, urlsplit

SINGLE_SCHEMES: Final = ("redis", "rediss", "unix")
CLUSTER_SCHEMES: Final = ("redis+cluster", "rediss+cluster")
SENTINEL_SCHEMES: Final = ("redis+sentinel", "rediss+sentinel")
SCHEMES: Final = SINGLE_SCHEMES + CLUSTER_SCHEMES + SENTINEL_SCHEMES
DEFAULT_REDIS_PORT: Final = 6379  # Redis default
DEFAULT_SENTINEL_PORT: Final = 26379  # Redis Sentinel default
MULTI_HOST_OPTIONS: Final = ("ssl_ca_certs",)

RedisMode = Literal["single", "cluster", "sentinel"]


class RedisUrlError(ValueError):
    """A Redis URL that none of the accepted forms matches."""


@dataclass(frozen=True, slots=True)
class RedisTarget:
    """Where the fleet's Redis is: what ``parse_redis_url`` returns.

    ``hosts`` are (host, port) pairs: the server (single), the cluster seeds, or the sentinels;
    empty for ``unix://``. ``service`` is the Sentinel master name; ``db`` the database number
    (always 0 for a cluster); ``url`` the URL as given (what a single-server client is built from).
    """

    mode: RedisMode
    url: str
    hosts: tuple[tuple[str, int], ...]
    tls: bool
    db: int = 0
    service: str | None = None
    username: str | None = None
    ssl_ca_certs: str | None = None


def _host_port(item: str, default_port: int, url: str) -> tuple[str, int]:
    item = item.strip()
    if item.startswith("["):  # [IPv6]:port
        host, _, rest = item[1:].partition("]")
        port_text = rest.removeprefix(":")
    else:
        host, _, port_text = item.rpartition(":") if ":" in item else (item, "", "")
    if not host:
        raise RedisUrlError(f"empty host in Redis URL {url!r}")
    try:
        port = int(port_text) if port_text else default_port
    except ValueError as exc:
        raise RedisUrlError(f"bad port {port_text!r} in Redis URL {url!r}") from exc
    if not 0 < port <= 65535:
        raise RedisUrlError(f"port {port} out of range in Redis URL {url!r}")
    return host, port


def _db(text: str, url: str) -> int:
    try:
        db = int(text)
    except ValueError as exc:
        raise RedisUrlError(f"database must be an integer, got {text!r} in {url!r}") from exc
    if db < 0:
        raise RedisUrlError(f"database must be >= 0, got {db} in {url!r}")
    return db


def parse_redis_url(url: str) -> RedisTarget:
    """Parse one of the module's URL forms. Raises ``RedisUrlError`` naming what is wrong."""
    scheme, sep, rest = url.partition("://")
    scheme = scheme.lower()
    if not sep or scheme not in SCHEMES:
        raise RedisUrlError(f"Redis URL must start with {', '.join(s + '://' for s in SCHEMES)}; "
                            f"got {url!r}")
    tls = scheme.startswith("rediss")
    if scheme in SINGLE_SCHEMES:
        parts = urlsplit(url)
        if scheme == "unix":
            if not parts.path:
                raise RedisUrlError(f"unix:// URL needs a socket path, got {url!r}")
            db_text = parse_qs(parts.query).get("db", ["0"])[0]
            return RedisTarget("single", url, (), False, _db(db_text, url))
        try:
            port = parts.port or DEFAULT_REDIS_PORT
        except ValueError as exc:
            raise RedisUrlError(f"bad port in Redis URL {url!r}") from exc
        if not parts.hostname:
            raise RedisUrlError(f"no host in Redis URL {url!r}")
        path = parts.path.strip("/")
        return RedisTarget("single", url, ((parts.hostname, port),), tls,
                           _db(path, url) if path else 0,
                           username=unquote(parts.username) if parts.username else None)
    location, _, query = rest.partition("?")
    netloc, _, path = location.partition("/")
    username = None
    if "@" in netloc:
        userinfo, _, netloc = netloc.rpartition("@")
        user, has_password, _ = userinfo.partition(":")
        if has_password:
            raise RedisUrlError("a password in a multi-host Redis URL would show on command lines; "
                                "use --redis-password-file (or REDIS_PASSWORD) instead")
        username = unquote(user) or None
    cluster = scheme in CLUSTER_SCHEMES
    default_port = DEFAULT_REDIS_PORT if cluster else DEFAULT_SENTINEL_PORT
    if not netloc.strip():
        raise RedisUrlError(f"no host in Redis URL {url!r}")
    items = netloc.split(",")
    if any(not item.strip() for item in items):  # "h:7000,,h:7001": a seed left out by mistake
        raise RedisUrlError(f"empty host entry in the host list {netloc!r} of Redis URL {url!r}")
    hosts = tuple(_host_port(item, default_port, url) for item in items)
    options = parse_qs(query, keep_blank_values=True)
    unknown = sorted(set(options) - set(MULTI_HOST_OPTIONS))
    if unknown:
        raise RedisUrlError(f"unknown Redis URL option(s) {', '.join(unknown)} in {url!r}; "
                            f"accepted: {', '.join(MULTI_HOST_OPTIONS)}")
    ca = options.get("ssl_ca_certs", [None])[0] or None
    segments = [unquote(s) for s in path.split("/") if s] if path else []
    if cluster:
        if segments and segments != ["0"]:
            raise RedisUrlError(f"a Redis Cluster has database 0 only; got /{'/'.join(segments)} "
                                f"in {url!r}")
        return RedisTarget("cluster", url, hosts, tls, 0, None, username, ca)
    if not segments or len(segments) > 2:
        raise RedisUrlError(f"a Sentinel URL needs /SERVICE[/DB] (the master's name), got {url!r}")
    db = _db(segments[1], url) if len(segments) == 2 else 0
    return RedisTarget("sentinel", url, hosts, tls, db, segments[0], username, ca)


def redis_errors() -> tuple[type[Exception], ...]:
    """The exceptions that mean the fleet's Redis failed or cannot be reached, for a retry loop:
    redis-py's ``RedisError``, ``OSError``, and ``RedisClusterException``, which is *not* a
    ``RedisError`` (redis-py 5-7 ``redis/exceptions.py``) yet is what ``RedisCluster`` raises
    when no seed answers ("Redis Cluster cannot be connected") or a slot is not covered."""
    from redis.exceptions import RedisClusterException, RedisError

    return (RedisError, RedisClusterException, OSError)


def redis_client(url: str, password: str | None = None, **connection: Any) -> Any:
    """A redis-py asyncio client for ``url`` (``redis.asyncio.Redis``, ``RedisCluster``, or a
    Sentinel-managed ``Redis``). ``connection`` holds redis-py connection keywords
    (``socket_timeout``, ``socket_connect_timeout``, ...), applied to every node and, for a
    Sentinel set, to the sentinels too. Raises ``RedisUrlError`` for a bad URL."""
    import redis.asyncio as aioredis
    from redis.asyncio.cluster import ClusterNode, RedisCluster
    from redis.asyncio.sentinel import Sentinel

    target = parse_redis_url(url)
    if target.mode == "single":
        return aioredis.Redis.from_url(url, password=password, **connection)
    tls: dict[str, Any] = {"ssl": True} if target.tls else {}
    if target.tls and target.ssl_ca_certs:
        tls["ssl_ca_certs"] = target.ssl_ca_certs
    auth: dict[str, Any] = {"password": password}
    if target.username:
        auth["username"] = target.username
    if target.mode == "cluster":
        nodes = [ClusterNode(host, port) for host, port in target.hosts]
        return RedisCluster(startup_nodes=nodes, **auth, **tls, **connection)
    sentinel = Sentinel(list(target.hosts), sentinel_kwargs={**tls, **connection}, **tls,
                        **connection)
    assert target.service is not None
    return sentinel.master_for(target.service, db=target.db, **auth)


def cluster_masters(client: Any) -> frozenset[str] | None:
    """The ``host:port`` of each master a Redis Cluster client (``redis_client``) knows, from
    redis-py's cached slot map, which the client refreshes itself after a connection error or a
    ``MOVED``: a set that differs from an earlier one means the cluster failed over (or a master
    was added or removed) in between. None for a client of one server or of a Sentinel set.
    No I/O."""
    from redis.asyncio.cluster import RedisCluster

    if not isinstance(client, RedisCluster):
        return None
    return frozenset(node.name for node in client.get_primaries())


RECONNECT_BASE_S: Final = 0.05  # the first wait is 2 x this: 0.1 s, then doubling ...
RECONNECT_CAP_S: Final = 5.0  # ... up to this, for as long as Redis stays away
FIRST_RECONNECT_WAIT_S: Final = 2 * RECONNECT_BASE_S  # ExponentialBackoff.compute(1)


def reconnect_retry(base_s: float = RECONNECT_BASE_S, cap_s: float = RECONNECT_CAP_S) -> Any:
    """redis-py's own asyncio ``Retry`` for the edges' reconnect loops: forever (``retries=-1``),
    waiting ``min(cap_s, base_s * 2**failures)`` seconds after each failure
    (``ExponentialBackoff``), on any ``RedisError`` or ``OSError`` (connection refused or reset,
    timeouts, a failover's ``READONLY``/``MOVED`` storms; ``redis_errors()``: a cluster none of
    whose seeds answers too). Use ``call_with_retry(do, fail)``:
    ``fail(exc)`` runs after each failure (log it, count it, mark the edge disconnected);
    ``CancelledError`` and errors of other types pass through."""
    from redis.asyncio.retry import Retry
    from redis.backoff import ExponentialBackoff

    # supported_errors is typed narrowly in some redis releases, not in others
    return Retry(ExponentialBackoff(cap=cap_s, base=base_s), retries=-1,
                 supported_errors=redis_errors())  # type: ignore[arg-type, unused-ignore]
