"""A ZMQ SUB client whose messages are bounded in total, not only per frame: the wire protocol
(ZMTP 3.0, RFC 23, NULL security) read over asyncio streams. Does I/O (tcp and ipc sockets).

Why not libzmq's SUB socket: its ``MAXMSGSIZE`` bounds each frame, and it hands a multipart
message over only once every part is buffered in its pipe (a pipe is flushed at the last part),
so a publisher sending ``[topic, seq, 300 x 1 MB]``, each part under the limit, grew the worker
by 300 MB before the application saw a byte of it (issue 29; no socket option bounds a message's
total). Here a message is read frame by frame: once it has more than ``max_frames`` frames or
``max_bytes`` bytes the connection is dropped at that frame (what libzmq does for one frame over
``MAXMSGSIZE``), so at most ``max_bytes`` of it is ever held, and connected again after
``RECONNECT_S``; the publisher's next messages then follow a gap the caller replays.

What it speaks: the greeting (signature, version 3.0, mechanism NULL), a READY command with
``Socket-Type: SUB`` (the peer's must say PUB or XPUB), subscriptions as ZMTP 3.0 messages
(``\\x01`` + topic, which libzmq's PUB and XPUB take from peers of every 3.x version), PING
answered with PONG. Messages whose first frame does not start with the topic are dropped, as a
SUB socket drops them. Endpoints: ``tcp://HOST:PORT`` and ``ipc://PATH`` (``ipc://@NAME``: the
abstract namespace), what a worker connects to (vLLM's publisher binds them).

Received messages wait in a queue of at most ``max_bytes`` (and ``max_queued`` messages): when it
is full the socket is not read, TCP pushes back and the publisher drops at its high-water mark,
as with libzmq's receive HWM.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable
from typing import Final

logger = logging.getLogger(__name__)

RECONNECT_S: Final = 0.1  # pause before connecting again (libzmq's ZMQ_RECONNECT_IVL default)
# greeting (RFC 23): signature, version 3.0, mechanism NULL, as-server 0, filler
_SIGNATURE: Final = b"\xff" + b"\x00" * 8 + b"\x7f"
GREETING: Final = _SIGNATURE + b"\x03\x00" + b"NULL".ljust(20, b"\x00") + b"\x00" + b"\x00" * 31
_MORE: Final = 0x01
_LONG: Final = 0x02
_COMMAND: Final = 0x04
_MAX_COMMAND_BYTES: Final = 64 * 1024  # READY, PING, ERROR: a few bytes each
_PUBLISHERS: Final = (b"PUB", b"XPUB")


class ProtocolError(Exception):
    """The peer broke ZMTP 3 (or is no PUB socket): the connection is dropped."""


class MessageTooLarge(ProtocolError):
    """A message over the frame or byte bound: the connection is dropped at that frame."""


def command(name: bytes, body: bytes = b"") -> bytes:
    """A command frame: flags, size, name-size, name, body."""
    data = bytes([len(name)]) + name + body
    return _frame_head(_COMMAND, len(data)) + data


def message_frame(data: bytes, more: bool = False) -> bytes:
    """One frame of a message."""
    return _frame_head(_MORE if more else 0, len(data)) + data


def _frame_head(flags: int, size: int) -> bytes:
    if size > 255:
        return bytes([flags | _LONG]) + size.to_bytes(8, "big")
    return bytes([flags, size])


def ready_properties(body: bytes) -> dict[bytes, bytes]:
    """The metadata of a READY command's body (after its name): ``{name: value}``. Raises
    ``ProtocolError`` when it is cut short."""
    props: dict[bytes, bytes] = {}
    i = 0
    while i < len(body):
        name_len = body[i]
        name = body[i + 1:i + 1 + name_len]
        i += 1 + name_len
        if i + 4 > len(body):
            raise ProtocolError("READY metadata cut short")
        value_len = int.from_bytes(body[i:i + 4], "big")
        value = body[i + 4:i + 4 + value_len]
        i += 4 + value_len
        if len(value) != value_len or len(name) != name_len:
            raise ProtocolError("READY metadata cut short")
        props[name.lower()] = value
    return props


async def open_endpoint(endpoint: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Connect to ``tcp://HOST:PORT`` or ``ipc://PATH``. Raises ``ValueError`` for another
    transport, ``OSError`` when the connect fails."""
    transport, _, address = endpoint.partition("://")
    if transport == "tcp":
        host, sep, port = address.rpartition(":")
        if not sep or not port.isdigit():
            raise ValueError(f"ZMQ endpoint {endpoint!r} has no port")
        return await asyncio.open_connection(host.strip("[]"), int(port))
    if transport == "ipc":
        path = "\0" + address[1:] if address.startswith("@") else address
        return await asyncio.open_unix_connection(path)
    raise ValueError(f"ZMQ endpoint {endpoint!r}: only tcp:// and ipc:// are supported")


