"""Slow or idle client connections are closed: request heads and bodies have a time limit and
idle keep-alive connections a number limit (counted in the router process's open fds).

A router process on port 0 (its one static replica need not exist); raw loopback sockets.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest

from tests.helpers import wait_for
from tests.integration.test_router_fleet import Router, http

pytestmark = pytest.mark.timeout(90)


def num_fds(router: Router) -> int:
    return len(os.listdir(f"/proc/{router.proc.pid}/fd"))


def connect(router: Router) -> socket.socket:
    host, port = router.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=5)
    sock.setblocking(False)
    return sock


def closed_by_peer(sock: socket.socket) -> bool:
    try:
        data = sock.recv(65536)
    except BlockingIOError:
        return False
    except OSError:
        return True
    if data == b"":
        return True
    return closed_by_peer(sock)  # an answer (the 408), then the close


def dribble(socks: list[socket.socket], byte: bytes = b"a") -> None:
    for sock in socks:
        try:
            sock.send(byte)
        except OSError:
            pass


def test_slow_heads_and_bodies_are_closed(tmp_path: Path) -> None:
    router = Router(tmp_path, ["--replica", "http://127.0.0.1:9", "--client-idle-timeout-s", "2",
                               "--client-body-timeout-s", "2"])
    socks: list[socket.socket] = []
    try:
        before = num_fds(router)
        heads = [connect(router) for _ in range(40)]
        bodies = [connect(router) for _ in range(40)]
        idle = [connect(router) for _ in range(40)]
        socks = heads + bodies + idle
        for sock in heads:
            sock.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        for sock in bodies:
            sock.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                      b"\r\nContent-Length: 100000\r\n\r\n{")
        wait_for(lambda: num_fds(router) >= before + 100, 10, message="connections accepted")
        opened = time.monotonic()
        # a byte every 0.2 s: never idle, never finished; only the 2 s timeouts close them (the
        # next limit, aiohttp's 75 s keep-alive, lies beyond this generous bound)
        while time.monotonic() - opened < 40 and not all(closed_by_peer(s) for s in socks):
            dribble(heads)
            dribble(bodies)
            time.sleep(0.2)
        assert all(closed_by_peer(s) for s in socks), "slow connections still open"
        wait_for(lambda: num_fds(router) <= before + 2, 5, message="fds released")
        status, _, _ = http("GET", router.url + "/health")
        assert status == 200
    finally:
        for sock in socks:
            sock.close()
        router.stop()


def test_slow_body_gets_408_in_openai_shape(tmp_path: Path) -> None:
    router = Router(tmp_path, ["--replica", "http://127.0.0.1:9", "--client-body-timeout-s", "1"])
    try:
        sock = socket.create_connection(tuple(router.url.removeprefix("http://").split(":")))  # type: ignore[arg-type]
        sock.settimeout(5)
        sock.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n\r\n{")
        answer = sock.recv(65536)
        assert answer.startswith(b"HTTP/1.1 408"), answer
        assert b'"type":"RequestTimeoutError"' in answer and b"client_body_timeout_s" in answer
        sock.close()
    finally:
        router.stop()


def test_idle_client_connections_are_bounded(tmp_path: Path) -> None:
    router = Router(tmp_path, ["--replica", "http://127.0.0.1:9", "--client-idle-timeout-s", "60",
                               "--max-idle-client-connections", "5"])
    socks: list[socket.socket] = []
    try:
        before = num_fds(router)
        socks = [connect(router) for _ in range(30)]
        wait_for(lambda: sum(closed_by_peer(s) for s in socks) >= 25, 10,
                 message="idle connections beyond the bound closed")
        assert num_fds(router) <= before + 5 + 1
        assert not any(closed_by_peer(s) for s in socks[-5:])  # the newest stay
    finally:
        for sock in socks:
            sock.close()
        router.stop()


def read_answer(sock: socket.socket) -> bytes:
    """One whole answer with a Content-Length (the router's JSON answers), b"" if closed."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(line.split(b":", 1)[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:")))
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return head + b"\r\n\r\n" + body


def test_keepalive_is_advertised_and_a_head_arriving_at_the_idle_limit_is_answered(
        tmp_path: Path) -> None:
    """A client told the idle limit (Keep-Alive: timeout=4) and one whose next request head
    began arriving before it are not cut off: the head gets the limit from its first byte (stock
    aiohttp closed the connection at the limit counted from the last answer, the request unanswered:
    the client's ServerDisconnectedError)."""
    router = Router(tmp_path, ["--replica", "http://127.0.0.1:9", "--client-idle-timeout-s", "4"])
    try:
        host, port = router.url.removeprefix("http://").split(":")
        sock = socket.create_connection((host, int(port)), timeout=20)
        sock.send(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = read_answer(sock)
        answered = time.monotonic()
        assert answer.startswith(b"HTTP/1.1 200"), answer
        assert b"\r\nKeep-Alive: timeout=4\r\n" in answer, answer
        time.sleep(max(0.0, answered + 3.5 - time.monotonic()))
        sock.send(b"GET /health HTTP/1.1\r\n")  # the head starts before the idle limit ...
        time.sleep(max(0.0, answered + 6.5 - time.monotonic()))
        sock.send(b"Host: x\r\n\r\n")  # ... and ends after it (and after its 1 s grace)
        answer = read_answer(sock)
        assert answer.startswith(b"HTTP/1.1 200"), answer
        sock.close()
    finally:
        router.stop()
