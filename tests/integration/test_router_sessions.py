"""Session affinity (issue 33) through real processes: the ``x-session-id`` header and the body's
``prompt_cache_key`` keep a session's requests on one replica of an emulated fleet (emulator,
workers, Redis, router), an overloaded replica lets the session move (held replicas, so the
test decides the load), and the session names never reach the metrics."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import wait_for
from tests.integration.test_router_admission import (
    BODY,
    Call,
    HoldingReplica,
    replicas,
)
from tests.integration.test_router_admission import start_router as start_held_router
from tests.integration.test_router_fleet import Fleet, Router, fleet, start_router, tokens

__all__ = ["fleet", "replicas"]  # the fixtures, shared

pytestmark = pytest.mark.timeout(240)

REPLICA = "x-prefix-router-replica"
REASON = "x-prefix-router-reason"


@pytest.fixture
def router(fleet: Fleet, tmp_path: Path) -> Iterator[Router]:
    r = start_router(fleet, tmp_path)
    yield r
    r.stop()


def send(router: Router, prompt: list[int], session: str | None = None,
         cache_key: str | None = None) -> tuple[str, str]:
    """A completion; returns (replica, reason) of its routing."""
    body: dict[str, Any] = {"model": "emulated-llm", "prompt": prompt, "max_tokens": 2}
    if cache_key is not None:
        body["prompt_cache_key"] = cache_key
    headers = {"x-session-id": session} if session is not None else None
    status, resp_headers, answer = router.post("/v1/completions", body, headers=headers)
    assert status == 200, answer
    return resp_headers[REPLICA], resp_headers[REASON]


def test_a_session_stays_on_its_replica_while_its_prompts_are_nowhere_in_the_index(
        router: Router) -> None:
    rng = random.Random(33)
    # each session's requests are unrelated prompts: no replica holds any of the next one, so
    # the prefix policy alone places it on its own ring home (spread over the fleet)
    groups = [[tokens(rng, 160) for _ in range(3)] for _ in range(8)]
    unsessioned = [{send(router, p)[0] for p in group} for group in groups]
    # the control: without a session, most groups spread (else this test could not fail)
    assert sum(len(placed) > 1 for placed in unsessioned) >= 4, unsessioned
    reasons = []
    for i, group in enumerate(groups):
        fresh = [[t + 1 for t in p] for p in group]  # same shapes, new tokens: nothing held
        header = f"conversation-{i}" if i % 2 else None
        cache_key = None if i % 2 else f"cache-key-{i}"
        placed = [send(router, p, header, cache_key) for p in fresh]
        assert len({rid for rid, _ in placed}) == 1, (i, placed)
        reasons += [reason for _, reason in placed]
    # where a prompt's own choice was another replica, the session decided (and said so)
    assert reasons.count("session_affinity") >= 4, reasons


def test_debug_route_says_session_affinity_when_the_session_decided(router: Router) -> None:
    rng = random.Random(34)
    home, _ = send(router, tokens(rng, 160), session="debugged-session")

    def route(prompt: list[int], headers: dict[str, str] | None) -> dict[str, Any]:
        status, _, body = router.post("/debug/route", {"model": "emulated-llm", "prompt": prompt},
                                      headers=headers)
        assert status == 200, body
        answer: dict[str, Any] = json.loads(body)
        return answer

    # a fresh prompt whose own ring home is elsewhere (found by trying a few)
    elsewhere = next(p for p in (tokens(rng, 160) for _ in range(50))
                     if route(p, None)["replica"] != home)
    decided = route(elsewhere, {"x-session-id": "debugged-session"})
    assert (decided["replica"], decided["reason"], decided["session_replica"]) == (
        home, "session_affinity", home)
    assert route(elsewhere, None)["session_replica"] is None


def test_session_names_are_never_metric_labels(router: Router) -> None:
    rng = random.Random(35)
    send(router, tokens(rng, 160), session="tenant-secret-session-name")
    send(router, tokens(rng, 160), cache_key="tenant-secret-cache-key")
    metrics = router.metrics()
    assert "session_affinity" in metrics  # the decision reason is a label ...
    assert "tenant-secret" not in metrics  # ... the session's name never


def test_an_overloaded_replica_lets_the_session_move_and_it_stays_where_it_moved(
        replicas: list[HoldingReplica], tmp_path: Path) -> None:
    # bounded load cap ceil(1.0 x mean) + 0: a second request on a replica holding one, with the
    # other idle, is over it
    router = start_held_router(tmp_path, replicas, "--load-factor", "1.0", "--load-headroom", "0")
    try:
        headers = {"x-session-id": "busy-session"}
        first = Call(router, headers=headers)
        wait_for(lambda: sum(r.arrived() for r in replicas) == 1, 30, message="first held")
        home = next(r for r in replicas if r.arrived() == 1)
        other = next(r for r in replicas if r is not home)
        second = Call(router, headers=headers)  # home over the cap: the session moves
        wait_for(lambda: other.arrived() == 1, 30, message="second on the other replica")
        for r in replicas:
            r.release()
        assert first.wait()[0] == 200 and second.wait()[0] == 200
        assert first.wait()[1][REPLICA] == home.url.removeprefix("http://")
        moved = second.wait()[1]
        assert moved[REPLICA] == other.url.removeprefix("http://")
        assert moved[REASON] != "session_affinity"  # the policy's choice, away from home
        # no load now: the session stays where its last request was served (without the memory
        # it would go back to its ring owner, home), over the policy's own choice if that differs
        status, after, _ = router.post("/v1/completions", BODY, headers=headers)
        status_free, unsessioned, _ = router.post("/v1/completions", BODY)
        assert status == status_free == 200
        assert after[REPLICA] == other.url.removeprefix("http://")
        assert (after[REASON] == "session_affinity") == (unsessioned[REPLICA] != after[REPLICA])
    finally:
        router.stop()
