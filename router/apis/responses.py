"""OpenAI Responses (``POST /v1/responses``) for the router: the body parsed to the chat
``PromptSpec`` vLLM renders it as (the conversion is ``router.shared.responses_chat``), with the
stored response it continues (``previous_response_id``: routed to the replica holding it,
``router.apis.affinity``), and the error event of a stream that fails after its start. Pure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from router.request.prompts import CACHE_SALT_MAX_CHARS, PromptError, PromptSpec
from router.shared.responses_chat import check_responses_body, responses_chat


class ResponsesError(PromptError):
    """A Responses body vLLM would refuse (HTTP 400 through the error middleware)."""


@dataclass(frozen=True, slots=True)
class ParsedResponses:
    """A Responses body as the router routes it: its chat ``spec``, and the stored response it
    continues (``previous_response_id``), whose replica must serve it."""

    spec: PromptSpec
    previous_response_id: str | None = None
    store: bool = True  # the engine keeps the answer (when it runs with a response store)


def responses_sse_error(message: str, error_type: str, status: int) -> bytes:
    """The ``error`` event of a Responses stream that failed after its start (the OpenAI
    Responses stream's ``ResponseErrorEvent``: ``code``, ``message``, ``param``,
    ``sequence_number``; the router does not count the stream's events, so 0)."""
    return b"event: error\ndata: " + msgspec.json.encode({
        "type": "error", "code": error_type, "message": message, "param": None,
        "sequence_number": 0}) + b"\n\n"


def parse_responses(body: Any) -> ParsedResponses:
    """A Responses body's JSON -> its chat ``PromptSpec`` (the input as vLLM renders it) and
    the previous response it continues. Raises ``ResponsesError`` (a ``PromptError``, 400)."""
    try:
        body = check_responses_body(body)
        chat = responses_chat(body)
    except ValueError as exc:
        raise ResponsesError(str(exc)) from exc
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not 0 < len(salt) <= CACHE_SALT_MAX_CHARS):
        raise ResponsesError(f"'cache_salt' must be a string of 1..{CACHE_SALT_MAX_CHARS} characters")
    spec = PromptSpec("chat", body.get("model"), messages=chat["messages"],
                      add_special_tokens=False, chat_options=chat["options"], cache_salt=salt,
                      stream=bool(body.get("stream")))
    return ParsedResponses(spec, body.get("previous_response_id"), body.get("store") is not False)
