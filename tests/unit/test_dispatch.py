"""The dispatch record (``router.request.dispatch.Dispatch``): per send, the load ticket, the speculative
placement and the KV writes, settled once; with the real index, load tracker and chainer."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from router.request.prompts import parse_prompt
from tests.unit.router_service import MODEL, service_with_replicas


def long_prompt(seed: int, tokens: int = 4096) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 100_000) for _ in range(tokens)]


def test_a_failed_send_then_a_served_one_settle_each_their_way() -> None:
    """Replica A fails (502) before the first byte, B serves: A's placement is withdrawn and its
    KV writes count twice (a failing replica never looks the emptiest); B keeps its placement
    and writes; both tickets are released by the proxy, none leaks; a second settle is a no-op."""
    service = service_with_replicas(2)
    spec = parse_prompt("completion", {"model": MODEL, "prompt": long_prompt(1, 1024)})

    async def scenario() -> None:
        routed = await service.router.route(spec)
        assert routed.complete
        a, b = routed.decision.replica_id, routed.decision.fallbacks[0]
        dispatch = service.dispatcher.begin(routed, spec)
        window = routed.write_window_blocks
        blocks = routed.num_tokens // 16
        for rid in (a, b):
            ticket = dispatch.start_ticket(rid)
            assert service.tracker.requests(rid) == 1
            dispatch.sent(rid)
            ticket.finish()  # the proxy releases each attempt's ticket
        dispatch.settle(200, b)
        assert [p.withdrawn for p in dispatch.placements] == [True, False]
        # (recent writes decay with the writes since: approx)
        assert service.tracker.recent_writes(a, window) == pytest.approx(2 * blocks, rel=0.02)
        assert service.tracker.recent_writes(b, window) == pytest.approx(blocks, rel=0.02)
        dry = await service.router.route(spec, dry_run=True)  # the placements as routing sees them
        assert dry.decision.hit(b).blocks == (routed.num_tokens - 1) // 16
        assert dry.decision.hit(a).blocks == 0
        dispatch.settle(502, a)  # settled already: nothing moves
        assert service.tracker.recent_writes(b, window) == pytest.approx(blocks, rel=0.02)
        assert service.tracker.requests(a) == service.tracker.requests(b) == 0

    asyncio.run(scenario())
    service.chainer.shutdown(wait=True)


def test_a_refused_request_withdraws_its_writes_and_a_lazy_rest_is_hashed_once() -> None:
    """A lazily hashed prompt sent twice (a retry on another replica after a failure) hashes its
    rest once; the second replica's 4xx refusal of the request withdraws every placement and its
    own KV writes (the failed first send's count twice), and cancels the rest."""
    service = service_with_replicas(2)
    spec = parse_prompt("completion", {"model": MODEL, "prompt": long_prompt(2)})

    async def scenario() -> None:
        routed = await service.router.route(spec)
        assert not routed.complete
        release = service.chainer.hold_rests()  # the rests held back, as on a busy router
        dispatch = service.dispatcher.begin(routed, spec)
        for rid in (routed.decision.replica_id, routed.decision.fallbacks[0]):
            dispatch.start_ticket(rid).finish()
            dispatch.sent(rid)
        assert service.chainer.queued_rests == 1
        dispatch.settle(400, routed.decision.fallbacks[0])
        (recorded,) = service.chainer.pending_tails.values()
        await asyncio.wait_for(recorded, 5)  # cancelled, never hashed
        assert service.chainer.queued_rests == 0
        first, second = routed.decision.replica_id, routed.decision.fallbacks[0]
        window = routed.write_window_blocks
        assert service.tracker.recent_writes(first, window) == pytest.approx(
            2 * (routed.num_tokens // 16), rel=0.02)
        assert service.tracker.recent_writes(second, window) == 0
        assert not any(key in service.fleet.speculative for key in routed.chain)
        release()

    try:
        asyncio.run(scenario())
    finally:
        service.chainer.shutdown(wait=True)


def test_a_passthrough_request_has_the_deadline_of_its_recent_answers() -> None:
    """Issue 35 review F2: a pooling, scoring or tokenizer attempt expects its first byte within
    the longest of the recent such answers (none yet: 0 s, so its first-byte deadline is the
    floor), never ``math.inf`` (no deadline: a hung replica held it until the client left)."""
    service = service_with_replicas(2)
    rid = next(iter(service.fleet.replicas))
    first = service.dispatcher.passthrough()
    first.start_ticket(rid).finish()
    assert first.expected_first_byte_s(rid) == 0.0
    first.sent(rid)
    first.observe_answer(rid, time.perf_counter() + 2.5)  # answered 2.5 s after the send
    second = service.dispatcher.passthrough()
    assert second.expected_first_byte_s(rid) == pytest.approx(2.5, abs=0.5)
    second.observe_answer(rid, time.perf_counter())  # never sent there: no sample
    assert service.dispatcher.passthrough_allowance_s() == pytest.approx(2.5, abs=0.5)
    service.chainer.shutdown(wait=True)
