"""Anthropic Messages bodies (``POST /v1/messages``) as the chat requests vLLM serves them as. Pure
(shared: the router routes by it, the emulator serves by it).

vLLM answers ``/v1/messages`` by converting the body into a chat completion request and serving
that (vLLM 0.32 ``entrypoints/anthropic/serving.py``,
``AnthropicServingMessages.to_chat_completion_request``): the top-level ``system`` (a string, or
its text blocks joined without separator, Claude Code's billing-header blocks dropped) becomes
one system message first; each message's blocks become chat content parts (``text``,
``image``), assistant ``tool_calls`` (``tool_use``, arguments ``json.dumps``-ed), a
``reasoning`` field (``thinking`` blocks joined) and, for ``tool_result`` blocks in a user
message, ``tool`` messages placed before that user message's own content; ``tools`` become
chat function tools (``input_schema`` as ``parameters``; ``tool_addition`` / ``tool_removal``
blocks applied); ``output_config.effort`` and ``thinking.type == "disabled"`` set
``reasoning_effort``. When the model's chat template refuses a system message after the first
(``merges_inline_system``), inline system messages are merged into the leading one.

``check_messages_body`` validates the fields vLLM's request model requires (``MessagesError``
otherwise) and ``messages_to_chat`` does the conversion on the JSON body
(``router.apis.messages`` makes the router's chat request of it).
"""

from __future__ import annotations

import json
import time
from typing import Any, Final

BILLING_HEADER: Final = "x-anthropic-billing-header"  # Claude Code's per-request attribution
ROLES: Final = frozenset({"user", "assistant", "system"})  # vLLM AnthropicMessage.role
BLOCK_TYPES: Final = frozenset({"text", "image", "tool_use", "tool_result", "tool_reference",
                                "thinking", "redacted_thinking", "tool_addition", "tool_removal"})
# the reasoning_effort ``thinking: {"type": "disabled"}`` maps to: vLLM probes the template and
# uses "low" only where "none" renders like a thinking effort (not so for Qwen3); its render
# endpoint always uses "none"
DISABLED_THINKING_EFFORT: Final = "none"


class MessagesError(ValueError):
    """A Messages body vLLM's request model would refuse (an HTTP 400)."""


def merges_inline_system(template: str | None) -> bool:
    """Whether vLLM merges inline system messages into the leading one for this chat template:
    it renders ``[system, user, system, user]`` in Jinja's sandbox and merges when that raises
    (Qwen-style ``loop.first`` guards) or there is no template (vLLM 0.32
    ``AnthropicServingMessages._detect_merge_inline_system``)."""
    if not template:
        return True
    import jinja2
    import jinja2.ext
    import jinja2.sandbox

    try:
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
        env.from_string(template).render(
            messages=[{"role": "system", "content": "t"}, {"role": "user", "content": "t"},
                      {"role": "system", "content": "t"}, {"role": "user", "content": "t"}],
            add_generation_prompt=False)
    except jinja2.TemplateError:
        return True
    return False


def _blocks(content: Any) -> list[dict[str, Any]]:
    return content if isinstance(content, list) else []


def _system_text(message: dict[str, Any]) -> str | None:
    """An inline system message's text, billing-header blocks dropped (vLLM
    ``_extract_system_text``)."""
    content = message.get("content")
    if isinstance(content, str):
        return None if content.startswith(BILLING_HEADER) else content
    parts = [b["text"] for b in _blocks(content)
             if b.get("type") == "text" and b.get("text") and not b["text"].startswith(BILLING_HEADER)]
    return "".join(parts) if parts else None


def _system_messages(body: dict[str, Any], merge_inline_system: bool) -> list[dict[str, Any]]:
    """The leading system message (vLLM ``_convert_system_message``)."""
    parts: list[str] = []
    system = body.get("system")
    if isinstance(system, str) and system:
        parts.append(system)
    elif isinstance(system, list):
        parts += [b["text"] for b in system if b.get("type") == "text" and b.get("text")
                  and not b["text"].startswith(BILLING_HEADER)]
    if merge_inline_system:
        parts += [text for m in body["messages"] if m.get("role") == "system"
                  if (text := _system_text(m))]
    return [{"role": "system", "content": "".join(parts)}] if parts else []


def _image_url(source: dict[str, Any]) -> str:
    """vLLM ``_convert_image_source_to_url``: a URL source's URL, else a base64 data URL."""
    if source.get("type") == "url":
        return str(source.get("url", ""))
    return f"data:{source.get('media_type', 'image/jpeg')};base64,{source.get('data', '')}"


