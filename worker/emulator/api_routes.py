"""The Responses (``/v1/responses``) and Anthropic Messages (``/v1/messages``) handlers of an
emulated replica: vLLM 0.33's conversions to chat (shared with the router, ``router.shared``),
one generated sequence answered in each API's shape, the Responses store that
``previous_response_id``, retrieve and cancel read, and Messages ``count_tokens``. Does I/O
(aiohttp).
"""

from __future__ import annotations

import os
import time
from typing import Any, Final

from aiohttp import web

from router.shared.messages_chat import check_messages_body, messages_to_chat
from router.shared.responses_chat import check_responses_body, input_messages, responses_chat
from worker.emulator.api_formats import MessagesAnswer, ResponsesAnswer
from worker.emulator.engine import EmulatedEngine
from worker.emulator.generation import Generation, MessagesOut, ResponsesOut
from worker.emulator.http_checks import (
    ApiError,
    api_params,
    bad_request,
    check_length,
    read_body,
    resolve_model,
)
from worker.emulator.prompt_input import PromptInput

# vLLM keeps Responses answers for ``previous_response_id`` only with this set to 1 (and never
# drops them); the emulator keeps the last MAX_STORED_RESPONSES
RESPONSES_STORE_ENV: Final = "VLLM_ENABLE_RESPONSES_API_STORE"
MAX_STORED_RESPONSES: Final = 10_000


class ApiRoutes:
    """``handle_responses`` and ``handle_messages`` over a replica's ``Generation`` and
    ``PromptInput``; ``engine`` answers for the LoRA adapters every rank shares."""

    def __init__(self, engine: EmulatedEngine, generation: Generation,
                 prompts: PromptInput) -> None:
        self.engine = engine
        self.config = engine.config
        self.generation = generation
        self.prompts = prompts
        self.store_responses = os.environ.get(RESPONSES_STORE_ENV) == "1"
        # {response id: (its chat messages, its output text, the response object)}, oldest first
        self.responses: dict[str, tuple[list[dict[str, Any]], str, dict[str, Any]]] = {}

    def _stored(self, response_id: str) -> tuple[list[dict[str, Any]], str, dict[str, Any]]:
        """A stored response; vLLM ``_make_not_found_error`` (404) if unknown."""
        stored = self.responses.get(response_id)
        if stored is None:
            raise ApiError(404, f"Response with id '{response_id}' not found.",
                           "invalid_request_error", "response_id")
        return stored

    def _with_history(self, data: dict[str, Any], messages: list[dict[str, Any]],
                      previous: str) -> list[dict[str, Any]]:
        """vLLM ``construct_input_messages`` with the stored turn ``previous``: 404 if unknown."""
        stored = self._stored(previous)
        history = [m for m in stored[0] if m.get("role") != "system"]
        history.append({"role": "assistant", "content": stored[1]})
        new = input_messages(data)
        system = new[:1] if data.get("instructions") else []
        return system + history + new[len(system):]

    async def handle_responses(self, request: web.Request) -> web.StreamResponse:
        """vLLM's ``/v1/responses`` for text answers; with ``VLLM_ENABLE_RESPONSES_API_STORE=1``
        answers are kept for ``previous_response_id`` (an unknown id is a 404, as in vLLM)."""
        data = await read_body(request)
        model, lora = resolve_model(self.config, self.engine.lora_paths, data)
        try:
            chat = responses_chat(check_responses_body(data))
        except ValueError as exc:
            raise bad_request(str(exc), "input") from exc
        messages = chat["messages"]
        previous = data.get("previous_response_id")
        if previous is not None:
            messages = self._with_history(data, messages, previous)
        params = api_params(data, "max_output_tokens")
        prompt = await self.prompts.api_prompt(messages, chat["options"])
        answer = ResponsesOut(ResponsesAnswer(
            data, model, int(time.time()),
            check_length(self.config, len(prompt), params.max_tokens)))
        response, text = await self.generation.answer_api(request, prompt, params, lora,
                                                          answer.answer.id, answer)
        if self.store_responses and data.get("store") is not False:
            self.responses[answer.answer.id] = (
                messages, text, answer.answer.response("completed", answer.usage))
            while len(self.responses) > MAX_STORED_RESPONSES:
                del self.responses[next(iter(self.responses))]
        return response

    async def handle_retrieve_response(self, request: web.Request) -> web.Response:
        """vLLM ``GET /v1/responses/{id}``: the stored response object (404 if unknown; the
        emulator answers every response synchronously, so it has no background stream)."""
        return web.json_response(self._stored(request.match_info["response_id"])[2])

    async def handle_cancel_response(self, request: web.Request) -> web.Response:
        """vLLM ``POST /v1/responses/{id}/cancel``: 404 if unknown; only a queued or running
        (background) response can be cancelled, and every stored one here has finished, so
        vLLM's 400 (``OpenAIServingResponses.cancel_responses``)."""
        self._stored(request.match_info["response_id"])
        raise ApiError(400, "Cannot cancel a synchronous response.", "invalid_request_error",
                       "response_id")

    async def _messages_prompt(self, data: dict[str, Any]) -> list[int]:
        """A Messages body's prompt token ids, as vLLM renders it."""
        merge_inline_system = await self.prompts.merge_inline_system()
        try:
            chat = messages_to_chat(check_messages_body(data),
                                    merge_inline_system=merge_inline_system)
        except ValueError as exc:
            raise bad_request(str(exc), "messages") from exc
        options = {k: v for k, v in chat.items() if k != "messages"}
        if "tools" in options:
            options["tool_dicts"] = options.pop("tools")
        return await self.prompts.api_prompt(chat["messages"], options)

    async def handle_count_tokens(self, request: web.Request) -> web.Response:
        """vLLM ``/v1/messages/count_tokens``: the rendered prompt's length, ``{"input_tokens":
        N, "context_management": {"original_input_tokens": N}}`` (``AnthropicServingMessages.
        count_tokens``; its request has no ``max_tokens``)."""
        data = await read_body(request)
        resolve_model(self.config, self.engine.lora_paths, data)
        num_tokens = len(await self._messages_prompt({**data, "max_tokens": 1}))
        return web.json_response({"input_tokens": num_tokens, "context_management": {
            "original_input_tokens": num_tokens}})

    async def handle_messages(self, request: web.Request) -> web.StreamResponse:
        """vLLM's ``/v1/messages`` (Anthropic Messages) for text answers."""
        data = await read_body(request)
        model, lora = resolve_model(self.config, self.engine.lora_paths, data)
        prompt = await self._messages_prompt(data)
        params = api_params(data, "max_tokens")
        answer = MessagesOut(MessagesAnswer(model), self.config.enable_prompt_tokens_details)
        response, _ = await self.generation.answer_api(request, prompt, params, lora,
                                                       answer.answer.id, answer)
        return response
