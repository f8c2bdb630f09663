"""Session affinity (issue 33): which replica a session's requests go to. Pure (no I/O).

A request names its session in the ``x-session-id`` header or, without it, in the body's
``prompt_cache_key`` (OpenAI's field for prompt-cache affinity). A session's requests share a
growing prefix (a conversation), so they belong on the replica that holds it: the routing
decision keeps them there while that replica holds the prefix and is not overloaded
(``router.decision.policy.keep_session``); its first request goes to the ring owner of the
session key, which every router instance computes alike.

The session key is the xxh64 of the request's ``cache_salt`` partition and the session name.
With API keys on, the router sets the partition to the tenant's salt, so two tenants naming
the same session are two sessions and never share a replica's placement through it. Only the
64-bit key is kept; the name is no metric label and appears in no log.

``SessionTable`` remembers the last replica that served each session, in this process: an LRU
bounded by entries, each forgotten after ``ttl_s`` unused (``cachetools.TTLCache``).
Active-active routers do not share it: each remembers the sessions it routed. They still agree
on a session's first replica (the ring), so they diverge only after one of them moved the
session off an overloaded replica; the prefix the moved session writes is then indexed from the
new replica's KV events and the other routers follow it there (``keep_session``'s prefix rule).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Final

import cachetools

from router.decision.ring import text_key

SESSION_HEADER: Final = "x-session-id"
DEFAULT_MAX_SESSIONS: Final = 100_000  # ~200 bytes each (int key, str value, TTL links): ~20 MB
DEFAULT_SESSION_TTL_S: Final = 600.0  # a session idle this long is forgotten (its KV likely is)


def session_key(header: str | None, body_key: str | None, partition: str | None) -> int | None:
    """The 64-bit key of the request's session: its ``x-session-id`` header, else its body's
    ``prompt_cache_key``, within ``partition`` (the request's ``cache_salt``); None when the
    request names no session (an empty name is none)."""
    name = header or body_key
    if not name:
        return None
    return text_key(json.dumps([partition, name]))


class SessionTable:
    """The last replica that served each session: at most ``max_sessions`` (least recently
    used forgotten first), each for ``ttl_s`` seconds after its last use. ``max_sessions`` 0
    turns session affinity off (``enabled`` False). Not thread-safe (the event loop's only).
    Raises ``ValueError`` for a negative bound or a ``ttl_s`` not above 0."""

    def __init__(self, max_sessions: int = DEFAULT_MAX_SESSIONS,
                 ttl_s: float = DEFAULT_SESSION_TTL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_sessions < 0 or ttl_s <= 0:
            raise ValueError(f"need max_sessions >= 0 and ttl_s > 0, got {max_sessions}, {ttl_s}")
        self.enabled = max_sessions > 0
        self._replicas: cachetools.TTLCache[int, str] = cachetools.TTLCache(
            maxsize=max(max_sessions, 1), ttl=ttl_s, timer=clock)

    def replica(self, key: int) -> str | None:
        """The replica that last served session ``key``, or None (unknown or expired)."""
        return self._replicas.get(key)

    def served(self, key: int, replica_id: str) -> None:
        """Session ``key`` was routed to (or answered by) ``replica_id``: its TTL restarts."""
        if self.enabled:
            self._replicas[key] = replica_id

    def __len__(self) -> int:
        return len(self._replicas)
