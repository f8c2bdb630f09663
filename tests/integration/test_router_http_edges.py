"""The router's HTTP edges: parser-level errors in OpenAI JSON, a bounded X-Request-Id, the 413
message, a lone UTF-16 surrogate in the JSON (400, not valid Unicode), /v1/models with every replica down, metric series of a departed replica, and a
graceful stop (/ready 503 before the listener closes, in-flight requests finish).

Router processes on port 0, real Redis, a small aiohttp replica; raw sockets where the request
itself is malformed.
"""

from __future__ import annotations

import json
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from router.shared import contract as c
from tests.helpers import (
    FAKE_REPLICA_TAIL,
    start_emulator,
    start_script_replica,
    stop_all,
    wait_for,
)
from tests.integration.test_router_fleet import Router, http

pytestmark = pytest.mark.timeout(90)

DOWN = "http://127.0.0.1:9"  # nothing listens there


def raw(router: Router, data: bytes) -> bytes:
    host, port = router.url.removeprefix("http://").split(":")
    # under the router's 30 s body timeout, far over any answer's time on a busy machine
    with socket.create_connection((host, int(port)), timeout=25) as sock:
        sock.sendall(data)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def test_malformed_requests_get_openai_json(tmp_path: Path) -> None:
    router = Router(tmp_path, ["--replica", DOWN, "--max-body-bytes", "1024"])
    try:
        cases = {
            "oversized header": b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 10000
                                + b"\r\n\r\n",
            "CR in a header value": b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: a\rb\r\n\r\n",
            "NUL in a header value": b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: a\x00b\r\n\r\n",
            "Content-Length with Transfer-Encoding":
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        }
        for name, request in cases.items():
            head, _, body = raw(router, request).partition(b"\r\n\r\n")
            assert head.split(b" ", 2)[1] == b"400", (name, head)
            assert b"application/json" in head.lower(), (name, head)
            error = json.loads(body)["error"]
            assert error["type"] == "BadRequestError" and error["code"] == 400, (name, error)
            assert error["message"].startswith("malformed HTTP request"), (name, error)

        status, headers, body = router.post("/v1/completions", b"x" * 2000)
        assert status == 413 and "max_body_bytes" in json.loads(body)["error"]["message"]
        # a declared length beyond max_body_bytes is refused at once, the body never awaited
        # (before: the client waited client_body_timeout_s, 30 s, for a 408)
        started = time.monotonic()
        head, _, body = raw(router, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                                    b"Content-Type: application/json\r\n"
                                    b"Content-Length: 300000000\r\n\r\n{\"prompt\": ").partition(b"\r\n\r\n")
        assert time.monotonic() - started < 20.0  # not the 30 s body timeout
        assert head.split(b" ", 2)[1] == b"413", head
        error = json.loads(body)["error"]
        assert error["type"] == "RequestEntityTooLargeError" and "max_body_bytes" in error["message"]

        status, headers, _ = http("GET", router.url + "/health", headers={"X-Request-Id": "a" * 8000})
        assert status == 200 and len(headers["x-request-id"]) == 32  # replaced by a fresh id
        _, headers, _ = http("GET", router.url + "/health", headers={"X-Request-Id": "a\tb"})
        assert headers["x-request-id"] != "a\tb"
        _, headers, _ = http("GET", router.url + "/health", headers={"X-Request-Id": "job-7:step.2"})
        assert headers["x-request-id"] == "job-7:step.2"

        wait_for(lambda: not router.ready()["replicas"][0]["routable"], 10)
        status, _, body = http("GET", router.url + "/v1/models")
        assert status == 503 and json.loads(body)["error"]["type"] == "ServiceUnavailableError"

        # client errors in the handlers: bad JSON, wrong types, a body that does not decode
        for bad in (b"{bad", b"[]", b'{"prompt": 5}', b'{"messages": "x"}', b"\xff\xfe",
                    b'{"prompt": "x", "stream": "yes"}'):
            for path in ("/v1/completions", "/v1/chat/completions"):
                assert router.post(path, bad)[0] == 400, (path, bad)
    finally:
        output = router.stop()
    # no client error is logged with a traceback or at ERROR (aiohttp logged each parser-level
    # 400 at ERROR with its traceback): at most one line per malformed request
    assert "Traceback" not in output and " ERROR " not in output, output
    assert output.count("malformed HTTP request") <= len(cases), output


def test_a_departed_replica_leaves_no_metric_series(redis_url: str, tmp_path: Path) -> None:
    import redis as redis_lib

    client = redis_lib.Redis.from_url(redis_url)
    rid = "replica-gone"
    key = c.replica_key("pr", rid)
    client.hset(key, mapping={c.F_URL: DOWN, c.F_MODELS: '["m"]', c.F_EPOCH: "1",
                              c.F_HEARTBEAT_TS: str(time.time())})
    router = Router(tmp_path, ["--redis-url", redis_url])
    try:
        wait_for(lambda: f'replica="{rid}"' in router.metrics(), 15, message="series of the replica")
        client.delete(key)
        wait_for(lambda: not router.ready()["replicas"], 15, message="replica dropped")
        assert f'replica="{rid}"' not in router.metrics()
    finally:
        router.stop()
        client.close()


SLOW_REPLICA = """
import asyncio, sys
from aiohttp import web
async def completions(request):
    await request.read()
    await asyncio.sleep(2.0)
    return web.json_response({"id": "slow", "object": "text_completion", "choices": []})""" + FAKE_REPLICA_TAIL


