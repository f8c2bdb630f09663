"""The KV event sources of one engine: one per data-parallel rank. Pure: no I/O.

A vLLM engine started with ``--data-parallel-size N`` runs N engine cores behind one API server;
each core has its own KV block pool and publishes its own KV event stream (vLLM 0.33
``vllm/distributed/kv_events.py``: the configured tcp port offset by the DP rank, port 0 stays
ephemeral; every ``KVEventBatch`` carries its ``data_parallel_rank``). ``GET /kv_event_sources``
(``vllm/entrypoints/serve/kv_events/api_router.py``) lists the resolved endpoints of the ready
ranks. The worker keeps one replica view per rank and publishes each (engine, rank) as its own
routing target (replica id ``{replica_id}#{rank}``, ``worker.report.rank_configs``); the router sends a target's requests to the
engine URL with vLLM's ``X-data-parallel-rank`` header. The router reads the same list to check
that a static ``--replica URL#RANK`` names a rank the engine has (``router.tools.rank_check``); the
module lives in ``router`` so both sides share it (the worker may import the router's pure
modules, never the reverse).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import urlsplit

from router.shared.contract import RANK_SEPARATOR

__all__ = ["AUTO_ENDPOINT", "RANK_SEPARATOR", "RankSource", "offset_sources",
           "parse_kv_event_sources"]

AUTO_ENDPOINT: Final = "auto"  # --kv-events-endpoint value: discover from GET /kv_event_sources


@dataclass(frozen=True, slots=True)
class RankSource:
    """One DP rank's KV event sockets: ``endpoint`` (PUB, to connect to), ``replay_endpoint``
    (ROUTER or None) and ``topic``."""

    dp_rank: int
    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""


def _connectable(endpoint: str, engine_host: str) -> str:
    """A bind address (``tcp://*:P``, ``tcp://0.0.0.0:P``, ``tcp://[::]:P``) as the address to
    connect to on the engine's host; other endpoints as given."""
    if not endpoint.startswith("tcp://"):
        return endpoint
    host, sep, port = endpoint[len("tcp://"):].rpartition(":")
    if sep and host in ("*", "0.0.0.0", "[::]", "::"):
        shown = f"[{engine_host}]" if ":" in engine_host else engine_host
        return f"tcp://{shown}:{port}"
    return endpoint


def _entry(rank: Any, raw: Any, engine_host: str) -> RankSource:
    if not isinstance(raw, Mapping):
        raise ValueError(f"source of rank {rank!r} is not an object")
    try:
        dp_rank = int(rank)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"bad data_parallel_rank {rank!r}") from exc
    if dp_rank < 0:
        raise ValueError(f"bad data_parallel_rank {dp_rank}")
    endpoint = raw.get("endpoint")
    if not isinstance(endpoint, str) or "://" not in endpoint:
        raise ValueError(f"rank {dp_rank}: endpoint {endpoint!r} is not a ZMQ endpoint")
    replay = raw.get("replay_endpoint")
    if replay is not None and (not isinstance(replay, str) or "://" not in replay):
        raise ValueError(f"rank {dp_rank}: replay_endpoint {replay!r} is not a ZMQ endpoint")
    topic = raw.get("topic") or ""
    return RankSource(dp_rank, _connectable(endpoint, engine_host),
                      _connectable(replay, engine_host) if replay else None, str(topic))


def parse_kv_event_sources(body: Any, engine_url: str) -> list[RankSource]:
    """``GET /kv_event_sources`` body -> the sources in rank order.

    Accepts the shapes vLLM has served: a bare array of ``{data_parallel_rank, endpoint,
    replay_endpoint, topic}`` (0.33), the same array under ``"sources"``, and an object keyed by
    the rank (each value a ``KVEventsConfig``; what vllm-router's ``kv_aware`` reads). Entries
    with ``publisher`` "null" or ``enable_kv_cache_events`` false publish nothing and are left
    out. Bind addresses (``*``, ``0.0.0.0``) become the engine URL's host. Raises
    ``ValueError`` for another shape, a bad entry or a rank listed twice.
    """
    host = urlsplit(engine_url).hostname or "127.0.0.1"
    if isinstance(body, Mapping) and isinstance(body.get("sources"), list):
        body = body["sources"]
    pairs: list[tuple[Any, Any]]
    if isinstance(body, list):
        pairs = [(raw.get("data_parallel_rank") if isinstance(raw, Mapping) else None, raw)
                 for raw in body]
    elif isinstance(body, Mapping):
        pairs = list(body.items())
    else:
        raise ValueError("kv_event_sources body is neither an array nor an object")
    sources: dict[int, RankSource] = {}
    for rank, raw in pairs:
        if isinstance(raw, Mapping) and (raw.get("publisher") == "null"
                                         or raw.get("enable_kv_cache_events") is False):
            continue
        source = _entry(rank, raw, host)
        if source.dp_rank in sources:
            raise ValueError(f"rank {source.dp_rank} listed twice")
        sources[source.dp_rank] = source
    return [sources[r] for r in sorted(sources)]


def offset_sources(endpoint: str, replay_endpoint: str | None, topic: str,
                   dp_size: int) -> list[RankSource]:
    """The sources of ``dp_size`` ranks configured by rank 0's endpoints: each rank's tcp port
    is rank 0's plus the rank (vLLM 0.33 ``offset_endpoint_port``), ipc/inproc paths get
    ``_dp{rank}``. Raises ``ValueError`` for ``dp_size`` < 1, or a tcp endpoint without a port
    or with port 0 when ``dp_size`` > 1 (ephemeral ports cannot be derived: use discovery)."""
    if dp_size < 1:
        raise ValueError("data parallel size must be >= 1")
    if dp_size == 1:
        return [RankSource(0, endpoint, replay_endpoint, topic)]

    def offset(address: str, rank: int) -> str:
        if address.startswith(("ipc://", "inproc://")):
            return f"{address}_dp{rank}"
        parts = urlsplit(address)
        try:
            port = parts.port
        except ValueError:
            port = None
        if parts.scheme != "tcp" or not port:
            raise ValueError(f"cannot derive rank {rank}'s endpoint from {address!r} (a tcp "
                             f"endpoint with a fixed port is needed; or use {AUTO_ENDPOINT!r})")
        host = address[len("tcp://"):].rpartition(":")[0]
        return f"tcp://{host}:{port + rank}"

    return [RankSource(rank, offset(endpoint, rank),
                       offset(replay_endpoint, rank) if replay_endpoint else None, topic)
            for rank in range(dp_size)]
