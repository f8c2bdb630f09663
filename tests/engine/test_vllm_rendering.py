"""Chat rendering as vLLM renders it: for each chat body, the token ids the router computes
(``POST /debug/route?token_ids=1``) equal the prompt ids the engine serves the chat completion
with (``return_token_ids``) and those of its own ``POST /tokenize`` (ids, not counts). The
engine is one of the package's pair, serving the tiny Qwen3 model with Qwen3's tokenizer and
chat template, tool calling on (hermes parser, as for Qwen3).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from loadtest.harness.vllm_engine import HTTPError, post_json
from tests.engine.conftest import EngineFleet

# the package's engines start together when the first is needed (conftest.EnginePool)
pytestmark = pytest.mark.timeout(2700)

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "City name"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city"]}}}
SEARCH_TOOL = {"type": "function", "function": {
    "name": "search", "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}
TOOL_CALL = {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": json.dumps({"city": "Zürich"})}}

CHAT_BODIES: dict[str, dict[str, Any]] = {
    "system-user": {"messages": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hello there."}]},
    "user-only": {"messages": [{"role": "user", "content": "Just a question?"}]},
    "developer": {"messages": [
        {"role": "developer", "content": "Answer in French."},
        {"role": "user", "content": "What is a router?"}]},
    "multi-turn": {"messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another one."},
        {"role": "assistant", "content": "Green."},
        {"role": "user", "content": "And a third?"}]},
    "tools": {"tools": [WEATHER_TOOL, SEARCH_TOOL], "messages": [
        {"role": "system", "content": "Use tools when needed."},
        {"role": "user", "content": "Weather in Zürich?"}]},
    "tool-call-and-result": {"tools": [WEATHER_TOOL], "messages": [
        {"role": "user", "content": "Weather in Zürich?"},
        {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21, "sky": "clear"}'},
        {"role": "user", "content": "Thanks. Tomorrow?"}]},
    "two-tool-calls": {"tools": [WEATHER_TOOL, SEARCH_TOOL], "messages": [
        {"role": "user", "content": "Compare Bern and Basel."},
        {"role": "assistant", "content": "Checking both.", "tool_calls": [
            TOOL_CALL, {"id": "call_2", "type": "function", "function": {
                "name": "search", "arguments": '{"q": "Basel weather"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "19 C"}]},
    "content-parts": {"messages": [
        {"role": "system", "content": [{"type": "text", "text": "Part one."},
                                       {"type": "text", "text": "Part two."}]},
        {"role": "user", "content": [{"type": "text", "text": "Look:"},
                                     {"type": "text", "text": "two parts\nwith a newline"}]}]},
    "unicode": {"messages": [
        {"role": "system", "content": "Réponds en français. 日本語も可。"},
        {"role": "user", "content": "Emoji 🚀👩‍👩‍👧, combining é, RTL שלום, math ∑∫, tab\tend  "}]},
    "continue-final-message": {"add_generation_prompt": False, "continue_final_message": True,
                               "messages": [
        {"role": "user", "content": "Write a haiku about caches."},
        {"role": "assistant", "content": "Blocks of warm prefix"}]},
    "no-generation-prompt": {"add_generation_prompt": False, "messages": [
        {"role": "user", "content": "Only the user turn."}]},
    "enable-thinking-false": {"chat_template_kwargs": {"enable_thinking": False}, "messages": [
        {"role": "user", "content": "Think or not?"}]},
    "assistant-with-reasoning": {"messages": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "Adding two and two."},
        {"role": "user", "content": "3+3?"}]},
    "named-user-and-empty-content": {"messages": [
        {"role": "user", "name": "alice", "content": ""},
        {"role": "user", "content": "Second message."}]},
    "add-special-tokens": {"add_special_tokens": True, "messages": [
        {"role": "user", "content": "With special tokens."}]},
    "crlf-and-trailing-space": {"messages": [
        {"role": "user", "content": "line one\r\nline two \n\n  indented\n"}]},
    "system-and-developer": {"messages": [
        {"role": "system", "content": "System rules."},
        {"role": "user", "content": "Hi."},
        {"role": "developer", "content": "Developer rules."},
        {"role": "user", "content": "Again."}]},
    "refusal-and-thinking-parts": {"messages": [
        {"role": "user", "content": "Do something bad."},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "No."},
                                          {"type": "refusal", "refusal": "I can't."}]},
        {"role": "user", "content": [{"type": "text", "text": "Fine."}, "a bare string"]}]},
    "developer-parts-after-system": {"messages": [
        {"role": "system", "content": "S"},
        {"role": "developer", "content": [{"type": "text", "text": "p1"},
                                          {"type": "text", "text": "p2"}]},
        {"role": "user", "content": "u"}]},
    "tool-result-parts": {"tools": [WEATHER_TOOL], "messages": [
        {"role": "user", "content": "Weather in Zürich?"},
        {"role": "assistant", "content": "", "tool_calls": [TOOL_CALL]},
        {"role": "tool", "tool_call_id": "call_1",
         "content": [{"type": "text", "text": "21 C"}, {"type": "text", "text": "clear"}]}]},
    "claude-code-billing-header": {"messages": [
        {"role": "system", "content": "x-anthropic-billing-header: cc_version=1; cch=8f3a\n"
                                      "You are Claude Code."},
        {"role": "user", "content": "List files."}]},
    "billing-header-parts": {"messages": [
        {"role": "system", "content": [
            {"type": "text", "text": "x-anthropic-billing-header: cch=1\nKeep"},
            {"type": "text", "text": "x-anthropic-billing-header: a"},
            {"type": "text", "text": "Tail"}]},
        {"role": "user", "content": "x-anthropic-billing-header: stays in a user message"}]},
    "kwargs-cannot-override-request-fields": {
        "chat_template_kwargs": {"add_generation_prompt": False},
        "messages": [{"role": "user", "content": "Generation prompt stays."}]},
    "reasoning-effort-none": {"reasoning_effort": "none", "messages": [
        {"role": "user", "content": "No thinking, please."}]},
    "reasoning-effort-with-enable-thinking": {
        "reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": True},
        "messages": [{"role": "user", "content": "The kwarg wins."}]},
    "documents-and-task": {"documents": [{"title": "t", "text": "doc"}], "messages": [
        {"role": "user", "content": "Use the document.", "task": "qa"}]},
    # issue 35 review F4: vLLM 0.32 passes the kwargs as safe_apply_chat_template(**kwargs),
    # whose own "tools" and "tokenize" parameters take these (the router refused both with 400)
    "kwargs-tools": {"chat_template_kwargs": {"tools": [WEATHER_TOOL]}, "messages": [
        {"role": "user", "content": "Weather in Zürich?"}]},
    "kwargs-tools-over-request-tools": {"tools": [SEARCH_TOOL],
                                        "chat_template_kwargs": {"tools": [WEATHER_TOOL]},
                                        "messages": [{"role": "user", "content": "Which tool?"}]},
    "kwargs-tokenize": {"chat_template_kwargs": {"tokenize": True}, "messages": [
        {"role": "user", "content": "Tokenized by the template."}]},
    "kwargs-tokenize-and-add-special-tokens": {
        "add_special_tokens": True, "chat_template_kwargs": {"tokenize": True},
        "messages": [{"role": "user", "content": "The template's ids as they are."}]},
    "unused-template-kwarg": {"chat_template_kwargs": {"not_a_template_var": 1,
                                                       "enable_thinking": True},
                              "messages": [{"role": "user", "content": "Kwargs."}]},
}


def ids_mismatch(ours: list[int], theirs: list[int]) -> str:
    """Where two id lists first differ, for the assertion message."""
    first = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b),
                 min(len(ours), len(theirs)))
    return (f"router {len(ours)} ids, vLLM {len(theirs)}; first difference at {first}: "
            f"router {ours[first:first + 8]} vLLM {theirs[first:first + 8]}")


# request fields that vLLM's /tokenize does not take into the template (only chat completions
# does, vLLM 0.32 ChatCompletionRequest.build_chat_params)
CHAT_ONLY_FIELDS = ("reasoning_effort", "documents")


@pytest.mark.parametrize("name", sorted(CHAT_BODIES))
def test_router_token_ids_equal_vllms(engine_fleet: EngineFleet, name: str) -> None:
    """The router's ids equal the prompt ids vLLM serves the chat completion with
    (``return_token_ids``) and, for bodies without chat-only fields, its ``/tokenize``."""
    engine = engine_fleet.engines[0]
    body = {"model": engine.model, **CHAT_BODIES[name]}
    try:
        served = post_json(f"{engine.url}/v1/chat/completions",
                           {**body, "max_tokens": 1, "return_token_ids": True})["prompt_token_ids"]
        tokenized = (None if any(f in body for f in CHAT_ONLY_FIELDS)
                     else post_json(f"{engine.url}/tokenize", body)["tokens"])
    except HTTPError as exc:
        pytest.fail(f"vLLM refused the body: {exc.code} {exc.read()!r}")
    ours = post_json(f"{engine_fleet.url}/debug/route?token_ids=1", body)["token_ids"]
    assert ours == served, ids_mismatch(ours, served)
    assert tokenized is None or ours == tokenized, ids_mismatch(ours, tokenized)
