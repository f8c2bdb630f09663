"""Session affinity, pure parts: the session key, the table of sessions' replicas, and the rule
keeping a session on its replica (``keep_session``) for every policy."""

from __future__ import annotations

import pytest

from router.decision.policy import (
    REASON_SESSION_AFFINITY,
    Candidate,
    PolicyParams,
    RouteInput,
    decide,
    keep_session,
    session_replica,
)
from router.request.prompts import PromptError, parse_prompt, parse_request
from router.shared.contract import BlockKey
from router.traffic.sessions import SessionTable, session_key
from tests.unit.policy_fleet import IDS, RING

CHAIN = [BlockKey(k) for k in range(2000, 2032)]  # 32 blocks
REQUEST = RouteInput(CHAIN, 32 * 16 + 1, CHAIN[0])
PARAMS = PolicyParams(block_size=16, load_factor=1.25, load_headroom=1)
POLICIES = ("prefix", "ttft", "round_robin", "least_loaded", "consistent_hash")


def candidates(loads: dict[str, int] | None = None) -> list[Candidate]:
    loads = loads or {}
    return [Candidate(rid, inflight_requests=loads.get(rid, 0)) for rid in IDS]


def other_than(rid: str) -> str:
    return next(r for r in IDS if r != rid)


@pytest.mark.parametrize("policy", POLICIES)
def test_a_session_whose_prefix_no_replica_is_known_to_hold_stays_on_its_replica(
        policy: str) -> None:
    replicas = candidates()
    decision = decide(policy, REQUEST, replicas, RING, params=PARAMS)
    home = other_than(decision.replica_id)
    kept = keep_session(decision, replicas, home, PARAMS, policy)
    assert (kept.replica_id, kept.reason) == (home, REASON_SESSION_AFFINITY)
    assert kept.fallbacks[0] == decision.replica_id  # the policy's choice is the first retry
    assert home not in kept.fallbacks
    assert set(kept.fallbacks) == set(IDS) - {home}


@pytest.mark.parametrize("policy", POLICIES)
def test_an_overloaded_replica_lets_the_session_move(policy: str) -> None:
    decision = decide(policy, REQUEST, candidates(), RING, params=PARAMS)
    home = other_than(decision.replica_id)
    # 12 in flight there, 0 elsewhere: ceil(1.25 * 13 / 4) + headroom < 13 for both headrooms
    loaded = candidates({home: 12})
    decision = decide(policy, REQUEST, loaded, RING, params=PARAMS)
    assert decision.replica_id != home
    assert keep_session(decision, loaded, home, PARAMS, policy) == decision


@pytest.mark.parametrize("policy", ("prefix", "ttft"))
def test_a_session_follows_its_prefix_where_the_index_shows_it_deeper(policy: str) -> None:
    replicas = candidates()
    holder, home = "replica-1", "replica-2"
    decision = decide(policy, REQUEST, replicas, RING, params=PARAMS,
                      confirmed={holder: 20}, combined={holder: 20, home: 18})
    assert decision.replica_id == holder
    # 2 blocks (min_affinity_blocks) deeper elsewhere: the home lost the prefix, it moves
    assert keep_session(decision, replicas, home, PARAMS, policy) == decision
    decision = decide(policy, REQUEST, replicas, RING, params=PARAMS,
                      confirmed={holder: 20}, combined={holder: 20, home: 19})
    kept = keep_session(decision, replicas, home, PARAMS, policy)
    assert (kept.replica_id, kept.reason, kept.hit_blocks) == (home, REASON_SESSION_AFFINITY, 19)


def test_a_sessions_first_request_goes_to_the_ring_owner_of_its_key() -> None:
    key = session_key(None, "conversation-7", None)
    assert key is not None
    replicas = candidates()
    assert session_replica(RING, key, replicas, None) == RING.home(key)
    assert session_replica(RING, key, replicas, "replica-3") == "replica-3"
    gone = [r for r in replicas if r.replica_id != "replica-3"]  # remembered replica left
    assert session_replica(RING, key, gone, "replica-3") == RING.order(key)[
        0 if RING.home(key) != "replica-3" else 1]


def test_session_key_header_first_and_partitioned_by_cache_salt() -> None:
    assert session_key(None, None, None) is None
    assert session_key("", "", "salt") is None
    assert session_key("s1", "other", None) == session_key("s1", None, None)
    assert session_key(None, "s1", "tenant-a") != session_key(None, "s1", "tenant-b")
    assert session_key(None, "s1", None) != session_key(None, "s1", "tenant-a")


def test_session_table_bounds_expires_and_turns_off() -> None:
    now = [0.0]
    table = SessionTable(max_sessions=2, ttl_s=10.0, clock=lambda: now[0])
    table.served(1, "a")
    table.served(2, "b")
    assert table.replica(1) == "a"  # now the most recently used
    table.served(3, "c")
    assert (table.replica(2), table.replica(1), table.replica(3)) == (None, "a", "c")
    now[0] = 11.0
    assert table.replica(1) is None and len(table) == 0
    off = SessionTable(max_sessions=0)
    off.served(1, "a")
    assert not off.enabled and off.replica(1) is None
    with pytest.raises(ValueError):
        SessionTable(max_sessions=-1)


def test_prompt_cache_key_is_parsed_on_both_paths_and_checked() -> None:
    fast = parse_request("completion", b'{"prompt": [1, 2], "prompt_cache_key": "k"}')
    assert fast.session_key == "k"
    chat = parse_prompt("chat", {"messages": [{"role": "user", "content": "hi"}],
                                 "prompt_cache_key": "k2"})
    assert chat.session_key == "k2"
    with pytest.raises(PromptError, match="prompt_cache_key"):
        parse_request("completion", b'{"prompt": [1, 2], "prompt_cache_key": 5}')
