"""OpenAI Responses bodies (``POST /v1/responses``) as the chat prompts vLLM renders them as. Pure
(shared: the router routes by it, the emulator serves by it).

vLLM renders a Responses request through its chat template (vLLM 0.32
``renderers/online_renderer.py`` ``render_responses`` with
``entrypoints/openai/responses/utils.py``): ``instructions`` become a system message; a string
``input`` one user message; a list of input items chat messages (``construct_input_messages``):
messages with a ``role`` as given (assistant ones reduced to their first part's text), a
``reasoning`` item's first content text (else its first summary text) as an assistant's
``reasoning``, ``function_call`` / ``custom_tool_call`` items as assistant ``tool_calls`` (merged
into the assistant message before them), ``function_call_output`` items as ``tool`` messages;
function tools (namespaced ones flattened to ``<namespace>__<name>``) as chat function tools
(``construct_tool_dicts``); ``reasoning.effort`` as ``reasoning_effort`` (which also sets
``enable_thinking``); a last item that is an unfinished assistant message (``status``
``in_progress`` / ``incomplete``) continues it instead of adding a generation prompt
(``ResponsesRequest.build_chat_params``).

A request naming ``previous_response_id`` is rendered by the engine after the conversation it
stored under that id: only the replica holding it can serve it, so the router routes it by
that (``router.apis.responses``), not by its prompt.
"""

from __future__ import annotations

import json
from typing import Any, Final

NAMESPACE_SEPARATOR: Final = "__"  # vLLM tool_parsers.utils flat_namespace_tool_name
CUSTOM_TOOL_INPUT_KEY: Final = "input"  # vLLM tool_parsers.utils: a custom tool's shim argument
UNFINISHED: Final = ("in_progress", "incomplete")  # statuses of a message to continue


class ResponsesError(ValueError):
    """A Responses body vLLM would refuse (an HTTP 400)."""


def _tool_call(item: dict[str, Any]) -> dict[str, Any] | None:
    """A ``function_call`` or ``custom_tool_call`` item as a chat tool call, else None."""
    kind = item.get("type")
    if kind == "function_call":
        name = item.get("name")
        if item.get("namespace"):
            name = f"{item['namespace']}{NAMESPACE_SEPARATOR}{name}"
        return {"id": item.get("call_id"), "function": {"name": name,
                                                         "arguments": item.get("arguments")},
                "type": "function"}
    if kind == "custom_tool_call":
        payload = json.dumps({CUSTOM_TOOL_INPUT_KEY: item.get("input") or ""}, ensure_ascii=False)
        return {"id": item.get("call_id"), "function": {"name": item.get("name"),
                                                         "arguments": payload},
                "type": "function"}
    return None


def _assistant_text(item: dict[str, Any]) -> str | None:
    content = item.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content and isinstance(content[0], dict):
        text = content[0].get("text")
        return text if isinstance(text, str) else None
    return None


def _message_of(item: Any, prev: dict[str, Any] | None) -> dict[str, Any] | None:
    """One input item -> a new chat message, or None when it was merged into ``prev`` (vLLM
    ``_construct_message_from_response_item``). Raises ``ResponsesError``."""
    if not isinstance(item, dict):
        raise ResponsesError("each 'input' item must be an object")
    assistant = prev if prev is not None and prev.get("role") == "assistant" else None
    call = _tool_call(item)
    if call is not None:
        if assistant is not None and isinstance(assistant.get("tool_calls", []), list):
            assistant.setdefault("tool_calls", []).append(call)
            return None
        return {"role": "assistant", "tool_calls": [call]}
    kind = item.get("type")
    if kind == "reasoning":
        if item.get("encrypted_content"):
            raise ResponsesError("Encrypted content is not supported.")
        parts = item.get("content") or item.get("summary") or []
        first = parts[0] if isinstance(parts, list) and parts else {}
        reasoning = first.get("text", "") if isinstance(first, dict) else ""
        if assistant is not None and assistant.get("reasoning") is None:
            assistant["reasoning"] = reasoning
            return None
        return {"role": "assistant", "reasoning": reasoning}
    if kind in ("function_call_output", "custom_tool_call_output"):
        return {"role": "tool", "content": item.get("output"), "tool_call_id": item.get("call_id")}
    if item.get("role") == "assistant":
        text = _assistant_text(item)
        if text is not None:
            if assistant is not None and assistant.get("content") is None:
                assistant["content"] = text
                return None
            return {"role": "assistant", "content": text}
    if "role" in item:
        return dict(item)
    raise ResponsesError(f"Unsupported input item type: {kind}")


