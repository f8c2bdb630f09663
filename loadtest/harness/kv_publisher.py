"""A vLLM-0.33-compatible KV event publisher (PUB + ROUTER replay), for tests and benchmarks. Does I/O (ZMQ).

Speaks the wire format of vLLM's ``ZmqEventPublisher``: live messages
``[topic, seq (8-byte big-endian), payload]`` on a PUB socket, a bounded buffer
of past batches served on a ROUTER socket (request ``[identity, b"", start_seq]``,
replies ``[identity, b"", topic, seq, payload]`` then the end marker
``[identity, b"", b"", seq=-1, b""]``). Extra knobs let a test lose batches
(``publish(..., drop=True)``) and restart the sequence like a restarted engine.

The live socket is an XPUB (a PUB whose subscribers' subscriptions can be read): vLLM's PUB
drops what it sends before a subscription has reached it (ZMQ's slow joiner), and a test that
must not lose its first batch waits for ``wait_subscribed`` first. To a subscriber the two are
the same socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque

import zmq
import zmq.asyncio

from router.shared.kv_events import (
    REPLAY_END_FRAME,
    KVEventBatch,
    encode_batch,
    parse_seq,
    seq_bytes,
)

logger = logging.getLogger(__name__)

DEFAULT_BUFFER_STEPS = 10_000  # batches kept for replay; vLLM KVEventsConfig.buffer_steps


class KVEventPublisher:
    """PUB socket + replay ROUTER bound on ``host`` ephemeral ports (asyncio).

    ``endpoint`` / ``replay_endpoint`` are the ``tcp://host:port`` addresses once
    started. ``replay_enabled=False`` binds a ROUTER that never answers (a replay
    that times out).
    """

    def __init__(self, host: str = "127.0.0.1", topic: str = "",
                 buffer_steps: int = DEFAULT_BUFFER_STEPS, replay_enabled: bool = True) -> None:
        self.host = host
        self.topic = topic.encode()
        self.replay_enabled = replay_enabled
        self.next_seq = 0
        self.num_replay_requests = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)  # (seq, payload)
        self._ctx = zmq.asyncio.Context()
        self._pub: zmq.asyncio.Socket | None = None
        self._router: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        self._subscriptions_task: asyncio.Task[None] | None = None
        self.num_subscriptions = 0  # subscribe messages the XPUB has taken (one per connection)
        self._subscribed = asyncio.Event()
        self.endpoint = ""
        self.replay_endpoint = ""

    async def start(self) -> KVEventPublisher:
        self._pub = self._ctx.socket(zmq.XPUB)
        self._pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscription, not a topic's first only
        self._pub.setsockopt(zmq.SNDHWM, 1_000_000)
        self._pub.setsockopt(zmq.LINGER, 0)
        port = self._pub.bind_to_random_port(f"tcp://{self.host}")
        self.endpoint = f"tcp://{self.host}:{port}"
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        rport = self._router.bind_to_random_port(f"tcp://{self.host}")
        self.replay_endpoint = f"tcp://{self.host}:{rport}"
        self._task = asyncio.create_task(self._serve_replay())
        self._subscriptions_task = asyncio.create_task(self._count_subscriptions())
        return self

    async def wait_subscribed(self, count: int = 1, timeout_s: float = 30.0) -> None:
        """Wait until the live socket has taken ``count`` subscriptions in all (a reader that
        connects again subscribes again); a batch published after it reaches them. Raises
        ``TimeoutError``."""
        async with asyncio.timeout(timeout_s):
            while self.num_subscriptions < count:
                self._subscribed.clear()
                await self._subscribed.wait()

    async def _count_subscriptions(self) -> None:
        assert self._pub is not None
        while True:
            message = await self._pub.recv()
            if message[:1] == b"\x01":  # subscribe (b"\x00": unsubscribe)
                self.num_subscriptions += 1
                self._subscribed.set()

    async def close(self) -> None:
        for task in (self._task, self._subscriptions_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        for sock in (self._pub, self._router):
            if sock is not None:
                sock.close(linger=0)
        self._ctx.term()

    async def __aenter__(self) -> KVEventPublisher:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def publish(self, batch: KVEventBatch | bytes, *, drop: bool = False) -> int:
        """Publish one batch (or a ready payload); ``drop`` buffers it for replay without sending.

        Returns its sequence number.
        """
        payload = batch if isinstance(batch, bytes) else encode_batch(batch)
        seq = self.next_seq
        self.next_seq += 1
        self._buffer.append((seq, payload))
        if not drop:
            assert self._pub is not None
            await self._pub.send_multipart([self.topic, seq_bytes(seq), payload])
        return seq

    async def send_raw(self, frames: list[bytes]) -> None:
        """Send arbitrary frames on the PUB socket (malformed-message tests)."""
        assert self._pub is not None
        await self._pub.send_multipart(frames)

    def restart(self) -> None:
        """Behave like a restarted engine: sequence back to 0, replay buffer empty."""
        self.next_seq = 0
        self._buffer.clear()

    async def _serve_replay(self) -> None:
        assert self._router is not None
        router = self._router
        while True:
            frames = await router.recv_multipart()
            if not self.replay_enabled:
                continue
            if len(frames) != 3:
                logger.warning("bad replay request with %d frames", len(frames))
                continue
            identity, _, start_frame = frames
            start = parse_seq(start_frame)
            self.num_replay_requests += 1
            for seq, payload in list(self._buffer):
                if seq >= start:
                    await router.send_multipart([identity, b"", self.topic, seq_bytes(seq), payload])
            await router.send_multipart([identity, b"", b"", REPLAY_END_FRAME, b""])
