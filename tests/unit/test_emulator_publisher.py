"""The emulator's KV-event publisher over real ZMQ sockets reproduces vLLM 0.33's frames
byte for byte (``vectors/vllm-kv-event-frames.json``), live and through the replay socket."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest
import zmq
import zmq.asyncio

from router.shared.hashing import BlockHasher
from router.shared.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    encode_batch,
)
from tests.conftest import load_vectors
from worker.emulator.kv_cache import BlockEvicted, BlocksStored, CacheCleared
from worker.emulator.publisher import PublisherConfig, ZmqEventPublisher, to_wire_events


def vector_events() -> list[Any]:
    """The vector's batch as the block pool would queue it: range40, sha256, seed unset."""
    digests = BlockHasher(16, "sha256", None).digests(list(range(40)))
    return [
        BlocksStored(block_hashes=digests, parent_block_hash=None, token_ids=list(range(32)),
                     block_size=16, lora_id=None, lora_name=None, extra_keys=[None, None]),
        BlockEvicted(digests[1]),
        CacheCleared(),
    ]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("variant_index", [0, 1])
async def test_publisher_frames_match_vllm_vectors(variant_index: int) -> None:
    vectors = load_vectors("vllm-kv-event-frames.json")
    variant = vectors["variants"][variant_index]
    ctx: zmq.Context[Any] = zmq.Context()
    actx = zmq.asyncio.Context.shadow(ctx.underlying)
    publisher = ZmqEventPublisher(PublisherConfig(
        endpoint="tcp://127.0.0.1:0", bind=True, replay_endpoint="tcp://127.0.0.1:0",
        topic=variant["topic"], int_block_hashes=variant["int_block_hashes"]), ctx)
    publisher.start()
    sub = actx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(publisher.endpoint)
    dealer = actx.socket(zmq.DEALER)
    dealer.connect(publisher.replay_endpoint or "")
    try:
        # PUB drops messages until the SUB's subscription has arrived: send probes until one
        # lands, then rewind the publisher to a fresh start (seq 0, empty replay buffer).
        async def probe_lands() -> bool:
            publisher.publish_payload(b"probe")
            try:
                await asyncio.wait_for(sub.recv_multipart(), timeout=0.05)
                return True
            except TimeoutError:
                return False

        for _ in range(100):
            if await probe_lands():
                break
        while await sub.poll(50):
            await sub.recv_multipart()
        publisher._seq = 0
        publisher._buffer.clear()
        publisher.publish(vector_events(), ts=vectors["ts"])
        frames = await asyncio.wait_for(sub.recv_multipart(), timeout=5)
        assert [f.hex() for f in frames] == variant["frames_hex"]

        await dealer.send_multipart([bytes.fromhex(h) for h in variant["replay_request_hex"]])
        replies = []
        for _ in variant["replay_reply_frames_hex"]:
            replies.append([f.hex() for f in await asyncio.wait_for(dealer.recv_multipart(), 5)])
        assert replies == variant["replay_reply_frames_hex"]
    finally:
        sub.close(linger=0)
        dealer.close(linger=0)
        publisher.close()
        ctx.term()


@pytest.mark.timeout(30)
async def test_replay_from_a_later_seq_and_buffer_steps() -> None:
    ctx: zmq.Context[Any] = zmq.Context()
    actx = zmq.asyncio.Context.shadow(ctx.underlying)
    publisher = ZmqEventPublisher(PublisherConfig(
        endpoint="tcp://127.0.0.1:0", bind=True, replay_endpoint="tcp://127.0.0.1:0",
        buffer_steps=3), ctx)
    publisher.start()
    dealer = actx.socket(zmq.DEALER)
    dealer.connect(publisher.replay_endpoint or "")
    try:
        for _ in range(5):
            publisher.publish([CacheCleared()], ts=1.0)
        await dealer.send_multipart([b"", (3).to_bytes(8, "big")])
        seqs = []
        while True:
            frames = await asyncio.wait_for(dealer.recv_multipart(), 5)
            if frames[2] == b"\xff" * 8:
                assert frames[1] == b"" and frames[3] == b""
                break
            seqs.append(int.from_bytes(frames[2], "big"))
        assert seqs == [3, 4]
        await dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        seqs = []
        while True:
            frames = await asyncio.wait_for(dealer.recv_multipart(), 5)
            if frames[2] == b"\xff" * 8:
                break
            seqs.append(int.from_bytes(frames[2], "big"))
        assert seqs == [2, 3, 4]  # only the last buffer_steps batches are kept
    finally:
        dealer.close(linger=0)
        publisher.close()
        ctx.term()


def _struct_events(events: list[Any], int_hashes: bool) -> list[Any]:
    """The same events as plain msgspec structs (what vLLM's publisher encodes)."""
    def conv(digest: bytes) -> int | bytes:
        return int.from_bytes(digest[-8:], "big") if int_hashes else digest

    out: list[Any] = []
    for e in events:
        if isinstance(e, BlockEvicted):
            out.append(BlockRemoved(block_hashes=[conv(e.block_hash)], medium="GPU", group_idx=0))
        elif isinstance(e, BlocksStored):
            out.append(BlockStored(
                block_hashes=[conv(h) for h in e.block_hashes],
                parent_block_hash=None if e.parent_block_hash is None else conv(
                    e.parent_block_hash),
                token_ids=e.token_ids, block_size=e.block_size, lora_id=e.lora_id, medium="GPU",
                lora_name=e.lora_name, extra_keys=e.extra_keys, group_idx=0))
        else:
            out.append(AllBlocksCleared())
    return out


@pytest.mark.parametrize("int_hashes", [True, False])
def test_pre_encoded_events_are_the_structs_bytes(int_hashes: bool) -> None:
    """to_wire_events writes int hashes as pre-encoded msgpack: the batch must still be byte
    for byte what encoding the structs gives, for runs across msgpack's array-size forms and for
    the rare keys below 2**32 that msgpack packs shorter."""
    rng = random.Random(7)

    def digest(small: bool = False) -> bytes:
        raw = rng.randbytes(32)
        return raw[:24] + b"\0\0\0\0" + raw[28:] if small else raw

    events: list[Any] = [CacheCleared()]
    for n in (1, 15, 16, 17, 65535, 65536):
        hashes = [digest(small=(n == 17 and i == 5)) for i in range(n)]
        events.append(BlocksStored(block_hashes=hashes, parent_block_hash=digest() if n > 1
                                   else None, token_ids=list(range(4 * n)), block_size=4,
                                   lora_id=None, lora_name=None, extra_keys=None))
        events.append(BlockEvicted(hashes[0]))
    events.append(BlockEvicted(digest(small=True)))
    fast = encode_batch(KVEventBatch(ts=2.5, events=to_wire_events(events, int_hashes),
                                     data_parallel_rank=0))
    plain = encode_batch(KVEventBatch(ts=2.5, events=_struct_events(events, int_hashes),
                                      data_parallel_rank=0))
    assert fast == plain
