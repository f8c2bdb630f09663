"""A real worker process fed by a test-side vLLM-format ZMQ publisher, with a real Redis.

The engine HTTP side (heartbeat) is a real emulator; the KV events come from
the test so it can send exactly the sequences a real engine may produce: the
same hash stored twice then removed once, and changes made during a Redis outage.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import redis
import requests

from loadtest.harness.kv_publisher import KVEventPublisher
from loadtest.harness.redis_server import RedisServer
from router.shared import contract
from router.shared.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    encode_batch,
    seq_bytes,
)
from tests.helpers import PYTHON, free_port, start_process, stop_process, wait_for
from tests.integration.test_worker_emulator import REPLICA, Emulator, start_emulator

pytestmark = pytest.mark.timeout(120)


def stored(*hashes: int, medium: str = "GPU") -> KVEventBatch:
    return KVEventBatch(ts=0.0, events=[BlockStored(
        block_hashes=list(hashes), parent_block_hash=None, token_ids=[1] * 16 * len(hashes),
        block_size=16, lora_id=None, medium=medium, lora_name=None)], data_parallel_rank=0)


def removed(*hashes: int) -> KVEventBatch:
    return KVEventBatch(ts=0.0, events=[BlockRemoved(block_hashes=list(hashes), medium="GPU")],
                        data_parallel_rank=0)


async def until(cond: Callable[[], object], timeout_s: float = 20.0, message: str = "") -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    last: Exception | None = None
    while loop.time() < deadline:
        try:
            if cond():
                return
        except Exception as exc:  # Redis may be down on purpose
            last = exc
        await asyncio.sleep(0.05)
    raise TimeoutError(f"timed out waiting for {message}; last error {last!r}")


@pytest.fixture(scope="module")
def emulator() -> Iterator[Emulator]:
    with tempfile.TemporaryDirectory(prefix="worker-proc-") as name:
        emu = start_emulator(Path(name))
        yield emu
        stop_process(emu.proc)


@pytest.fixture
async def publisher() -> AsyncIterator[KVEventPublisher]:
    async with KVEventPublisher() as pub:
        yield pub


def start_worker(emu: Emulator, pub: KVEventPublisher, redis_url: str,
                 metrics_port: int = 0, *extra: str) -> subprocess.Popen[bytes]:
    return start_process([PYTHON, "-m", "worker.cli", "report", "--engine-url", emu.url,
                          "--redis-url", redis_url, "--replica-id", REPLICA,
                          "--hash-seed", "0", "--metrics-port", str(metrics_port),
                          "--index-stride", "1", *extra],  # the exact index: every key
                         env={"WORKER_KV_EVENTS_ENDPOINT": pub.endpoint,
                              "WORKER_KV_REPLAY_ENDPOINT": pub.replay_endpoint})


async def store_first(client: redis.Redis, publisher: KVEventPublisher, *keys: int) -> None:
    """Wait for the worker's first heartbeat, publish ``keys`` stored and wait until Redis holds
    exactly them."""
    await until(lambda: epoch(client) > 0, message="first heartbeat")
    await publisher.publish(stored(*keys))
    await until(lambda: blocks(client) == set(keys), message="stored")


def blocks(client: redis.Redis, tier: str = contract.TIER_GPU) -> set[int]:
    members: set[bytes] = client.smembers(contract.blocks_key("pr", REPLICA, tier))  # type: ignore[assignment]
    return {contract.unpack_key(m) for m in members}


def epoch(client: redis.Redis) -> int:
    value = client.hget(contract.replica_key("pr", REPLICA), contract.F_EPOCH)
    return int(value) if value is not None else -1  # type: ignore[arg-type]


async def test_stored_twice_removed_once_stays_resident(
        emulator: Emulator, publisher: KVEventPublisher, redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    metrics_port = free_port()
    worker = start_worker(emulator, publisher, redis_url, metrics_port)
    try:
        await until(lambda: epoch(client) > 0, message="first heartbeat")
        await publisher.publish(stored(11, 12))
        await until(lambda: blocks(client) == {11, 12}, message="stored")
        await publisher.publish(stored(12))  # a second physical copy of 12
        await publisher.publish(removed(12))
        await publisher.publish(removed(11))
        await until(lambda: blocks(client) == {12}, message="11 removed")
        await publisher.publish(removed(12))
        await until(lambda: blocks(client) == set(), message="12 removed")

        def changes() -> list[tuple[list[int], list[int]]]:
            entries: Any = client.xrange(contract.events_key("pr"))
            return [(list(contract.unpack_keys(f[b"stored"])),
                     list(contract.unpack_keys(f[b"removed"]))) for _, f in entries]

        # one entry per flush, a key in at most one of its lists; the copies of 12 kept it
        # resident until its second removal (the entry follows its set change)
        await until(lambda: changes()[-3:] == [([11, 12], []), ([], [11]), ([], [12])],
                    message="the three entries")
        text = await asyncio.to_thread(worker_metrics, metrics_port)
        assert 'worker_events_total{type="BlockStored"} 2.0' in text
        assert 'worker_events_total{type="BlockRemoved"} 3.0' in text
        assert "worker_resident_blocks 0.0" in text
        seq = client.hget(contract.replica_key("pr", REPLICA), contract.F_SEQ)
        assert int(seq) == publisher.next_seq - 1  # type: ignore[arg-type]
    finally:
        stop_process(worker)


async def test_offload_mediums_through_a_real_worker(
        emulator: Emulator, publisher: KVEventPublisher, redis_url: str) -> None:
    """vLLM's offload mediums on constructed frames (map- and array-encoded, as vLLM 0.33 and
    0.9-0.11 publish them): "CPU" is indexed as the CPU tier; "STORAGE" (disk or remote, which
    no router values) and a medium vLLM does not name are skipped and counted by medium; a host
    tier of another block size changes no set."""
    client = redis.Redis.from_url(redis_url)
    client.flushall()
    metrics_port = free_port()
    worker = start_worker(emulator, publisher, redis_url, metrics_port)
    try:
        await until(lambda: epoch(client) > 0, message="first heartbeat")
        gpu, cpu, storage = (stored(21, 22, medium=m).events[0] for m in ("GPU", "CPU", "STORAGE"))
        await publisher.publish(KVEventBatch(0.0, [gpu, cpu, storage, stored(23, medium="NVME")
                                                   .events[0]], 0))
        await publisher.publish(msgspec.msgpack.encode([0.0, [
            ["BlockStored", [24], None, [1] * 16, 16, None, "STORAGE"],
            ["BlockRemoved", [21], "STORAGE"],
            ["BlockRemoved", [22], "CPU"],
            ["BlockStored", [22], None, [], 64, None, "CPU"],  # a host block of 4 GPU blocks
            ["BlockRemoved", [22], "CPU"],  # (no block size: finds nothing resident)
        ], 0]))
        await publisher.publish(stored(99))  # the last: once it is in, every batch before is
        await until(lambda: 99 in blocks(client), message="the marker batch")
        assert blocks(client) == {21, 22, 99} and blocks(client, "CPU") == {21}
        text = await asyncio.to_thread(worker_metrics, metrics_port)
        for series, value in (('worker_skipped_events_total{reason="tier"}', 4),
                              ('worker_skipped_tier_events_total{medium="STORAGE"}', 3),
                              ('worker_skipped_tier_events_total{medium="other"}', 1),
                              ('worker_skipped_tier_events_total{medium="CPU"}', 0),
                              ('worker_tier_events_total{medium="CPU"}', 3),
                              ('worker_tier_events_total{medium="GPU"}', 2),
                              ('worker_skipped_events_total{reason="block_size"}', 1),
                              ("worker_unknown_removals_total", 1),
                              ("worker_resident_cpu_blocks", 1)):
            assert f"{series} {float(value)}" in text, (series, text)
    finally:
        stop_process(worker)


def first_entry(client: redis.Redis) -> tuple[bytes, set[int]]:
    """``cleared`` flag and stored keys of the first stream entry (a rewrite: both in one),
    waited for: the entry follows the set change."""
    wait_for(lambda: client.xlen(contract.events_key("pr")), 10, message="a stream entry")
    _, fields = client.xrange(contract.events_key("pr"))[0]  # type: ignore[index]
    return fields[b"cleared"], set(contract.unpack_keys(fields[b"stored"]))


def worker_metrics(port: int) -> str:
    return requests.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text


async def store_then_stop_redis(client: redis.Redis, publisher: KVEventPublisher,
                                server: RedisServer) -> int:
    """After the worker's first heartbeat, store keys 1-3 and stop Redis; returns the epoch the
    set had."""
    await until(lambda: epoch(client) > 0, message="first heartbeat")
    await publisher.publish(stored(1, 2, 3))
    await until(lambda: blocks(client) == {1, 2, 3}, message="stored")
    old_epoch = epoch(client)
    server.stop()
    return old_epoch


async def test_redis_outage_rewrites_set_under_new_epoch(
        emulator: Emulator, publisher: KVEventPublisher) -> None:
    server = RedisServer().start()
    client = redis.Redis.from_url(server.url)
    metrics_port = free_port()
    worker = start_worker(emulator, publisher, server.url, metrics_port)

    try:
        old_epoch = await store_then_stop_redis(client, publisher, server)
        await publisher.publish(stored(4, 5))
        await publisher.publish(removed(1))
        await until(lambda: "worker_redis_up 0.0" in worker_metrics(metrics_port),
                    message="write failed")
        server = RedisServer(port=server.port).start()  # an empty Redis on the same port
        client = redis.Redis.from_url(server.url)
        await until(lambda: blocks(client) == {2, 3, 4, 5}, message="rewritten set")
        await until(lambda: epoch(client) > old_epoch, message="epoch bump")
        assert first_entry(client) == (b"1", {2, 3, 4, 5})
    finally:
        output = stop_process(worker)
        server.stop()
    assert "Redis is back" in output
    assert "rewriting the replica's full block set" in output


def snapshot(client: redis.Redis) -> tuple[int, set[int]]:
    """The heartbeat epoch (-1 when the hash is gone) and the block set, read atomically."""
    with client.pipeline(transaction=True) as pipe:
        pipe.hget(contract.replica_key("pr", REPLICA), contract.F_EPOCH)
        pipe.smembers(contract.blocks_key("pr", REPLICA))
        value, members = pipe.execute()
    return (int(value) if value is not None else -1), {contract.unpack_key(m) for m in members}


async def republished(client: redis.Redis, expected: set[int], old_epoch: int,
                      timeout_s: float = 12.0) -> None:
    """Wait until the heartbeat advertises a newer epoch over ``expected``; while waiting, a
    heartbeat hash must never advertise an incomplete set (routers would load it)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    seen: list[tuple[int, int]] = []
    while loop.time() < deadline:
        try:
            got_epoch, got = await asyncio.to_thread(snapshot, client)
        except redis.RedisError:
            got_epoch, got = -2, set()
        if got_epoch >= 0 and got_epoch != old_epoch:
            assert got == expected, f"heartbeat epoch {got_epoch} advertises {got}, not {expected}"
        if got_epoch > old_epoch and got == expected:
            return
        if not seen or seen[-1] != (got_epoch, len(got)):
            seen.append((got_epoch, len(got)))
        await asyncio.sleep(0.02)
    raise TimeoutError(f"set not republished under a new epoch; (epoch, blocks) seen: {seen}")


