"""Benchmark of the worker sidecar: block keys ingested per second into Redis, and Redis memory per block.

``python -m loadtest.bench.worker [--keys 1000000] [--min-batch 32] [--max-batch 512]
[--evict-beyond N] [--vocab N] [--batch-interval-ms MS] [--worker-arg=ARG ...]``

Starts a local Redis, one emulator replica (the worker's engine for heartbeat
and probe) and a real ``prefix-worker report`` process whose KV events come
from a fast vLLM-format ZMQ publisher in this process: BlockStored batches of
random 64-bit hashes, sizes uniform in [min, max] blocks, plus one BlockRemoved
of a few earlier keys every tenth batch; or, with ``--evict-beyond N``, the shape of a loaded
replica: once N blocks are resident each batch also evicts its oldest blocks, one
``BlockRemoved`` per block as vLLM publishes them (``_maybe_evict_cached_block``).
``--batch-interval-ms`` paces the batches (a loaded engine publishes one per scheduler step)
and ``--worker-arg`` passes a worker flag (e.g. ``--event-window-s``) for an A/B.
Reports keys/s from the first publish until Redis holds the last batch's seq, the worker's
CPU seconds (and per batch), and Redis memory per resident block (INFO memory, plus MEMORY USAGE of the set and stream),
also per engine block (with ``--index-stride`` N > 1 only anchor keys are written).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import redis

from loadtest.harness.kv_publisher import KVEventPublisher
from loadtest.harness.processes import (
    PYTHON,
    ProcessExited,
    cpu_seconds,
    output,
    start_emulator,
    start_process,
    stop_process,
)
from loadtest.harness.redis_server import RedisServer
from router.shared import contract
from router.shared.kv_events import BlockRemoved, BlockStored, KVEventBatch, encode_batch

REPLICA = "bench-0"


def _payloads(num_keys: int, lo: int, hi: int, rng: random.Random,
              evict_beyond: int = 0, vocab: int = 0) -> tuple[list[bytes], int, int]:
    """Pre-encoded batches; returns (payloads, keys stored, keys resident at the end).
    ``evict_beyond`` > 0: evict the oldest blocks past that many, one event per block.
    ``vocab`` > 0: token ids drawn from ``range(vocab)`` (0: every id 7)."""
    payloads: list[bytes] = []
    resident: list[int | bytes] = []
    total = 0
    while total < num_keys:
        n = min(rng.randint(lo, hi), num_keys - total)
        hashes: list[int | bytes] = [rng.getrandbits(64) for _ in range(n)]
        events: list[Any] = [BlockStored(block_hashes=hashes, parent_block_hash=None,
                                         token_ids=([rng.randrange(vocab) for _ in range(16 * n)]
                                                    if vocab else [7] * (16 * n)),
                                         block_size=16, lora_id=None,
                                         medium="GPU", lora_name=None, extra_keys=[None] * n)]
        resident.extend(hashes)
        total += n
        if evict_beyond:
            num_evicted = max(0, len(resident) - evict_beyond)
            events.extend(BlockRemoved(block_hashes=[h], medium="GPU")
                          for h in resident[:num_evicted])
            del resident[:num_evicted]
        elif len(payloads) % 10 == 9 and len(resident) > 64:
            gone = [resident.pop(rng.randrange(len(resident))) for _ in range(16)]
            events.append(BlockRemoved(block_hashes=gone, medium="GPU"))
        payloads.append(encode_batch(KVEventBatch(ts=time.time(), events=events, data_parallel_rank=0)))
    return payloads, total, len(set(resident))


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    payloads, num_keys, num_resident = _payloads(args.keys, args.min_batch, args.max_batch, rng,
                                                 args.evict_beyond, args.vocab)
    with RedisServer() as server, tempfile.TemporaryDirectory() as tmp:
        client = redis.Redis.from_url(server.url)
        emu, replicas = start_emulator(Path(tmp) / "ready.json")
        worker = None
        try:
            url = replicas[0]["url"]
            async with KVEventPublisher() as pub:
                worker = start_process([PYTHON, "-m", "worker.cli", "report", "--engine-url", url,
                                        "--kv-events-endpoint", pub.endpoint,
                                        "--kv-replay-endpoint", pub.replay_endpoint,
                                        "--redis-url", server.url, "--replica-id", REPLICA,
                                        "--index-stride", str(args.index_stride),
                                        "--log-level", "warning", *args.worker_arg])
                key = contract.replica_key("pr", REPLICA)
                await _await_subscribed(client, key, worker, pub)
                mem_before = int(client.info("memory")["used_memory"])
                cpu_before = cpu_seconds(worker.pid)
                publish_s, elapsed = await _publish_until_applied(
                    client, key, worker, pub, payloads, args.batch_interval_ms / 1000)
                cpu = cpu_seconds(worker.pid) - cpu_before
                mem_after = int(client.info("memory")["used_memory"])
                set_bytes = int(client.memory_usage(contract.blocks_key("pr", REPLICA), samples=0) or 0)
                stream_bytes = int(client.memory_usage(contract.events_key("pr"), samples=0) or 0)
                resident = int(client.scard(contract.blocks_key("pr", REPLICA)))
        finally:
            if worker is not None:
                stop_process(worker)
            stop_process(emu)
    return {
        "batches": len(payloads),
        "keys_stored": num_keys,
        "keys_resident_expected": num_resident,
        "keys_resident_in_redis": resident,
        "publish_s": round(publish_s, 3),
        "elapsed_s": round(elapsed, 3),
        "keys_per_s": round(num_keys / elapsed),
        "worker_cpu_s": round(cpu, 3),
        "worker_cpu_us_per_batch": round(cpu / len(payloads) * 1e6, 1),
        "batch_interval_ms": args.batch_interval_ms,
        "keys_per_worker_cpu_s": round(num_keys / cpu) if cpu else None,
        "index_stride": args.index_stride,
        "evict_beyond": args.evict_beyond,
        "redis_bytes_per_engine_block_info": round((mem_after - mem_before) / num_resident, 1),
        "redis_bytes_per_resident_block_info": round((mem_after - mem_before) / resident, 1),
        "redis_set_bytes_per_block": round(set_bytes / resident, 1),
        "redis_stream_bytes_per_block": round(stream_bytes / resident, 1),
    }


async def _await_subscribed(client: redis.Redis, key: str, worker: subprocess.Popen[bytes],
                            pub: KVEventPublisher) -> None:
    """Wait (up to 30 s) for the worker's heartbeat at ``key``, then until it has applied a
    batch: empty ones are published until it has (ZMQ's slow joiner drops the first)."""
    deadline = time.monotonic() + 30
    while not client.exists(key):
        _check_running(worker)
        if time.monotonic() > deadline:
            raise TimeoutError("worker heartbeat")
        await asyncio.sleep(0.05)
    # Warm-up batch so the subscription is live (ZMQ slow joiner).
    await pub.publish(KVEventBatch(ts=time.time(), events=[], data_parallel_rank=0))
    while client.hget(key, contract.F_SEQ) in (None, b"-1"):
        _check_running(worker)
        await pub.publish(KVEventBatch(ts=time.time(), events=[], data_parallel_rank=0))
        await asyncio.sleep(0.05)


async def _publish_until_applied(client: redis.Redis, key: str, worker: subprocess.Popen[bytes],
                                 pub: KVEventPublisher, payloads: list[bytes],
                                 interval_s: float) -> tuple[float, float]:
    """Publish ``payloads`` (one every ``interval_s``, or as fast as possible for 0) and wait
    until the worker has applied the last: seconds to publish, seconds until applied."""
    start = time.perf_counter()
    for i, payload in enumerate(payloads):
        if interval_s:
            # paced like an engine publishing one batch per scheduler step
            await asyncio.sleep(max(0.0, start + i * interval_s - time.perf_counter()))
        await pub.publish(payload)
    publish_s = time.perf_counter() - start
    last = str(pub.next_seq - 1).encode()
    while True:
        if client.hget(key, contract.F_SEQ) == last:
            break
        _check_running(worker)
        await asyncio.sleep(0.005)
    return publish_s, time.perf_counter() - start


def _check_running(worker: subprocess.Popen[bytes]) -> None:
    """Raises ``ProcessExited`` with the worker's last output line (a bad ``--worker-arg`` is
    its one-line config error) once it has exited: the waits would otherwise never end."""
    if worker.poll() is not None:
        lines = output(worker).strip().splitlines()
        raise ProcessExited(f"the worker exited with status {worker.returncode}"
                            + (f": {lines[-1]}" if lines else ""))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.bench.worker", description=__doc__)
    parser.add_argument("--keys", type=int, default=1_000_000, help="block keys to store")
    parser.add_argument("--min-batch", type=int, default=32, help="blocks per BlockStored, min")
    parser.add_argument("--max-batch", type=int, default=512, help="blocks per BlockStored, max")
    parser.add_argument("--evict-beyond", type=int, default=0,
                        help="resident blocks past which each batch evicts its oldest, one "
                             "BlockRemoved per block (0: a few removals every tenth batch)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab", type=int, default=0,
                        help="draw token ids from this many (e.g. 151000, most then take 5 bytes "
                             "and a Python int each when decoded); 0: every id 7, as before")
    parser.add_argument("--batch-interval-ms", type=float, default=0.0,
                        help="publish one batch every this many ms (0: as fast as possible); a "
                             "loaded engine publishes one batch per scheduler step, tens of ms apart")
    parser.add_argument("--worker-arg", action="append", default=[],
                        help="extra argument for the worker (repeatable; A/B of worker settings)")
    parser.add_argument("--index-stride", type=int, default=contract.DEFAULT_INDEX_STRIDE,
                        help="the worker's coarse-index stride (1 = every key)")
    args = parser.parse_args(argv)
    if args.keys < 1 or args.min_batch < 1 or args.max_batch < args.min_batch:
        # 0-block batches never reach --keys: the payloads would grow without end
        parser.error(f"need --keys >= 1 and 1 <= --min-batch <= --max-batch, got {args.keys}, "
                     f"{args.min_batch}, {args.max_batch}")
    if not (math.isfinite(args.batch_interval_ms) and args.batch_interval_ms >= 0):
        parser.error(f"--batch-interval-ms must be a number >= 0, got {args.batch_interval_ms}")
    try:
        result = asyncio.run(_run(args))
    except ProcessExited as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