class BoundedSubscriber:
    """SUB client of ``endpoint`` for messages of ``topic`` (a prefix of their first frame), each
    at most ``max_frames`` frames and ``max_bytes`` bytes (module docstring). ``start`` connects
    (and keeps connecting) on a task, ``recv_multipart`` / ``recv_nowait`` take messages,
    ``close`` stops it. ``on_drop(reason)`` hears of every dropped connection (an oversized
    message, a protocol error or the publisher gone); ``num_drops`` counts them. ``subscribed``
    is set while a connection has sent its subscription (the publisher sends this reader what
    it publishes from then on: a PUB socket drops messages for a peer not yet subscribed) and
    cleared when that connection drops."""

    def __init__(self, endpoint: str, topic: bytes, max_frames: int, max_bytes: int,
                 on_drop: Callable[[str], None] | None = None, max_queued: int = 100_000) -> None:
        transport = endpoint.partition("://")[0]
        if transport not in ("tcp", "ipc"):
            raise ValueError(f"ZMQ endpoint {endpoint!r}: only tcp:// and ipc:// are supported")
        self.endpoint = endpoint
        self.topic = topic
        self.max_frames = max_frames
        self.max_bytes = max_bytes
        self.max_queued = max_queued
        self.on_drop = on_drop
        self.num_drops = 0
        self._queue: deque[list[bytes]] = deque()
        self._queued_bytes = 0
        self._arrived = asyncio.Event()  # a message is queued
        self._room = asyncio.Event()  # the queue has room
        self._room.set()
        self.subscribed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Connect on a task of the running loop; messages queue from now on."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"zmtp-sub {self.endpoint}")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def recv_multipart(self) -> list[bytes]:
        """The next message (waits for one)."""
        while not self._queue:
            self._arrived.clear()
            await self._arrived.wait()
        return self._take()

    def recv_nowait(self) -> list[bytes] | None:
        """The next message already received, else None."""
        return self._take() if self._queue else None

    def _take(self) -> list[bytes]:
        frames = self._queue.popleft()
        self._queued_bytes -= sum(len(f) for f in frames)
        if self._queued_bytes < self.max_bytes and len(self._queue) < self.max_queued:
            self._room.set()
        return frames

    async def _run(self) -> None:
        while True:
            writer: asyncio.StreamWriter | None = None
            try:
                reader, writer = await open_endpoint(self.endpoint)
                await self._handshake(reader, writer)
                logger.debug("subscribed to %s (topic %r)", self.endpoint, self.topic)
                self.subscribed.set()
                await self._receive(reader, writer)
            except MessageTooLarge as exc:
                self._dropped(str(exc))
            except (ProtocolError, OSError, asyncio.IncompleteReadError) as exc:
                if writer is not None:  # (a refused connect is no drop: nothing was there)
                    self._dropped(str(exc) or type(exc).__name__)
            finally:
                self.subscribed.clear()
                if writer is not None:
                    writer.close()
                    with contextlib.suppress(OSError):
                        await writer.wait_closed()
            await asyncio.sleep(RECONNECT_S)

    def _dropped(self, reason: str) -> None:
        self.num_drops += 1
        if self.on_drop is not None:
            self.on_drop(reason)

    async def _handshake(self, reader: asyncio.StreamReader,
                         writer: asyncio.StreamWriter) -> None:
        writer.write(GREETING)
        peer = await reader.readexactly(len(GREETING))
        if peer[0] != 0xFF or peer[9] & 0x01 != 0x01 or peer[10] < 3:
            raise ProtocolError("the peer does not speak ZMTP 3")
        mechanism = peer[12:32].rstrip(b"\x00")
        if mechanism != b"NULL":
            raise ProtocolError(f"the peer wants security {mechanism!r}")
        writer.write(command(b"READY", b"\x0bSocket-Type" + (3).to_bytes(4, "big") + b"SUB"))
        name, body = await self._command(reader)
        if name == b"ERROR":
            raise ProtocolError(f"the peer refused: {body[1:1 + body[0]]!r}" if body else
                                "the peer refused")
        if name != b"READY":
            raise ProtocolError(f"expected READY, got {name!r}")
        socket_type = ready_properties(body).get(b"socket-type")
        if socket_type not in _PUBLISHERS:
            raise ProtocolError(f"the peer is a {socket_type!r} socket, not a publisher")
        writer.write(message_frame(b"\x01" + self.topic))
        await writer.drain()

    async def _command(self, reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
        flags, size = await self._head(reader)
        if not flags & _COMMAND or flags & _MORE or size > _MAX_COMMAND_BYTES:
            raise ProtocolError("expected a command frame")
        data = await reader.readexactly(size)
        if not data or 1 + data[0] > len(data):
            raise ProtocolError("bad command frame")
        return data[1:1 + data[0]], data[1 + data[0]:]

    async def _head(self, reader: asyncio.StreamReader) -> tuple[int, int]:
        flags = (await reader.readexactly(1))[0]
        if flags & ~(_MORE | _LONG | _COMMAND):
            raise ProtocolError(f"bad frame flags 0x{flags:02x}")
        size = await reader.readexactly(8 if flags & _LONG else 1)
        return flags, int.from_bytes(size, "big")

    async def _receive(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        frames: list[bytes] = []
        total = 0
        while True:
            if not frames:
                await self._room.wait()
            flags, size = await self._head(reader)
            if flags & _COMMAND:
                if frames or flags & _MORE or size > _MAX_COMMAND_BYTES:
                    raise ProtocolError("bad command frame inside a message")
                data = await reader.readexactly(size)
                if data[:5] == b"\x04PING" and len(data) >= 7:  # ttl (2 bytes), context
                    writer.write(command(b"PONG", data[7:]))
                continue
            total += size
            if len(frames) >= self.max_frames or total > self.max_bytes:
                raise MessageTooLarge(
                    f"message over {self.max_frames} frames or {self.max_bytes} bytes "
                    f"(frame {len(frames) + 1}, {total} bytes so far)")
            frames.append(await reader.readexactly(size))
            if flags & _MORE:
                continue
            if frames[0].startswith(self.topic):
                self._queue.append(frames)
                self._queued_bytes += total
                self._arrived.set()
                if self._queued_bytes >= self.max_bytes or len(self._queue) >= self.max_queued:
                    self._room.clear()
            frames, total = [], 0
