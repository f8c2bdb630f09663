"""The answers of vLLM's Responses (``/v1/responses``) and Anthropic Messages (``/v1/messages``)
APIs for one generated text, whole or as SSE events. Pure (builds dicts and bytes).

Shapes follow vLLM 0.32: ``ResponsesResponse`` and the simple (non-Harmony) Responses stream
(``response.created``, ``response.in_progress``, ``response.output_item.added``,
``response.content_part.added``, ``response.output_text.delta`` ..., the matching ``.done``
events and ``response.completed`` with the usage; every event ``event: TYPE`` with a
``sequence_number``), whose usage always reports ``input_tokens_details.cached_tokens``; and
``AnthropicMessagesResponse`` with its stream (``message_start``, ``content_block_start``,
``content_block_delta`` ..., ``content_block_stop``, ``message_delta`` with the stop reason and
usage, ``message_stop``), whose usage reports ``cache_read_input_tokens`` only when the server
reports prompt-token details (vLLM ``_build_anthropic_usage``: ``input_tokens`` is then the
uncached rest).
"""

from __future__ import annotations

import uuid
from typing import Any

import msgspec

_encode = msgspec.json.encode


def sse_event(event: str, data: dict[str, Any]) -> bytes:
    """One named SSE event, as vLLM writes them for both APIs."""
    return b"event: " + event.encode() + b"\ndata: " + _encode(data) + b"\n\n"


def responses_usage(prompt_tokens: int, output_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"input_tokens": prompt_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0,
                                     "input_tokens_per_turn": [],
                                     "cached_tokens_per_turn": []},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0, "tool_output_tokens": 0,
                                      "output_tokens_per_turn": [],
                                      "tool_output_tokens_per_turn": []},
            "total_tokens": prompt_tokens + output_tokens}


def anthropic_usage(prompt_tokens: int, output_tokens: int,
                    cached_tokens: int | None) -> dict[str, Any]:
    if cached_tokens is None:
        return {"input_tokens": prompt_tokens, "output_tokens": output_tokens}
    return {"input_tokens": max(0, prompt_tokens - cached_tokens), "output_tokens": output_tokens,
            "cache_read_input_tokens": cached_tokens}


def anthropic_stop_reason(finish: str | None) -> str | None:
    """vLLM ``_to_anthropic_stop_reason`` for a text answer."""
    return {"length": "max_tokens", "stop": "end_turn"}.get(finish or "")


class ResponsesAnswer:
    """One Responses request's answer: ``body`` (whole) or ``start`` / ``delta`` / ``end``
    (stream bytes). ``request`` is the request body (echoed fields)."""

    def __init__(self, request: dict[str, Any], model: str, created: int,
                 max_output_tokens: int) -> None:
        self.request = request
        self.id = request.get("request_id") or f"resp_{uuid.uuid4().hex}"
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self.model = model
        self.created = created
        self.max_output_tokens = max_output_tokens
        self.text: list[str] = []
        self.seq = 0

    def _part(self, text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": None}

    def _item(self, status: str, content: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.message_id, "type": "message", "role": "assistant", "status": status,
                "content": content}

    def response(self, status: str, usage: dict[str, Any] | None) -> dict[str, Any]:
        r = self.request
        output = ([self._item("completed", [self._part("".join(self.text))])]
                  if status == "completed" else [])
        return {"id": self.id, "created_at": self.created, "incomplete_details": None,
                "instructions": r.get("instructions"), "metadata": r.get("metadata"),
                "model": self.model, "object": "response", "output": output,
                "parallel_tool_calls": r.get("parallel_tool_calls", True),
                "temperature": r.get("temperature") or 1.0,
                "tool_choice": r.get("tool_choice", "auto"), "tools": r.get("tools") or [],
                "top_p": r.get("top_p") or 1.0, "background": bool(r.get("background")),
                "max_output_tokens": self.max_output_tokens, "max_tool_calls": None,
                "previous_response_id": r.get("previous_response_id"), "prompt": None,
                "reasoning": r.get("reasoning"), "service_tier": "auto", "status": status,
                "text": None, "top_logprobs": None, "truncation": "disabled", "usage": usage,
                "user": None}

    def body(self, text: str, usage: dict[str, Any]) -> dict[str, Any]:
        self.text = [text]
        return self.response("completed", usage)

    def _event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return sse_event(kind, data)

    def start(self) -> bytes:
        where = {"item_id": self.message_id, "output_index": 0, "content_index": 0}
        return (self._event("response.created", response=self.response("in_progress", None))
                + self._event("response.in_progress", response=self.response("in_progress", None))
                + self._event("response.output_item.added", output_index=0,
                              item=self._item("in_progress", []))
                + self._event("response.content_part.added", part=self._part(""), **where))

    def delta(self, text: str) -> bytes:
        self.text.append(text)
        return self._event("response.output_text.delta", item_id=self.message_id, output_index=0,
                           content_index=0, delta=text, logprobs=[])

    def end(self, usage: dict[str, Any]) -> bytes:
        text = "".join(self.text)
        where = {"item_id": self.message_id, "output_index": 0, "content_index": 0}
        return (self._event("response.output_text.done", text=text, logprobs=[], **where)
                + self._event("response.content_part.done", part=self._part(text), **where)
                + self._event("response.output_item.done", output_index=0,
                              item=self._item("completed", [self._part(text)]))
                + self._event("response.completed", response=self.response("completed", usage)))


class MessagesAnswer:
    """One Messages request's answer: ``body`` (whole) or ``start`` / ``delta`` / ``end``."""

    def __init__(self, model: str) -> None:
        self.id = f"chatcmpl-{uuid.uuid4().hex}"  # vLLM answers with its chat completion's id
        self.model = model
        self.started_block = False

    def body(self, text: str, finish: str | None, usage: dict[str, Any]) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant",
                "content": [{"type": "text", "text": text}], "model": self.model,
                "stop_reason": anthropic_stop_reason(finish), "stop_sequence": None,
                "usage": usage}

    def start(self, usage: dict[str, Any]) -> bytes:
        return sse_event("message_start", {"type": "message_start", "message": {
            "id": self.id, "type": "message", "role": "assistant", "content": [],
            "model": self.model, "stop_reason": None, "stop_sequence": None, "usage": usage}})

    def delta(self, text: str) -> bytes:
        out = b""
        if not self.started_block:
            self.started_block = True
            out = sse_event("content_block_start", {"type": "content_block_start", "index": 0,
                                                    "content_block": {"type": "text", "text": ""}})
        return out + sse_event("content_block_delta", {
            "type": "content_block_delta", "index": 0,
            "delta": {"type": "text_delta", "text": text}})

    def end(self, finish: str | None, usage: dict[str, Any]) -> bytes:
        out = b""
        if self.started_block:
            out = sse_event("content_block_stop", {"type": "content_block_stop", "index": 0})
        return out + sse_event("message_delta", {
            "type": "message_delta",
            "delta": {"stop_reason": anthropic_stop_reason(finish), "stop_sequence": None},
            "usage": usage}) + sse_event("message_stop", {"type": "message_stop"})
