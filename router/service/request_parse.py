"""The request path's first step: a generate request's body read, decoded once and parsed to a
``PromptSpec``, with the router's own changes to it (the tenant's ``cache_salt``, an alias's
served ``model``) recorded on the one ``RequestBody``. HTTP edge (reads the aiohttp request).
"""

from __future__ import annotations

import asyncio
import dataclasses
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Final

from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from router.apis.aliases import AliasTable
from router.apis.messages import parse_messages
from router.apis.responses import ParsedResponses, parse_responses
from router.edges.auth import TenantAuth
from router.request.body import RequestBody
from router.request.chat_render import (
    UNTRUSTED_TEMPLATE_MESSAGE,
    TemplateRenderer,
    has_request_template,
)
from router.request.errors import BadRequest, RequestTimeout
from router.request.prompts import PromptSpec, parse_prompt, parse_token_ids_completion
from router.service.config import RouterConfig

# the APIs besides completions and chat that are routed by prefix, by request kind (router.apis)
API_PATHS: Final = {"responses": "/v1/responses", "messages": "/v1/messages"}


@dataclass(slots=True)
class ParsedRequest:
    """A generate request after its parse: what routing reads (``spec``), the body to send on
    (``body``: its changes applied by ``body.encoded()``) and, for a Responses request, the
    response it continues and whether its answer is stored (``responses``)."""

    spec: PromptSpec
    body: RequestBody
    responses: ParsedResponses | None = None


async def read_body(request: web.Request, timeout_s: float) -> bytes:
    """The request body, decoded per its Content-Encoding (aiohttp does that); a body that does
    not decode is a 400 (413 beyond ``max_body_bytes`` is raised by aiohttp), one that takes
    longer than ``timeout_s`` to arrive a 408 (and the connection is closed)."""
    try:
        async with asyncio.timeout(timeout_s):
            return await request.read()
    except RequestPayloadError as exc:
        raise BadRequest(f"request body could not be read: {exc}") from exc
    except TimeoutError as exc:
        raise RequestTimeout(f"request body not received within {timeout_s:g} s "
                             "(client_body_timeout_s)") from exc


class RequestParser:
    """Completions, chat, Responses and Messages bodies -> ``ParsedRequest``. Raises
    ``BadRequest`` (400; ``PromptError`` is one) for a body or field the router refuses,
    ``RequestTimeout`` (408) for a body that does not arrive."""

    def __init__(self, config: RouterConfig, auth: TenantAuth | None, aliases: AliasTable,
                 renderer: TemplateRenderer | None, render_executor: Executor,
                 merge_inline_system: bool) -> None:
        self.config = config
        self.auth = auth
        self.aliases = aliases
        self.renderer = renderer  # a request's own chat template (trusted only), else None
        self.render_executor = render_executor
        # /v1/messages: inline system messages merged into the first (router.apis.messages)
        self.merge_inline_system = merge_inline_system

    async def read(self, request: web.Request) -> RequestBody:
        return RequestBody(await read_body(request, self.config.client_body_timeout_s))

    async def parse(self, kind: str, request: web.Request, *,
                    advance: bool = True) -> ParsedRequest:
        """``kind``'s body of ``request`` parsed (``advance``: an alias's split moves on, as for
        a request sent; False for ``/debug/route``)."""
        return await self.parse_body(kind, await self.read(request), request, advance=advance)

    async def parse_body(self, kind: str, body: RequestBody, request: web.Request, *,
                         advance: bool = True) -> ParsedRequest:
        """``body`` of a ``kind`` request ("completion", "chat", "responses", "messages") parsed
        under the tenant's ``cache_salt``, an alias ``model`` resolved to its served model, and a
        chat request's own template rendered when trusted."""
        salt = self.auth.request_salt(request) if self.auth is not None else None
        spec = parse_token_ids_completion(body.raw) if kind == "completion" else None
        responses = None
        if spec is not None:  # the token-id fast path: the body is never decoded whole
            if salt is not None:
                self._salt(body, salt, spec.cache_salt)
                spec = dataclasses.replace(spec, cache_salt=salt)
        else:
            data = body.data()
            if salt is not None:
                if not isinstance(data, dict):
                    raise BadRequest("request body must be a JSON object")
                self._salt(body, salt, data.get("cache_salt"))
            if kind == "responses":
                responses = parse_responses(data)
                spec = responses.spec
            elif kind == "messages":
                spec = parse_messages(data, merge_inline_system=self.merge_inline_system)
            else:
                spec = parse_prompt(kind, data)
            if kind in API_PATHS and data.get("priority") is not None:
                spec = dataclasses.replace(spec, priority=data["priority"])
        target = self.aliases.resolve(spec.model, advance=advance) if spec.model else None
        if target is not None:  # an alias: the served model it maps to, in the body too
            body.set("model", target)
            spec = dataclasses.replace(spec, model=target)
        if kind not in API_PATHS:  # those APIs' conversions rendered their own
            spec = await self._request_template(spec)
        return ParsedRequest(spec, body, responses)

    def _salt(self, body: RequestBody, salt: str, sent: object) -> None:
        assert self.auth is not None
        self.auth.check_client_salt(sent)
        body.set("cache_salt", salt)

    async def _request_template(self, spec: PromptSpec) -> PromptSpec:
        """A chat request's own ``chat_template``: refused as vLLM does unless
        ``trust_request_chat_template``; when trusted, rendered in the bounded child process
        (``router.request.chat_render``) and the spec carries the text. Raises ``BadRequest``."""
        if not has_request_template(spec):
            return spec
        if not self.config.trust_request_chat_template:
            raise BadRequest(UNTRUSTED_TEMPLATE_MESSAGE)
        if self.renderer is None:
            return spec  # no tokenizer: routed by hashing the text, never rendered here
        loop = asyncio.get_running_loop()
        # a PromptError is a BadRequest: the error middleware answers it
        text = await loop.run_in_executor(self.render_executor, self.renderer.render, spec)
        return dataclasses.replace(spec, text=text)