async def test_redis_restarted_empty_without_traffic_is_republished(
        emulator: Emulator, publisher: KVEventPublisher) -> None:
    """Redis restarts EMPTY while no KV events flow: the failed heartbeat marks the writer
    disconnected and the set comes back under a new epoch with no event to trigger it."""
    server = RedisServer(port=free_port()).start()  # fixed port: restarted on the same one
    client = redis.Redis.from_url(server.url)
    metrics_port = free_port()
    worker = start_worker(emulator, publisher, server.url, metrics_port)

    try:
        old_epoch = await store_then_stop_redis(client, publisher, server)
        await until(lambda: "worker_redis_up 0.0" in worker_metrics(metrics_port), timeout_s=5,
                    message="heartbeat write failed")
        server = RedisServer(port=server.port).start()  # an empty Redis on the same port
        client = redis.Redis.from_url(server.url)
        await republished(client, {1, 2, 3}, old_epoch)
        assert "worker_redis_up 1.0" in await asyncio.to_thread(worker_metrics, metrics_port)
        assert first_entry(client) == (b"1", {1, 2, 3})
    finally:
        output = stop_process(worker)
        server.stop()
    assert "Redis is back; rewriting the replica's full block set" in output


async def test_redis_lost_state_without_error_is_republished(
        emulator: Emulator, publisher: KVEventPublisher) -> None:
    """Redis loses the replica's keys without any failed write (FLUSHALL, a fast restart, a
    failover to an empty replica): the next heartbeat finds its hash gone and re-creates it
    in the same transaction as the full set, under a new epoch."""
    with RedisServer() as server:
        client = redis.Redis.from_url(server.url)
        worker = start_worker(emulator, publisher, server.url)
        try:
            await until(lambda: epoch(client) > 0, message="first heartbeat")
            await publisher.publish(stored(7, 8))
            await until(lambda: blocks(client) == {7, 8}, message="stored")
            old_epoch = epoch(client)
            client.flushall()
            await republished(client, {7, 8}, old_epoch, timeout_s=6.0)
            # once republished the worker settles: no rewrite loop, the epoch stays put
            settled = epoch(client)
            await publisher.publish(stored(9))
            await until(lambda: blocks(client) == {7, 8, 9}, message="stored after rewrite")
            assert epoch(client) == settled
        finally:
            output = stop_process(worker)
    assert "Redis lost the replica's state" in output
    assert output.count("rewriting the replica's full block set") == 1


