"""The worker's ZMTP SUB reader (``worker.zmtp_sub.BoundedSubscriber``) against a real libzmq PUB
socket (pyzmq), in each start order: reader before the publisher binds, publisher first, and a
publisher that goes away and binds the same endpoint again; over tcp and ipc.

A PUB socket drops what it publishes before a subscriber's subscription reached it (ZMQ's slow
joiner), so each case publishes a marker until one arrives, then checks that every message
published after it arrives, in order. ``subscribed`` tells when the reader's subscription is
out (the hash probe waits for it before sending its prompt).
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator

import pytest
import zmq
import zmq.asyncio

from tests.helpers import free_port
from worker.zmtp_sub import RECONNECT_S, BoundedSubscriber

pytestmark = pytest.mark.timeout(60)

TOPIC = b"kv"
SETTLE_S = 20.0  # bound on each wait: generous on a busy machine


@pytest.fixture(params=["tcp", "ipc"])
def endpoint(request: pytest.FixtureRequest) -> Iterator[str]:
    """An endpoint nothing listens on yet: a free tcp port on loopback, or an ipc path."""
    if request.param == "tcp":
        yield f"tcp://127.0.0.1:{free_port()}"
    else:
        with tempfile.TemporaryDirectory(prefix="zmtp-") as directory:
            yield f"ipc://{directory}/events"


@contextlib.asynccontextmanager
async def reader(endpoint: str) -> AsyncIterator[BoundedSubscriber]:
    sub = BoundedSubscriber(endpoint, TOPIC, max_frames=3, max_bytes=1 << 20)
    sub.start()
    try:
        yield sub
    finally:
        await sub.close()


class Publisher:
    """A libzmq PUB socket bound at ``endpoint`` (the engine's side), numbering its messages."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str) -> None:
        self.sock = ctx.socket(zmq.PUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(endpoint)
        self.num_sent = 0

    async def send(self, body: bytes) -> None:
        await self.sock.send_multipart([TOPIC, self.num_sent.to_bytes(8, "big"), body])
        self.num_sent += 1

    def close(self) -> None:
        self.sock.close(linger=0)


@pytest.fixture
def ctx() -> Iterator[zmq.asyncio.Context]:
    context = zmq.asyncio.Context()
    yield context
    context.term()


async def until(cond: Callable[[], object], message: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + SETTLE_S
    while not cond():
        if loop.time() > deadline:
            raise TimeoutError(f"timed out waiting for {message}")
        await asyncio.sleep(0.01)


async def joined(pub: Publisher, sub: BoundedSubscriber) -> None:
    """Wait for the reader's subscription, then publish markers until one arrives (the
    subscription may still be on its way to the PUB socket); the markers are consumed."""
    await asyncio.wait_for(sub.subscribed.wait(), SETTLE_S)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + SETTLE_S
    while loop.time() < deadline:
        await pub.send(b"marker")
        with contextlib.suppress(TimeoutError):
            frames = await asyncio.wait_for(sub.recv_multipart(), 0.05)
            while frames[2] == b"marker" and (more := sub.recv_nowait()) is not None:
                frames = more
            if frames[2] == b"marker":
                return
    raise TimeoutError("no marker arrived")


async def all_arrive(pub: Publisher, sub: BoundedSubscriber, count: int) -> None:
    """Publish ``count`` messages; each must arrive, in order, with nothing else between."""
    for i in range(count):
        await pub.send(b"m%d" % i)
    for i in range(count):
        frames = await asyncio.wait_for(sub.recv_multipart(), SETTLE_S)
        assert frames[0] == TOPIC and frames[2] == b"m%d" % i


async def heard_until_closed(ctx: zmq.asyncio.Context, endpoint: str, sub: BoundedSubscriber,
                             count: int) -> None:
    """Bind a publisher at ``endpoint``; ``sub`` joins it and hears ``count`` messages in
    order (``all_arrive``); then the publisher closes."""
    pub = Publisher(ctx, endpoint)
    try:
        await joined(pub, sub)
        await all_arrive(pub, sub, count)
    finally:
        pub.close()


async def test_a_reader_started_before_the_publisher_subscribes_once_it_binds(
        ctx: zmq.asyncio.Context, endpoint: str) -> None:
    async with reader(endpoint) as sub:
        await asyncio.sleep(5 * RECONNECT_S)  # several refused connects
        assert not sub.subscribed.is_set()
        assert sub.num_drops == 0  # a refused connect is no dropped connection
        await heard_until_closed(ctx, endpoint, sub, 50)


async def test_a_reader_started_after_the_publisher_subscribes_at_once(
        ctx: zmq.asyncio.Context, endpoint: str) -> None:
    pub = Publisher(ctx, endpoint)
    try:
        for _ in range(3):  # published before any subscriber: dropped by the PUB socket
            await pub.send(b"early")
        async with reader(endpoint) as sub:
            await joined(pub, sub)
            await all_arrive(pub, sub, 50)
            assert sub.num_drops == 0
    finally:
        pub.close()


async def test_a_reader_follows_a_publisher_that_restarts_at_the_same_endpoint(
        ctx: zmq.asyncio.Context, endpoint: str) -> None:
    """The engine restarts: its PUB socket closes and a new one binds the same endpoint (an ipc
    path is unlinked and bound anew). The reader sees the connection drop, clears
    ``subscribed``, connects again and subscribes to the new socket."""
    async with reader(endpoint) as sub:
        await heard_until_closed(ctx, endpoint, sub, 10)
        await until(lambda: not sub.subscribed.is_set(), "the reader to see the publisher go")
        # the drop, and maybe a connect the closing socket still accepted
        assert sub.num_drops >= 1
        await asyncio.sleep(5 * RECONNECT_S)  # nothing listening meanwhile: refused connects
        drops = sub.num_drops
        await heard_until_closed(ctx, endpoint, sub, 50)
        assert sub.num_drops == drops