def _user_tool_result(block: dict[str, Any]) -> list[dict[str, Any]]:
    """A user's ``tool_result`` block as the chat messages vLLM makes of it
    (``_convert_user_tool_result``): a tool message, then a user message with its images, then
    a tool message with its tool references."""
    text, images, references = "", [], []
    content = block.get("content")
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        texts = []
        for item in content:
            if not isinstance(item, dict):
                continue
            if item.get("type") == "text":
                texts.append(item.get("text", ""))
            elif item.get("type") == "image":
                url = _image_url(item.get("source", {}))
                if url:
                    images.append(url)
            elif item.get("type") == "tool_reference":
                name = item.get("tool_name") or item.get("name")
                if name:
                    references.append({"type": "tool_reference", "name": name})
        text = "\n".join(texts)
    call_id = block.get("tool_use_id") or ""
    out: list[dict[str, Any]] = [{"role": "tool", "tool_call_id": call_id, "content": text or ""}]
    if images:
        out.append({"role": "user", "content": [{"type": "image_url", "image_url": {"url": u}}
                                                for u in images]})
    if references:
        out.append({"role": "tool", "tool_call_id": call_id, "content": references})
    return out


def _convert_message(message: dict[str, Any], out: list[dict[str, Any]]) -> None:
    """One non-system message appended to ``out`` (vLLM ``_convert_messages`` and
    ``_convert_message_content``)."""
    role = message["role"]
    chat: dict[str, Any] = {"role": role}
    content = message["content"]
    if isinstance(content, str):
        chat["content"] = content
    else:
        parts: list[dict[str, Any]] = []
        calls: list[dict[str, Any]] = []
        reasoning: list[str] = []
        for block in content:
            kind = block["type"]
            if kind == "text" and block.get("text"):
                parts.append({"type": "text", "text": block["text"]})
            elif kind == "image" and block.get("source"):
                parts.append({"type": "image_url", "image_url": {"url": _image_url(block["source"])}})
            elif kind == "thinking" and block.get("thinking") is not None:
                reasoning.append(block["thinking"])
            elif kind == "tool_use":
                calls.append({"id": block.get("id") or f"call_{int(time.time())}",
                              "type": "function",
                              "function": {"name": block.get("name") or "",
                                           "arguments": json.dumps(block.get("input") or {})}})
            elif kind == "tool_result":
                if role == "user":
                    out += _user_tool_result(block)
                else:  # vLLM renders the content with str(): a list shows as its Python repr
                    result = block.get("content")
                    parts.append({"type": "text", "text": f"Tool result: {str(result) if result else ''}"})
        if reasoning:
            chat["reasoning"] = "".join(reasoning)
        if calls:
            chat["tool_calls"] = calls
        if parts:
            chat["content"] = (parts[0]["text"] if len(parts) == 1 and parts[0]["type"] == "text"
                               else parts)
    if not (role == "user" and "content" not in chat):
        out.append(chat)