async def test_sigterm_while_a_batch_waits_in_the_event_window(
        emulator: Emulator, publisher: KVEventPublisher, redis_url: str) -> None:
    """A worker stopped while a batch waits in its (1 s) event window exits 0 without handling
    it; the batch is not lost: the next worker gets it from the engine's replay buffer."""
    client = redis.Redis.from_url(redis_url)
    worker = start_worker(emulator, publisher, redis_url, 0, "--event-window-s", "1")
    try:
        await store_first(client, publisher, 1)
        await asyncio.sleep(1.2)  # that batch's window is over
        await publisher.publish(stored(2))
        await asyncio.sleep(0.1)  # inside the window of batch 2: 0.9 s of it left
        worker.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(worker.wait, 10) == 0
        # a worker that sat out the window would have handled batch 2 and written its stream
        # entry before leaving (the stream outlives the deregistration; the sets do not)
        entries: Any = client.xrange(contract.events_key("pr"))
        assert {k for _, f in entries for k in contract.unpack_keys(f[b"stored"])} == {1}
    finally:
        output = stop_process(worker)
    assert "Traceback" not in output and "ERROR" not in output, output
    worker = start_worker(emulator, publisher, redis_url, 0, "--event-window-s", "1")
    try:
        await until(lambda: blocks(client) == {1, 2}, message="batch 2 replayed")
    finally:
        stop_process(worker)


