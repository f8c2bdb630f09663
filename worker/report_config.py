"""Configuration of ``prefix-worker report``: one frozen dataclass from CLI > ``WORKER_*`` env > YAML > defaults.

Pure apart from reading the YAML file named by ``--config`` / ``WORKER_CONFIG``.
Each field ``name`` has the flag ``--name-with-dashes``, the environment variable
``WORKER_NAME`` and the YAML key ``name``, derived by ``SETTINGS`` (``router.shared.settings.Settings``,
the mechanism the router and the emulator share); the fields without a default are required.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final
from urllib.parse import urlsplit

from router.shared.contract import (
    DEFAULT_INDEX_STRIDE,
    DEFAULT_REDIS_PREFIX,
    DEFAULT_STATE_TTL_S,
    check_configured_replica_id,
)
from router.shared.hashing import HASH_ALGOS
from router.shared.kv_event_sources import AUTO_ENDPOINT, offset_sources
from router.shared.logs import LOG_FORMATS
from router.shared.redis_client import RedisUrlError, parse_redis_url
from router.shared.secrets import with_redis_password
from router.shared.settings import ConfigError, Settings
from router.shared.version import version_line
from worker.event_filter import DEFAULT_KV_TIERS, parse_kv_tiers
from worker.probe import PROBE_TIMEOUT_S

ENV_PREFIX: Final = "WORKER_"
DEFAULT_METRICS_HOST: Final = "127.0.0.1"  # set 0.0.0.0 in a pod so Prometheus can scrape
DEFAULT_METRICS_PORT: Final = 0  # ephemeral; the bound port is logged
DEFAULT_REPLAY_TIMEOUT_S: Final = 2.0  # seconds without a replay reply before giving up
# Seconds a KV event batch waits before the worker handles it together with every batch
# published meanwhile. A loaded engine publishes one batch per scheduler step (tens of
# ms apart); handled one by one, each costs a wake-up and a Redis flush, so a window cuts the
# worker's CPU per batch (bench_worker --batch-interval-ms; its figures: docs/benchmarks.md,
# "Figures from the code's comments"). 50 ms matches the routers' default stream read interval.
DEFAULT_EVENT_WINDOW_S: Final = 0.05


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """Settings of one worker sidecar (one replica)."""

    engine_url: str  # the engine's HTTP base URL, e.g. http://127.0.0.1:8000
    # the engine's KV event PUB socket, tcp://HOST:PORT (rank 0's with data parallelism), or
    # "auto": every rank's sockets from the engine's GET /kv_event_sources
    kv_events_endpoint: str
    redis_url: str
    replica_id: str
    kv_replay_endpoint: str | None = None  # the engine's replay ROUTER socket; None: no replay
    kv_events_topic: str = ""  # vLLM KVEventsConfig.topic
    # DP ranks of the engine (vLLM --data-parallel-size) when the endpoints are given by hand:
    # rank r's ports are rank 0's + r; each rank is published as replica "{replica_id}#{r}"
    data_parallel_size: int = 1
    advertise_url: str = ""  # URL routers send traffic to; default engine_url
    redis_password: str | None = field(default=None, repr=False)  # resolved from the file/env
    redis_password_file: str | None = None  # file holding the password (a mounted Secret)
    redis_prefix: str = DEFAULT_REDIS_PREFIX
    hash_seed: str | None = None  # the routers' PYTHONHASHSEED setting (None: unset)
    block_size: int | None = None  # routers' block size if it differs from the engine's declared one
    hash_algo: str | None = None  # routers' hash algorithm; None: the engine's declared one
    index_stride: int = DEFAULT_INDEX_STRIDE  # blocks between published anchor keys; = the routers'
    kv_tiers: str = ",".join(DEFAULT_KV_TIERS)  # mediums whose events are indexed (GPU always)
    metrics_host: str = DEFAULT_METRICS_HOST
    metrics_port: int = DEFAULT_METRICS_PORT
    replay_timeout_s: float = DEFAULT_REPLAY_TIMEOUT_S
    # seconds a hash probe waits for the event socket's subscription, the completion and its
    # BlockStored, each; a probe that misses is sent again (worker.hash_check)
    probe_timeout_s: float = PROBE_TIMEOUT_S
    # seconds a KV event batch waits so that the batches of the next steps join it (one
    # wake-up and one Redis flush for all); adds at most this much index lag; 0: one by one
    event_window_s: float = DEFAULT_EVENT_WINDOW_S
    # seconds the replica's block sets outlive its last heartbeat in Redis (a scaled-down
    # replica's state expires then); a TTL refreshed by every heartbeat and flush
    state_ttl_s: float = DEFAULT_STATE_TTL_S
    log_level: str = "info"
    log_format: str = "text"  # text or json (one JSON object per line)

    @property
    def url(self) -> str:
        return self.advertise_url or self.engine_url


_HELP: Final = {
    "redis_url": "redis[s]://HOST:PORT/DB, unix:///PATH, redis[s]+cluster://HOST:PORT[,...] or "
                 "redis[s]+sentinel://HOST:PORT[,...]/SERVICE[/DB]",
    "redis_password": "DEPRECATED (visible in ps): use --redis-password-file or "
                      f"{ENV_PREFIX}REDIS_PASSWORD / REDIS_PASSWORD",
    "redis_password_file": "file holding the Redis password (e.g. a mounted Secret)",
    "log_format": "text or json (one object per line)",
    "kv_events_endpoint": "tcp://HOST:PORT of the PUB socket (rank 0's with data parallelism) "
                          "or 'auto' (every rank's from the engine's GET /kv_event_sources)",
    "data_parallel_size": "DP ranks of the engine when the endpoints are given by hand (rank "
                          "r: ports + r); each rank is the replica REPLICA_ID#r",
    "kv_tiers": "mediums whose KV events are indexed, comma-separated: GPU (always), CPU; "
                "default GPU,CPU; GPU alone makes the CPU tier invisible (STORAGE is not indexed)",
    "event_window_s": "seconds (0..1) a KV event batch waits for the next steps' batches, "
                      "handled and written to Redis together (CPU per batch, at most this much "
                      "more index lag); 0: each batch at once",
    "state_ttl_s": "seconds the replica's block sets stay in Redis after its last heartbeat "
                   "(a scaled-down replica's state then expires); at least 10",
    "replica_id": "this replica's name in Redis and on the routers' metrics; no '#' (it "
                  "separates data-parallel ranks: REPLICA_ID#rank)",
}
SETTINGS: Final = Settings(
    WorkerConfig, prog="prefix-worker report", env_prefix=ENV_PREFIX,
    description="Publish one replica's resident KV-cache block keys, heartbeat and load to "
    "Redis. Every flag can also be set as WORKER_<FLAG> (e.g. WORKER_REDIS_URL) or in the "
    "YAML file given by --config; precedence: flag > env > YAML > default.",
    version=version_line("prefix-worker"), help=_HELP)


def load_config(argv: Sequence[str], env: Mapping[str, str] | None = None) -> WorkerConfig:
    """Parse ``argv`` and merge with env (``env`` None: the process environment) and YAML
    (``router.shared.settings.Settings``). Raises ``ConfigError`` naming the flag, env var or file
    and key of a bad value."""
    env = os.environ if env is None else env

    def make(values: dict[str, Any]) -> WorkerConfig:
        config = WorkerConfig(**with_redis_password(values, argv, env))
        _validate(config)
        return config

    return SETTINGS.build(argv, env, make)


_RANK_HINT: Final = " (a data-parallel rank goes in --data-parallel-size, not the URL)"


def _check_engine_urls(config: WorkerConfig) -> None:
    """Raises ``ConfigError`` for an engine or advertised URL that is not an engine's base
    URL: not http(s), or with a query or fragment (API paths are appended to it)."""
    for name in ("engine_url", "advertise_url"):
        value = getattr(config, name)
        if value and urlsplit(value).scheme not in ("http", "https"):
            raise ConfigError(f"{name} must be an http(s) URL, got {value!r}", name)
        for mark, part, hint in (("?", "query", ""), ("#", "fragment", _RANK_HINT)):
            if mark in value:
                raise ConfigError(f"{name} {value!r} must not have a {part} ('{mark}...'): "
                                  f"give the engine's base URL{hint}", name)


def _validate(config: WorkerConfig) -> None:
    """Raises ``ConfigError`` naming the bad setting (``Settings.build`` adds its source)."""
    try:
        check_configured_replica_id(config.replica_id)
    except ValueError as exc:
        raise ConfigError(str(exc), "replica_id") from exc
    _check_engine_urls(config)
    for name in ("kv_events_endpoint", "kv_replay_endpoint"):
        value = getattr(config, name)
        if value and "://" not in value and not (name == "kv_events_endpoint"
                                                 and value == AUTO_ENDPOINT):
            raise ConfigError(f"{name} must be a ZMQ endpoint like tcp://host:port "
                              f"(or {AUTO_ENDPOINT!r}), got {value!r}", name)
    if config.data_parallel_size < 1:
        raise ConfigError(f"data_parallel_size must be >= 1, got {config.data_parallel_size}",
                          "data_parallel_size")
    if config.kv_events_endpoint != AUTO_ENDPOINT:
        try:
            offset_sources(config.kv_events_endpoint, config.kv_replay_endpoint,
                           config.kv_events_topic, config.data_parallel_size)
        except ValueError as exc:
            raise ConfigError(f"data_parallel_size {config.data_parallel_size}: {exc}",
                              "data_parallel_size") from exc
    try:
        parse_redis_url(config.redis_url)
    except RedisUrlError as exc:
        raise ConfigError(f"redis_url: {exc}", "redis_url") from exc
    if config.log_format not in LOG_FORMATS:
        raise ConfigError(f"log_format must be one of {', '.join(LOG_FORMATS)}", "log_format")
    if config.hash_algo is not None and config.hash_algo not in HASH_ALGOS:
        raise ConfigError(f"hash_algo must be one of {', '.join(HASH_ALGOS)}", "hash_algo")
    try:
        parse_kv_tiers(config.kv_tiers)
    except ValueError as exc:
        raise ConfigError(f"kv_tiers: {exc}", "kv_tiers") from exc
    if config.block_size is not None and config.block_size < 1:
        raise ConfigError(f"block_size must be >= 1, got {config.block_size}", "block_size")
    if config.index_stride < 1:
        raise ConfigError(f"index_stride must be >= 1, got {config.index_stride}", "index_stride")
    if not 0 <= config.metrics_port <= 65535:
        raise ConfigError(f"metrics_port must be 0..65535, got {config.metrics_port}",
                          "metrics_port")
    if not 0 < config.replay_timeout_s < float("inf"):
        raise ConfigError("replay_timeout_s must be a positive number of seconds",
                          "replay_timeout_s")
    if not 0 < config.probe_timeout_s < float("inf"):
        raise ConfigError("probe_timeout_s must be a positive number of seconds",
                          "probe_timeout_s")
    if not 10 <= config.state_ttl_s < float("inf"):
        raise ConfigError(f"state_ttl_s must be at least 10 seconds, got {config.state_ttl_s}",
                          "state_ttl_s")
    if not 0 <= config.event_window_s <= 1:
        raise ConfigError(f"event_window_s must be 0..1 seconds, got {config.event_window_s}",
                          "event_window_s")
    if config.log_level.lower() not in ("debug", "info", "warning", "error", "critical"):
        raise ConfigError("log_level must be one of debug, info, warning, error, critical",
                          "log_level")
