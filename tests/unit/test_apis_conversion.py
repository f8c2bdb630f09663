"""Responses and Anthropic Messages bodies converted to chat as vLLM converts them: the chat
messages, the tool dicts handed to the template and the template kwargs equal those vLLM 0.32's
own code produced for the same bodies (``tests/vectors/vllm-api-conversions.json``, written by
``tests/vectors/make_api_conversions.py``); bad bodies are refused with a 400 naming the field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from router.apis.messages import MessagesError, anthropic_error_body, parse_messages
from router.apis.responses import ResponsesError, parse_responses
from router.request.prompts import PromptError
from router.shared.chat_messages import prepare_messages, template_kwargs
from router.shared.messages_chat import merges_inline_system, messages_to_chat

VECTORS = json.loads((Path(__file__).parents[1] / "vectors" / "vllm-api-conversions.json")
                     .read_text())


def _template_view(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What the chat template sees of ``messages`` (the router's vLLM chat preparation), so
    that keys vLLM's pydantic models add as None (and the template never reads) compare equal."""
    return prepare_messages(messages, None)


@pytest.mark.parametrize("merged", [True, False], ids=["merge-inline-system", "inline-system"])
@pytest.mark.parametrize("name", sorted(VECTORS["messages"]))
def test_messages_conversion_equals_vllms(name: str, merged: bool) -> None:
    case = VECTORS["messages"][name]
    expected = case["merged" if merged else "inline"]
    spec = parse_messages(case["body"], merge_inline_system=merged)
    assert spec.messages is not None
    assert _template_view(spec.messages) == _template_view(expected["messages"])
    options = spec.chat_options or {}
    assert options.get("tool_dicts") == expected["tools"]
    assert template_kwargs(options) == expected["chat_template_kwargs"]


@pytest.mark.parametrize("name", sorted(VECTORS["responses"]))
def test_responses_conversion_equals_vllms(name: str) -> None:
    case = VECTORS["responses"][name]
    expected = case["chat"]
    parsed = parse_responses(case["body"])
    assert parsed.spec.messages is not None
    assert _template_view(parsed.spec.messages) == _template_view(expected["messages"])
    options = parsed.spec.chat_options or {}
    assert options.get("tool_dicts") == expected["tools"]
    assert template_kwargs(options) == expected["chat_template_kwargs"]


def test_vectors_come_from_vllm_0_32() -> None:
    assert VECTORS["vllm_version"].startswith("0.32")


MESSAGES_OK: dict[str, Any] = {"model": "m", "max_tokens": 8,
                               "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(("change", "field"), [
    ({"max_tokens": None}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"model": 3}, "model"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "role"),
    ({"messages": [{"role": "user", "content": [{"type": "video"}]}]}, "content"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "text"),
    ({"system": 5}, "system"),
    ({"stream": "yes"}, "stream"),
    ({"tools": [{"name": "t"}]}, "input_schema"),
    ({"cache_salt": ""}, "cache_salt"),
    ({"thinking": "off"}, "thinking"),
])
def test_bad_messages_bodies_are_refused_naming_the_field(change: dict[str, Any],
                                                          field: str) -> None:
    body = {**MESSAGES_OK, **change}
    body = {k: v for k, v in body.items() if v is not None}
    with pytest.raises(MessagesError, match=field) as caught:
        parse_messages(body, merge_inline_system=True)
    assert isinstance(caught.value, PromptError)  # a BadRequest: HTTP 400


def test_messages_not_an_object() -> None:
    with pytest.raises(MessagesError, match="JSON object"):
        parse_messages([1], merge_inline_system=True)


def test_tool_removal_of_an_undeclared_tool_is_refused() -> None:
    body = {**MESSAGES_OK, "messages": [
        {"role": "system", "content": [{"type": "tool_removal",
                                        "tool": {"type": "tool_reference", "name": "nope"}}]},
        {"role": "user", "content": "hi"}]}
    with pytest.raises(ValueError, match="not declared"):
        messages_to_chat(body, merge_inline_system=False)
    with pytest.raises(MessagesError, match="not declared"):
        parse_messages(body, merge_inline_system=False)


def test_tool_changes_apply_in_order() -> None:
    tool = {"name": "ls", "input_schema": {"type": "object"}, "defer_loading": True}
    body = {**MESSAGES_OK, "tools": [tool], "messages": [
        {"role": "system", "content": [{"type": "tool_addition",
                                        "tool": {"type": "tool_reference", "name": "ls"}}]},
        {"role": "user", "content": "hi"}]}
    spec = parse_messages(body, merge_inline_system=False)
    assert spec.chat_options is not None
    # added by reference: no longer deferred
    assert spec.chat_options["tool_dicts"][0]["function"] == {
        "name": "ls", "description": None, "parameters": {"type": "object"}}


@pytest.mark.parametrize(("body", "field"), [
    ({}, "input"),
    ({"input": 3}, "input"),
    ({"input": "x", "stream": 1}, "stream"),
    ({"input": "x", "model": 1}, "model"),
    ({"input": "x", "reasoning": "low"}, "reasoning"),
    ({"input": "x", "tools": [{"name": "no type"}]}, "tools"),
    ({"input": [{"type": "web_search_call", "id": "w"}]}, "Unsupported input item type"),
    ({"input": [{"type": "reasoning", "encrypted_content": "x", "summary": []}]}, "Encrypted"),
    ({"input": "x", "previous_response_id": "r", "previous_input_messages": [{}]}, "Only one"),
])
def test_bad_responses_bodies_are_refused(body: dict[str, Any], field: str) -> None:
    with pytest.raises(ResponsesError, match=field):
        parse_responses(body)


def test_previous_response_id_and_store_are_carried() -> None:
    parsed = parse_responses({"input": "next", "previous_response_id": "resp_1", "store": False})
    assert parsed.previous_response_id == "resp_1"
    assert parsed.store is False
    assert parse_responses({"input": "x"}).store is True


def test_anthropic_error_shape() -> None:
    assert json.loads(anthropic_error_body("bad", "BadRequestError", 400)) == {
        "type": "error", "error": {"type": "invalid_request_error", "message": "bad"}}
    assert json.loads(anthropic_error_body("x", "ServiceUnavailableError", 503))["error"][
        "type"] == "overloaded_error"


def test_merge_inline_system_follows_the_template() -> None:
    guarded = ("{% for m in messages %}{% if m.role == 'system' and not loop.first %}"
               "{{ raise_exception('system first') }}{% endif %}{{ m.content }}{% endfor %}")
    assert merges_inline_system(guarded)
    assert not merges_inline_system("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert merges_inline_system(None)


def test_a_stream_failing_after_its_start_ends_with_the_apis_error_event() -> None:
    from router.apis.error_shapes import ERROR_BODIES, SSE_ERROR_EVENTS

    anthropic_event = SSE_ERROR_EVENTS["/v1/messages"]("replica r1 stream failed", "BadGatewayError", 502)
    head, data = anthropic_event.decode().strip().split("\n")
    assert head == "event: error"
    assert json.loads(data.removeprefix("data: ")) == {
        "type": "error", "error": {"type": "api_error", "message": "replica r1 stream failed"}}
    responses_event = SSE_ERROR_EVENTS["/v1/responses"]("late", "GatewayTimeoutError", 504)
    head, data = responses_event.decode().strip().split("\n")
    assert head == "event: error"
    assert json.loads(data.removeprefix("data: ")) == {
        "type": "error", "code": "GatewayTimeoutError", "message": "late", "param": None,
        "sequence_number": 0}
    assert "/v1/responses" not in ERROR_BODIES  # the OpenAI shape, as every other path