# -- a rogue or broken publisher on the worker's endpoint ---------------------------------
# A 300 MB message part is refused by libzmq unread (``zmq.MAXMSGSIZE``, derived from the
# engine's KV capacity), a 2,000,000-block batch too, and a well-formed batch of more blocks
# than the engine (4,000 blocks) holds is refused by the worker: the worker's memory stays
# small, nothing of them reaches Redis, each is counted once, the log says so in at most one
# line per interval, and the real events go on being published.

RSS_LIMIT_KB = 200 * 1024


def peak_rss_kb(pid: int) -> int:
    """VmHWM of ``pid``: the most resident memory it ever had, in kB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise RuntimeError("no VmHWM")


def counter(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + " ") or line.startswith(name + "{"))


async def test_rogue_publisher_is_bounded(emulator: Emulator, publisher: KVEventPublisher,
                                          redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    metrics_port = free_port()
    worker = start_worker(emulator, publisher, redis_url, metrics_port)
    try:
        await until(lambda: epoch(client) > 0, message="first heartbeat")

        async def publish_until_resident(key: int) -> None:
            for _ in range(40):  # a dropped connection loses what was sent before it is back
                await publisher.publish(stored(key))
                try:
                    await until(lambda: key in blocks(client), timeout_s=1.0, message="stored")
                    return
                except TimeoutError:
                    continue
            raise TimeoutError(f"block {key} never reached Redis")

        await publish_until_resident(1)
        topic = publisher.topic
        # 1: a 300 MB message part
        await publisher.send_raw([topic, seq_bytes(publisher.next_seq), b"\x00" * 300_000_000])
        await until(lambda: counter(worker_metrics(metrics_port),
                                    "worker_publisher_disconnects_total") >= 1,
                    message="the 300 MB frame refused")
        await publish_until_resident(2)
        # 2: a well-formed 2,000,000-block batch (about 50 MB)
        huge = stored(*range(10_000_000, 12_000_000))
        await publisher.send_raw([topic, seq_bytes(publisher.next_seq), encode_batch(huge)])
        del huge
        await until(lambda: counter(worker_metrics(metrics_port),
                                    "worker_publisher_disconnects_total") >= 2,
                    message="the 2,000,000-block batch refused")
        await publish_until_resident(3)
        # 3: 5,000 blocks, more than the engine's 4,000: small enough to read, impossible
        await publisher.send_raw([topic, seq_bytes(publisher.next_seq),
                                  encode_batch(stored(*range(20_000_000, 20_005_000)))])
        await until(lambda: counter(worker_metrics(metrics_port),
                                    "worker_refused_batches_total") == 1,
                    message="the over-capacity batch refused")
        await publish_until_resident(4)
        assert blocks(client) == {1, 2, 3, 4}  # nothing impossible reached Redis
        text = await asyncio.to_thread(worker_metrics, metrics_port)
        assert counter(text, "worker_refused_batches_total") == 1
        assert counter(text, "worker_publisher_disconnects_total") == 2
        assert peak_rss_kb(worker.pid) < RSS_LIMIT_KB
    finally:
        output = stop_process(worker)
    assert "refusing KV event batch" in output
    assert output.count("KV event publisher at") <= 2, output


async def test_a_message_of_many_small_parts_is_bounded_in_total(
        emulator: Emulator, publisher: KVEventPublisher, redis_url: str) -> None:
    """Issue 29 review: libzmq's ``MAXMSGSIZE`` bounds each frame, and its SUB socket buffers a
    multipart message whole before handing it over, so ``[topic, seq, 300 x 1 MB]`` (each part
    under the worker's 2.4 MB limit) took the worker from 70 to 365 MB. The worker now reads the
    message frame by frame (``worker.zmtp_sub``) and drops the connection once it passes 3
    frames or the byte limit: its peak RSS stays under 200 MB, the refusal is counted once as a
    publisher disconnect, nothing of it reaches Redis, and the real events go on."""
    client = redis.Redis.from_url(redis_url)
    metrics_port = free_port()
    worker = start_worker(emulator, publisher, redis_url, metrics_port)
    try:
        await store_first(client, publisher, 1)
        part = b"\x00" * 1_000_000  # one object sent 300 times: the test's own memory stays small
        await publisher.send_raw([publisher.topic, seq_bytes(publisher.next_seq), *[part] * 300])
        await until(lambda: counter(worker_metrics(metrics_port),
                                    "worker_publisher_disconnects_total") >= 1,
                    message="the 300-part message refused")
        for key in range(2, 40):  # the dropped connection loses what was sent before it is back
            await publisher.publish(stored(key))
            with contextlib.suppress(TimeoutError):
                await until(lambda: key in blocks(client), timeout_s=1.0,  # noqa: B023
                            message="stored")
                break
        assert blocks(client) - {1} and blocks(client) <= set(range(1, 40))
        text = await asyncio.to_thread(worker_metrics, metrics_port)
        assert counter(text, "worker_publisher_disconnects_total") == 1
        peak_kb = peak_rss_kb(worker.pid)
        assert peak_kb < RSS_LIMIT_KB, f"worker peak RSS {peak_kb} kB"
    finally:
        output = stop_process(worker)
    assert output.count("KV event publisher at") == 1, output


async def test_consecutive_refused_batches_use_their_seqs_up(
        emulator: Emulator, publisher: KVEventPublisher, redis_url: str) -> None:
    """Six impossible batches in a row (more blocks than the engine's 4,000; three refused after
    the decode, three of 15,000 blocks by the precheck before it), each in the publisher's replay
    buffer: each is refused and counted once, its seq used up, so the next batch is no gap and
    nothing asks the replay socket to send (and the worker to refuse) them again; the real batch
    after them reaches Redis under the same epoch. (Before the fix: each refusal left a gap, every
    next batch replayed the buffer from the refused seq, and the counter grew quadratically.)"""
    client = redis.Redis.from_url(redis_url)
    metrics_port = free_port()
    worker = start_worker(emulator, publisher, redis_url, metrics_port)
    try:
        await store_first(client, publisher, 1)
        first_epoch = epoch(client)
        replays_before = publisher.num_replay_requests
        num_impossible = 6
        for i in range(num_impossible):
            num_blocks = 5_000 if i % 2 else 15_000  # the first refusal logged: precheck
            start = 20_000_000 + i * 100_000
            await publisher.publish(stored(*range(start, start + num_blocks)))
            await asyncio.sleep(0.1)
        await publisher.publish(stored(2))
        await until(lambda: 2 in blocks(client), message="the real batch after them stored")
        text = await asyncio.to_thread(worker_metrics, metrics_port)
        assert counter(text, "worker_refused_batches_total") == num_impossible
        assert publisher.num_replay_requests == replays_before
        assert blocks(client) == {1, 2}  # nothing of the refused batches reached Redis
        assert epoch(client) == first_epoch  # no resync either
    finally:
        output = stop_process(worker)
    assert "(gap)" not in output, output
    assert "refused before decoding" in output, output  # the precheck path was taken too


async def test_a_batch_beyond_a_large_kv_cache_is_refused_before_it_is_decoded(
        publisher: KVEventPublisher, redis_url: str, tmp_path: Path) -> None:
    """An engine of 500,000 blocks: its MAXMSGSIZE (about 170 MB) admits a 2,000,000-block
    batch (about 42 MB, one id per token); the worker counts the batch's blocks from the msgpack
    headers and refuses it before building its hashes and 32,000,000 token ids (decoded whole
    first, the worker peaked at 440 MB): peak RSS stays under 200 MB, the refusal is counted once,
    nothing of it reaches Redis, the real events go on."""
    emu = start_emulator(tmp_path, num_gpu_blocks=500_000)
    client = redis.Redis.from_url(redis_url)
    metrics_port = free_port()
    worker = start_worker(emu, publisher, redis_url, metrics_port)
    try:
        await store_first(client, publisher, 1)
        num_blocks = 2_000_000
        token_ids = msgspec.Raw(b"\xdd" + (16 * num_blocks).to_bytes(4, "big") + b"\x01" * 16 * num_blocks)
        huge = KVEventBatch(ts=0.0, events=[BlockStored(
            block_hashes=list(range(10_000_000, 10_000_000 + num_blocks)), parent_block_hash=None,
            token_ids=token_ids, block_size=16, lora_id=None, medium="GPU",  # type: ignore[arg-type]
            lora_name=None)], data_parallel_rank=0)
        payload = encode_batch(huge)
        del huge, token_ids
        await publisher.send_raw([publisher.topic, seq_bytes(publisher.next_seq), payload])
        del payload
        await until(lambda: counter(worker_metrics(metrics_port),
                                    "worker_refused_batches_total") >= 1, timeout_s=60,
                    message="the 2,000,000-block batch refused")
        # the next batch shows a gap (the refused seq is lost): replayed or resynced, then stored
        await publisher.publish(stored(2))
        await until(lambda: 2 in blocks(client), message="the next real batch stored")
        assert blocks(client) <= {1, 2}  # nothing of the refused batch reached Redis
        text = await asyncio.to_thread(worker_metrics, metrics_port)
        assert counter(text, "worker_refused_batches_total") == 1
        assert counter(text, "worker_publisher_disconnects_total") == 0  # under MAXMSGSIZE
        peak_kb = peak_rss_kb(worker.pid)  # 152 MB measured; 440 MB decoding it whole
        assert peak_kb < RSS_LIMIT_KB, f"worker peak RSS {peak_kb} kB"
    finally:
        output = stop_process(worker)
        stop_process(emu.proc)
    assert "refused before decoding" in output, output


async def test_sigterm_deregisters_the_replica(
        emulator: Emulator, publisher: KVEventPublisher, redis_url: str) -> None:
    """A stopped worker deletes its heartbeat and block sets (routers take the replica out at
    their next refresh, not after the heartbeat's TTL) and says so; a worker started again
    begins afresh and rebuilds the set from the engine's replay buffer."""
    client = redis.Redis.from_url(redis_url)
    worker = start_worker(emulator, publisher, redis_url)
    try:
        await store_first(client, publisher, 1, 2)
        worker.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(worker.wait, 15) == 0
        assert not client.exists(contract.replica_key("pr", REPLICA),
                                 contract.blocks_key("pr", REPLICA))
    finally:
        output = stop_process(worker)
    assert f"deregistered replica {REPLICA}" in output, output
    worker = start_worker(emulator, publisher, redis_url)
    try:
        await until(lambda: blocks(client) == {1, 2}, message="rebuilt from the replay buffer")
    finally:
        output = stop_process(worker)
    assert f"no previous state for replica {REPLICA}" in output, output


async def test_a_gone_replicas_block_sets_expire(
        emulator: Emulator, publisher: KVEventPublisher, redis_url: str) -> None:
    """A worker killed without a word (a scaled-down pod): its heartbeat expires after its TTL
    and its block sets ``state_ttl_s`` after the last heartbeat; nothing of it stays in Redis."""
    client = redis.Redis.from_url(redis_url)
    worker = start_worker(emulator, publisher, redis_url, 0, "--state-ttl-s", "10")
    try:
        await store_first(client, publisher, 5)
        ttl_ms = client.pttl(contract.blocks_key("pr", REPLICA))
        assert 0 < ttl_ms <= 10_000  # type: ignore[operator]
        worker.kill()
        await asyncio.to_thread(worker.wait, 10)
        await until(lambda: not client.exists(contract.blocks_key("pr", REPLICA)), 30,
                    message="the block set expired")
        assert not client.exists(contract.replica_key("pr", REPLICA))
    finally:
        stop_process(worker)


async def test_a_reset_batched_with_the_next_stores_is_applied_on_a_full_cache(
        emulator: Emulator, publisher: KVEventPublisher, redis_url: str) -> None:
    """vLLM publishes ``/reset_prefix_cache``'s ``AllBlocksCleared`` with the next step's batch,
    before its stores. With the engine's 4,000 blocks all resident, such a batch leaves 3 blocks,
    not 4,003: the capacity check must not refuse it (it did: the set kept the 4,000 old keys and
    never followed the reset, seen against the real vLLM CPU engine)."""
    client = redis.Redis.from_url(redis_url)
    metrics_port = free_port()
    worker = start_worker(emulator, publisher, redis_url, metrics_port)
    try:
        await store_first(client, publisher, *range(1, 4_001))
        cleared_and_stored = stored(50_001, 50_002, 50_003)
        cleared_and_stored.events.insert(0, AllBlocksCleared())
        await publisher.publish(cleared_and_stored)
        await until(lambda: blocks(client) == {50_001, 50_002, 50_003},
                    message="the reset and the stores after it applied")
        text = await asyncio.to_thread(worker_metrics, metrics_port)
        assert counter(text, "worker_refused_batches_total") == 0
    finally:
        stop_process(worker)
