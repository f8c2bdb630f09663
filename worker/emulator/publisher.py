"""KV-event publisher of one emulated replica: ZMQ PUB plus the ROUTER replay socket. Does I/O.

Wire behaviour copies vLLM 0.33 ``ZmqEventPublisher`` (``vllm/distributed/kv_events.py``):
each batch is published as ``[topic, seq (8-byte big-endian), msgpack KVEventBatch]``
with ``seq`` counting from 0; the last ``buffer_steps`` batches are kept for
replay; a DEALER that sends ``[b"", start_seq]`` to the ROUTER socket gets
``[b"", topic, seq, payload]`` for every buffered batch with ``seq >= start_seq``
and then the end marker ``[b"", b"", -1 as signed 8 bytes, b""]``. Sockets bind
when the endpoint contains ``*`` or ``::`` or is ``ipc://``/``inproc://`` and
connect otherwise; ``*`` binds on the emulator's ``--host``.

The PUB socket is a plain (non-blocking) socket owned by one sender thread, as in
vLLM (whose publisher thread takes batches from a queue): a PUB send never blocks on
the subscriber (messages beyond the high-water mark are dropped, as in vLLM), but each
send wakes ZMQ's I/O thread, and on a busy host the sending thread then waits for a
core; that wait must not stall the engine's steps. The ROUTER socket is served by one
asyncio task.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from router.shared.hashing import block_key
from router.shared.kv_events import (
    REPLAY_END_FRAME,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    encode_batch,
    encode_event,
    seq_bytes,
)
from worker.emulator.kv_cache import BlockEvicted, BlocksStored, CacheCleared, KVEvent
from worker.emulator.offload import OffloadEvent, OffloadRemoved, OffloadStored

logger = logging.getLogger(__name__)

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"  # vLLM CPUOffloadingSpec's medium


class PublisherError(RuntimeError):
    """A KV-event socket could not be bound or connected."""


@dataclass(frozen=True, slots=True)
class PublisherConfig:
    """Resolved settings of one replica's publisher (from ``--kv-events-config``)."""

    endpoint: str  # address to bind or connect, "*" already replaced by the bind host
    bind: bool = True  # vLLM ``should_bind`` of the endpoint as configured
    replay_endpoint: str | None = None  # always bound (a ROUTER serves requests)
    topic: str = ""
    buffer_steps: int = 10000
    hwm: int = 100000
    int_block_hashes: bool = True  # VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES
    data_parallel_rank: int = 0
    block_size: int = 16  # tokens; the block size CPU-tier events carry (vLLM offloaded_block_size)


