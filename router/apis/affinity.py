"""Which replica holds a stored Responses answer, for ``previous_response_id``. Redis I/O edge.

vLLM keeps a Responses answer only in the memory of the API server that produced it (with
``VLLM_ENABLE_RESPONSES_API_STORE=1``; vLLM 0.32 ``OpenAIServingResponses.response_store``), and
renders a request naming it as ``previous_response_id`` after that stored conversation: only
that replica can serve it (another answers 404). The router learns ``response id -> replica``
from the answers that pass through it (``response_id_from_head``: the first ``"id"`` of the
answer, which is the response's in a JSON body and in a stream's first event,
``response.created``) and keeps it in Redis under ``{prefix}:response:{id}`` with a TTL, so
active-active routers share it, and in a bounded local LRU (all there is without Redis, and the
fallback while Redis fails: a Redis error never fails a request).

Tenants: the engine's store is one per replica, shared by every client, so the record carries
the tenant whose request produced the answer (with API keys on; None without) and a lookup by
another tenant finds nothing: the same 404 as an id never seen, so no tenant can learn that
another's id exists nor continue, read or cancel it. The Redis value is ``[replica, tenant]``
(JSON); a plain string (a record written before tenants were kept) is the replica with tenant
None.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final

import msgspec

from router.decision.policy import Decision
from router.request.errors import ModelNotFound, NoRoutableReplica
from router.request.lru import SizedLRU
from router.request.routing import Target

if TYPE_CHECKING:
    from router.decision.fleet import Fleet

logger = logging.getLogger(__name__)

PREVIOUS_RESPONSE_REASON: Final = "previous_response"  # the decision's reason (reason header)
LOCAL_ENTRIES: Final = 100_000  # response ids kept in the router's own memory
_ENTRY_BYTES: Final = 260  # an LRU entry: id (~40 chars), replica id, tenant, tuple, overhead
_RESPONSE_ID: Final = re.compile(rb'"id"\s*:\s*"([^"\\]{1,256})"')


def response_id_from_head(head: bytes) -> str | None:
    """The response id of a Responses answer from its first bytes (JSON body or SSE stream), or
    None when ``head`` holds no ``"id"`` (an error body, a cut head)."""
    match = _RESPONSE_ID.search(head)
    return match.group(1).decode("utf-8", "replace") if match else None


def response_key(prefix: str, response_id: str) -> str:
    """Redis key of a response's holder: ``{prefix}:response:{id}`` (``[replica, tenant]``)."""
    return f"{prefix}:response:{response_id}"


def decode_record(value: bytes | str) -> tuple[str, str | None]:
    """A Redis record -> (replica id, tenant or None): ``[replica, tenant]`` JSON, or a plain
    replica id (written before records kept the tenant). Raises ``ValueError`` for neither."""
    raw = value.encode() if isinstance(value, str) else value
    if not raw.startswith(b"["):
        return raw.decode(), None
    try:
        replica, tenant = msgspec.json.decode(raw, type=tuple[str, str | None])
    except msgspec.DecodeError as exc:
        raise ValueError(f"bad response record {raw[:80]!r}") from exc
    return replica, tenant


class ResponseAffinity:
    """``response id -> (replica id, tenant)``, in Redis with a TTL (when ``client`` builds a redis-py
    asyncio client) and in a local LRU. Not thread-safe: use on the event loop.

    ``remember`` and ``holder`` never raise for Redis failures: they log, count them in
    ``num_redis_errors`` and use the local LRU.
    """

    def __init__(self, client: Callable[[], Any] | None, prefix: str, ttl_s: float,
                 local_entries: int = LOCAL_ENTRIES) -> None:
        self._make_client = client
        self._client: Any = None
        self.prefix = prefix
        self.ttl_s = ttl_s
        # {response id: (replica id, tenant or None, monotonic expiry)}
        self.local: SizedLRU[tuple[str, str | None, float]] = SizedLRU(
            local_entries, local_entries * _ENTRY_BYTES, lambda key, value: _ENTRY_BYTES)
        self.num_redis_errors = 0

    def _redis(self) -> Any:
        if self._client is None and self._make_client is not None:
            self._client = self._make_client()
        return self._client

    async def remember(self, response_id: str, replica_id: str, tenant: str | None) -> None:
        """Record that ``replica_id`` holds ``response_id``, ``tenant``'s, for ``ttl_s``."""
        self.local.put(response_id, (replica_id, tenant, time.monotonic() + self.ttl_s))
        client = self._redis()
        if client is None:
            return
        try:
            await client.set(response_key(self.prefix, response_id),
                             msgspec.json.encode([replica_id, tenant]),
                             ex=max(1, round(self.ttl_s)))
        except Exception as exc:  # redis_errors(): the local entry stands
            self._failed("record", exc)

    async def holder(self, response_id: str, tenant: str | None) -> str | None:
        """The replica holding ``response_id`` (Redis first: another router may have seen the
        answer), or None when no router remembers it or it is not ``tenant``'s (the caller
        cannot tell these apart)."""
        client = self._redis()
        if client is not None:
            try:
                value = await client.get(response_key(self.prefix, response_id))
            except Exception as exc:
                self._failed("look up", exc)
            else:
                if value is not None:
                    try:
                        replica, owner = decode_record(value)
                    except ValueError:
                        logger.warning("response affinity: unreadable record for %r", response_id)
                        return None
                    return replica if owner == tenant else None
        entry = self.local.get(response_id)
        if entry is None or entry[2] < time.monotonic() or entry[1] != tenant:
            return None
        return entry[0]

    def _failed(self, what: str, exc: Exception) -> None:
        from router.shared.redis_client import redis_errors

        if not isinstance(exc, redis_errors()):
            raise exc
        self.num_redis_errors += 1
        logger.warning("response affinity: could not %s a response id in Redis (%r); "
                       "using this router's memory", what, exc)

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None


class ResponseNotFound(ModelNotFound):
    """A ``previous_response_id`` no replica can serve (HTTP 404)."""


def holder_target(fleet: Fleet, response_id: str, holder: str | None, model: str | None,
                  now: float) -> tuple[Decision, list[Target], tuple[str, str] | None]:
    """The decision and the one target of a request continuing ``response_id`` held by
    ``holder`` (None: unknown), and the request's LoRA (name, path). Raises
    ``ResponseNotFound`` (404) when no router remembers the response or its replica left the
    fleet (its answers were in that engine's memory), ``NoRoutableReplica`` (503) while the
    replica is in the fleet but not routable, and ``ModelNotFound`` for an unknown model."""
    if holder is None:
        raise ResponseNotFound(
            f"Response with id '{response_id}' not found: no router saw it answered (its "
            "replica must run with VLLM_ENABLE_RESPONSES_API_STORE=1, and the router remembers "
            "a response for response_affinity_ttl_s)")
    if holder not in fleet.replicas:
        raise ResponseNotFound(
            f"Response with id '{response_id}' is gone: replica {holder!r}, which held it, left "
            "the fleet (a stored response lives in its engine's memory only)")
    eligible, lora, _ = fleet.eligible(model, now)
    replica = next((r for r in eligible if r.replica_id == holder), None)
    if replica is None:
        raise NoRoutableReplica(
            f"replica {holder!r}, which holds response '{response_id}', is not routable now "
            f"(or does not serve model {model!r}); retry later")
    decision = Decision(holder, PREVIOUS_RESPONSE_REASON, (), hit_blocks=0, chain_blocks=0)
    return decision, [Target(holder, replica.url, dp_rank=replica.dp_rank)], lora
