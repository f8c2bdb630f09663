"""The router's client connections: how long an idle keep-alive connection is kept and what
clients are told of it. HTTP edge (aiohttp).

HTTP/1.1 lets either side close an idle persistent connection (RFC 9112 section 9.6), so a
client that sends a request on a pooled connection just as the server closes it sees the
connection drop with its request unanswered (aiohttp: ``ServerDisconnectedError``, a POST is not
retried). Two rules keep the router's side of that race closed:

* every keep-alive response says how long the router keeps the connection idle,
  ``Keep-Alive: timeout=N`` (RFC 2068 section 19.7.1.1; Node's undici and browsers stop reusing
  a connection before that), and the router closes it only ``KEEPALIVE_GRACE_S`` later
  (Node's http server does the same: ``keepAliveTimeoutBuffer``), so a client that honours the
  header never sends on a connection the router is closing;
* a connection on which a request has started arriving is not idle. aiohttp closes a connection
  whose next request head is incomplete at the idle limit counted from the last response (its
  guard against slowly dribbled heads), which cut a head whose first bytes came just before the
  limit. Here a head has the idle limit from its own first byte instead: a dribbled head is
  still closed, at most that long after it started.
"""

from __future__ import annotations

import math
from typing import Any, Final

from aiohttp import web

from router.edges.http_errors import OpenAIErrorHandler, openai_parser_errors

KEEPALIVE_GRACE_S: Final = 1.0  # an idle connection is closed this long after the advertised
# timeout: a client that honours it has let the connection go by then (undici's own margin: 1 s)
_HEAD_FROM: Final = "prefix_router_head_from"  # handler cache key: loop time of a head's first byte


def advertised_timeout_s(idle_timeout_s: float) -> int:
    """The ``Keep-Alive: timeout=`` value for an idle limit of ``idle_timeout_s``: whole seconds
    (the header's delta-seconds), at least 1."""
    return max(1, math.floor(idle_timeout_s))


def server_idle_timeout_s(idle_timeout_s: float) -> float:
    """Seconds the router keeps an idle client connection: the advertised timeout and the grace."""
    return max(idle_timeout_s, advertised_timeout_s(idle_timeout_s)) + KEEPALIVE_GRACE_S


def advertise_keepalive(app: web.Application, idle_timeout_s: float) -> None:
    """Add ``Keep-Alive: timeout=N`` to every response that keeps its connection open. Call
    before the app is frozen (``AppRunner.setup``)."""
    value = f"timeout={advertised_timeout_s(idle_timeout_s)}"

    async def on_prepare(request: web.Request, response: web.StreamResponse) -> None:
        if response.keep_alive is not False and request.keep_alive:
            response.headers.setdefault("Keep-Alive", value)

    app.on_response_prepare.append(on_prepare)


class ClientConnection(OpenAIErrorHandler):
    """aiohttp's connection handler (with the router's JSON parser errors) that does not close a
    connection at the idle limit while a request head is arriving on it (module docstring)."""

    __slots__ = ()

    def data_received(self, data: bytes) -> None:
        between = not self._request_in_progress and not self._messages
        super().data_received(data)
        if self._messages or self._request_in_progress:
            self._cache.pop(_HEAD_FROM, None)  # a whole head came: the handler's limits apply
        elif between and _HEAD_FROM not in self._cache:
            self._cache[_HEAD_FROM] = self._loop.time()

    def _process_keepalive(self) -> None:
        started = self._cache.get(_HEAD_FROM)
        if started is not None and self._waiter is not None and not self._waiter.done():
            # a head is arriving: it has the whole idle limit from its first byte
            self._next_keepalive_close_time = max(
                self._next_keepalive_close_time, started + self._keepalive_timeout
            )
        super()._process_keepalive()


def is_idle(handler: Any) -> bool:
    """Whether client connection ``handler`` waits for a request with no byte of one come
    (``_waiter`` is set while aiohttp waits for a whole request head)."""
    return getattr(handler, "_waiter", None) is not None and _HEAD_FROM not in handler._cache


def install_client_connections(server: web.Server) -> None:
    """Make ``server`` (the runner's, before listening) handle each client connection with
    ``ClientConnection``: the router's JSON parser errors and the head rule above."""
    openai_parser_errors(server, ClientConnection)
