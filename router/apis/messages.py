"""Anthropic Messages (``POST /v1/messages``) for the router: the body parsed to the chat
``PromptSpec`` vLLM renders it as (the conversion is ``router.shared.messages_chat``), and the
Anthropic error shape the router answers that path with. Pure.
"""

from __future__ import annotations

from typing import Any, Final

import msgspec

from router.request.prompts import CACHE_SALT_MAX_CHARS, PromptError, PromptSpec
from router.shared.messages_chat import check_messages_body, messages_to_chat

# HTTP status -> Anthropic error type (Anthropic's API errors page)
ANTHROPIC_ERROR_TYPES: Final = {400: "invalid_request_error", 401: "authentication_error",
                                403: "permission_error", 404: "not_found_error",
                                408: "timeout_error", 413: "request_too_large",
                                429: "rate_limit_error", 500: "api_error", 502: "api_error",
                                503: "overloaded_error", 504: "timeout_error"}


class MessagesError(PromptError):
    """A Messages body vLLM would refuse (HTTP 400 through the error middleware)."""


def anthropic_error_body(message: str, error_type: str, status: int) -> bytes:
    """``{"type": "error", "error": {"type", "message"}}`` (Anthropic's error shape); the
    router's own ``error_type`` gives way to Anthropic's name for ``status``."""
    kind = ANTHROPIC_ERROR_TYPES.get(status, "api_error" if status >= 500 else
                                     "invalid_request_error")
    return msgspec.json.encode({"type": "error", "error": {"type": kind, "message": message}})


def anthropic_upstream_error(body: bytes, status: int) -> bytes:
    """An engine's error answer on ``/v1/messages`` (``body``, answered with HTTP ``status``)
    in Anthropic's shape with Anthropic's type for ``status``. vLLM answers there in
    Anthropic's envelope but keeps its OpenAI error type (``BadRequestError``: vLLM 0.32
    ``anthropic/api_router.py`` ``translate_error_response``), which Anthropic clients do not
    know; its message is kept. A body that is not JSON becomes the message."""
    try:
        data = msgspec.json.decode(body)
    except msgspec.DecodeError:
        data = None
    error = data.get("error") if isinstance(data, dict) else None
    message = error.get("message") if isinstance(error, dict) else None
    if not isinstance(message, str):
        message = body.decode("utf-8", "replace").strip() or f"HTTP {status} from the engine"
    return anthropic_error_body(message, "", status)


def anthropic_sse_error(message: str, error_type: str, status: int) -> bytes:
    """The SSE ``error`` event of a Messages stream that failed after its start."""
    return b"event: error\ndata: " + anthropic_error_body(message, error_type, status) + b"\n\n"


def parse_messages(body: Any, *, merge_inline_system: bool) -> PromptSpec:
    """A Messages body's JSON -> the chat ``PromptSpec`` vLLM renders it as
    (``router.shared.messages_chat``). Raises ``MessagesError`` (a ``PromptError``, HTTP 400)."""
    try:
        checked = check_messages_body(body)
        chat = messages_to_chat(checked, merge_inline_system=merge_inline_system)
    except ValueError as exc:
        raise MessagesError(str(exc)) from exc
    salt = checked.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not 0 < len(salt) <= CACHE_SALT_MAX_CHARS):
        raise MessagesError(f"'cache_salt' must be a string of 1..{CACHE_SALT_MAX_CHARS} characters")
    options: dict[str, Any] = {k: chat[k] for k in ("chat_template_kwargs", "reasoning_effort")
                               if k in chat}
    if "tools" in chat:
        options["tool_dicts"] = chat["tools"]
    return PromptSpec("chat", checked["model"], messages=chat["messages"],
                      add_special_tokens=False, chat_options=options or None,
                      cache_salt=salt, stream=bool(checked.get("stream")))