def test_stop_turns_ready_503_first_and_lets_requests_finish(tmp_path: Path) -> None:
    replica, port = start_script_replica(SLOW_REPLICA, name="slow replica")
    router = None
    try:
        router = Router(tmp_path, ["--replica", f"http://127.0.0.1:{port}", "--drain-delay-s", "1.5"])
        assert router.ready()["ready"]
        result: list[Any] = []
        inflight = threading.Thread(target=lambda: result.append(
            router.post("/v1/completions", {"model": "fixed", "prompt": [1, 2]})))  # type: ignore[union-attr]
        inflight.start()
        time.sleep(0.3)
        router.proc.send_signal(signal.SIGTERM)
        url = router.url

        def draining() -> bytes | None:
            status, _, body = http("GET", url + "/ready")
            return body if status == 503 else None

        assert json.loads(wait_for(draining, 5, message="/ready 503 while draining"))["draining"]
        assert http("GET", router.url + "/health")[0] == 200  # still accepting meanwhile
        inflight.join(10)
        assert result and result[0][0] == 200  # the request in flight finished
        assert router.proc.wait(10) == 0
    finally:
        stop_all(router, replica)


def test_a_lone_surrogate_in_the_json_is_a_400_saying_not_unicode(tmp_path: Path) -> None:
    emulator, replicas = start_emulator(tmp_path / "emulator.json")
    router = None
    try:
        router = Router(tmp_path, ["--replica", replicas[0]["url"]])
        bodies = {  # raw JSON escapes: json.dumps would write them as they are too
            "/v1/completions": [rb'{"prompt": "\ud800"}',  # msgspec: "Input data was truncated"
                                rb'{"prompt": "a\udc00b", "max_tokens": 1}'],
            "/v1/chat/completions": [rb'{"messages": [{"role": "user", "content": "\ud83d"}]}'],
        }
        for path, cases in bodies.items():
            for body in cases:
                status, headers, answer = router.post(path, body)
                assert status == 400 and "application/json" in headers["content-type"], answer
                error = json.loads(answer)["error"]
                assert error["type"] == "BadRequestError" and error["code"] == 400, error
                assert "not valid Unicode" in error["message"], error
                assert "truncated" not in error["message"], error
        # a surrogate pair is one character, and the router still serves
        status, _, answer = router.post("/v1/completions",
                                        rb'{"prompt": "\ud83d\ude00", "max_tokens": 1}')
        assert status == 200, answer
    finally:
        stop_all(router, emulator)


COOKIE_REPLICA = """
import json, sys
from aiohttp import web
async def completions(request):
    await request.read()
    resp = web.json_response({"id": "c", "object": "text_completion", "choices": [],
                              "cookie": request.headers.get("Cookie")})
    resp.set_cookie("affinity", "client-a")  # as a sticky-session load balancer in front would
    return resp""" + FAKE_REPLICA_TAIL


def test_a_cookie_a_replica_sets_is_not_sent_with_other_clients_requests(tmp_path: Path) -> None:
    """The router's one upstream session is shared by every client: a cookie one answer set
    must reach that client only, never ride along on the next client's request to the replica
    (aiohttp's default cookie jar kept it and sent it with every later request to that host).
    A client's own Cookie header still passes."""
    replica, port = start_script_replica(COOKIE_REPLICA, name="cookie replica")
    router = None
    try:
        # a host name: aiohttp's default jar ignores cookies from IP addresses, not from the
        # service names replicas have in a cluster
        router = Router(tmp_path, ["--replica", f"http://localhost:{port}"])
        body = {"model": "fixed", "prompt": [1, 2]}
        status, headers, answer = router.post("/v1/completions", body)
        assert status == 200 and "affinity=client-a" in headers.get("set-cookie", ""), headers
        assert json.loads(answer)["cookie"] is None
        status, _, answer = router.post("/v1/completions", body)  # another client
        assert status == 200 and json.loads(answer)["cookie"] is None, answer
        status, _, answer = router.post("/v1/completions", body, headers={"Cookie": "own=1"})
        assert status == 200 and json.loads(answer)["cookie"] == "own=1", answer
    finally:
        stop_all(router, replica)


HEADERS_REPLICA = """
import json, sys
from aiohttp import web
async def completions(request):
    await request.read()
    resp = web.json_response({"id": "h", "object": "text_completion", "choices": [],
                              "headers": [k.lower() for k in request.headers]})
    resp.headers["Connection"] = "X-Reply-Hop"  # X-Reply-Hop is for the router, not the client
    resp.headers["X-Reply-Hop"] = "1"
    resp.headers["X-Reply-End"] = "1"
    return resp""" + FAKE_REPLICA_TAIL


def test_headers_a_connection_header_names_are_not_forwarded_either_way(tmp_path: Path) -> None:
    """RFC 9110 section 7.6.1: a header named in ``Connection`` is for the next hop only; the
    router drops it from the client's request and from the replica's answer (it forwarded both)."""
    replica, port = start_script_replica(HEADERS_REPLICA, name="headers replica")
    router = None
    try:
        router = Router(tmp_path, ["--replica", f"http://127.0.0.1:{port}"])
        body = json.dumps({"model": "fixed", "prompt": [1, 2]}).encode()
        head, _, answer = raw(router, (
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Connection: close, X-Client-Hop\r\nConnection: x-second-hop\r\n"
            b"X-Client-Hop: secret\r\nX-Second-Hop: 2\r\nX-Client-End: 1\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)).partition(
                b"\r\n\r\n")
        assert head.split(b" ", 2)[1] == b"200", head
        seen = json.loads(answer)["headers"]
        assert "x-client-end" in seen, seen
        assert "x-client-hop" not in seen and "x-second-hop" not in seen, seen
        names = {line.split(b":", 1)[0].strip().lower() for line in head.split(b"\r\n")[1:]}
        assert b"x-reply-end" in names, head
        assert b"x-reply-hop" not in names, head
    finally:
        stop_all(router, replica)
