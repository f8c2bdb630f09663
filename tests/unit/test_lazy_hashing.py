"""Lazy hashing of long token-id prompts in the router process (``RouterService.route`` and the
speculative placement of a chain's rest), with the real hasher, index and thread pool."""

from __future__ import annotations

import asyncio
import random
import threading
import time

from router import contract as c
from router.config import load_config
from router.prompts import parse_prompt
from router.server import RouterService

MODEL = "m"


def service_with_replicas(n: int) -> RouterService:
    service = RouterService(load_config(["--model", MODEL, "--redis-url", "redis://127.0.0.1:1/0"], env={}), tokenizer=None)
    now = time.time()
    for i in range(n):
        service.fleet.apply_heartbeat(f"replica-{i}", {
            c.F_URL: f"http://127.0.0.1:{9000 + i}", c.F_MODELS: f'["{MODEL}"]',
            c.F_HEARTBEAT_TS: str(now)}, now)
    return service


def test_a_request_reaching_a_pending_tail_waits_for_it_and_follows_the_whole_prefix() -> None:
    """The first request of a new 16k-token prefix is routed on its first piece; while the rest
    of its chain waits for the (busy) thread pool, a second request with the same prefix waits
    for that rest to be recorded, then goes to the same replica with the whole prefix as its hit
    (without the wait it would see a 16-block hit, too small for affinity, and go to a replica
    with fewer recent writes)."""
    rng = random.Random(5)
    shared = [rng.randrange(1000, 100_000) for _ in range(16384)]
    first = parse_prompt("completion", {"model": MODEL, "prompt": shared + [7] * 40})
    second = parse_prompt("completion", {"model": MODEL, "prompt": shared + [9] * 40})
    service = service_with_replicas(4)
    gate = threading.Event()

    async def scenario() -> None:
        routed = await service.route(first)
        assert not routed.complete and len(routed.chain) == 16, len(routed.chain)
        home = routed.decision.replica_id
        for _ in range(service.config.tokenizer_threads):  # the tokenizer threads are busy
            service.executor.submit(gate.wait)
        placed = service._place_speculative(routed, home, first, None)
        assert placed is not None and len(placed.keys) == 16
        service.tracker.record_writes(home, routed.num_tokens // 16, routed.write_window_blocks)
        waiting = asyncio.create_task(service.route(second))
        await asyncio.sleep(0.2)
        assert not waiting.done()
        gate.set()
        again = await waiting
        assert len(placed.keys) == 16384 // 16 + 2  # the rest was recorded, tail blocks included
        assert again.complete
        assert (again.decision.replica_id, again.decision.hit_blocks) == (home, 16384 // 16)

    try:
        asyncio.run(scenario())
    finally:
        gate.set()
        service.executor.shutdown(wait=True)


def test_a_withdrawn_lazy_placement_records_nothing_more() -> None:
    """A replica refused the request before the rest of its chain was hashed: the rest is not
    recorded, and requests are not kept waiting for it."""
    rng = random.Random(6)
    prompt = [rng.randrange(1000, 100_000) for _ in range(4096)]
    spec = parse_prompt("completion", {"model": MODEL, "prompt": prompt})
    service = service_with_replicas(2)
    gate = threading.Event()

    async def scenario() -> None:
        routed = await service.route(spec)
        home = routed.decision.replica_id
        for _ in range(service.config.tokenizer_threads):
            service.executor.submit(gate.wait)
        placed = service._place_speculative(routed, home, spec, None)
        assert placed is not None
        slot = service.fleet.index.bit(home)
        placed.withdrawn = True
        service.fleet.speculative.withdraw(slot, placed.keys)
        (recorded,) = service._pending_tails.values()
        gate.set()
        await asyncio.wait_for(recorded, 5)
        assert not service._pending_tails
        assert len(placed.keys) == 16
        assert not any(key in service.fleet.speculative for key in routed.chain)
        dry = await service.route(spec, dry_run=True)
        assert dry.decision.hit_blocks == 0

    try:
        asyncio.run(scenario())
    finally:
        gate.set()
        service.executor.shutdown(wait=True)
