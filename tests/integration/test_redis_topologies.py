"""The router and workers against a real Redis Cluster (3 masters, with or without a replica
each) and a real Sentinel set (a master, a replica, 3 sentinels) on loopback, through the
``redis+cluster://`` and ``redis+sentinel://`` URLs.

Sentinel and Cluster: routing hits survive a master failover during traffic with zero failed
requests, whether the failover is asked for or the master is killed (SIGKILL) (on the cluster: the master of the shared stream ``pr:events``, then the master of a
worker's keys); a master killed long enough to lose a worker's heartbeat, with the router's
reads riding out the outage, leaves the replica in the router until its worker re-registers.
Cluster (contract version 3): a replica's keys share the hash tag ``{r}`` (one slot, checked
with ``CLUSTER KEYSLOT``), workers and routers run unchanged on it, and a router following many
replicas whose keys spread over the three masters, started in the middle of their traffic,
holds only whole flushes and repairs a missing stream entry (``entry_seq`` gap) by reloading
that replica's set.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import random
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from loadtest.harness.redis_topology import (
    NODE_TIMEOUT_MS,
    NUM_SLOTS,
    RedisClusterServers,
    RedisSentinelSet,
)
from router.shared import contract as c
from router.shared.redis_client import redis_client
from tests.helpers import stop_process, wait_for, wait_routable
from tests.integration.test_router_failover import _emulated_fleet
from tests.integration.test_router_fleet import Router, prometheus_value
from worker.redis_writer import RedisWriter
from worker.replica_store import _FLUSH
from worker.replica_view import Change

pytestmark = pytest.mark.timeout(180)


def confirmed_hit(router: Router, prompt: list[int], blocks: int = 8) -> bool:
    # a 160-token prompt has 9 full blocks before its last token; the default coarse index
    # (stride 16) holds the anchors at positions 0, 1, 3 and 7 of them: a confirmed depth of 8
    decision = json.loads(router.post("/debug/route", {"prompt": prompt})[2])
    return any(v["confirmed_hit_blocks"] >= blocks for v in decision["replicas"].values())


def test_cluster_fixture_spreads_slots_over_three_masters() -> None:
    with RedisClusterServers(3) as cluster:
        async def check() -> tuple[list[Any], list[bytes | None]]:
            client = redis_client(cluster.url, None, socket_timeout=5.0)
            try:
                slots = await client.cluster_slots()
                keys = [f"k{i}" for i in range(30)]  # spread over the masters
                for key in keys:
                    await client.set(key, key)
                return slots, [await client.get(k) for k in keys]
            finally:
                await client.aclose()

        slots, values = asyncio.run(check())
    ranges = sorted(slots)
    assert len(ranges) == 3 and ranges[0][0] == 0 and ranges[-1][1] == NUM_SLOTS - 1
    assert values == [f"k{i}".encode() for i in range(30)]


def test_routing_hits_on_a_redis_cluster(tmp_path: Path) -> None:
    procs: list[Any] = []
    router = None
    with RedisClusterServers(3) as cluster:
        try:
            procs = _emulated_fleet(cluster.url, tmp_path, 2)
            router = Router(tmp_path, ["--redis-url", cluster.url, "--hash-seed", "0"])
            workers = procs[1:]
            wait_routable(router, len(workers), workers)
            # contract version 2 exited here: its start-up read and every flush spanned slots
            assert all(w.poll() is None for w in workers), "a worker exited"
            prompt = [random.Random(3).randrange(1000, 90_000) for _ in range(160)]
            assert router.post("/v1/completions", {"prompt": prompt, "max_tokens": 1})[0] == 200
            wait_for(lambda: confirmed_hit(router, prompt), 15, message="KV events reach the index")
        finally:
            if router is not None:
                router.stop()
            logs = "".join(stop_process(p) for p in reversed(procs))
            print(logs[-3000:])



def test_a_router_and_workers_started_before_the_cluster_connect_once_it_is_up(
        tmp_path: Path) -> None:
    """No cluster seed answers at start (a rolling restart of everything, or the cluster still
    coming up): redis-py raises ``RedisClusterException``, which is not a ``RedisError``. The
    router's stream reader must keep retrying rather than die (the router then never connected),
    and the workers must wait for Redis rather than exit."""
    procs: list[Any] = []
    router = None
    cluster = RedisClusterServers(3)  # ports chosen, nothing listening yet
    try:
        procs = _emulated_fleet(cluster.url, tmp_path, 2)
        router = Router(tmp_path, ["--redis-url", cluster.url, "--hash-seed", "0"])
        time.sleep(3.0)  # several connection attempts of router and workers fail
        workers = procs[1:]
        assert all(w.poll() is None for w in workers), "a worker exited while the cluster was down"
        assert router.ready()["redis"]["connected"] is False
        with cluster:
            wait_for(lambda: router.ready()["redis"]["connected"], 30,
                     message="the router connects once the cluster is up")
            wait_routable(router, len(workers), workers)
            assert all(w.poll() is None for w in workers), "a worker exited"
            prompt = [random.Random(4).randrange(1000, 90_000) for _ in range(160)]
            send_and_confirm(router, [prompt], "KV events reach the index")
    finally:
        if router is not None:
            print(router.stop()[-3000:])
        logs = "".join(stop_process(p) for p in reversed(procs))
        print(logs[-3000:])

K = 5  # keys stored (and, from the 4th flush on, removed) per flush
NUM_REPLICAS = 16
KEPT_FLUSHES = 3  # a replica holds the keys of its last 3 flushes: 15


def _flush_keys(replica: int, flush: int) -> list[int]:
    return [(replica << 32) | (flush * K + j) for j in range(K)]


def test_a_replicas_keys_hash_to_one_slot_on_a_real_cluster() -> None:
    rids = [f"replica-{i}" for i in range(NUM_REPLICAS)] + ["10.0.0.5:8000", "a}b", "{x}y", "ü"]
    with RedisClusterServers(3) as cluster:
        async def check() -> tuple[list[int], list[int], set[str]]:
            client = redis_client(cluster.url, None, socket_timeout=5.0)
            try:
                slots, owners = [], set()
                for rid in rids:
                    keys = [c.replica_key("pr", rid), c.blocks_key("pr", rid)]
                    found = {int(await client.cluster_keyslot(k)) for k in keys}
                    assert len(found) == 1, (rid, keys, found)
                    slots.append(found.pop())
                    owners.add(client.get_node_from_key(keys[0]).name)
                ours = [c.key_slot(c.blocks_key("pr", rid)) for rid in rids]
                return slots, ours, owners
            finally:
                await client.aclose()

        slots, ours, owners = asyncio.run(check())
    assert slots == ours  # router.shared.contract.key_slot is CLUSTER KEYSLOT
    assert len(owners) == 3  # 16 replicas' keys spread over every master


def test_a_router_following_many_replicas_on_a_cluster_holds_whole_flushes(
        tmp_path: Path) -> None:
    """16 replicas (the worker's own RedisWriter, in this process) flush K keys at a time on a
    3-master cluster; a router started in the middle of their traffic must only ever hold a
    multiple of K keys per replica (whole flushes), and end with exactly each replica's set,
    although one flush's stream entry never reached the stream (its XADD "failed" after its
    script: the router must see the entry_seq gap and reload that replica)."""
    with RedisClusterServers(3) as cluster:
        router: Router | None = None
        samples: list[dict[str, int]] = []

        async def scenario() -> dict[str, int]:
            nonlocal router
            client = redis_client(cluster.url, None, socket_timeout=5.0)
            rids = [f"replica-{i}" for i in range(NUM_REPLICAS)]
            writers = {rid: RedisWriter(client, "pr", rid,
                                        on_recovered=lambda: Change(c.OP_CLEARED, [], 1, 0))
                       for rid in rids}
            flush_script = client.register_script(_FLUSH)

            async def heartbeats() -> None:
                while True:
                    for rid, writer in writers.items():
                        await writer.write_heartbeat({
                            c.F_REPLICA_ID: rid, c.F_URL: "http://127.0.0.1:9",
                            c.F_MODELS: '["m"]', c.F_CONTRACT: c.CONTRACT_VERSION,
                            c.F_INDEX_STRIDE: 1, c.F_HEARTBEAT_TS: time.time()}, 30.0)
                    await asyncio.sleep(0.5)

            async def sample() -> None:
                assert router is not None
                ready = await asyncio.to_thread(router.ready)
                samples.append({r["replica_id"]: r["index_blocks"] for r in ready["replicas"]})

            beating: asyncio.Task[None] | None = None
            try:
                for writer in writers.values():
                    await writer.read_state()
                    writer.enqueue(Change(c.OP_CLEARED, [], 1, 0))
                    await writer.flush()
                beating = asyncio.create_task(heartbeats())
                for flush in range(1, 31):
                    for i, (rid, writer) in enumerate(writers.items()):
                        writer.enqueue(Change(c.OP_STORED, _flush_keys(i, flush), 1, flush))
                        if flush > KEPT_FLUSHES:
                            writer.enqueue(Change(c.OP_REMOVED,
                                                  _flush_keys(i, flush - KEPT_FLUSHES), 1, flush))
                        if (rid, flush) == ("replica-3", 15):
                            # the set change and entry_seq commit, the stream entry is lost
                            writer.entry_seq += 1
                            await flush_script(
                                keys=[writer.blocks_key, writer.replica_key,
                                      writer.cpu_blocks_key],
                                args=[1, flush, "0", c.pack_keys(_flush_keys(i, flush)),
                                      c.pack_keys(_flush_keys(i, flush - KEPT_FLUSHES)),
                                      writer.entry_seq, "", b"", b"", writer.state_ttl_ms])
                            writer._pending.clear()
                        else:
                            await writer.flush()
                    if flush == 5:  # a new router starts in the middle of the traffic
                        router = await asyncio.to_thread(
                            Router, tmp_path, ["--redis-url", cluster.url, "--index-stride", "1"])
                    if router is not None:
                        await sample()
                    await asyncio.sleep(0.05)
                assert router is not None
                deadline = time.monotonic() + 20
                while time.monotonic() < deadline:
                    await sample()
                    if samples[-1] == dict.fromkeys(rids, K * KEPT_FLUSHES):
                        break
                    await asyncio.sleep(0.1)
                return samples[-1]
            finally:
                if beating is not None:
                    beating.cancel()
                await client.aclose()

        try:
            final = asyncio.run(scenario())
            assert router is not None
            assert len(samples) > 20
            assert all(n % K == 0 for s in samples for n in s.values()), samples
            assert final == {f"replica-{i}": K * KEPT_FLUSHES for i in range(NUM_REPLICAS)}
            assert prometheus_value(router.metrics(), "router_event_stream_gaps_total") == 1
        finally:
            if router is not None:
                print(router.stop()[-3000:])


def send_and_confirm(router: Router, prompts: list[list[int]], message: str) -> None:
    """Send each prompt once (answered 200), then wait until each is a confirmed hit."""
    for p in prompts:
        assert router.post("/v1/completions", {"prompt": p, "max_tokens": 1})[0] == 200
    for p in prompts:
        wait_for(functools.partial(confirmed_hit, router, p), 30, message=message)


@contextlib.contextmanager
def steady_traffic(router: Router, prompts: list[list[int]]) -> Iterator[list[int]]:
    """Send ``prompts`` in turn from a thread until the block exits; yields the statuses."""
    statuses: list[int] = []
    stop = threading.Event()

    def traffic() -> None:
        i = 0
        while not stop.is_set():
            body = {"prompt": prompts[i % len(prompts)], "max_tokens": 1}
            statuses.append(router.post("/v1/completions", body)[0])
            i += 1

    thread = threading.Thread(target=traffic)
    thread.start()
    try:
        yield statuses
    finally:
        stop.set()
        thread.join(30)


@pytest.mark.parametrize("kill", [False, True], ids=["manual", "master-killed"])
def test_routing_hits_survive_a_sentinel_failover_with_no_failed_request(
        tmp_path: Path, kill: bool) -> None:
    procs: list[Any] = []
    router = None
    with RedisSentinelSet() as sentinels:
        try:
            procs = _emulated_fleet(sentinels.url, tmp_path, 2)
            router = Router(tmp_path, ["--redis-url", sentinels.url, "--hash-seed", "0"])
            wait_routable(router, 2, procs)
            rng = random.Random(11)
            prompts = [[rng.randrange(1000, 90_000) for _ in range(160)] for _ in range(6)]
            send_and_confirm(router, prompts[:3], "hits before failover")
            old_master = sentinels.master_port()
            # traffic throughout the failover: every request must succeed
            with steady_traffic(router, prompts[:3]) as statuses:
                new_master = sentinels.failover(30.0, kill=kill)
                # the workers write to the new master: new prompts become hits through it
                send_and_confirm(router, prompts[3:], "hits after failover")
            assert new_master != old_master
            assert statuses and set(statuses) == {200}, statuses
            # prompts sent before the failover still hit where they were cached
            for p in prompts[:3]:
                assert confirmed_hit(router, p)
            assert router.ready()["redis"]["connected"] is True
        finally:
            if router is not None:
                print(router.stop()[-3000:])
            for proc in reversed(procs):
                stop_process(proc)


@contextlib.contextmanager
def failover_fleet(tmp_path: Path, node_timeout_ms: int = NODE_TIMEOUT_MS,
                   ) -> Iterator[tuple[RedisClusterServers, Router, list[Any]]]:
    """3 masters with a replica each, an emulated fleet of 2 workers on them and a router, all
    routable: ``(cluster, router, [emulator, worker 0, worker 1])``. Stopped when the block
    exits, the ends of their logs printed."""
    procs: list[Any] = []
    router = None
    with RedisClusterServers(3, replicas_per_master=1, node_timeout_ms=node_timeout_ms) as cluster:
        try:
            procs = _emulated_fleet(cluster.url, tmp_path, 2)
            router = Router(tmp_path, ["--redis-url", cluster.url, "--hash-seed", "0"])
            wait_routable(router, 2, procs[1:])
            yield cluster, router, procs
        finally:
            if router is not None:
                print(router.stop()[-3000:])
            logs = "".join(stop_process(p) for p in reversed(procs))
            print(logs[-3000:])


@pytest.mark.parametrize("kill", [False, True], ids=["manual", "master-killed"])
def test_routing_hits_survive_a_cluster_master_failover_with_no_failed_request(
        tmp_path: Path, kill: bool) -> None:
    """3 masters, each with a replica: during traffic, the master holding the shared stream
    ``pr:events`` fails over to its replica, then the master holding a worker's keys (``{r}``);
    every request is answered, prompts sent before still hit, new ones become confirmed hits
    (the workers write to the new masters and the router reads the stream from them). Either
    by ``CLUSTER FAILOVER`` (manual) or by SIGKILL of the master (the cluster is down for about
    ``NODE_TIMEOUT_MS`` until the replica takes over)."""
    with failover_fleet(tmp_path) as (cluster, router, procs):
        workers = procs[1:]
        rng = random.Random(13)
        prompts = [[rng.randrange(1000, 90_000) for _ in range(160)] for _ in range(9)]
        send_and_confirm(router, prompts[:3], "hits before failover")
        moved = []
        with steady_traffic(router, prompts[:3]) as statuses:
            events = c.events_key("pr")
            old = cluster.master_port(events)
            moved.append((old, cluster.failover(events, kill=kill)))
            send_and_confirm(router, prompts[3:6], "hits after the stream's master failed over")
            # then a master holding a worker's keys (another one than the stream's, if any)
            keys = [c.blocks_key("pr", f"replica-{i}") for i in range(2)]
            key = next((k for k in keys if cluster.master_port(k) != moved[0][1]), keys[0])
            old = cluster.master_port(key)
            moved.append((old, cluster.failover(key, kill=kill)))
            send_and_confirm(router, prompts[6:], "hits after a worker's master failed over")
        assert all(old != new for old, new in moved), moved
        assert all(w.poll() is None for w in workers), "a worker exited"
        assert statuses and set(statuses) == {200}, statuses
        for p in prompts[:6]:  # prompts sent before a failover still hit
            assert confirmed_hit(router, p)
        assert router.ready()["redis"]["connected"] is True


def _prompts_routed_to(router: Router, rid: str, rng: random.Random, num: int) -> list[list[int]]:
    """Up to ``num`` new prompts the router sent to replica ``rid`` (of at most 40 sent)."""
    held: list[list[int]] = []
    for _ in range(40):
        p = [rng.randrange(1000, 90_000) for _ in range(160)]
        status, headers, _ = router.post("/v1/completions", {"prompt": p, "max_tokens": 1})
        assert status == 200
        if headers["x-prefix-router-replica"] == rid:
            held.append(p)
        if len(held) == num:
            break
    return held


def test_a_router_keeps_a_replica_whose_heartbeat_a_cluster_failover_lost(tmp_path: Path) -> None:
    """The master of a worker's keys is killed and its replica takes over without the
    worker's heartbeat (expired while the master was down: the worker is stopped, SIGSTOP,
    until its heartbeat has less TTL left than the failover takes; with a running worker it
    lapses whenever the failover outlasts the TTL). The router is stopped over the outage too
    and continued once the cluster is whole, so its reads go through without an error, as when
    a short failover fits inside redis-py's retries (no reconnect, no resync): it finds the
    heartbeat gone and keeps the replica and its index (the failover is logged and counted)
    until the worker, continued, re-registers with its full set under a new epoch. The nodes
    detect a failure after 1 s, so the router's stop (about the failover's time) stays well
    below its Redis socket timeout (5 s), past which its pending read would fail on resuming."""
    node_timeout_ms = 1000
    with failover_fleet(tmp_path, node_timeout_ms) as (cluster, router, procs):
        # a worker whose keys another master than the stream's holds (the router's XREAD
        # stays up): the fixture's even slot split puts {replica-1} apart from pr:events
        stream_master = cluster.master_port(c.events_key("pr"))
        index = next(i for i in range(2)
                     if cluster.master_port(c.blocks_key("pr", f"replica-{i}")) != stream_master)
        rid, worker = f"replica-{index}", procs[1 + index]
        held = _prompts_routed_to(router, rid, random.Random(17), 2)
        assert held, f"no prompt routed to {rid}"
        send_and_confirm(router, held, "hits before the failover")
        epoch = next(r["epoch"] for r in router.ready()["replicas"] if r["replica_id"] == rid)
        heartbeat = c.replica_key("pr", rid)

        def listed() -> bool:
            return any(r["replica_id"] == rid for r in router.ready()["replicas"])

        os.kill(worker.pid, signal.SIGSTOP)
        try:
            # less TTL left than a failover takes (node timeout plus an election of >= 0.5 s)
            ttl = redis.Redis(port=cluster.master_port(heartbeat), socket_timeout=5.0)
            wait_for(lambda: 0 < ttl.pttl(heartbeat) < node_timeout_ms + 500, 10,
                     message="the stopped worker's heartbeat about to expire")
            ttl.close()
            os.kill(router.proc.pid, signal.SIGSTOP)
            try:
                promoted = redis.Redis(port=cluster.failover(heartbeat, kill=True),
                                       socket_timeout=5.0)
                wait_for(lambda: not promoted.exists(heartbeat), 10,
                         message="the heartbeat gone from the promoted replica")
                promoted.close()
            finally:
                os.kill(router.proc.pid, signal.SIGCONT)
            # the router's first heartbeat refresh after the failover (or the replica dropped)
            wait_for(lambda: prometheus_value(router.metrics(),
                                              "router_redis_cluster_failovers_total") >= 1
                     or not listed(), 30, message="the router to see the failover")
            assert listed(), f"{rid} dropped as heartbeat gone after the failover"
            assert all(confirmed_hit(router, p) for p in held)
        finally:
            os.kill(worker.pid, signal.SIGCONT)
        assert prometheus_value(router.metrics(), "router_redis_resyncs_total") == 1, (
            "the router reconnected: the path under test (no error seen) was not taken")
        # the worker re-registers: its full set under a new epoch, the hits confirmed again
        wait_for(lambda: any(r["replica_id"] == rid and r["epoch"] > epoch
                             for r in router.ready()["replicas"]), 30,
                 message=f"{rid} back under a new epoch")
        for p in held:
            wait_for(functools.partial(confirmed_hit, router, p), 30,
                     message="hits after the worker re-registered")
        assert all(proc.poll() is None for proc in procs), "a process exited"
