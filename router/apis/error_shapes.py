"""Error answers in each API's own shape, by path: the body of an error answered there, the SSE
event of a stream failing after its start, and an engine's error answer reshaped, where not
OpenAI's (``router.request.errors``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

from router.apis.messages import (
    anthropic_error_body,
    anthropic_sse_error,
    anthropic_upstream_error,
)
from router.apis.responses import responses_sse_error

ErrorShape = Callable[[str, str, int], bytes]  # (message, router error type, HTTP status) -> bytes
# {path: the body of an error answered there} where not OpenAI's (router.errors.error_body)
ERROR_BODIES: Final[dict[str, ErrorShape]] = {"/v1/messages": anthropic_error_body,
                                               "/v1/messages/count_tokens": anthropic_error_body}
# {path: the SSE event of a stream failing after its start} where not a bare ``data: {"error"}``
SSE_ERROR_EVENTS: Final[dict[str, ErrorShape]] = {"/v1/messages": anthropic_sse_error,
                                                  "/v1/responses": responses_sse_error}
# {path: an engine's whole error answer (body, HTTP status) -> the body the client gets} where the
# engine's shape is not the API's own
UPSTREAM_ERROR_BODIES: Final[dict[str, Callable[[bytes, int], bytes]]] = {
    "/v1/messages": anthropic_upstream_error, "/v1/messages/count_tokens": anthropic_upstream_error}
