"""Write ``vllm-api-conversions.json``: Anthropic Messages and OpenAI Responses bodies with the
chat fields vLLM's own code turns them into (the messages, the tool dicts handed to the chat
template and the template kwargs). Run with a Python that has vLLM installed (the ``vllm``
extra, or the real-engine tests' venv)::

    python tests/vectors/make_api_conversions.py

vLLM 0.32 code used: ``AnthropicServingMessages.to_chat_completion_request`` (with and without
``merge_inline_system``), ``ChatCompletionRequest.build_chat_params``; for Responses
``construct_input_messages``, ``construct_tool_dicts`` and ``ResponsesRequest.build_chat_params``.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from loadtest.harness.vllm_engine import hide_unmatched_torch_packages

hide_unmatched_torch_packages()

OUT = Path(__file__).with_name("vllm-api-conversions.json")
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}

MESSAGES_BODIES: dict[str, dict[str, Any]] = {
    "plain": {"messages": [{"role": "user", "content": "Hello there."}]},
    "system-string": {"system": "You are terse.",
                      "messages": [{"role": "user", "content": "Hi."}]},
    "system-blocks-billing": {"system": [
        {"type": "text", "text": "x-anthropic-billing-header: cch=1"},
        {"type": "text", "text": "You are Claude Code."},
        {"type": "text", "text": " Be brief."}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "List files."}]}]},
    "multi-turn-blocks": {"messages": [
        {"role": "user", "content": [{"type": "text", "text": "Name a colour."},
                                     {"type": "text", "text": "Any."}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Blue."}]},
        {"role": "user", "content": "Another."}]},
    "tool-use-and-result": {
        "tools": [{"name": "get_weather", "description": "Weather of a city.",
                   "input_schema": SCHEMA}],
        "messages": [
            {"role": "user", "content": "Weather in Bern?"},
            {"role": "assistant", "content": [
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                 "input": {"city": "Bern"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1",
                 "content": [{"type": "text", "text": "21 C"}, {"type": "text", "text": "sun"}]},
                {"type": "text", "text": "And tomorrow?"}]}]},
    "tool-result-only": {
        "tools": [{"name": "ls", "input_schema": {"properties": {}}, "strict": True}],
        "messages": [
            {"role": "user", "content": "List."},
            {"role": "assistant", "content": [
                {"type": "tool_use", "id": "toolu_2", "name": "ls", "input": {}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_2", "content": "a.txt b.txt"}]}]},
    "thinking": {"messages": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Two and two.", "signature": "s"},
            {"type": "text", "text": "4"}]},
        {"role": "user", "content": "3+3?"}]},
    "inline-system": {"system": "Lead.", "messages": [
        {"role": "user", "content": "One."},
        {"role": "system", "content": "Reminder."},
        {"role": "user", "content": "Two."}]},
    "thinking-disabled": {"thinking": {"type": "disabled"},
                          "messages": [{"role": "user", "content": "No thinking."}]},
    "effort-and-kwargs": {"output_config": {"effort": "low"},
                          "chat_template_kwargs": {"enable_thinking": False},
                          "messages": [{"role": "user", "content": "Low effort."}]},
    "assistant-tool-result": {"messages": [
        {"role": "user", "content": "Go."},
        {"role": "assistant", "content": [
            {"type": "tool_result", "tool_use_id": "x", "content": "done"}]}]},
    "empty-text-block": {"messages": [
        {"role": "user", "content": [{"type": "text", "text": ""},
                                     {"type": "text", "text": "Only this."}]}]},
}

RESPONSES_BODIES: dict[str, dict[str, Any]] = {
    "string-input": {"input": "Hello there."},
    "instructions": {"instructions": "Be terse.", "input": "Hi."},
    "easy-messages": {"input": [
        {"role": "system", "content": "Rules."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another."}]},
    "typed-messages": {"input": [
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "Part one."},
                     {"type": "input_text", "text": "Part two."}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Yes.", "annotations": []}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "More."}]}]},
    "function-call-round-trip": {
        "tools": [{"type": "function", "name": "get_weather", "description": "Weather.",
                   "parameters": SCHEMA, "strict": True}],
        "input": [
            {"role": "user", "content": "Weather in Bern?"},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather",
             "arguments": "{\"city\": \"Bern\"}", "id": "fc_1", "status": "completed"},
            {"type": "function_call_output", "call_id": "call_1", "output": "21 C"},
            {"role": "user", "content": "Tomorrow?"}]},
    "reasoning-then-message": {"reasoning": {"effort": "low"}, "input": [
        {"role": "user", "content": "2+2?"},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "Adding."}]},
        {"type": "message", "role": "assistant", "id": "msg_2", "status": "completed",
         "content": [{"type": "output_text", "text": "4", "annotations": []}]},
        {"role": "user", "content": "3+3?"}]},
    "continue-final": {"input": [
        {"role": "user", "content": "Write a haiku."},
        {"type": "message", "role": "assistant", "id": "msg_3", "status": "incomplete",
         "content": [{"type": "output_text", "text": "Blocks of warm", "annotations": []}]}]},
    "namespace-tools": {"tools": [
        {"type": "namespace", "name": "fs", "description": "Files.", "tools": [
            {"type": "function", "name": "ls", "parameters": {"type": "object", "properties": {}}}]},
        {"type": "function", "name": "now", "parameters": None}],
        "input": "What time is it?"},
    "kwargs-and-effort-none": {"reasoning": {"effort": "none"},
                               "chat_template_kwargs": {"foo": 1},
                               "input": "Kwargs."},
}


def _plain(value: Any) -> Any:
    """JSON of what pydantic leaves in messages: models, and iterators of tool calls."""
    return value.model_dump() if hasattr(value, "model_dump") else list(value)


def messages_vector(body: dict[str, Any], merge: bool) -> dict[str, Any]:
    from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest
    from vllm.entrypoints.anthropic.serving import AnthropicServingMessages

    request = AnthropicMessagesRequest.model_validate(copy.deepcopy(body))
    chat = AnthropicServingMessages.to_chat_completion_request(request, merge_inline_system=merge)
    params = chat.build_chat_params(None, "auto")
    return {"messages": json.loads(json.dumps(list(chat.messages), default=_plain)),
            "tools": None if chat.tools is None else [t.model_dump() for t in chat.tools],
            "chat_template_kwargs": params.chat_template_kwargs}


def responses_vector(body: dict[str, Any]) -> dict[str, Any]:
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest
    from vllm.entrypoints.openai.responses.utils import (
        construct_input_messages,
        construct_tool_dicts,
    )

    request = ResponsesRequest.model_validate(copy.deepcopy(body))  # (it edits the input)
    messages = construct_input_messages(request_instructions=request.instructions,
                                        request_input=request.input)
    params = request.build_chat_params(None, "auto")
    return {"messages": json.loads(json.dumps(messages, default=_plain)),
            "tools": construct_tool_dicts(request.tools, request.tool_choice),
            "chat_template_kwargs": params.chat_template_kwargs}


def main() -> None:
    import vllm

    out: dict[str, Any] = {"vllm_version": vllm.__version__, "messages": {}, "responses": {}}
    for name, body in MESSAGES_BODIES.items():
        full = {"model": "m", "max_tokens": 8, **body}
        out["messages"][name] = {"body": full,
                                 "merged": messages_vector(full, True),
                                 "inline": messages_vector(full, False)}
    for name, body in RESPONSES_BODIES.items():
        full = {"model": "m", **body}
        out["responses"][name] = {"body": full, "chat": responses_vector(full)}
    OUT.write_text(json.dumps(out, indent=1, ensure_ascii=False, sort_keys=True) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
