"""Router configuration: one frozen dataclass, built from CLI flags > ``ROUTER_*`` env > YAML > defaults.

Pure apart from reading the YAML file named by ``--config`` / ``ROUTER_CONFIG``.
Every setting is a field of ``RouterConfig``; ``SETTINGS`` (``router.shared.settings.Settings``, the
mechanism the worker and the emulator share) derives its CLI flag ``--field-name``, its
environment variable ``ROUTER_FIELD_NAME`` and its YAML key ``field_name``. List settings
(``replicas``) take repeated singular flags (``--replica``), a comma-separated env value
(``ROUTER_REPLICAS`` or ``ROUTER_REPLICA``) or a YAML list.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final
from urllib.parse import urlsplit

from router.apis.aliases import AliasTable
from router.decision.policy import POLICIES, PolicyParams
from router.shared.contract import DEFAULT_INDEX_STRIDE, DEFAULT_REDIS_PREFIX
from router.shared.hashing import DEFAULT_BLOCK_SIZE, DEFAULT_HASH_ALGO, HASH_ALGOS
from router.shared.logs import LOG_FORMATS
from router.shared.redis_client import RedisUrlError, parse_redis_url
from router.shared.secrets import with_redis_password
from router.shared.settings import ConfigError, Settings
from router.shared.version import version_line
from router.traffic.admission import (
    DEFAULT_MAX_QUEUE_LENGTH,
    DEFAULT_MAX_QUEUE_WAIT_S,
    AdmissionLimits,
)
from router.traffic.classes import (
    DEFAULT_AGING_S,
    DEFAULT_CLASS,
    DEFAULT_CLASSES,
    PriorityClasses,
    TenantTraffic,
    priority_classes,
)
from router.traffic.sessions import DEFAULT_MAX_SESSIONS, DEFAULT_SESSION_TTL_S

LOG_LEVELS: Final = ("debug", "info", "warning", "error", "critical")
ENV_PREFIX: Final = "ROUTER_"
MAX_DP_RANK: Final = 2**31 - 1  # a rank is a C int in vLLM's process groups (torch.distributed)

# The policy's tunables are declared once, with their defaults, in ``router.decision.policy.PolicyParams``;
# the settings below take those defaults and ``RouterConfig.policy_params`` hands them back.
_POLICY: Final = PolicyParams()
DEFAULT_PORT: Final = 8000
DEFAULT_LOAD_FACTOR: Final = _POLICY.load_factor  # bounded-load cap as a multiple of the mean load
DEFAULT_VNODES: Final = 128  # virtual nodes per replica on the ring
DEFAULT_SPECULATIVE_TTL_S: Final = 10.0  # seconds a router-side placement counts as a hit
DEFAULT_QUEUE_SLACK_TOKENS: Final = _POLICY.queue_slack_tokens  # tokens of extra queue accepted to keep affinity/ring home
DEFAULT_LOAD_HEADROOM: Final = _POLICY.load_headroom  # requests allowed above ceil(load_factor * mean) (small counts)
DEFAULT_RECOMPUTE_PENALTY: Final = _POLICY.recompute_penalty  # extra weight on recomputed prefix tokens in a load move:
# a held prefix moves only behind a queue ~50x its size; a higher penalty keeps more prefix hits at
# about the same TTFT (the Mooncake sweep: docs/benchmarks.md, "Figures from the code's comments")
DEFAULT_MIN_HIT_FRACTION: Final = _POLICY.min_hit_fraction  # share of the prompt's blocks a replica must hold beyond the ring home
DEFAULT_MIN_AFFINITY_BLOCKS: Final = _POLICY.min_affinity_blocks  # and at least this many blocks, for affinity to count
DEFAULT_CONSISTENT_HASH_TOKENS: Final = _POLICY.consistent_hash_blocks * _POLICY.block_size  # tokens keyed by the consistent_hash baseline
DEFAULT_COLD_CANDIDATES: Final = _POLICY.cold_candidates  # replicas, in ring order, a cold prefix may go to (the one with
# the fewest recent KV writes wins); 0 = all, 1 = the ring home only. More candidates spread cold
# prefixes over the caches and bring the hit rate to the single-cache bound (the Mooncake placement
# simulation: docs/benchmarks.md, "Figures from the code's comments")
DEFAULT_COLD_QUEUE_SLACK_TOKENS: Final = _POLICY.cold_queue_slack_tokens  # a cold prefix treats queues this close to the shortest
# as equally short and picks among them by recent writes (0: the shortest queue always wins)
DEFAULT_COLD_WRITE_WINDOW: Final = 0.5  # recent KV writes decay with e-folding at this share of the
# fleet's KV capacity written (scale-free: the span an LRU cache remembers, not seconds)
DEFAULT_TTFT_PRIOR_TOKENS_PER_S: Final = _POLICY.ttft_prior_tokens_per_s  # ttft policy: prefill work
# tokens/s a replica is assumed to do before its first few dozen requests taught the router its rate
DEFAULT_TTFT_EVICTED_REUSE: Final = _POLICY.evicted_reuse  # ttft policy: chance that a block a new
# prefix evicts (from a replica writing its fair share of KV) would have been hit again
DEFAULT_TTFT_DECODE_WEIGHT: Final = _POLICY.decode_weight  # ttft policy: TTFT seconds one second of
# decode-step time (summed over the requests sharing a replica's steps) is worth
DEFAULT_CPU_LOAD_TOKENS_PER_S: Final = _POLICY.cpu_load_tokens_per_s  # tokens/s a replica loads
# from its CPU tier (host memory) into the GPU: what a CPU-tier hit costs instead of its prefill
# (router.decision.ttft: 50 GB/s host link / 128 KiB of KV per token, an 8B model; the emulator's profile)
DEFAULT_REPLICA_KV_BLOCKS: Final = 32_000  # KV capacity assumed for replicas that do not report it
DEFAULT_MAX_BODY_BYTES: Final = 32 * 1024 * 1024  # a 128k-token token-id body is ~1 MB; text ~0.5 MB
DEFAULT_CONNECT_TIMEOUT_S: Final = 5.0
DEFAULT_FIRST_BYTE_TIMEOUT_S: Final = 600.0  # a long prefill behind a queue can take minutes
DEFAULT_STREAM_IDLE_TIMEOUT_S: Final = 120.0
DEFAULT_STREAM_READ_INTERVAL_S: Final = 0.05  # pause after a KV-event stream read that returned
# fewer entries than a full batch, so a trickle gathers into fewer XREADs (each costs Python CPU):
# CPU against index lag (loadtest.bench.streams, docs/benchmarks.md)
DEFAULT_TOKENIZER_THREADS: Final = 2
DEFAULT_TOKEN_CACHE_CHUNKS: Final = 65536  # prompt chain cache entries (text chunks of 256-1024
# chars or 256-token id spans, ~1-3 KB each); the per-chunk token cache keeps 1/8 of that
DEFAULT_PROMPT_CACHE_MIB: Final = 128  # memory bound of the prompt caches together: 3/4 chain
# nodes, 1/8 chunk tokens, 1/8 rendered chats (issue 15: a count bound let 2 MB prompts hold GBs)
DEFAULT_STATIC_PROBE_INTERVAL_S: Final = 2.0  # /health probe period for static --replica URLs
DEFAULT_HEALTH_FAILURES: Final = 3  # consecutive failed /health probes before a static replica is
# down (Kubernetes' failureThreshold default); one slow probe of a busy replica is not an outage
DEFAULT_CIRCUIT_FAILURES: Final = 3  # consecutive failed requests (5xx, connection, timeout) ...
DEFAULT_CIRCUIT_WINDOW_S: Final = 30.0  # ... within this many seconds open a replica's circuit
DEFAULT_CIRCUIT_EJECTION_S: Final = 5.0  # first ejection; doubles per repeat (Envoy: 30 s base)
DEFAULT_CIRCUIT_MAX_EJECTION_S: Final = 60.0
DEFAULT_PANIC_THRESHOLD: Final = 0.5  # fewer routable replicas than this share: route to all
# (Envoy's healthy_panic_threshold default, 50%); 0 turns panic mode off
DEFAULT_STALL_TIMEOUT_S: Final = 15.0  # no byte on any streamed request while others progress
DEFAULT_FIRST_BYTE_DEADLINE_FACTOR: Final = 4.0  # a request's first-byte deadline: this x the time
# its replica should take (predicted TTFT, queue wait and prefill included, + a non-streamed
# answer's generation); the learned model is only roughly right (router/decision/ttft.py;
# docs/benchmarks.md), a queue can double it
DEFAULT_FIRST_BYTE_DEADLINE_FLOOR_S: Final = 5.0  # ... and at least this: a hung replica fed
# non-streamed prompts every few seconds is benched after at most a few of them (issue 29)
DEFAULT_OVERLOAD_SHED_MIN_INFLIGHT: Final = 64  # shed new requests while the loop runs late only
# with at least this many in flight: a handful cannot make the loop late, so the lateness is the
# machine's and shedding them would relieve nothing (issue 29: 1,000 streams starved it)
DEFAULT_CLIENT_IDLE_TIMEOUT_S: Final = 15.0  # a client connection idle or sending its request head
# this long is closed (uvicorn closes idle connections after 5 s, nginx's header timeout is 60 s)
DEFAULT_CLIENT_BODY_TIMEOUT_S: Final = 30.0  # a request body must arrive within this (408 beyond)
DEFAULT_MAX_IDLE_CLIENT_CONNECTIONS: Final = 1024  # idle keep-alive client connections kept
DEFAULT_SHUTDOWN_TIMEOUT_S: Final = 120.0  # in-flight requests' time to finish after a stop
# signal (the stream idle timeout: a stream silent longer is cut anyway)
DEFAULT_CHAT_TEMPLATE_TIMEOUT_S: Final = 2.0  # a request-supplied chat template's render, at most
DEFAULT_CHAT_TEMPLATE_MAX_BYTES: Final = 4 * 1024 * 1024  # and its rendered text, at most
# a Responses answer's replica is remembered this long for previous_response_id (vLLM keeps
# stored responses for the engine's lifetime; a day bounds what Redis holds)
DEFAULT_RESPONSE_AFFINITY_TTL_S: Final = 86_400.0


# the proxy's client to replicas: the httptools pool for http:// replicas (the default: cheaper per
# request, router/edges/upstream_pool.py; docs/benchmarks.md, router CPU per request), or
# aiohttp's ClientSession for every replica; https:// replicas use the session either way
UPSTREAM_CLIENTS: Final = ("aiohttp", "httptools")


# RouterConfig's checks, by kind: {setting: allowed values}, {setting: least value}, settings > 0
_ONE_OF: Final = {"log_format": LOG_FORMATS, "policy": POLICIES, "hash_algo": HASH_ALGOS,
                  "log_level": LOG_LEVELS, "client_cache_salt": ("override", "reject"),
                  "debug_access": ("admin", "tenant"), "metrics_access": ("open", "admin"),
                  "upstream_client": UPSTREAM_CLIENTS}
_AT_LEAST: Final = {
    "block_size": 1, "index_stride": 1, "load_factor": 1.0, "vnodes": 1, "max_body_bytes": 1024,
    "replica_kv_blocks": 1, "health_failures": 1, "circuit_failures": 1,
    "chat_template_max_bytes": 1, "tokenizer_threads": 1, "audit_head_tokens": 16,
    **dict.fromkeys(("drain_delay_s", "shutdown_timeout_s", "stream_read_interval_s", "queue_slack_tokens",
                     "consistent_hash_tokens", "token_cache_chunks", "prompt_cache_mib",
                     "load_headroom", "recompute_penalty", "min_affinity_blocks", "cold_candidates",
                     "cold_queue_slack_tokens", "audit_families", "audit_top_k",
                     "max_idle_client_connections", "admission_max_inflight",
                     "admission_max_inflight_per_replica", "admission_max_queued_prefill_s",
                     "admission_priority_aging_s", "session_affinity_max_sessions",
                     "rate_limit_requests_per_min", "rate_limit_tokens_per_min",
                     "overload_shed_min_inflight"), 0),
    "admission_max_queue_length": 1}
_POSITIVE: Final = ("ttft_prior_tokens_per_s", "cpu_load_tokens_per_s", "cold_write_window",
                    "speculative_ttl_s", "connect_timeout_s", "first_byte_timeout_s", "stream_idle_timeout_s",
                    "static_probe_interval_s", "circuit_window_s", "circuit_ejection_s",
                    "circuit_max_ejection_s", "stall_timeout_s", "first_byte_deadline_factor",
                    "first_byte_deadline_floor_s", "client_idle_timeout_s",
                    "client_body_timeout_s", "chat_template_timeout_s",
                    "admission_max_queue_wait_s", "response_affinity_ttl_s",
                    "session_affinity_ttl_s")


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """All router settings, validated once in ``__post_init__`` (raises ``ConfigError``)."""

    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    redis_url: str | None = None
    redis_password: str | None = field(default=None, repr=False)  # resolved from the file/env
    redis_password_file: str | None = None  # file holding the password (a mounted Secret)
    redis_prefix: str = DEFAULT_REDIS_PREFIX
    replicas: tuple[str, ...] = ()  # static replica base URLs (no worker needed)
    model: str | None = None  # served model name of static replicas (default: ask their /v1/models)
    tokenizer: str | None = None  # local dir or hub id; None -> route text by hashing the text
    block_size: int = DEFAULT_BLOCK_SIZE  # tokens; vLLM default
    hash_algo: str = DEFAULT_HASH_ALGO
    hash_seed: str | None = None  # the engines' PYTHONHASHSEED, if set
    index_stride: int = DEFAULT_INDEX_STRIDE  # blocks between index anchors; must equal the workers'
    stream_read_interval_s: float = DEFAULT_STREAM_READ_INTERVAL_S  # seconds between event reads
    policy: str = "prefix"
    load_factor: float = DEFAULT_LOAD_FACTOR
    log_level: str = "info"
    log_format: str = "text"  # text or json (one JSON object per line, with the request id)
    otlp_traces_endpoint: str | None = None  # OTLP/HTTP traces endpoint; None: no tracing
    ready_file: str | None = None
    vnodes: int = DEFAULT_VNODES
    speculative_ttl_s: float = DEFAULT_SPECULATIVE_TTL_S
    queue_slack_tokens: int = DEFAULT_QUEUE_SLACK_TOKENS
    load_headroom: int = DEFAULT_LOAD_HEADROOM
    recompute_penalty: float = DEFAULT_RECOMPUTE_PENALTY
    min_hit_fraction: float = DEFAULT_MIN_HIT_FRACTION
    min_affinity_blocks: int = DEFAULT_MIN_AFFINITY_BLOCKS
    consistent_hash_tokens: int = DEFAULT_CONSISTENT_HASH_TOKENS
    cold_candidates: int = DEFAULT_COLD_CANDIDATES
    cold_write_window: float = DEFAULT_COLD_WRITE_WINDOW
    cold_queue_slack_tokens: int = DEFAULT_COLD_QUEUE_SLACK_TOKENS
    replica_kv_blocks: int = DEFAULT_REPLICA_KV_BLOCKS  # static replicas (no heartbeat capacity)
    ttft_prior_tokens_per_s: float = DEFAULT_TTFT_PRIOR_TOKENS_PER_S
    ttft_evicted_reuse: float = DEFAULT_TTFT_EVICTED_REUSE
    ttft_decode_weight: float = DEFAULT_TTFT_DECODE_WEIGHT
    cpu_load_tokens_per_s: float = DEFAULT_CPU_LOAD_TOKENS_PER_S
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S
    first_byte_timeout_s: float = DEFAULT_FIRST_BYTE_TIMEOUT_S
    stream_idle_timeout_s: float = DEFAULT_STREAM_IDLE_TIMEOUT_S
    upstream_client: str = "httptools"  # httptools (the pool, http:// replicas) | aiohttp
    tokenizer_threads: int = DEFAULT_TOKENIZER_THREADS
    token_cache_chunks: int = DEFAULT_TOKEN_CACHE_CHUNKS
    prompt_cache_mib: int = DEFAULT_PROMPT_CACHE_MIB
    static_probe_interval_s: float = DEFAULT_STATIC_PROBE_INTERVAL_S
    # tenant isolation (router/auth.py): API keys on, per-tenant cache_salt injected
    api_keys: str | None = None  # key-hash file, or a directory of one file per tenant (a Secret)
    cache_salt_secret_file: str | None = None  # HMAC secret of the tenant salts (same on all routers)
    client_cache_salt: str = "override"  # a client's own cache_salt: override | reject
    admin_tenants: tuple[str, ...] = ()  # tenants that may call restricted endpoints
    debug_access: str = "admin"  # /debug/* with keys on: admin tenants | any tenant (own salt)
    metrics_access: str = "open"  # /metrics with keys on: open | admin tenants
    # template audit (router/audit.py, GET /debug/prefixes); 0 families: off
    audit_families: int = 256
    audit_head_tokens: int = 1024  # tokens of each prompt's head the audit compares
    audit_top_k: int = 10  # families exported as metrics and listed by default
    health_failures: int = DEFAULT_HEALTH_FAILURES
    circuit_failures: int = DEFAULT_CIRCUIT_FAILURES
    circuit_window_s: float = DEFAULT_CIRCUIT_WINDOW_S
    circuit_ejection_s: float = DEFAULT_CIRCUIT_EJECTION_S
    circuit_max_ejection_s: float = DEFAULT_CIRCUIT_MAX_EJECTION_S
    stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S
    first_byte_deadline_factor: float = DEFAULT_FIRST_BYTE_DEADLINE_FACTOR
    first_byte_deadline_floor_s: float = DEFAULT_FIRST_BYTE_DEADLINE_FLOOR_S
    panic_threshold: float = DEFAULT_PANIC_THRESHOLD
    overload_shed_min_inflight: int = DEFAULT_OVERLOAD_SHED_MIN_INFLIGHT  # 0: never shed
    client_idle_timeout_s: float = DEFAULT_CLIENT_IDLE_TIMEOUT_S
    client_body_timeout_s: float = DEFAULT_CLIENT_BODY_TIMEOUT_S
    max_idle_client_connections: int = DEFAULT_MAX_IDLE_CLIENT_CONNECTIONS
    # vLLM --trust-request-chat-template: without it a request's own chat_template is refused
    trust_request_chat_template: bool = False
    chat_template_timeout_s: float = DEFAULT_CHAT_TEMPLATE_TIMEOUT_S
    chat_template_max_bytes: int = DEFAULT_CHAT_TEMPLATE_MAX_BYTES
    response_affinity_ttl_s: float = DEFAULT_RESPONSE_AFFINITY_TTL_S
    # replicas used while no worker-reported fleet is known (Redis down at start-up)
    fallback_replicas: tuple[str, ...] = ()
    # client-facing model names: NAME=MODEL, or a weighted split NAME=A:WA;B:WB (router.apis.aliases)
    model_aliases: tuple[str, ...] = ()
    fleet_cache_file: str | None = None  # the last fleet seen in Redis, kept for a cold start
    drain_delay_s: float = 0.0  # after a stop signal: /ready 503 while still accepting, this long
    shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S
    # admission (router/traffic): a limit of 0 is off; all off (the default): nothing waits
    admission_max_inflight: int = 0  # this router's requests admitted and not finished
    admission_max_inflight_per_replica: int = 0  # this router's requests in flight on a replica
    admission_max_queued_prefill_s: float = 0.0  # predicted prefill seconds queued on a replica
    admission_max_queue_length: int = DEFAULT_MAX_QUEUE_LENGTH  # requests waiting for room
    admission_max_queue_wait_s: float = DEFAULT_MAX_QUEUE_WAIT_S  # a request's wait, at most
    admission_priority_classes: tuple[str, ...] = DEFAULT_CLASSES  # highest first
    admission_default_priority_class: str = DEFAULT_CLASS
    admission_priority_aging_s: float = DEFAULT_AGING_S  # waiting that raises a class a rank
    admission_tenants_file: str | None = None  # YAML: each tenant's default class and weight
    admission_forward_priority: bool = False  # the class rank as the body's priority (vLLM)
    admission_ttft_targets: tuple[str, ...] = ()  # CLASS=SECONDS: SLO-aware admission
    # session affinity (router/traffic/sessions.py): sessions remembered, 0 = off; idle expiry
    session_affinity_max_sessions: int = DEFAULT_MAX_SESSIONS
    session_affinity_ttl_s: float = DEFAULT_SESSION_TTL_S
    # per-tenant rate limits through Redis (router/traffic/rate_limits.py); 0: none
    rate_limit_requests_per_min: int = 0
    rate_limit_tokens_per_min: int = 0
    config: str | None = field(default=None, compare=False)  # the YAML file this came from

    def policy_params(self) -> PolicyParams:
        """The policy's tunables from these settings: every ``PolicyParams`` field of the same
        name, plus the derived ones (``consistent_hash_blocks``, ``evicted_reuse``,
        ``decode_weight``)."""
        same = {f.name: getattr(self, f.name) for f in dataclasses.fields(PolicyParams)
                if hasattr(self, f.name)}
        return PolicyParams(
            **same, consistent_hash_blocks=max(1, self.consistent_hash_tokens // self.block_size),
            evicted_reuse=self.ttft_evicted_reuse, decode_weight=self.ttft_decode_weight)

    def admission_limits(self) -> AdmissionLimits:
        """The admission limits from the ``admission_*`` settings."""
        return AdmissionLimits(
            self.admission_max_inflight, self.admission_max_inflight_per_replica,
            self.admission_max_queued_prefill_s, self.admission_max_queue_length,
            self.admission_max_queue_wait_s)

    def priority_classes(self, tenants: Mapping[str, TenantTraffic] | None = None,
                         ) -> PriorityClasses:
        """The priority classes from the ``admission_*`` settings, with ``tenants``' settings
        (the tenant file). Raises ``ValueError`` for a tenant naming an unknown class."""
        return priority_classes(self.admission_priority_classes,
                                self.admission_default_priority_class, tenants,
                                self.admission_ttft_targets)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"{f.name} must be a finite number, got {value}", f.name)
        if self.redis_url is not None:
            try:
                parse_redis_url(self.redis_url)
            except RedisUrlError as exc:
                raise ConfigError(f"redis_url: {exc}", "redis_url") from exc
        for name, allowed in _ONE_OF.items():
            if getattr(self, name) not in allowed:
                raise ConfigError(f"{name} must be one of {', '.join(allowed)}, "
                                  f"got {getattr(self, name)!r}", name)
        if self.otlp_traces_endpoint is not None and not self.otlp_traces_endpoint.startswith(
                ("http://", "https://")):
            raise ConfigError(f"otlp_traces_endpoint must be an http(s) URL (OTLP/HTTP), "
                              f"got {self.otlp_traces_endpoint!r}", "otlp_traces_endpoint")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be 0..65535, got {self.port}", "port")
        for name, least in _AT_LEAST.items():
            if getattr(self, name) < least:
                raise ConfigError(f"{name} must be >= {least}, got {getattr(self, name)}", name)
        for name in _POSITIVE:
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}", name)
        for name in ("min_hit_fraction", "ttft_evicted_reuse", "ttft_decode_weight",
                     "panic_threshold"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ConfigError(f"{name} must be in [0, 1], got {getattr(self, name)}", name)
        for name in ("replicas", "fallback_replicas"):
            for url in getattr(self, name):
                if not url.startswith(("http://", "https://")):
                    raise ConfigError(f"replica URL must start with http:// or https://, "
                                      f"got {url!r}", name)
                if "?" in url:  # the proxy appends the API path: a query would end up before it
                    raise ConfigError(f"replica URL {url!r} must not have a query ('?...'): "
                                      f"give the engine's base URL", name)
            try:
                check_replica_urls(getattr(self, name))
            except ValueError as exc:
                raise ConfigError(str(exc), name) from exc
        AliasTable.from_specs(self.model_aliases)  # raises ConfigError
        if self.api_keys and not self.cache_salt_secret_file:
            raise ConfigError("api_keys needs cache_salt_secret_file (every router process "
                              "must derive the same per-tenant cache salts)", "api_keys")
        try:
            priority_classes(self.admission_priority_classes,
                             self.admission_default_priority_class)
        except ValueError as exc:
            raise ConfigError(f"admission_priority_classes: {exc}",
                              "admission_priority_classes") from exc
        try:
            self.priority_classes()
        except ValueError as exc:
            raise ConfigError(f"admission_ttft_targets: {exc}", "admission_ttft_targets") from exc
        if not self.redis_url and not self.replicas:
            raise ConfigError("need --redis-url (worker-reported fleet) or at least one --replica URL")


def split_replica_url(url: str) -> tuple[str, int | None]:
    """``http://host:port[/path][#RANK]`` -> (the base URL, without the fragment and trailing
    ``/``; the engine's data-parallel rank, or None without a fragment).

    The fragment names one DP rank of an engine started with vLLM's ``--data-parallel-size``
    (every rank behind the one URL; the router selects it with ``X-data-parallel-rank``, vLLM
    ``_get_data_parallel_rank``); a fragment is never sent over HTTP, so it can carry it.
    Raises ``ValueError`` for a fragment that is not a non-negative decimal integer.
    """
    base, has_rank, rank = url.partition("#")
    if not has_rank:
        return url.rstrip("/"), None
    if not (rank.isascii() and rank.isdigit()):
        raise ValueError(f"replica URL fragment must be a data-parallel rank (0, 1, ...), "
                         f"got {url!r}")
    if len(rank) > 1 and rank.startswith("0"):
        raise ValueError(f"replica URL fragment must be a rank without leading zeros, got {url!r}")
    if len(rank) > len(str(MAX_DP_RANK)) or int(rank) > MAX_DP_RANK:
        raise ValueError(f"data-parallel rank must be at most {MAX_DP_RANK}, got {url!r}")
    return base.rstrip("/"), int(rank)


def static_replica_id(url: str) -> str:
    """Id of a static replica: ``host:port`` of its URL (host lower-cased, default ports filled
    in), with ``#RANK`` for one data-parallel rank of an engine (``split_replica_url``), as
    workers name ranks. Raises ``ValueError`` for a URL without a host, a bad port or a
    fragment that is not a rank."""
    _, dp_rank = split_replica_url(url)
    parts = urlsplit(url)
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError as exc:
        raise ValueError(f"replica URL {url!r}: {exc}") from exc
    if not parts.hostname:
        raise ValueError(f"replica URL has no host: {url!r}")
    return f"{parts.hostname}:{port}" + ("" if dp_rank is None else f"#{dp_rank}")


def check_replica_urls(urls: Sequence[str]) -> None:
    """Refuse a list of static replica URLs (``--replica`` or ``--fallback-replica``) that
    names one routing target twice (same id after ``static_replica_id``: ``http://h:80/#1``
    is ``http://h#1``) or lists an engine both whole (no fragment: vLLM balances its ranks)
    and by rank: the whole engine's requests would land on the named ranks unseen by their
    load and placements. Raises ``ValueError`` naming the URLs."""
    seen: dict[str, str] = {}  # {replica id: the URL that gave it}
    for url in urls:
        rid = static_replica_id(url)
        if rid in seen:
            raise ValueError(f"{url!r} names the same replica {rid} as {seen[rid]!r}")
        seen[rid] = url
    for rid, url in seen.items():
        engine, has_rank, _ = rid.partition("#")
        if has_rank and engine in seen:
            raise ValueError(f"engine {engine} is listed whole ({seen[engine]!r}) and by rank "
                             f"({url!r}): list it once without a fragment (vLLM balances its "
                             f"ranks) or once per rank")


_HELP: Final = {
    "replicas": "static replica base URL (repeatable; env ROUTER_REPLICA(S), comma-separated); "
                "id is host:port; URL#RANK targets one data-parallel rank of the engine "
                "(X-data-parallel-rank), id host:port#RANK",
    "redis_url": "the fleet's Redis: redis[s]://HOST:PORT/DB, unix:///PATH, "
                 "redis[s]+cluster://HOST:PORT[,HOST:PORT...] or "
                 "redis[s]+sentinel://HOST:PORT[,...]/SERVICE[/DB]",
    "redis_password": "DEPRECATED on the command line (visible in ps); use --redis-password-file "
                      "or ROUTER_REDIS_PASSWORD / REDIS_PASSWORD",
    "redis_password_file": "file holding the Redis password (e.g. a mounted Secret)",
    "log_format": "|".join(LOG_FORMATS) + "; json: one object per line with the request id",
    "otlp_traces_endpoint": "OTLP/HTTP endpoint for OpenTelemetry traces, e.g. "
                            "http://otel-collector:4318/v1/traces (needs prefix-router[tracing]); "
                            "default: no tracing",
    "model": "served model name of static replicas (default: ask their /v1/models)",
    "load_factor": "bounded load: no replica above ceil(load_factor x mean) + load_headroom "
                   "in-flight requests",
    "min_hit_fraction": "share of the prompt a replica must hold beyond the ring home for affinity",
    "cold_candidates": "replicas (in ring order) a cold prefix may go to; 0 = all, 1 = ring home",
    "cold_queue_slack_tokens": "queued prefill within this of the shortest counts as short "
                               "for cold placement",
    "cold_write_window": "recent KV writes decay over this share of the fleet's KV capacity",
    "replica_kv_blocks": "KV capacity (blocks) assumed for replicas that do not report it",
    "recompute_penalty": "extra weight of recomputed prefix tokens when moving for load",
    "queue_slack_tokens": "queue advantage (tokens) a load move must exceed beyond the recompute",
    "ttft_prior_tokens_per_s": "ttft policy: prefill tokens/s assumed per replica until learned",
    "cpu_load_tokens_per_s": "tokens/s a replica loads from its CPU tier (host memory) into the "
                             "GPU: a CPU-tier hit costs this transfer instead of its prefill "
                             "(default: 50 GB/s host link / 128 KiB KV per token)",
    "ttft_evicted_reuse": "ttft policy: hit chance (0-1) of a KV block a new prefix evicts, at a "
                          "fair write share",
    "ttft_decode_weight": "ttft policy: TTFT seconds (0-1) one second of decode-step time is "
                          "worth, summed over the requests sharing a replica's steps (0: off)",
    "speculative_ttl_s": "seconds this router's own placements count as hits",
    "max_body_bytes": "request body limit (413 beyond)",
    "upstream_client": "the proxy's client to replicas: httptools (a small pooled client, http:// "
                       "replicas; https:// stay on aiohttp) | aiohttp (ClientSession)",
    "prompt_cache_mib": "memory bound of the prompt caches (MiB, estimated): 3/4 block-key "
                        "chains, 1/8 chunk tokens, 1/8 rendered chats; 0 turns them off",
    "tokenizer": "tokenizer dir or hub id; without it text prompts are routed by hashing the text",
    "policy": "|".join(POLICIES),
    "health_failures": "consecutive failed /health probes before a static replica is down",
    "circuit_failures": "consecutive failed requests (within circuit_window_s) that open a "
                        "replica's circuit",
    "circuit_ejection_s": "first ejection of an open circuit (doubles per repeat, at most "
                          "circuit_max_ejection_s); then a router-made 1-token probe",
    "stream_read_interval_s": "pause (s) after a KV-event stream read that was not a full batch: "
                              "fewer reads (router CPU) against more index lag",
    "panic_threshold": "when fewer than this share (0-1) of a model's replicas are routable, "
                       "route to all of them as if healthy (Envoy's panic mode; 0 = off)",
    "overload_shed_min_inflight": "answer new generate requests 503 router_overloaded at once "
                                  "while the router's event loop ran late for most of the last "
                                  "second, its timers fall due late and at least this many "
                                  "requests are in flight (this one included); 0: never",
    "stall_timeout_s": "a replica sending no byte on its streamed requests this long, while "
                       "others do, is benched and its waiting requests move",
    "first_byte_deadline_factor": "a request's first-byte deadline is this x the time its replica "
                                  "should take (predicted TTFT + a non-streamed answer's "
                                  "generation); a replica silent past it is hung (benched) or "
                                  "failing (counted), see docs/router.md",
    "first_byte_deadline_floor_s": "a first-byte deadline is at least this (s)",
    "client_idle_timeout_s": "close client connections idle (or sending a request head) this long",
    "client_body_timeout_s": "a request body must arrive within this (408 beyond)",
    "trust_request_chat_template": "true: render a request's own chat_template (vLLM "
                                   "--trust-request-chat-template); default refuse it",
    "chat_template_timeout_s": "a request chat template's render is killed after this",
    "chat_template_max_bytes": "a request chat template's rendered text is refused beyond this",
    "model_aliases": "client-facing model name: NAME=MODEL, or a weighted split (a canary) "
                     "NAME=MODEL_A:WEIGHT_A;MODEL_B:WEIGHT_B (repeatable; env comma-separated)",
    "response_affinity_ttl_s": "a Responses answer's replica is remembered this long (s, in "
                               "Redis) to route its previous_response_id continuations there",
    "fallback_replicas": "replica URL used while Redis gives no fleet (repeatable, comma-separated; "
                         "URL#RANK as for --replica)",
    "drain_delay_s": "after SIGTERM: /ready answers 503 and requests are still accepted this long",
    "shutdown_timeout_s": "then in-flight requests get this long to finish",
    "fleet_cache_file": "file keeping the last fleet seen in Redis, loaded when Redis is down "
                        "at start-up",
    "index_stride": "blocks between the block index's anchor keys (1 = exact index); must equal "
                    "the workers' --index-stride (a replica that differs gets no prefix credit)",
    "api_keys": "turn on API-key auth: file of 'TENANT sha256:HEX' lines, or a directory "
                "(a mounted Secret) of one file per tenant with 'sha256:HEX' lines",
    "cache_salt_secret_file": "file with the secret the per-tenant cache_salt is derived from "
                              "(HMAC-SHA256); required with api_keys",
    "client_cache_salt": "a cache_salt the client sent: override (replaced) | reject (400)",
    "admin_tenants": "tenants allowed on restricted endpoints (repeatable / comma-separated)",
    "debug_access": "/debug/* with api_keys: admin (admin tenants) | tenant (any key)",
    "metrics_access": "/metrics with api_keys: open | admin (admin tenants' keys)",
    "audit_families": "prefix families the template audit keeps (GET /debug/prefixes); 0: off",
    "audit_head_tokens": "tokens of each prompt's head the template audit compares",
    "audit_top_k": "families listed by /debug/prefixes and exported as metrics",
    "admission_max_inflight": "admission: this router's requests in flight fleet-wide, at most; "
                              "more wait in the admission queue (0 = no limit)",
    "admission_max_inflight_per_replica": "admission: this router's requests in flight on one "
                                          "replica, at most (0 = no limit)",
    "admission_max_queued_prefill_s": "admission: predicted prefill seconds queued on one "
                                      "replica, at most (0 = no limit)",
    "admission_max_queue_length": "admission: requests waiting for room, at most (503 with "
                                  "Retry-After beyond)",
    "admission_max_queue_wait_s": "admission: seconds a request waits for room, at most (then "
                                  "503 with Retry-After)",
    "admission_priority_classes": "admission: priority class names, highest first (repeatable "
                                  "/ comma-separated); a request names one in x-priority-class",
    "admission_default_priority_class": "admission: the class of a request that names none "
                                        "(and whose tenant has no default)",
    "admission_priority_aging_s": "admission: seconds of waiting that raise a class one rank, "
                                  "so no class starves (0: strict order)",
    "admission_forward_priority": "admission: send each request's class rank (0 = highest) to "
                                  "the engine as the body's priority, for vLLM started with "
                                  "--scheduling-policy priority (lower first); with API keys "
                                  "and this off, a client's own priority is sent as 0",
    "admission_ttft_targets": "admission: a TTFT target per priority class, CLASS=SECONDS "
                              "(repeatable or comma-separated): a request predicted to miss its "
                              "class's target waits while it can still meet it, then is shed "
                              "(503); admission on only",
    "session_affinity_max_sessions": "session affinity: sessions (x-session-id header or the "
                                     "body's prompt_cache_key) whose replica this router "
                                     "remembers, least recently used forgotten first (0 = off)",
    "session_affinity_ttl_s": "session affinity: seconds an idle session's replica is remembered",
    "rate_limit_requests_per_min": "requests per minute per tenant, shared by the routers "
                                   "through Redis (429 beyond; 0 = none; the tenant file's "
                                   "requests_per_min replaces it)",
    "rate_limit_tokens_per_min": "prompt tokens per minute per tenant, as above (the tenant "
                                 "file's tokens_per_min replaces it)",
    "admission_tenants_file": "admission: YAML file of each tenant's default priority_class "
                              "and fair-share weight (tenants: {NAME: {priority_class, weight}})",
}


# YAML keys: each field's name and its flag's spelling (``replicas`` or ``replica``; Settings)
SETTINGS: Final = Settings(
    RouterConfig, prog="prefix-router serve", env_prefix=ENV_PREFIX,
    description="Prefix-aware, load-aware router for vLLM replicas.",
    version=version_line("prefix-router"), help=_HELP,
    flags={"replicas": "--replica", "fallback_replicas": "--fallback-replica",
           "model_aliases": "--model-alias"})


def build_parser() -> argparse.ArgumentParser:
    """The ``prefix-router serve`` argument parser; every flag defaults to ``None`` (= not given)."""
    return SETTINGS.parser()


def load_config(argv: Sequence[str], env: Mapping[str, str] | None = None) -> RouterConfig:
    """Parse ``argv`` and merge: CLI flag > ``ROUTER_*`` env var > YAML file > default
    (``router.shared.settings.Settings``); ``env`` None: the process environment.

    Raises ``ConfigError`` (one line, naming the flag, env var or file and key of a bad value)
    for unknown flags or YAML keys, bad values or an unreadable or malformed file.
    """
    env = os.environ if env is None else env
    return SETTINGS.build(argv, env, lambda values: RouterConfig(
        **with_redis_password(values, argv, env)))
