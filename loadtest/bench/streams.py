"""Stream-layout benchmark: the CPU a router spends following the fleet's change entries with
ONE shared stream (contract version 3, as before it) versus one stream per replica, on one Redis
and on a 3-master Redis Cluster. Does I/O (real ``redis-server`` processes).

``python -m loadtest.bench.streams [--replicas 64] [--rate 1000] [--seconds 5]``

A writer process pours ``--rate`` flushes/s (each entry: ``--keys`` packed 8-byte keys stored
and as many removed, from a replica chosen uniformly) into the layout's stream(s), through the
layout's topology client. The reader (this process) follows them the way
``router.edges.fleet_sync.FleetReader`` does: ``XREAD BLOCK`` with ``COUNT 1000``, the packed keys
unpacked, and a ``STREAM_READ_INTERVAL_S`` pause after a read that returned less than a full
batch. Per-replica streams on one server: one ``XREAD BLOCK`` naming every stream. On a
cluster a multi-key ``XREAD`` must stay in one hash slot (CROSSSLOT otherwise), so per-replica
streams cost one non-blocking ``XREAD`` per stream per read, in one cluster pipeline, with the
same pause between reads. Reported per (topology, layout): the reader's CPU seconds per wall
second (share of one core), entries read and the index lag (entry id time to read time, median
and p99). Figures, not pass/fail; on a busy 2-core machine Redis, the writer and the reader
share the cores.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import random
import statistics
import time
from typing import Any

from loadtest.harness.redis_server import RedisServer
from loadtest.harness.redis_topology import RedisClusterServers
from router.edges.fleet_sync import STREAM_READ_INTERVAL_S
from router.shared import contract as c
from router.shared.redis_client import redis_client

COUNT = 1000  # entries per XREAD, as FleetReader
BLOCK_MS = 250  # FleetReader: HEARTBEAT_INTERVAL_S / 4


def _stream(layout: str, rid: str) -> str:
    return c.events_key("pr") if layout == "shared" else f"pr:{{{rid}}}:events"


def pour(url: str, layout: str, rids: list[str], rate: float, seconds: float, keys: int,
         out: Any) -> None:
    """Writer process: ``rate`` entries/s for ``seconds``; puts the number written on ``out``."""

    async def run() -> int:
        client = redis_client(url, None, socket_timeout=5.0)
        rng = random.Random(1)
        written, tick, start = 0, 0, time.monotonic()
        try:
            while time.monotonic() - start < seconds:
                tick += 1
                due = int(rate * tick * 0.01) - written
                pipe = client.pipeline(transaction=False)
                for _ in range(due):
                    rid = rids[rng.randrange(len(rids))]
                    pipe.xadd(_stream(layout, rid), {
                        c.E_REPLICA: rid, c.E_EPOCH: 1, c.E_ENTRY_SEQ: written,
                        c.E_CLEARED: "0", c.E_STORED: os.urandom(8 * keys),
                        c.E_REMOVED: os.urandom(8 * keys)}, maxlen=c.EVENTS_STREAM_MAXLEN,
                        approximate=True)
                if due:
                    await pipe.execute()
                written += due
                pause = start + tick * 0.01 - time.monotonic()
                if pause > 0:
                    await asyncio.sleep(pause)
        finally:
            await client.aclose()
        return written

    out.put(asyncio.run(run()))


def _entries(reply: Any, positions: dict[str, Any], lags: list[float], now: float) -> int:
    """Unpack a reply's entries (as FleetReader does), advance ``positions``; returns the count."""
    n = 0
    for name, entries in reply or ():
        for _, fields in entries:
            c.unpack_keys(fields[b"stored"])
            c.unpack_keys(fields[b"removed"])
            n += 1
        if entries:
            last = entries[-1][0]
            positions[name.decode() if isinstance(name, bytes) else name] = last
            lags.append(now - int(last.split(b"-", 1)[0]) / 1000.0)
    return n


async def follow(url: str, layout: str, cluster: bool, rids: list[str], stop_at: float,
                 lags: list[float]) -> int:
    """The reader: follow until ``stop_at`` (monotonic); returns entries read."""
    client = redis_client(url, None, socket_timeout=5.0)
    streams = sorted({_stream(layout, rid) for rid in rids})
    positions: dict[str, Any] = dict.fromkeys(streams, "$")
    try:
        for name in streams:  # "$" once per stream: the position is its last id from now on
            last = await client.xrevrange(name, count=1)
            positions[name] = last[0][0] if last else "0-0"
        read = 0
        while time.monotonic() < stop_at:
            if cluster and len(streams) > 1:
                pipe = client.pipeline(transaction=False)
                for name in streams:
                    pipe.xread({name: positions[name]}, count=COUNT)
                replies = await pipe.execute()
                reply = [item for r in replies for item in (r or ())]
                got = _entries(reply, positions, lags, time.time())
                await asyncio.sleep(STREAM_READ_INTERVAL_S)
            else:
                reply = await client.xread(positions, count=COUNT, block=BLOCK_MS)
                got = _entries(reply, positions, lags, time.time())
                if 0 < got < COUNT:
                    await asyncio.sleep(STREAM_READ_INTERVAL_S)
            read += got
        return read
    finally:
        await client.aclose()


def run_one(url: str, topology: str, layout: str, args: argparse.Namespace) -> dict[str, Any]:
    rids = [f"replica-{i}" for i in range(args.replicas)]
    queue: Any = mp.get_context("spawn").Queue()
    writer = mp.get_context("spawn").Process(target=pour, args=(
        url, layout, rids, args.rate, args.seconds, args.keys, queue))
    lags: list[float] = []
    cpu0, wall0 = time.process_time(), time.monotonic()
    writer.start()
    read = asyncio.run(follow(url, layout, topology == "cluster", rids,
                              time.monotonic() + args.seconds + 1.0, lags))
    cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
    written = queue.get(timeout=30)
    writer.join(30)
    lags.sort()
    return {"topology": topology, "layout": layout, "replicas": args.replicas,
            "written": written, "read": read, "reader_cores": round(cpu / wall, 3),
            "reader_us_per_entry": round(cpu / max(read, 1) * 1e6, 1),
            "lag_ms_p50": round(statistics.median(lags) * 1e3, 1) if lags else None,
            "lag_ms_p99": round(lags[int(len(lags) * 0.99)] * 1e3, 1) if lags else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=64)
    parser.add_argument("--rate", type=float, default=1000.0, help="fleet-wide flushes/s")
    parser.add_argument("--keys", type=int, default=32, help="keys stored (and removed) per entry")
    parser.add_argument("--seconds", type=float, default=5.0)
    args = parser.parse_args()
    print(f"{args.replicas} replicas, {args.rate:g} flushes/s, {args.keys} keys stored + "
          f"{args.keys} removed per entry, {args.seconds:g} s per run")
    print(f"{'topology':>8} {'layout':>12} {'written':>8} {'read':>8} {'cores':>6} "
          f"{'us/entry':>9} {'lag p50':>8} {'lag p99':>8}")
    for topology in ("single", "cluster"):
        server: Any = RedisServer() if topology == "single" else RedisClusterServers(3)
        with server:
            for layout in ("shared", "per-replica"):
                r = run_one(server.url, topology, layout, args)
                print(f"{r['topology']:>8} {r['layout']:>12} {r['written']:>8} {r['read']:>8} "
                      f"{r['reader_cores']:>6} {r['reader_us_per_entry']:>9} "
                      f"{r['lag_ms_p50']!s:>8} {r['lag_ms_p99']!s:>8}", flush=True)


if __name__ == "__main__":
    main()
