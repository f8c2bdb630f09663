"""The OpenAI front end of one emulated replica: vLLM 0.33's HTTP surface
(``../shared/vllm-spec.md`` §4) in front of an :class:`EmulatedEngine`. ``ReplicaServer`` owns
the lifecycle, the route table, the completions and chat handlers and the small status
endpoints; the jobs behind them sit beside it: request checks (``http_checks``), prompt ids
(``prompt_input``), generation and its JSON/SSE answers (``generation``), the Responses and
Messages APIs (``api_routes``), the tokenizer-only endpoints (``token_routes``).
Does I/O (aiohttp); the engine does no HTTP.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, Final

import msgspec
from aiohttp import web

from worker.emulator.api_routes import ApiRoutes
from worker.emulator.config import VLLM_VERSION, EmulatorConfig
from worker.emulator.engine import EmulatedEngine
from worker.emulator.generation import Generation
from worker.emulator.http_checks import ApiError, generation_params, read_body, resolve_model
from worker.emulator.metrics import EnginesExposition
from worker.emulator.prompt_input import PromptInput
from worker.emulator.token_routes import TokenRoutes
from worker.emulator.tokenizer import SharedTokenizer

MAX_BODY_BYTES: Final = 64 * 1024 * 1024
UVICORN_BACKLOG: Final = 2048  # listen backlog; uvicorn Config default, which vLLM's server keeps

_json_encode = msgspec.json.encode


class ReplicaServer:
    """The HTTP application of one replica; ``start(port)`` listens, ``stop()`` shuts down
    (the engines too).

    ``engines`` are the replica's data-parallel ranks in rank order (one without
    ``--data-parallel-size``), as vLLM's API server fronts one EngineCore per DP rank; a
    request goes to the rank ``Generation.select_engine`` picks.
    """

    def __init__(self, engines: list[EmulatedEngine], tokenizer: SharedTokenizer) -> None:
        if not engines:
            raise ValueError("a replica needs at least one engine")
        self.engines = engines
        self.engine = engines[0]  # the rank answering what every rank shares (LoRA adapters)
        self.config: EmulatorConfig = self.engine.config
        self.index = self.engine.index
        self.tokenizer = tokenizer
        self.metrics = EnginesExposition([e.metrics for e in engines])
        self.prompts = PromptInput(self.config, tokenizer)
        self.generation = Generation(engines, self.config)
        self.apis = ApiRoutes(self.engine, self.generation, self.prompts)
        self.tokens = TokenRoutes(self.engine, self.prompts)
        self.url = ""
        self.app = self._build_app()
        self._runner: web.AppRunner | None = None

    # ---------------------------------------------------------------- lifecycle

    async def start(self, port: int) -> None:
        for engine in self.engines:
            engine.start()
        # handler_cancellation: a client that goes away cancels its handler (aiohttp >= 3.9
        # defaults to not cancelling), so Generation.generate's finally aborts the request as
        # vLLM does.
        self._runner = web.AppRunner(self.app, access_log=None, handle_signals=False,
                                     handler_cancellation=True)
        await self._runner.setup()
        # uvicorn's (vLLM's server's) listen backlog, not aiohttp's 128: a burst of 1,000 streams
        # overflowed 128 and its connects waited out SYN retries past the router's connect
        # timeout, benching every replica at once (issue 29)
        site = web.TCPSite(self._runner, self.config.host, port, reuse_address=True,
                           backlog=UVICORN_BACKLOG)
        await site.start()
        server = site._server
        sockets = getattr(server, "sockets", None) or []
        bound_port = sockets[0].getsockname()[1] if sockets else port
        host = self.config.host
        url_host = f"[{host}]" if ":" in host else host
        self.url = f"http://{url_host}:{bound_port}"

    async def stop(self) -> None:
        for engine in self.engines:
            await engine.stop()
        if self._runner is not None:
            await self._runner.cleanup()

    def describe(self) -> dict[str, Any]:
        """``kv_events_endpoint``/``kv_replay_endpoint`` are rank 0's; ``ranks`` lists every
        rank's (``data_parallel_rank``, ``kv_events_endpoint``, ``kv_replay_endpoint``)."""
        ranks = [{"data_parallel_rank": e.dp_rank,
                  "kv_events_endpoint": e.publisher.endpoint if e.publisher else None,
                  "kv_replay_endpoint": e.publisher.replay_endpoint if e.publisher else None}
                 for e in self.engines]
        return {
            "index": self.index,
            "url": self.url,
            "kv_events_endpoint": ranks[0]["kv_events_endpoint"],
            "kv_replay_endpoint": ranks[0]["kv_replay_endpoint"],
            "data_parallel_size": len(self.engines),
            "ranks": ranks,
        }

    # ---------------------------------------------------------------- HTTP

    def _build_app(self) -> web.Application:
        app = web.Application(middlewares=[_error_middleware], client_max_size=MAX_BODY_BYTES)
        r = app.router
        r.add_post("/v1/completions", self.handle_completions)
        r.add_post("/v1/chat/completions", self.handle_chat)
        r.add_post("/v1/responses", self.apis.handle_responses)
        r.add_post("/v1/messages", self.apis.handle_messages)
        r.add_get("/v1/responses/{response_id}", self.apis.handle_retrieve_response)
        r.add_post("/v1/responses/{response_id}/cancel", self.apis.handle_cancel_response)
        r.add_post("/v1/messages/count_tokens", self.apis.handle_count_tokens)
        r.add_post("/v1/completions/render", self.tokens.handle_completions_render)
        r.add_post("/v1/chat/completions/render", self.tokens.handle_chat_render)
        r.add_get("/v1/models", self.handle_models)
        r.add_get("/health", self.handle_health)
        r.add_get("/version", self.handle_version)
        r.add_get("/load", self.handle_load)
        r.add_get("/metrics", self.handle_metrics)
        for path in ("/v1/embeddings", "/pooling"):
            r.add_post(path, self.tokens.handle_vectors)
        for path in ("/score", "/v1/score"):  # vLLM 0.32 serves both
            r.add_post(path, self.tokens.handle_score)
        for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
            r.add_post(path, self.tokens.handle_rerank)
        r.add_post("/tokenize", self.tokens.handle_tokenize)
        r.add_post("/detokenize", self.tokens.handle_detokenize)
        r.add_get("/kv_event_sources", self.handle_kv_event_sources)
        r.add_post("/reset_prefix_cache", self.handle_reset_prefix_cache)
        return app

    async def handle_completions(self, request: web.Request) -> web.StreamResponse:
        data = await read_body(request)
        model, lora = resolve_model(self.config, self.engine.lora_paths, data)
        params = generation_params(data, chat=False)
        prompts = await self.prompts.completion_prompts(data)
        return await self.generation.generate(request, prompts, params, model, lora, chat=False)

    async def handle_chat(self, request: web.Request) -> web.StreamResponse:
        data = await read_body(request)
        model, lora = resolve_model(self.config, self.engine.lora_paths, data)
        params = generation_params(data, chat=True)
        prompt = await self.prompts.chat_prompt(data)
        return await self.generation.generate(request, [prompt], params, model, lora, chat=True)

    async def handle_models(self, request: web.Request) -> web.Response:
        created = int(time.time())

        def card(model_id: str, root: str, parent: str | None) -> dict[str, Any]:
            return {"id": model_id, "object": "model", "created": created, "owned_by": "vllm",
                    "root": root, "parent": parent, "max_model_len": self.config.max_model_len,
                    "permission": [{"id": f"modelperm-{uuid.uuid4().hex}",
                                    "object": "model_permission", "created": created,
                                    "allow_create_engine": False, "allow_sampling": True,
                                    "allow_logprobs": True, "allow_search_indices": False,
                                    "allow_view": True, "allow_fine_tuning": False,
                                    "organization": "*", "group": None, "is_blocking": False}]}

        cards = [card(name, self.config.model, None) for name in self.config.served_model_names]
        base = self.config.served_model_names[0]
        cards += [card(name, path, base) for name, path in self.config.lora_modules]
        return web.json_response({"object": "list", "data": cards})

    async def handle_health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def handle_version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": VLLM_VERSION})

    async def handle_load(self, request: web.Request) -> web.Response:
        return web.json_response({"server_load": self.generation.num_inflight})

    async def handle_metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.exposition(),
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def handle_kv_event_sources(self, request: web.Request) -> web.Response:
        """vLLM 0.33: a bare JSON array, one entry per DP rank (rank order) with the resolved
        endpoints (vllm/entrypoints/serve/kv_events/api_router.py)."""
        return web.json_response([
            {"data_parallel_rank": e.dp_rank, "endpoint": e.publisher.endpoint,
             "replay_endpoint": e.publisher.replay_endpoint, "topic": self.config.kv_events.topic}
            for e in self.engines if e.publisher is not None])

    async def handle_reset_prefix_cache(self, request: web.Request) -> web.Response:
        # vLLM resets every engine's cache (a collective over the DP ranks)
        if not all([engine.reset_prefix_cache() for engine in self.engines]):
            raise ApiError(409, "Cannot reset the prefix cache while requests hold blocks.",
                           "ConflictError")
        return web.Response(status=200)


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def _error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """The one place that turns errors into vLLM-shaped JSON bodies."""
    try:
        return await handler(request)
    except ApiError as exc:
        body = exc.body()
        if request.path.startswith("/v1/messages"):  # vLLM translate_error_response: Anthropic's
            body = {"type": "error", "error": {"type": exc.err_type, "message": exc.message}}
        return web.Response(status=exc.status, body=_json_encode(body),
                            content_type="application/json")
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        err = ApiError(exc.status, exc.reason,
                       "NotFoundError" if exc.status == 404 else "BadRequestError")
        return web.Response(status=exc.status, body=_json_encode(err.body()),
                            content_type="application/json")