def _resolved_tools(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    """``tools`` with the messages' ``tool_addition`` / ``tool_removal`` blocks applied (vLLM
    ``_resolve_tools``). Raises ``MessagesError`` for a change naming an undeclared tool."""
    tools = body.get("tools")
    changes = [b for m in body["messages"] if not isinstance(m["content"], str)
               for b in m["content"] if b["type"] in ("tool_addition", "tool_removal")]
    if not changes:
        return tools
    by_name = {t["name"]: t for t in tools or []}
    removed: set[str] = set()
    for block in changes:
        change = block.get("tool")
        if not isinstance(change, dict):
            raise MessagesError(f"{block['type']} block needs a 'tool'")
        if change.get("type") == "tool_definition":
            definition = change.get("definition")
            if not isinstance(definition, dict) or not isinstance(definition.get("name"), str):
                raise MessagesError("a tool_definition needs a 'definition' with a 'name'")
            name = definition["name"]
            by_name[name] = _checked_tool(definition)
        else:
            name = change.get("name")
            if name not in by_name:
                raise MessagesError(f"{block['type']} references tool {name!r}, which is not "
                                    "declared in tools")
            if block["type"] == "tool_addition":
                by_name[name] = {**by_name[name], "defer_loading": None}
        if block["type"] == "tool_removal":
            removed.add(name)
        else:
            removed.discard(name)
    return [tool for name, tool in by_name.items() if name not in removed]


def _tool_dict(tool: dict[str, Any]) -> dict[str, Any]:
    """An Anthropic tool as the dict vLLM hands the chat template
    (``ChatCompletionToolsParam.model_dump()``: ``strict`` and ``defer_loading`` only when set)."""
    function: dict[str, Any] = {"name": tool["name"], "description": tool.get("description"),
                                "parameters": tool["input_schema"]}
    for key in ("strict", "defer_loading"):
        if tool.get(key) is not None:
            function[key] = tool[key]
    return {"type": "function", "function": function}


def messages_to_chat(body: dict[str, Any], *, merge_inline_system: bool) -> dict[str, Any]:
    """A validated Messages body (``check_messages_body``) -> the chat request fields vLLM
    renders: ``messages``, ``tools`` (as handed to the template, or absent), and, when set,
    ``chat_template_kwargs`` and ``reasoning_effort``."""
    messages = _system_messages(body, merge_inline_system)
    for message in body["messages"]:
        if message["role"] == "system":
            if not merge_inline_system and (text := _system_text(message)):
                messages.append({"role": "system", "content": text})
            continue
        _convert_message(message, messages)
    chat: dict[str, Any] = {"messages": messages}
    tools = _resolved_tools(body)
    if tools is not None:
        chat["tools"] = [_tool_dict(t) for t in tools]
    if body.get("chat_template_kwargs") is not None:
        chat["chat_template_kwargs"] = body["chat_template_kwargs"]
    effort = (body.get("output_config") or {}).get("effort")
    thinking = body.get("thinking") or {}
    if thinking.get("type") == "disabled":
        effort = DISABLED_THINKING_EFFORT
    if effort is not None:
        chat["reasoning_effort"] = effort
    return chat


def _checked_tool(tool: Any) -> dict[str, Any]:
    """A tool as vLLM's ``AnthropicTool`` accepts it (``input_schema`` gets ``"type":
    "object"`` when it has no type)."""
    if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
        raise MessagesError("each tool needs a string 'name'")
    schema = tool.get("input_schema")
    if not isinstance(schema, dict):
        raise MessagesError(f"tool {tool['name']!r}: 'input_schema' must be an object")
    return tool if "type" in schema else {**tool, "input_schema": {**schema, "type": "object"}}


def _check_blocks(blocks: Any, where: str) -> None:
    if not isinstance(blocks, list) or not all(
            isinstance(b, dict) and b.get("type") in BLOCK_TYPES for b in blocks):
        raise MessagesError(f"{where} must be a string or a list of content blocks with a type "
                            f"in {sorted(BLOCK_TYPES)}")
    for block in blocks:
        for key in ("text", "thinking", "id", "tool_use_id", "name"):
            if block.get(key) is not None and not isinstance(block[key], str):
                raise MessagesError(f"{where}: a {block['type']} block's {key!r} must be a string")
        if block.get("input") is not None and not isinstance(block["input"], dict):
            raise MessagesError(f"{where}: a tool_use block's 'input' must be an object")
        if block.get("source") is not None and not isinstance(block["source"], dict):
            raise MessagesError(f"{where}: an image block's 'source' must be an object")


def check_messages_body(body: Any) -> dict[str, Any]:
    """The fields vLLM's ``AnthropicMessagesRequest`` requires and the conversion reads, checked
    (a copy with tools' schemas completed); raises ``MessagesError`` (400) naming the field."""
    if not isinstance(body, dict):
        raise MessagesError("request body must be a JSON object")
    if not isinstance(body.get("model"), str):
        raise MessagesError("'model' is required and must be a string")
    max_tokens = body.get("max_tokens")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool):
        raise MessagesError("'max_tokens' is required and must be an integer")
    if max_tokens < 1:  # Anthropic's Messages reference: x >= 1
        raise MessagesError(f"'max_tokens' must be at least 1, got {max_tokens}")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise MessagesError("'messages' is required and must be a non-empty list")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise MessagesError(f"messages[{i}] must be an object with a 'role' in "
                                f"{sorted(ROLES)}")
        if not isinstance(message.get("content"), str):
            _check_blocks(message.get("content"), f"messages[{i}].content")
            if message["role"] != "system" and any(
                    b["type"] in ("tool_addition", "tool_removal") for b in message["content"]):
                raise MessagesError(f"messages[{i}]: tool_addition and tool_removal blocks "
                                    "belong in system messages")
    system = body.get("system")
    if system is not None and not isinstance(system, str):
        _check_blocks(system, "'system'")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise MessagesError("'stream' must be a boolean")
    for key in ("output_config", "thinking", "chat_template_kwargs", "tool_choice"):
        if body.get(key) is not None and not isinstance(body[key], dict):
            raise MessagesError(f"'{key}' must be an object")
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise MessagesError("'tools' must be a list")
        body = {**body, "tools": [_checked_tool(t) for t in tools]}
    return body
