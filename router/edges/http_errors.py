"""The one place that maps errors to OpenAI-shaped JSON responses. HTTP edge (aiohttp).

``error_middleware`` answers every ``RouterError`` (``router.request.errors``), aiohttp's HTTP
exceptions and anything unexpected (500, logged); ``openai_parser_errors`` does the same for
the errors aiohttp's HTTP parser answers before any handler runs.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any, Final

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from router.apis.error_shapes import ERROR_BODIES
from router.request.errors import (
    HTTP_ERROR_TYPES,
    REQUEST_ID_HEADER,
    BodyTooLarge,
    RequestTimeout,
    RouterError,
    error_body,
)

logger = logging.getLogger(__name__)


def error_response(message: str, error_type: str, status: int,
                   request_id: str | None = None, path: str = "") -> web.Response:
    """The error in the OpenAI shape, or in the shape of the API at ``path`` (``/v1/messages``:
    Anthropic's, ``router.apis.ERROR_BODIES``)."""
    headers = {REQUEST_ID_HEADER: request_id} if request_id else None
    body = ERROR_BODIES.get(path, error_body)(message, error_type, status)
    return web.Response(body=body, status=status, content_type="application/json",
                        headers=headers)


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# the request id the router answers and logs a request under (set first, by the router's
# request-id middleware); a typed key, as aiohttp 3.14 asks of request storage
REQUEST_ID_KEY: Final = web.RequestKey("request_id", str)


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Map ``RouterError`` and aiohttp's HTTP exceptions to OpenAI-shaped JSON; 500 otherwise."""
    request_id = request.get(REQUEST_ID_KEY)
    try:
        return await handler(request)
    except RouterError as exc:
        response = error_response(exc.message, exc.error_type, exc.status, request_id,
                                  request.path)
        response.headers.update(exc.headers)
        if isinstance(exc, RequestTimeout | BodyTooLarge):
            response.force_close()  # the rest of the body may still come: never read it
        return response
    except web.HTTPRequestEntityTooLarge as exc:
        return error_response(f"request body too large: {exc.text} (the router's max_body_bytes)",
                              "RequestEntityTooLargeError", 413, request_id, request.path)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return error_response(exc.reason, HTTP_ERROR_TYPES.get(exc.status, "Error"), exc.status,
                              request_id, request.path)
    except Exception:
        logger.exception("unhandled error on %s %s", request.method, request.path)
        return error_response("internal router error", "InternalServerError", 500, request_id,
                              request.path)


def body_limit_middleware(max_body_bytes: int,
                          refused: Callable[[web.Request, int], None] | None = None) -> Any:
    """Refuse a request whose declared ``Content-Length`` exceeds ``max_body_bytes`` with a 413
    at once, before any handler reads the body. (aiohttp's ``client_max_size`` only counts the
    bytes as they are read, so a client that declares 300 MB and sends little waited for the
    body timeout's 408.) A chunked body has no length up front: ``client_max_size`` bounds it.
    ``refused(request, 413)`` is called for each refusal (the router counts it as a request
    its handler would have counted)."""

    @web.middleware
    async def body_limit(request: web.Request, handler: Handler) -> web.StreamResponse:
        declared = request.content_length
        if declared is not None and declared > max_body_bytes:
            if refused is not None:
                refused(request, BodyTooLarge.status)
            raise BodyTooLarge(f"request body too large: Content-Length {declared} exceeds "
                               f"the router's max_body_bytes ({max_body_bytes})")
        return await handler(request)

    return body_limit


class OpenAIErrorHandler(RequestHandler):
    """aiohttp's connection handler, answering its own errors (the HTTP parser's) in JSON."""

    __slots__ = ()

    def handle_error(self, request: Any, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        text = message or getattr(exc, "message", None) or HTTPStatus(status).phrase
        if status >= 500:
            super().handle_error(request, status, exc, message)  # logs with the traceback
        else:
            # the client's fault: one line, no traceback (aiohttp logs ERROR with one, so any
            # client could flood the log); not rate-limited, since each such request costs the
            # client a new connection (the answer closes it), like a line of an access log
            first = str(text).strip().splitlines()[0] if str(text).strip() else ""
            self.logger.info("malformed HTTP request from %s: %d %s", request.remote, status,
                             first[:200])
            if request.writer.output_size > 0:  # as aiohttp: the connection is broken
                raise ConnectionError("response already started; cannot send the error")
        if status == 400:
            text = f"malformed HTTP request: {text}"
        response = error_response(str(text), HTTP_ERROR_TYPES.get(status, "Error"), status)
        response.force_close()  # the parser lost the request boundary: nothing after it is valid
        return response


def openai_parser_errors(server: web.Server,
                         handler_class: type[OpenAIErrorHandler] = OpenAIErrorHandler) -> None:
    """Make the errors aiohttp answers before any handler runs (oversized or malformed request
    heads, CR/LF/NUL in a header value, Content-Length with Transfer-Encoding) OpenAI-shaped
    JSON like every other error. Call once on the runner's ``Server`` before listening.
    ``handler_class``: ``OpenAIErrorHandler`` or a subclass of it without slots of its own."""

    class _Server(type(server)):  # type: ignore[misc]
        def __call__(self) -> RequestHandler:
            handler = super().__call__()
            handler.__class__ = handler_class  # same slots: a safe class swap
            return handler

    server.__class__ = _Server