def should_bind(endpoint: str) -> bool:
    """vLLM's rule: bind for ``*``, ``::``, ``ipc://`` and ``inproc://``, else connect."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


# msgpack of a 64-bit unsigned int: 0xcf then the 8 bytes big-endian, which for an int block
# hash (vLLM ``maybe_convert_block_hash``: the digest's last 8 bytes, big-endian) are the digest's
# last 8 bytes themselves. msgpack packs an int in the fewest bytes, so this holds for keys of
# 2**32 and more; the rare smaller key (one in 4 billion) goes through the encoder instead.
_UINT64 = b"\xcf"
_SMALL_KEY = b"\x00\x00\x00\x00"
_SENTINEL_KEY = (1 << 64) - 1


def _removed_template() -> tuple[bytes, bytes]:
    """The encoded BlockRemoved of one GPU block, split around its (uint64) hash."""
    encoded = encode_event(BlockRemoved(block_hashes=[_SENTINEL_KEY], medium=MEDIUM_GPU,
                                        group_idx=0))
    marker = _UINT64 + _SENTINEL_KEY.to_bytes(8, "big")
    head, tail = encoded.split(marker)
    return head, tail


_REMOVED_HEAD, _REMOVED_TAIL = _removed_template()


def _array_header(n: int) -> bytes:
    if n < 16:
        return bytes((0x90 | n,))
    if n < 1 << 16:
        return b"\xdc" + n.to_bytes(2, "big")
    return b"\xdd" + n.to_bytes(4, "big")


def _int_keys(digests: Sequence[bytes]) -> list[int] | msgspec.Raw:
    """The int block hashes of ``digests`` as the encoder would write ``list[int]``."""
    if any(d[-8:-4] == _SMALL_KEY for d in digests):
        return [block_key(d) for d in digests]
    return msgspec.Raw(_array_header(len(digests)) + _UINT64 + _UINT64.join(
        [d[-8:] for d in digests]))


def to_wire_events(events: Sequence[KVEvent | OffloadEvent], int_block_hashes: bool,
                   block_size: int = 16) -> list[Any]:
    """Convert the cache's plain events to vLLM 0.33 event structs (``maybe_convert_block_hash``).

    Int-form hashes are written as pre-encoded msgpack (``msgspec.Raw``), byte for byte what
    encoding the struct would give (``tests/unit/test_emulator_publisher.py`` checks): one
    eviction event per evicted block is most of what an emulated replica publishes.
    """
    def conv(digest: bytes) -> int | bytes:
        return block_key(digest) if int_block_hashes else digest

    out: list[Any] = []
    append = out.append
    for event in events:
        if type(event) is BlockEvicted:
            digest = event.block_hash
            if int_block_hashes and digest[-8:-4] != _SMALL_KEY:
                append(msgspec.Raw(_REMOVED_HEAD + _UINT64 + digest[-8:] + _REMOVED_TAIL))
            else:
                append(BlockRemoved(block_hashes=[conv(digest)], medium=MEDIUM_GPU, group_idx=0))
        elif isinstance(event, BlocksStored):
            hashes = event.block_hashes
            append(BlockStored(
                block_hashes=_int_keys(hashes) if int_block_hashes else list(hashes),  # type: ignore[arg-type]
                parent_block_hash=None if event.parent_block_hash is None
                else conv(event.parent_block_hash),
                token_ids=event.token_ids,
                block_size=event.block_size,
                lora_id=event.lora_id,
                medium=MEDIUM_GPU,
                lora_name=event.lora_name,
                extra_keys=event.extra_keys,
                group_idx=0,
            ))
        elif isinstance(event, CacheCleared):
            append(AllBlocksCleared())
        elif isinstance(event, OffloadStored):
            # vLLM OffloadingConnectorScheduler.take_events: no parent, tokens, LoRA or group.
            append(BlockStored(
                block_hashes=[conv(d) for d in event.block_hashes], parent_block_hash=None,
                token_ids=[], block_size=block_size, lora_id=None, medium=MEDIUM_CPU,
                lora_name=None))
        elif isinstance(event, OffloadRemoved):
            append(BlockRemoved(block_hashes=[conv(d) for d in event.block_hashes],
                                medium=MEDIUM_CPU))
    return out


class ZmqEventPublisher:
    """Publishes one replica's event batches; ``start()`` opens the sockets, ``close()`` ends them.

    ``endpoint`` / ``replay_endpoint`` after ``start()`` are the resolved
    addresses (ephemeral ports filled in).
    """

    def __init__(self, config: PublisherConfig, context: zmq.Context[Any]) -> None:
        self.config = config
        self._ctx = context
        self._actx = zmq.asyncio.Context.shadow(context.underlying)
        self._topic = config.topic.encode("utf-8")
        self._seq = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=max(config.buffer_steps, 1))
        self._pub: zmq.Socket[Any] | None = None
        self._replay: zmq.asyncio.Socket | None = None
        self._replay_task: asyncio.Task[None] | None = None
        self.endpoint: str = config.endpoint
        self.replay_endpoint: str | None = config.replay_endpoint
        self.num_batches = 0
        self._outbox: queue.SimpleQueue[tuple[bytes, bytes] | None] = queue.SimpleQueue()
        self._sender: threading.Thread | None = None

    def start(self) -> None:
        try:
            # A plain socket on the same context: send never blocks on PUB.
            pub = self._ctx.socket(zmq.PUB)
            pub.setsockopt(zmq.SNDHWM, self.config.hwm)
            pub.setsockopt(zmq.LINGER, 0)
            self._pub = pub  # (kept before binding, so close() also closes a socket that failed)
            self.endpoint = _attach(pub, self.config.endpoint, self.config.bind)
            self._sender = threading.Thread(target=self._send_loop, args=(pub,),
                                            name="kv-events-pub", daemon=True)
            self._sender.start()
            if self.config.replay_endpoint:
                replay = self._actx.socket(zmq.ROUTER)
                replay.setsockopt(zmq.SNDHWM, 2 * (self.config.buffer_steps + 1))
                replay.setsockopt(zmq.LINGER, 0)
                self._replay = replay
                self.replay_endpoint = _attach(replay, self.config.replay_endpoint, True)
                self._replay_task = asyncio.get_running_loop().create_task(self._serve_replay())
        except zmq.ZMQError as exc:
            self.close()
            raise PublisherError(f"KV events socket {self.config.endpoint}: {exc}") from exc

    def publish(self, events: Sequence[KVEvent | OffloadEvent], ts: float | None = None) -> None:
        """Publish one scheduler step's events as one batch (nothing if ``events`` is empty).

        ``ts`` defaults to ``time.time()`` (vLLM stamps batches with wall time).
        """
        if not events or self._pub is None:
            return
        batch = KVEventBatch(
            ts=time.time() if ts is None else ts,
            events=to_wire_events(events, self.config.int_block_hashes, self.config.block_size),
            data_parallel_rank=self.config.data_parallel_rank,
        )
        self.publish_payload(encode_batch(batch))

    def publish_payload(self, payload: bytes) -> None:
        """Send an encoded batch with the next sequence number and keep it for replay."""
        if self._pub is None:
            return
        seq = self._seq
        self._seq += 1
        self._buffer.append((seq, payload))
        self._outbox.put((seq_bytes(seq), payload))
        self.num_batches += 1

    def _send_loop(self, pub: zmq.Socket[Any]) -> None:
        """The sender thread: the only user of the PUB socket once started."""
        topic = self._topic
        while (item := self._outbox.get()) is not None:
            try:
                pub.send_multipart((topic, *item), flags=zmq.NOBLOCK)
            except zmq.Again:
                logger.warning("KV events PUB send dropped batch %d (high-water mark)",
                               int.from_bytes(item[0], "big"))
            except zmq.ZMQError as exc:
                logger.warning("KV events PUB send failed: %s", exc)
                if exc.errno == zmq.ETERM:
                    return

    async def _serve_replay(self) -> None:
        assert self._replay is not None
        sock = self._replay
        while True:
            try:
                frames = await sock.recv_multipart()
            except asyncio.CancelledError:
                raise
            except zmq.ZMQError as exc:
                if exc.errno == zmq.ETERM:
                    return
                logger.warning("KV events replay socket error: %s", exc)
                await asyncio.sleep(0.1)
                continue
            if len(frames) != 3 or len(frames[2]) != 8:
                logger.warning("KV events replay: ignoring malformed request of %d frames", len(frames))
                continue
            identity, _, seq_frame = frames
            start = int.from_bytes(seq_frame, "big")
            try:
                for seq, payload in list(self._buffer):
                    if seq >= start:
                        await sock.send_multipart(
                            (identity, b"", self._topic, seq_bytes(seq), payload))
                await sock.send_multipart((identity, b"", b"", REPLAY_END_FRAME, b""))
            except zmq.ZMQError as exc:
                logger.warning("KV events replay send failed: %s", exc)

    def close(self) -> None:
        if self._sender is not None:
            self._outbox.put(None)  # after every batch already queued
            self._sender.join(timeout=5)
            self._sender = None
        if self._replay_task is not None:
            self._replay_task.cancel()
            self._replay_task = None
        for sock in (self._pub, self._replay):
            if sock is not None:
                with contextlib.suppress(zmq.ZMQError):
                    sock.close(linger=0)
        self._pub = None
        self._replay = None


def _attach(sock: Any, endpoint: str, bind: bool) -> str:
    """Bind or connect ``sock``; return the resolved endpoint (ephemeral port filled in)."""
    if bind:
        sock.bind(endpoint)
        last = sock.getsockopt(zmq.LAST_ENDPOINT)
        return last.decode() if isinstance(last, bytes) else str(last)
    sock.connect(endpoint)
    return endpoint
