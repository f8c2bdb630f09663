"""Chat messages as vLLM hands them to the chat template, and the template's keyword arguments.
Pure.

Shared by the router (``router.request.prompts`` renders chat prompts to count their tokens) and
the emulator (``worker.emulator.tokenizer`` renders them to serve them), so both apply the same
vLLM 0.32 rules: text parts joined, ``developer`` folded into ``system`` when the template does not
know it, tool-call arguments decoded, Claude Code's billing header dropped.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any, Final

ImageMarker = Callable[[Any], str | None]  # a content part -> its marker text, None: no image

# the text of a text-like content part, by type (vLLM 0.32 chat_utils ``MM_PARSER_MAP`` and
# ``TEXT_PART_TYPES``): a refusal's text is under "refusal", a thinking part's under "thinking"
_TEXT_PART_KEYS: Final = {"text": "text", "input_text": "text", "output_text": "text",
                          "refusal": "refusal", "thinking": "thinking"}
# Claude Code's attribution line, whose ``cch`` changes on every request: vLLM drops it from
# system messages (vLLM 0.32 chat_utils ``_strip_claude_code_billing_header``)
CLAUDE_CODE_BILLING_HEADER: Final = "x-anthropic-billing-header"


def _part_text(part: Any) -> str | None:
    """A content part's text: a bare string, or a text-like part's field; None for others."""
    if isinstance(part, str):
        return part
    if isinstance(part, dict) and part.get("type") in _TEXT_PART_KEYS:
        text = part.get(_TEXT_PART_KEYS[part["type"]])
        return text if isinstance(text, str) else None
    return None


def _normalise_content(content: Any, system: bool = False,
                       image_marker: ImageMarker | None = None) -> Any:
    """vLLM "string" content format: text parts joined with newlines, image parts (with an
    ``image_marker``) as markers in front of them, one per line, as vLLM puts the placeholders
    it did not find in the text (vLLM 0.32 ``_get_full_multimodal_text_prompt``), other parts
    dropped, and
    no content (``None``) as "". For a ``system`` message a part (or the whole string) that
    starts with Claude Code's billing header loses its first line, and is dropped when nothing
    follows it."""
    if content is None:
        return ""
    if isinstance(content, str):
        content = [content] if system else content
    if isinstance(content, list):
        texts = [t for t in map(_part_text, content) if t is not None]
        if system:
            texts = [t.partition("\n")[2] if t.startswith(CLAUDE_CODE_BILLING_HEADER) else t
                     for t in texts if not (t.startswith(CLAUDE_CODE_BILLING_HEADER)
                                            and not t.partition("\n")[2])]
        markers = [m for m in map(image_marker, content) if m is not None] if image_marker else []
        text = "\n".join(texts)
        return "\n".join([*markers, text] if text else markers) if markers else text
    return content


def normalise_tool(tool: Any) -> Any:
    """vLLM ``ChatCompletionToolsParam.model_dump()`` field order and defaults."""
    if not isinstance(tool, dict) or not isinstance(tool.get("function"), dict):
        return tool
    fn = tool["function"]
    return {"type": tool.get("type", "function"),
            "function": {"name": fn.get("name"), "description": fn.get("description"),
                         "parameters": fn.get("parameters")}}


def knows_developer_role(template: str | None) -> bool:
    """Whether a chat template names the ``developer`` role (quoted, as vLLM 0.32
    ``_detect_developer_role_support`` looks for it)."""
    return template is not None and ('"developer"' in template or "'developer'" in template)


def prepare_messages(messages: Sequence[dict[str, Any]], template: str | None, *,
                     image_marker: ImageMarker | None = None) -> list[dict[str, Any]]:
    """Messages as vLLM hands them to the chat template (vLLM 0.32 chat_utils
    ``_parse_chat_message_content`` and ``_postprocess_messages``, renderers/hf
    ``safe_apply_chat_template``): each becomes ``role`` and string ``content`` (``None`` -> "";
    a system message without Claude Code's billing-header line), plus for an assistant its
    ``tool_calls`` (arguments JSON-decoded, ``{}`` when not JSON; an empty list dropped) and
    ``reasoning`` (also as ``reasoning_content``), for a tool its ``tool_call_id``, a string
    ``name`` and ``task``; other keys are not passed. When the template does not know the
    ``developer`` role, developer messages become system messages and all system messages are
    then merged into one at the front (``_consolidate_system_messages``). ``image_marker``:
    image parts become its markers (the router's routed prompt, ``router.apis.images``), else
    they are dropped (the emulator has no image tokens to give them)."""
    out = []
    for message in messages:
        role = message.get("role")
        content = _normalise_content(message.get("content"), system=role == "system",
                                     image_marker=image_marker)
        msg: dict[str, Any] = {"role": role, "content": content}
        if role == "assistant":
            calls = message.get("tool_calls")
            if isinstance(calls, list) and calls:
                msg["tool_calls"] = [_decoded_call(call) for call in calls]
            elif calls is not None and not isinstance(calls, list):
                msg["tool_calls"] = calls
            if message.get("reasoning") is not None:
                msg["reasoning"] = msg["reasoning_content"] = message["reasoning"]
        elif role == "tool" and "tool_call_id" in message:
            msg["tool_call_id"] = message["tool_call_id"]
        for key in ("name", "task"):
            if isinstance(message.get(key), str):
                msg[key] = message[key]
        if role == "developer":
            msg["tools"] = message.get("tools")
        out.append(msg)
    if any(m["role"] == "developer" for m in out) and not knows_developer_role(template):
        out = _consolidate_system([{k: v for k, v in m.items() if k != "tools"}
                                   | {"role": "system"} if m["role"] == "developer" else m
                                   for m in out])
    return out


def _consolidate_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """All system messages merged into one at the front, their non-empty contents joined by a
    blank line, when there is more than one or one is not first (vLLM 0.32 renderers/hf
    ``_consolidate_system_messages``; some templates need the system message first)."""
    systems = [i for i, m in enumerate(messages) if m["role"] == "system"]
    if not systems or systems == [0]:
        return messages
    merged = "\n\n".join(c for i in systems if (c := messages[i]["content"]))
    return [{"role": "system", "content": merged},
            *(m for m in messages if m["role"] != "system")]


def _decoded_call(call: Any) -> Any:
    """A tool call with its JSON-string ``arguments`` decoded ({} when not JSON or missing)."""
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        return call
    fn = dict(call["function"])
    arguments = fn.get("arguments")
    if isinstance(arguments, str):
        try:
            fn["arguments"] = json.loads(arguments)
        except json.JSONDecodeError:
            fn["arguments"] = {}
    elif not isinstance(arguments, (dict, list)):
        fn["arguments"] = {}
    return {**call, "function": fn}


def template_kwargs(options: dict[str, Any]) -> dict[str, Any]:
    """The chat template's keyword arguments for a chat request's ``chat_options``, merged as vLLM
    0.32 ``ChatCompletionRequest.build_chat_params`` merges them: the request's
    ``chat_template_kwargs``, overridden by its ``add_generation_prompt`` and
    ``continue_final_message`` and by its ``documents`` and ``reasoning_effort`` when set
    (``merge_kwargs`` skips None); a ``reasoning_effort`` also sets ``enable_thinking`` (False
    for "none") unless the request's kwargs set it."""
    user = dict(options.get("chat_template_kwargs") or {})
    explicit: dict[str, Any] = {
        "add_generation_prompt": bool(options.get("add_generation_prompt", True)),
        "continue_final_message": bool(options.get("continue_final_message", False)),
        "documents": options.get("documents"),
        "reasoning_effort": options.get("reasoning_effort"),
    }
    if explicit["reasoning_effort"] is not None and "enable_thinking" not in user:
        explicit["enable_thinking"] = explicit["reasoning_effort"] != "none"
    return user | {k: v for k, v in explicit.items() if v is not None and v != "auto"}


def template_call(options: dict[str, Any],
                  tools: list[Any] | None) -> tuple[list[Any] | None, bool, dict[str, Any]]:
    """``(tools, tokenize, kwargs)`` of the chat template call for a chat request's
    ``chat_options`` and its ``tools`` (as vLLM hands them over), as vLLM 0.32 makes it
    (``OnlineRenderer.preprocess_chat``): ``template_kwargs`` over the defaults
    ``{"tools": tools, "tokenize": False}`` (``ChatParams.with_defaults``: ``merge_kwargs`` drops
    the request's None and "auto" values), all passed as ``safe_apply_chat_template(**kwargs)``,
    whose own ``tools`` and ``tokenize`` parameters take those two keys. So a
    ``chat_template_kwargs`` "tools" replaces the request's ``tools`` (as given), and a true
    "tokenize" has the template's text tokenized there, without special tokens."""
    merged: dict[str, Any] = {"tools": tools, "tokenize": False} | {
        k: v for k, v in template_kwargs(options).items() if v is not None and v != "auto"}
    return merged.pop("tools"), bool(merged.pop("tokenize")), merged
