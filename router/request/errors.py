"""Router error types, each with its HTTP status and OpenAI error type. Pure.

``router.edges.http_errors`` is the one place that turns them (and aiohttp's own errors) into
responses: the body ``{"error": {"message", "type", "param", "code"}}`` (vLLM's ``ErrorResponse``
shape, ``code`` = HTTP status) with the request's ``X-Request-Id``. Pure modules raise
these (``router.request.prompts.PromptError`` is a ``BadRequest``) without importing aiohttp.
"""

from __future__ import annotations

from typing import Final

import msgspec

REQUEST_ID_HEADER = "X-Request-Id"
STATUS_CLIENT_CLOSED: Final = 499  # nginx's convention for "client closed request"


class RouterError(Exception):
    """Base of errors that become an HTTP response."""

    status = 500
    error_type = "InternalServerError"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message
        self.headers: dict[str, str] = {}  # extra response headers (e.g. the routing decision)


class BadRequest(RouterError):
    status, error_type = 400, "BadRequestError"


class ModelNotFound(RouterError):
    status, error_type = 404, "NotFoundError"


class RequestTimeout(RouterError):
    """The client did not send its request body in time; the connection is closed after."""

    status, error_type = 408, "RequestTimeoutError"


class BodyTooLarge(RouterError):
    status, error_type = 413, "RequestEntityTooLargeError"


class NoRoutableReplica(RouterError):
    status, error_type = 503, "ServiceUnavailableError"


class RouterOverloaded(RouterError):
    """The router's own event loop ran too late to connect to a replica in time (its loop, not
    the replica, timed the connects out): 503 with ``Retry-After``, as Envoy's overload manager
    answers 503 to new requests when it sheds load (``stop_accepting_requests``)."""

    status, error_type = 503, "ServiceUnavailableError"


class UpstreamError(RouterError):
    status, error_type = 502, "BadGatewayError"


class UpstreamTimeout(RouterError):
    status, error_type = 504, "GatewayTimeoutError"


HTTP_ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 405: "MethodNotAllowedError",
                    413: "RequestEntityTooLargeError"}  # aiohttp's own errors, by status


def error_body(message: str, error_type: str, status: int) -> bytes:
    # vLLM's ErrorInfo (and OpenAI's error object) carry "param", null where no field is named
    return msgspec.json.encode({"error": {"message": message, "type": error_type, "param": None,
                                          "code": status}})