def input_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The chat messages of a Responses body without a previous response (vLLM
    ``construct_input_messages``). Raises ``ResponsesError``."""
    messages: list[dict[str, Any]] = []
    if body.get("instructions"):
        messages.append({"role": "system", "content": body["instructions"]})
    items = body["input"]
    if isinstance(items, str):
        messages.append({"role": "user", "content": items})
        return messages
    converted: list[dict[str, Any]] = []
    for item in items:
        message = _message_of(item, converted[-1] if converted else None)
        if message is not None:
            converted.append(message)
    return messages + converted


def _function_tool_dict(tool: dict[str, Any]) -> dict[str, Any]:
    """A Responses function tool as vLLM hands it to the template
    (``convert_tool_responses_to_completions_format(...).model_dump()``)."""
    function: dict[str, Any] = {"name": tool.get("name"), "description": tool.get("description"),
                                "parameters": tool.get("parameters")}
    for key in ("strict", "defer_loading"):
        if tool.get(key) is not None:
            function[key] = tool[key]
    return {"type": "function", "function": function}


def tool_dicts(tools: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """The function tools the template sees (vLLM ``construct_tool_dicts`` with
    ``get_function_tools``: namespace functions flattened, other tool types dropped), or None
    without tools."""
    if not tools:
        return None
    out = []
    for tool in tools:
        if tool.get("type") == "namespace":
            out += [_function_tool_dict({**inner, "name": f"{tool.get('name')}"
                                         f"{NAMESPACE_SEPARATOR}{inner.get('name')}"})
                    for inner in tool.get("tools") or [] if inner.get("type") == "function"]
        elif tool.get("type") == "function":
            out.append(_function_tool_dict(tool))
    return out


def continues_final_message(items: Any) -> bool:
    """vLLM ``should_continue_final_message``: the last input item is a message or reasoning
    item still ``in_progress`` or ``incomplete``."""
    if not isinstance(items, list) or not items or not isinstance(items[-1], dict):
        return False
    last = items[-1]
    return last.get("type", "message") in ("message", "reasoning") and last.get("status") in UNFINISHED


def check_responses_body(body: Any) -> dict[str, Any]:
    """The fields the router reads, checked as vLLM's ``ResponsesRequest`` checks them. Raises
    ``ResponsesError`` naming the field."""
    if not isinstance(body, dict):
        raise ResponsesError("request body must be a JSON object")
    items = body.get("input")
    if not isinstance(items, str | list):
        raise ResponsesError("'input' is required and must be a string or a list of items")
    for key in ("model", "instructions", "previous_response_id"):
        if body.get(key) is not None and not isinstance(body[key], str):
            raise ResponsesError(f"'{key}' must be a string")
    for key in ("stream", "store", "background"):
        if body.get(key) is not None and not isinstance(body[key], bool):
            raise ResponsesError(f"'{key}' must be a boolean")
    for key in ("reasoning", "chat_template_kwargs"):
        if body.get(key) is not None and not isinstance(body[key], dict):
            raise ResponsesError(f"'{key}' must be an object")
    limit = body.get("max_output_tokens")
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
        # vLLM's own message names max_tokens (its SamplingParams'): the client sent this one
        raise ResponsesError(f"'max_output_tokens' must be a positive integer, got {limit!r}")
    tools = body.get("tools")
    if tools is not None and not (isinstance(tools, list)
                                  and all(isinstance(t, dict) and "type" in t for t in tools)):
        raise ResponsesError("'tools' must be a list of objects with a 'type'")
    if body.get("previous_input_messages") and body.get("previous_response_id"):
        raise ResponsesError("Only one of `previous_input_messages` and `previous_response_id` "
                             "can be set.")
    return body


def responses_chat(body: dict[str, Any]) -> dict[str, Any]:
    """A checked Responses body (``check_responses_body``) without a previous response -> its
    chat fields: ``messages`` and the options the router's chat path reads
    (``add_generation_prompt``, ``continue_final_message``, and when set
    ``chat_template_kwargs``, ``reasoning_effort``, ``tool_dicts``). Raises ``ResponsesError``."""
    continue_final = continues_final_message(body["input"])
    options: dict[str, Any] = {"add_generation_prompt": not continue_final,
                               "continue_final_message": continue_final}
    if body.get("chat_template_kwargs") is not None:
        options["chat_template_kwargs"] = body["chat_template_kwargs"]
    effort = (body.get("reasoning") or {}).get("effort")
    if effort is not None:
        options["reasoning_effort"] = effort
    tools = tool_dicts(body.get("tools") or [])
    if tools is not None:
        options["tool_dicts"] = tools
    return {"messages": input_messages(body), "options": options}
