"""Stored Responses answers and the paths around them through the router with API keys on
(issue 35 review F1, F3, F5): one emulator process keeping Responses answers (as vLLM with
``VLLM_ENABLE_RESPONSES_API_STORE=1``) as a static replica, real HTTP on loopback.

A response id is its tenant's: another tenant continuing, retrieving or cancelling it gets the
same 404 as for an id that never existed, while its own tenant continues it on the replica
holding it and retrieves it with the ``openai`` client. ``/v1/messages/count_tokens`` is routed
(the ``anthropic`` client's ``messages.count_tokens``, its key in ``x-api-key``). The pooling
paths carry the tenant's ``cache_salt``: a recording replica (a plain HTTP server on loopback,
standing where an engine would) shows the body it received.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from router.edges.auth import tenant_salt
from tests.helpers import start_emulator, stop_process, wait_for
from tests.integration.test_router_fleet import Router, http
from tests.integration.test_router_tenants import KEYS, SECRET, write_auth_files

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

pytestmark = pytest.mark.timeout(180)

MODEL = "emulated-llm"
REPLICA = "x-prefix-router-replica"
REASON = "x-prefix-router-reason"


def start_router(replica_url: str, tmp: Path, *extra: str) -> Router:
    keys, secret = write_auth_files(tmp, as_directory=False)
    router = Router(tmp, ["--replica", replica_url, "--api-keys", str(keys),
                          "--cache-salt-secret-file", str(secret), *extra])
    wait_for(lambda: all(r["routable"] for r in router.ready()["replicas"]), 60,
             message="static replica routable")
    return router


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Router]:
    tmp = tmp_path_factory.mktemp("stored-responses")
    proc, replicas = start_emulator(tmp / "emulator.json", ["--time-scale", "20"],
                                    env={"VLLM_ENABLE_RESPONSES_API_STORE": "1"})
    try:
        r = start_router(replicas[0]["url"], tmp)
        try:
            yield r
        finally:
            r.stop()
    finally:
        stop_process(proc)


def call(router: Router, who: str, method: str, path: str,
         body: Any = None) -> tuple[int, dict[str, str], Any]:
    status, headers, raw = http(method, router.url + path, body,
                                headers={"Authorization": f"Bearer {KEYS[who]}"})
    return status, headers, json.loads(raw)


def openai_client(router: Router, who: str) -> Any:
    return openai.OpenAI(base_url=router.url + "/v1", api_key=KEYS[who], max_retries=0)


def test_another_tenants_response_id_is_not_found(router: Router) -> None:
    """B naming A's response id (continue, retrieve, cancel) gets exactly the answer of an id
    that does not exist; A continues, retrieves and cancels its own on the replica holding it."""
    created = openai_client(router, "a1").responses.create(
        model=MODEL, instructions="A's secret instructions.", input="Remember 7.",
        max_output_tokens=3)
    mine, unknown = created.id, "resp_" + "0" * 32
    for method, path, body in [
            ("POST", "/v1/responses", {"model": MODEL, "input": "Which number?",
                                       "previous_response_id": "{id}", "max_output_tokens": 3}),
            ("GET", "/v1/responses/{id}", None),
            ("POST", "/v1/responses/{id}/cancel", None)]:
        answers = []
        for response_id in (mine, unknown):
            sent = json.loads(json.dumps(body).replace("{id}", response_id)) if body else None
            status, _, error = call(router, "b", method, path.replace("{id}", response_id), sent)
            answers.append((status, json.dumps(error).replace(response_id, "ID")))
        assert answers[0] == answers[1], (method, path)
        assert answers[0][0] == 404 and "not found" in answers[0][1]
    # A's own: continued on its replica, read back through the openai client, cancel relayed
    status, headers, body = call(router, "a2", "POST", "/v1/responses", {
        "model": MODEL, "input": "Which number?", "previous_response_id": mine,
        "max_output_tokens": 3})
    assert status == 200 and headers[REASON] == "previous_response", body
    retrieved = openai_client(router, "a1").responses.retrieve(mine)
    assert retrieved.id == mine and retrieved.status == "completed"
    assert retrieved.output_text == created.output_text
    status, headers, body = call(router, "a1", "POST", f"/v1/responses/{mine}/cancel")
    # the engine's own answer: a finished (not background) response cannot be cancelled
    assert status == 400 and "synchronous" in body["error"]["message"], body
    assert headers[REASON] == "stored_response"


def test_messages_count_tokens_through_the_router(router: Router) -> None:
    client = anthropic.Anthropic(base_url=router.url, api_key=KEYS["b"], max_retries=0)
    messages = [{"role": "user", "content": "Count these tokens, please: one two three."}]
    counted = client.messages.count_tokens(model=MODEL, system="Be brief.", messages=messages)
    answered = client.messages.create(model=MODEL, system="Be brief.", messages=messages,
                                      max_tokens=2)
    assert counted.input_tokens == answered.usage.input_tokens > 5
    # errors there are Anthropic's shape, as on /v1/messages
    with pytest.raises(anthropic.NotFoundError) as caught:
        client.messages.count_tokens(model="no-such-model", messages=messages)
    assert caught.value.body["type"] == "error"
    assert caught.value.body["error"]["type"] == "not_found_error"


def test_stored_response_refused_when_its_replica_is_down(tmp_path: Path) -> None:
    """The replica holding a response stops: retrieve and cancel are refused as the
    continuation is (503 while it is not routable, 502 when a send to it fails: here 502, as
    the lone static replica stays eligible in panic mode and refuses the connection), in the
    OpenAI shape."""
    proc, replicas = start_emulator(tmp_path / "emulator.json", ["--time-scale", "20"],
                                    env={"VLLM_ENABLE_RESPONSES_API_STORE": "1"})
    router = start_router(replicas[0]["url"], tmp_path)
    try:
        created = openai_client(router, "a1").responses.create(
            model=MODEL, input="Remember 7.", max_output_tokens=2)
        stop_process(proc)
        for method, path, body in [
                ("GET", f"/v1/responses/{created.id}", None),
                ("POST", f"/v1/responses/{created.id}/cancel", None),
                ("POST", "/v1/responses", {"model": MODEL, "input": "Which?",
                                           "previous_response_id": created.id})]:
            status, _, error = call(router, "a1", method, path, body)
            assert status in (502, 503), (method, path, status, error)
            assert error["error"]["code"] == status
    finally:
        router.stop()
        stop_process(proc)


class RecordingReplica:
    """An HTTP server on loopback standing where an engine would, recording the JSON body of
    every pooling request it answers (so a test sees what the router sent the engine)."""

    def __init__(self) -> None:
        self.bodies: list[tuple[str, dict[str, Any]]] = []
        self.loop = asyncio.new_event_loop()
        self.url = ""
        started = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(started,), daemon=True)
        self.thread.start()
        started.wait(10)

    async def _answer(self, request: web.Request) -> web.Response:
        self.bodies.append((request.path, await request.json()))
        return web.json_response({"object": "list", "data": [], "model": MODEL})

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response()

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    def _run(self, started: threading.Event) -> None:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        for path in ("/v1/embeddings", "/pooling", "/classify", "/score", "/rerank", "/tokenize"):
            app.router.add_post(path, self._answer)
        runner = web.AppRunner(app)
        self.loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        port = runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"
        started.set()
        self.loop.run_forever()
        self.loop.run_until_complete(runner.cleanup())

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.mark.parametrize("policy", ["override", "reject"])
def test_pooling_requests_carry_the_tenants_cache_salt(tmp_path: Path, policy: str) -> None:
    replica = RecordingReplica()
    router = start_router(replica.url, tmp_path, "--client-cache-salt", policy)
    try:
        bodies = {"/v1/embeddings": {"model": MODEL, "input": "a secret text"},
                  "/pooling": {"model": MODEL, "input": "a secret text"},
                  "/classify": {"model": MODEL, "input": "a secret text"},
                  "/score": {"model": MODEL, "text_1": "q", "text_2": "d"},
                  "/rerank": {"model": MODEL, "query": "q", "documents": ["d"]}}
        for path, body in bodies.items():
            status, _, _ = call(router, "a1", "POST", path, body)
            assert status == 200, path
        assert [path for path, _ in replica.bodies] == list(bodies)
        salt = tenant_salt(SECRET, "tenant-a")
        assert all(body.get("cache_salt") == salt for _, body in replica.bodies)
        # a client's own salt: replaced (override) or refused (reject), never sent as is
        status, _, answer = call(router, "b", "POST", "/v1/embeddings",
                                 {"model": MODEL, "input": "x", "cache_salt": salt})
        if policy == "reject":
            assert status == 400 and "cache_salt" in answer["error"]["message"]
        else:
            assert status == 200
            assert replica.bodies[-1][1]["cache_salt"] == tenant_salt(SECRET, "tenant-b")
        # the tokenizer paths are not salted (no cache read there)
        assert call(router, "a1", "POST", "/tokenize", {"model": MODEL, "prompt": "x"})[0] == 200
        assert "cache_salt" not in replica.bodies[-1][1]
    finally:
        router.stop()
        replica.stop()
