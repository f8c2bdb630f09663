"""The prompt token ids of an emulated replica's requests, as vLLM 0.33's serving code builds
them: completions prompts (ids or text), chat messages through the chat template, the Responses
and Messages APIs' chat conversions, and the texts of the pooling APIs. Does I/O only through
the shared tokenizer (a worker thread); errors are ``http_checks.ApiError``.
"""

from __future__ import annotations

from typing import Any

from router.shared.chat_messages import template_call, template_kwargs
from router.shared.messages_chat import merges_inline_system
from worker.emulator.config import EmulatorConfig
from worker.emulator.http_checks import (
    ApiError,
    bad_request,
    check_vocab,
    is_token_list,
    valid_token_ids,
)
from worker.emulator.tokenizer import SharedTokenizer, TokenizerError


class PromptInput:
    """Turns request bodies into prompt token ids with the replica's tokenizer (or, for token-id
    prompts, checks them against ``config.vocab_size``, else the tokenizer's vocabulary)."""

    def __init__(self, config: EmulatorConfig, tokenizer: SharedTokenizer) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self._merge_inline_system: bool | None = None  # from the chat template, on first use

    async def vocab_size(self) -> int:
        if self.config.vocab_size is not None:
            return self.config.vocab_size
        try:
            return await self.tokenizer.vocab_size()
        except TokenizerError as exc:
            raise ApiError(500, str(exc), "InternalServerError") from exc

    async def encode(self, text: str, add_special: bool) -> list[int]:
        try:
            return await self.tokenizer.encode(text, add_special)
        except TokenizerError as exc:
            raise ApiError(500, str(exc), "InternalServerError") from exc

    async def texts_tokens(self, texts: list[str]) -> list[list[int]]:
        return [await self.encode(text, True) for text in texts]

    async def merge_inline_system(self) -> bool:
        """Whether the chat template merges an inline system message (asked once)."""
        if self._merge_inline_system is None:
            tok = await self.tokenizer.get()
            self._merge_inline_system = merges_inline_system(getattr(tok, "chat_template", None))
        return self._merge_inline_system

    async def completion_prompts(self, data: dict[str, Any],
                                 field: str = "prompt") -> list[list[int]]:
        """The prompts of ``data[field]`` (a completions body's ``prompt``; the pooling paths'
        ``input``): a string, a token-id list, or a non-empty list of either. ApiError 400 naming
        ``field`` (the field the client sent) for anything else, negative or out-of-vocabulary
        ids, or an empty prompt."""
        if data.get(field) is None:
            raise bad_request(f"{field} is required", field)
        prompt = data[field]
        if isinstance(prompt, list) and prompt and type(prompt[0]) is int and valid_token_ids(
                prompt, await self.vocab_size()):
            return [prompt]  # one valid token-id prompt: the common case, checked in C
        add_special = data.get("add_special_tokens", True)
        items: list[Any]
        if isinstance(prompt, str) or is_token_list(prompt):
            items = [prompt]
        elif isinstance(prompt, list) and prompt:
            items = prompt
        else:
            raise bad_request(f"{field} must be a string, a list of token ids, or a non-empty list "
                              "of either", field)
        out: list[list[int]] = []
        vocab_size: int | None = None
        for item in items:
            if isinstance(item, str):
                out.append(await self.encode(item, bool(add_special)))
            elif isinstance(item, list) and all(type(t) is int for t in item):
                if any(t < 0 for t in item):
                    raise bad_request("token ids must be non-negative integers", field)
                if item:
                    if vocab_size is None:
                        vocab_size = await self.vocab_size()
                    check_vocab(item, vocab_size)
                out.append(item)
            else:
                raise bad_request(f"each item of {field} must be a string or a list of token ids",
                                  field)
            if not out[-1]:
                raise bad_request("The decoder prompt cannot be empty", field)
        return out

    async def chat_prompt(self, data: dict[str, Any]) -> list[int]:
        """A chat completions body's ``messages`` through the chat template. ApiError 400 for
        missing messages, conflicting flags, reserved template kwargs or a template error."""
        messages = data.get("messages")
        if not isinstance(messages, list) or not messages:
            raise bad_request("messages must be a non-empty list", "messages")
        add_generation_prompt = data.get("add_generation_prompt", True)
        continue_final = data.get("continue_final_message", False)
        if add_generation_prompt and continue_final:
            raise bad_request("Cannot set both `continue_final_message` and "
                              "`add_generation_prompt` to True.")
        kwargs = data.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise bad_request("chat_template_kwargs must be an object", "chat_template_kwargs")
        if "chat_template" in kwargs:  # vLLM: refused unless --trust-request-chat-template
            raise bad_request("Found unexpected chat template kwargs from request: "
                              "{'chat_template'}", "chat_template_kwargs")
        # "tools" and "tokenize" are the template call's own arguments (vLLM 0.32)
        tools, tokenize, kwargs = template_call({"chat_template_kwargs": kwargs}, data.get("tools"))
        for field in ("add_generation_prompt", "continue_final_message"):  # the request's win
            kwargs.pop(field)
        try:
            ids = await self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=bool(add_generation_prompt),
                continue_final_message=bool(continue_final), tools=tools,
                chat_template_kwargs=kwargs,
                add_special_tokens=bool(data.get("add_special_tokens", False)) and not tokenize)
        except TokenizerError as exc:
            raise bad_request(str(exc), "messages") from exc
        if not ids:
            raise bad_request("The decoder prompt cannot be empty", "messages")
        return ids

    async def api_prompt(self, messages: list[dict[str, Any]], options: dict[str, Any]) -> list[int]:
        """The prompt ids of a Responses or Messages request (its chat ``messages`` and
        ``options`` from ``router.shared``: vLLM's own conversion) through the chat template."""
        kwargs = template_kwargs(options)
        add_generation_prompt = kwargs.pop("add_generation_prompt")
        continue_final = kwargs.pop("continue_final_message")
        try:
            ids = await self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final, tools=options.get("tool_dicts"),
                chat_template_kwargs=kwargs, add_special_tokens=False)
        except TokenizerError as exc:
            raise bad_request(str(exc), "messages") from exc
        if not ids:
            raise bad_request("The decoder prompt cannot be empty", "messages")
        return ids
