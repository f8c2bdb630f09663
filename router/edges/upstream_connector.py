"""The router's upstream connector: aiohttp's ``TCPConnector`` whose connect timeout forgives the
router's own late event loop. HTTP client edge.

aiohttp times a connect with ``ClientTimeout.sock_connect``, a timer on the event loop. On a
starved loop the timer and the connect's completion fall due in the same late turn, the timer's
callback runs before the task the completion wakes, and a connection the kernel made long ago is
cancelled and made again (issue 29, docs/benchmarks.md "Overload, third pass"). Here the whole
connection set-up (``TCPConnector._create_connection``: name resolution, TCP and TLS handshakes)
runs under a ``router.observability.loop_lag.LagTolerantTimeout``: the time the loop ran late is
given back before the timeout fires, up to ``MAX_CONNECT_TIMEOUTS`` connect timeouts in all. An expired connect raises
aiohttp's ``ConnectionTimeoutError`` (a ``ServerTimeoutError``), as ``sock_connect`` does, so
callers handle it unchanged; they pass no ``sock_connect`` of their own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import aiohttp
from aiohttp.client_proto import ResponseHandler
from aiohttp.client_reqrep import ClientRequest
from aiohttp.tracing import Trace

from router.observability.loop_lag import MAX_CONNECT_TIMEOUTS, LagTolerantTimeout, LoopLag

# the method wrapped below: aiohttp 3.x's one place where a new connection is made (pooled ones
# skip it); checked at import, so that an aiohttp without it fails loudly instead of unbounded
if not callable(getattr(aiohttp.TCPConnector, "_create_connection", None)):
    raise ImportError("aiohttp.TCPConnector has no _create_connection: see router/edges/"
                      "upstream_connector.py")


class LagTolerantConnector(aiohttp.TCPConnector):
    """``aiohttp.TCPConnector`` (``kwargs``) whose new connections must be made within
    ``connect_timeout_s`` of loop time that ran on time (at most ``MAX_CONNECT_TIMEOUTS`` x
    ``connect_timeout_s`` in all)."""

    def __init__(self, loop_lag: LoopLag, connect_timeout_s: float,
                 on_give_back: Callable[[], None] | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._on_give_back = on_give_back  # called once per connect whose timer gave time back
        self._loop_lag = loop_lag
        self._connect_timeout_s = connect_timeout_s
        self._max_connect_s = MAX_CONNECT_TIMEOUTS * connect_timeout_s

    async def _create_connection(self, req: ClientRequest, traces: list[Trace],
                                 timeout: aiohttp.ClientTimeout,  # noqa: ASYNC109 (aiohttp's)
                                 ) -> ResponseHandler:
        deadline = LagTolerantTimeout(self._loop_lag, self._connect_timeout_s,
                                      self._max_connect_s)
        try:
            async with deadline:
                return await super()._create_connection(req, traces, timeout)
        except TimeoutError as exc:
            if not deadline.expired:  # another timeout's (the caller's own)
                raise
            raise aiohttp.ConnectionTimeoutError(
                f"Connection timeout to host {req.url.host}:{req.url.port}") from exc
        finally:
            if deadline.num_extended and self._on_give_back is not None:
                self._on_give_back()
