"""The KV event subscriber against real ZMQ PUB/ROUTER sockets driven by the test.

Covers, independently of the emulator: captured vLLM frames, a gap healed by
replay, a gap the replay cannot cover, an engine restart (seq backwards), a
restarted worker continuing from its last seq, a replay that never answers and
malformed messages.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import pytest

from loadtest.harness.kv_publisher import KVEventPublisher
from router.shared.kv_events import (
    BlockStored,
    KVEventBatch,
    event_hash_key,
    seq_bytes,
    stored_token_ids,
)
from tests.conftest import load_vectors
from worker.replica_view import NO_SEQ
from worker.subscriber import KVEventSubscriber

pytestmark = pytest.mark.timeout(60)


class RecordingSink:
    def __init__(self) -> None:
        self.applied: list[int] = []
        self.batches: list[KVEventBatch] = []
        self.resyncs: list[str] = []
        self.log: list[Any] = []

    def apply(self, seq: int, batch: KVEventBatch) -> None:
        self.applied.append(seq)
        self.batches.append(batch)
        self.log.append(seq)

    def resync(self, reason: str) -> None:
        self.resyncs.append(reason)
        self.log.append("resync")


def one_block(n: int) -> KVEventBatch:
    return KVEventBatch(ts=float(n), events=[BlockStored(
        block_hashes=[n], parent_block_hash=None, token_ids=[n] * 16, block_size=16,
        lora_id=None, medium="GPU", lora_name=None)], data_parallel_rank=0)


async def until(cond: Callable[[], object], timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not cond():
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError("condition not met")
        await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def running(sub: KVEventSubscriber) -> AsyncIterator[KVEventSubscriber]:
    task = asyncio.create_task(sub.run())
    try:
        yield sub
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def connected(pub: KVEventPublisher, sub: KVEventSubscriber, sink: RecordingSink) -> None:
    """Publish one batch once the subscription is live and wait until it is applied.
    ``sub.connected`` is set once the reader sent its subscription, which the PUB side may not
    have taken yet (a batch published at once was lost 8 times in 40: ZMQ's slow joiner), so
    the publisher's XPUB is asked too."""
    await sub.connected.wait()
    await pub.wait_subscribed()
    target = len(sink.applied) + 1
    await pub.publish(one_block(1000 + pub.next_seq))
    await until(lambda: len(sink.applied) >= target)


@dataclass
class Subscribed:
    """A publisher driven by the test and a running subscriber on it, applying into ``sink``."""

    pub: KVEventPublisher
    sub: KVEventSubscriber
    sink: RecordingSink


Subscribe = Callable[..., contextlib.AbstractAsyncContextManager[Subscribed]]


@pytest.fixture
def subscribed() -> Subscribe:
    """``async with subscribed(...) as s``: a ``KVEventPublisher`` (``publisher``: its keyword
    arguments) and a running ``KVEventSubscriber`` on it (``options``: its keyword arguments)
    applying into ``sink`` (a new ``RecordingSink`` unless given), with the publisher's replay
    socket unless ``replay`` is False. ``history`` batches are published before the subscriber
    starts (only the replay buffer has them); with ``connect`` the block waits until a batch went
    through (ZMQ slow joiner: the first batches may come by replay). Everything is closed when
    the block ends; ``s.sub`` and ``s.sink`` stay readable."""

    @contextlib.asynccontextmanager
    async def start(sink: RecordingSink | None = None, *, publisher: dict[str, Any] | None = None,
                    replay: bool = True, connect: bool = True, history: int = 0,
                    **options: Any) -> AsyncIterator[Subscribed]:
        sink = RecordingSink() if sink is None else sink
        async with KVEventPublisher(**(publisher or {})) as pub:
            for n in range(history):
                await pub.publish(one_block(n))
            sub = KVEventSubscriber(pub.endpoint, sink,
                                    replay_endpoint=pub.replay_endpoint if replay else None,
                                    **options)
            async with running(sub):
                if connect:
                    await connected(pub, sub, sink)
                yield Subscribed(pub, sub, sink)

    return start


async def test_captured_vllm_frames_are_applied(subscribed: Subscribe) -> None:
    frames = load_vectors("vllm-kv-event-frames.json")
    variant = frames["variants"][1]  # raw-digest hashes, topic "kv-events"
    payload = bytes.fromhex(variant["frames_hex"][2])
    async with subscribed(publisher={"topic": variant["topic"]}, connect=False,
                          topic=variant["topic"]) as s:
        await s.pub.publish(payload)
        await until(lambda: s.sink.applied == [0])
    sink = s.sink
    stored = sink.batches[0].events[0]
    assert isinstance(stored, BlockStored)
    assert [event_hash_key(h) for h in stored.block_hashes] == [3262291359910021016,
                                                                7142137847444424233]
    assert [e.__struct_config__.tag for e in sink.batches[0].events] == [
        "BlockStored", "BlockRemoved", "AllBlocksCleared"]
    assert stored_token_ids(stored) == list(range(32))  # decoded lazily: read on demand
    assert sink.resyncs == []


async def test_gap_is_filled_by_replay_in_order(subscribed: Subscribe) -> None:
    async with subscribed() as s:
        pub, sub, sink = s.pub, s.sub, s.sink
        gaps, replays = sub.stats.num_gaps, pub.num_replay_requests
        await pub.publish(one_block(1), drop=True)
        await pub.publish(one_block(2), drop=True)
        await pub.publish(one_block(3))
        await pub.publish(one_block(4))
        await until(lambda: sink.applied[-1:] == [4])
    assert sink.applied == [0, 1, 2, 3, 4]
    assert sink.resyncs == []
    assert sub.stats.num_gaps == gaps + 1
    assert pub.num_replay_requests == replays + 1
    assert sub.last_seq == 4


async def test_gap_the_replay_cannot_cover_resyncs_and_rebuilds(subscribed: Subscribe) -> None:
    async with subscribed(publisher={"buffer_steps": 2}) as s:
        pub, sub, sink = s.pub, s.sub, s.sink
        for n in (1, 2, 3):
            await pub.publish(one_block(n), drop=True)
        await pub.publish(one_block(4))  # buffer now holds 3 and 4 only
        await until(lambda: sink.applied[-1:] == [4])
    assert sink.log == [0, "resync", 3, 4]
    assert "replay buffer starts at seq 3, needed 1" in sink.resyncs[0]
    assert sub.stats.num_replay_failures == 1


async def test_gap_without_replay_socket_resyncs(subscribed: Subscribe) -> None:
    async with subscribed(replay=False, connect=False) as s:
        pub, sub, sink = s.pub, s.sub, s.sink
        await sub.connected.wait()
        # Without replay the first batches may be lost to the slow joiner: publish until one arrives.
        while not sink.applied:
            await pub.publish(one_block(pub.next_seq))
            await asyncio.sleep(0.02)
        first = sink.applied[0]
        assert sink.resyncs == []  # no history yet: any starting seq is accepted
        last = pub.next_seq - 1
        await until(lambda: sink.applied[-1] == last)
        await pub.publish(one_block(0), drop=True)
        await pub.publish(one_block(1))
        await until(lambda: sink.applied[-1] == last + 2)
    assert sink.applied == [*range(first, last + 1), last + 2]
    assert len(sink.resyncs) == 1 and "lost" in sink.resyncs[0]


async def test_engine_restart_is_detected(subscribed: Subscribe) -> None:
    async with subscribed() as s:
        pub, sub, sink = s.pub, s.sub, s.sink
        await pub.publish(one_block(1))
        await pub.publish(one_block(2))
        await until(lambda: sink.applied[-1:] == [2])
        pub.restart()
        await pub.publish(one_block(0), drop=True)  # the new engine's first batches are missed
        await pub.publish(one_block(1), drop=True)
        await pub.publish(one_block(2))
        await until(lambda: sink.log[-1:] == [2] and "resync" in sink.log)
    assert sink.log == [0, 1, 2, "resync", 0, 1, 2]
    assert "seq went from 2 to 2" in sink.resyncs[0]
    assert sub.stats.num_restarts == 1


async def test_engine_restart_to_seq_zero(subscribed: Subscribe) -> None:
    async with subscribed() as s:
        pub, sink = s.pub, s.sink
        await pub.publish(one_block(1))
        await until(lambda: sink.applied[-1:] == [1])
        pub.restart()
        await pub.publish(one_block(0))
        await until(lambda: sink.log[-2:] == ["resync", 0])
    assert sink.log == [0, 1, "resync", 0]
    assert "seq went from 1 to 0" in sink.resyncs[0]


async def test_restarted_worker_continues_from_last_seq(subscribed: Subscribe) -> None:
    # nobody listening to the first six: only the replay buffer has them
    async with subscribed(history=6, connect=False, last_seq=3) as s:
        pub, sink = s.pub, s.sink
        await until(lambda: sink.applied[-1:] == [5])
        await pub.publish(one_block(6))
        await until(lambda: sink.applied[-1:] == [6])
    assert sink.applied == [4, 5, 6]
    assert sink.resyncs == []


async def test_fresh_worker_picks_up_history_from_replay(subscribed: Subscribe) -> None:
    async with subscribed(history=3, connect=False, last_seq=NO_SEQ) as s:
        sink = s.sink
        await until(lambda: sink.applied[-1:] == [2])
    assert sink.applied == [0, 1, 2]


async def test_replay_timeout_resyncs(subscribed: Subscribe) -> None:
    async with subscribed(publisher={"replay_enabled": False}, connect=False, last_seq=NO_SEQ,
                          start_replay=False, replay_timeout_s=0.3) as s:
        pub, sub, sink = s.pub, s.sub, s.sink
        await sub.connected.wait()
        while not sink.applied:
            await pub.publish(one_block(pub.next_seq))
            await asyncio.sleep(0.05)
        last = pub.next_seq - 1
        await until(lambda: sink.applied[-1] == last)
        await pub.publish(one_block(0), drop=True)
        await pub.publish(one_block(1))
        await until(lambda: sink.applied[-1] == last + 2, timeout_s=5)
    assert len(sink.resyncs) == 1
    assert sub.stats.num_replay_failures >= 1


async def test_malformed_messages_are_counted_and_dropped(subscribed: Subscribe) -> None:
    async with subscribed() as s:
        pub, sub, sink = s.pub, s.sub, s.sink
        await pub.send_raw([b"", b"\x00\x01"])  # two frames
        await pub.send_raw([b"", b"\x00" * 8, b"\xc1 not msgpack"])
        await pub.send_raw([b"", b"\x00" * 3, b"\x90"])  # bad seq frame
        await pub.publish(one_block(1))
        await until(lambda: sink.applied[-1:] == [1])
    assert sub.stats.num_malformed == 3
    assert sink.applied == [0, 1]
    assert sink.resyncs == []


class TimedSink(RecordingSink):
    """Also records the loop time of each apply."""

    def __init__(self) -> None:
        super().__init__()
        self.times: list[float] = []

    def apply(self, seq: int, batch: KVEventBatch) -> None:
        super().apply(seq, batch)
        self.times.append(asyncio.get_running_loop().time())


async def test_event_window_handles_the_batches_published_meanwhile_in_one_go(
        subscribed: Subscribe) -> None:
    """With ``event_window_s`` the first batch waits the window; the batches published during
    it (a gap healed by replay among them) are handled right after it,
    in order, without another wake-up: one flush for all of them on the worker."""
    window_s = 1.0
    sink = TimedSink()
    async with subscribed(sink, event_window_s=window_s) as s:
        pub, sub = s.pub, s.sub
        await asyncio.sleep(window_s * 1.5)  # the connect batch's window is over
        base = len(sink.applied)
        first = pub.next_seq
        started = asyncio.get_running_loop().time()
        await pub.publish(one_block(1))
        await asyncio.sleep(0.03)
        await pub.publish(one_block(2), drop=True)  # a gap: filled by replay
        await pub.publish(one_block(3))
        await asyncio.sleep(0.03)
        await pub.publish(one_block(4))
        await until(lambda: len(sink.applied) >= base + 4)
    assert sink.applied[base:] == [first, first + 1, first + 2, first + 3]
    times = sink.times[base:]
    assert times[0] - started >= window_s * 0.9  # the first batch waited the window
    # the others came with it, not one window each: a window never ends early, so another one
    # would put them >= window_s after the first (was < 0.05 s, a loop stall's length on a busy
    # machine, with the replay's round trip among them)
    assert times[-1] - times[0] < 0.9 * window_s
    assert sub.stats.num_gaps == 1
    assert sink.resyncs == []


async def test_without_event_window_each_batch_is_handled_as_it_arrives(
        subscribed: Subscribe) -> None:
    sink = TimedSink()
    async with subscribed(sink) as s:
        pub = s.pub
        base = len(sink.applied)
        started = asyncio.get_running_loop().time()
        await pub.publish(one_block(1))
        await until(lambda: len(sink.applied) > base)
        first_after = sink.times[base] - started
        await asyncio.sleep(0.2)
        await pub.publish(one_block(2))
        await until(lambda: len(sink.applied) > base + 1)
    assert first_after < 0.15
    assert sink.times[base + 1] - sink.times[base] >= 0.15  # handled apart, as published


async def test_event_window_backlog_is_handled_in_parts_that_let_other_tasks_run(
        subscribed: Subscribe) -> None:
    """A backlog larger than one drain (the engine publishing faster than the worker keeps
    up) is handled in order, yielding between parts: the writer and the heartbeat run."""
    ticks = 0
    seen_ticks: list[int] = []

    class TickSink(RecordingSink):
        def apply(self, seq: int, batch: KVEventBatch) -> None:
            super().apply(seq, batch)
            seen_ticks.append(ticks)

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0)
            ticks += 1

    sink = TickSink()
    async with subscribed(sink, event_window_s=0.2) as s:
        pub = s.pub
        await asyncio.sleep(0.3)
        base = len(sink.applied)
        first = pub.next_seq
        for n in range(700):
            await pub.publish(one_block(n))
        tick_task = asyncio.create_task(ticker())
        try:
            await until(lambda: len(sink.applied) >= base + 700)
        finally:
            tick_task.cancel()
    assert sink.applied[base:] == list(range(first, first + 700))
    assert sink.resyncs == []
    parts = seen_ticks[base:]
    assert len(set(parts)) >= 3  # 700 batches: at least three parts with other tasks between


async def test_event_window_holding_malformed_messages_and_an_engine_restart(
        subscribed: Subscribe) -> None:
    """One window holding two batches, two malformed messages and a restarted engine's first
    batches (its seq 0 lost live): handled in order as without a window; malformed counted and
    dropped, the restart resyncs and the new engine's history comes from its replay."""
    async with subscribed(event_window_s=0.3) as s:
        pub, sub, sink = s.pub, s.sub, s.sink
        await asyncio.sleep(0.45)  # the connect batch's window is over
        first = pub.next_seq
        await pub.publish(one_block(1))
        await pub.publish(one_block(2))
        await pub.send_raw([b"", b"x"])  # two frames
        await pub.send_raw([b"", seq_bytes(first + 2), b"not msgpack"])
        pub.restart()
        await pub.publish(one_block(10), drop=True)
        await pub.publish(one_block(11))
        await pub.publish(one_block(12))
        await until(lambda: sink.log[-4:] == ["resync", 0, 1, 2])
    assert sink.log[sink.log.index(first):] == [first, first + 1, "resync", 0, 1, 2]
    assert sub.stats.num_malformed == 2
    assert sub.stats.num_restarts == 1
