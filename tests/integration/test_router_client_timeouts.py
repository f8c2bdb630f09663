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
