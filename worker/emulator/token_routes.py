"""The handlers of an emulated replica that answer from the tokenizer without generating:
``/tokenize``, ``/detokenize``, the scale-out render endpoints, and the pooling APIs
(``/v1/embeddings``, ``/pooling``, score, rerank: made-up vectors in vLLM 0.32's shapes,
``worker.emulator.pooling``). Does I/O (aiohttp).
"""

from __future__ import annotations

import uuid
from typing import Any

import msgspec
from aiohttp import web

from worker.emulator import pooling
from worker.emulator.engine import EmulatedEngine
from worker.emulator.http_checks import (
    ApiError,
    GenerationParams,
    bad_request,
    generation_params,
    read_body,
    resolve_model,
)
from worker.emulator.prompt_input import PromptInput
from worker.emulator.tokenizer import TokenizerError

_json_encode = msgspec.json.encode


def _render_item(prefix: str, model: str, tokens: list[int],
                 params: GenerationParams) -> dict[str, Any]:
    return {"request_id": f"{prefix}-{uuid.uuid4().hex}", "model": model, "token_ids": tokens,
            "sampling_params": {"max_tokens": params.max_tokens, "ignore_eos": params.ignore_eos,
                                "n": params.n},
            "cache_salt": params.cache_salt, "stream": params.stream}


class TokenRoutes:
    """Tokenizer-only handlers over a replica's ``PromptInput``; ``engine`` answers for the
    LoRA adapters every rank shares."""

    def __init__(self, engine: EmulatedEngine, prompts: PromptInput) -> None:
        self.engine = engine
        self.config = engine.config
        self.prompts = prompts

    async def _body_and_model(self, request: web.Request) -> tuple[dict[str, Any], str]:
        data = await read_body(request)
        model, _ = resolve_model(self.config, self.engine.lora_paths, data)
        return data, model

    async def handle_completions_render(self, request: web.Request) -> web.Response:
        """vLLM scale-out render: a list of GenerateRequest-shaped objects, one per prompt."""
        data, model = await self._body_and_model(request)
        params = generation_params(data, chat=False)
        prompts = await self.prompts.completion_prompts(data)
        items = [_render_item("cmpl", model, p, params) for p in prompts]
        return web.Response(body=_json_encode(items), content_type="application/json")

    async def handle_chat_render(self, request: web.Request) -> web.Response:
        """vLLM scale-out chat render: one GenerateRequest-shaped object."""
        data, model = await self._body_and_model(request)
        params = generation_params(data, chat=True)
        prompt = await self.prompts.chat_prompt(data)
        item = _render_item("chatcmpl", model, prompt, params)
        return web.Response(body=_json_encode(item), content_type="application/json")

    async def handle_tokenize(self, request: web.Request) -> web.Response:
        data, _ = await self._body_and_model(request)
        if "messages" in data:
            tokens = await self.prompts.chat_prompt(data)
        else:
            prompt = data.get("prompt")
            if not isinstance(prompt, str):
                raise bad_request("prompt must be a string", "prompt")
            tokens = await self.prompts.encode(prompt, bool(data.get("add_special_tokens", True)))
        token_strs = None
        if data.get("return_token_strs"):
            token_strs = await self.prompts.tokenizer.convert_ids_to_tokens(tokens)
        return web.json_response({"count": len(tokens), "max_model_len": self.config.max_model_len,
                                  "tokens": tokens, "token_strs": token_strs})

    async def handle_detokenize(self, request: web.Request) -> web.Response:
        data, _ = await self._body_and_model(request)
        tokens = data.get("tokens")
        if not isinstance(tokens, list) or not all(type(t) is int and t >= 0 for t in tokens):
            raise bad_request("tokens must be a list of non-negative token ids", "tokens")
        try:
            text = await self.prompts.tokenizer.decode(tokens)
        except TokenizerError as exc:
            raise ApiError(500, str(exc), "InternalServerError") from exc
        return web.json_response({"prompt": text})

    async def handle_vectors(self, request: web.Request) -> web.Response:
        """``/v1/embeddings`` and ``/pooling``: ``input`` as a completions ``prompt``
        (``worker.emulator.pooling``: made-up unit vectors in vLLM 0.32's shapes)."""
        data, model = await self._body_and_model(request)
        dim = data.get("dimensions") or pooling.EMBED_DIM
        if type(dim) is not int or not 0 < dim <= pooling.MAX_EMBED_DIM:
            raise bad_request(f"dimensions must be 1..{pooling.MAX_EMBED_DIM}", "dimensions")
        prompts = await self.prompts.completion_prompts(data, "input")
        kind = "embeddings" if request.path == "/v1/embeddings" else "pooling"
        return web.json_response(pooling.vectors_body(kind, model, prompts, dim))

    async def handle_score(self, request: web.Request) -> web.Response:
        data, model = await self._body_and_model(request)
        try:
            first, second = pooling.score_sides(data)
            body = pooling.score_body(model, await self.prompts.texts_tokens(first),
                                      await self.prompts.texts_tokens(second))
        except pooling.PoolingInputError as exc:
            raise bad_request(str(exc), exc.param) from exc
        return web.json_response(body)

    async def handle_rerank(self, request: web.Request) -> web.Response:
        data, model = await self._body_and_model(request)
        top_n = data.get("top_n", 0)
        if type(top_n) is not int or top_n < 0:
            raise bad_request("top_n must be a non-negative integer", "top_n")
        try:
            query = pooling.texts_of(data.get("query"), "query")
            documents = pooling.texts_of(data.get("documents"), "documents")
        except pooling.PoolingInputError as exc:
            raise bad_request(str(exc), exc.param) from exc
        if len(query) != 1:
            raise bad_request("query must be one string", "query")
        query_tokens = (await self.prompts.texts_tokens(query))[0]
        return web.json_response(pooling.rerank_body(
            model, query_tokens, await self.prompts.texts_tokens(documents), documents, top_n))
