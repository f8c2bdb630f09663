"""Routing policy table tests: each row is replicas' state + hit depths -> chosen replica + reason."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest

from router.decision.load import LoadTracker
from router.decision.policy import NO_HIT, Candidate, HitDepth, PolicyParams, RouteInput, decide
from router.decision.ring import HashRing
from tests.unit.policy_fleet import CHAIN, IDS, RING, home_of

PARAMS = PolicyParams(block_size=16, load_factor=1.25, load_headroom=1, queue_slack_tokens=256,
                      recompute_penalty=1.0)


@dataclass
class Row:
    name: str
    combined: dict[str, int]
    expect_reason: str
    expect: str | None = None  # None: the ring home of the first un-held block
    confirmed: dict[str, int] | None = None
    loads: dict[str, int] = field(default_factory=dict)
    prefill: dict[str, int] = field(default_factory=dict)
    no_affinity: tuple[str, ...] = ()
    num_tokens: int = 1030
    tokenized: bool = True


ROWS = [
    Row("empty index -> ring home of block 0", {}, "cold_ring"),
    Row("deepest confirmed wins", {"replica-2": 40, "replica-1": 10}, "prefix_hit", "replica-2"),
    Row("speculative depth counts", {"replica-3": 30}, "speculative_hit", "replica-3",
        confirmed={}),
    Row("shared system prompt on all: ring on first un-held block, a hit all the same",
        {rid: 32 for rid in IDS}, "prefix_hit"),
    Row("hash not verified: no credit", {"replica-2": 40}, "cold_ring", no_affinity=("replica-2",)),
    Row("over bounded-load cap spills", {"replica-2": 40, "replica-1": 39}, "load_spill",
        "replica-1", loads={"replica-2": 10, "replica-1": 2, "replica-0": 2, "replica-3": 2}),
    Row("queued prefill beyond saved prefill -> less loaded", {"replica-2": 20}, "load_balance",
        None, prefill={"replica-2": 5000}),
    Row("short shared header on a few replicas does not herd: ring home",
        {"replica-1": 4, "replica-3": 4}, "cold_ring"),
    Row("recompute penalty keeps a deep hit over a somewhat longer queue", {"replica-2": 60},
        "prefix_hit", "replica-2", prefill={"replica-2": 1500}),
    Row("headroom: two or three in flight per replica is not over the cap", {"replica-2": 40},
        "prefix_hit", "replica-2",
        loads={"replica-2": 3, "replica-1": 2, "replica-0": 2, "replica-3": 2}),
    Row("queued prefill smaller than saved prefill -> keep hit", {"replica-2": 60}, "prefix_hit",
        "replica-2", prefill={"replica-2": 600}),
    Row("hit capped at (N-1)//B blocks: equal caps tie -> ring",
        {"replica-1": 64, "replica-2": 64}, "prefix_hit", None, num_tokens=1024),
    Row("untokenized prompt rides the ring", {}, "no_tokenizer_ring", tokenized=False),
]


@pytest.mark.parametrize("row", ROWS, ids=[r.name for r in ROWS])
def test_prefix_policy_table(row: Row) -> None:
    replicas = [
        Candidate(rid, affinity=rid not in row.no_affinity,
                    inflight_requests=row.loads.get(rid, 0),
                    inflight_prefill_tokens=row.prefill.get(rid, 0))
        for rid in IDS
    ]
    confirmed = row.combined if row.confirmed is None else row.confirmed
    chain = CHAIN if row.tokenized else []
    request = RouteInput(chain, row.num_tokens if row.tokenized else 0, ring_key=42,
                         tokenized=row.tokenized)
    decision = decide("prefix", request, replicas, RING, confirmed=confirmed,
                      combined=row.combined, params=PARAMS)
    assert decision.reason == row.expect_reason
    if row.expect is not None:
        assert decision.replica_id == row.expect
    elif row.name.startswith("queued"):
        assert decision.replica_id != "replica-2"
    elif row.name.startswith("hit capped"):
        # both hold the full capped hit (63 blocks); the tie goes to the earlier in ring order
        # 64 held blocks = the whole chain, so the ring key is the chain's last block
        order = [r for r in RING.order(CHAIN[-1]) if r in ("replica-1", "replica-2")]
        assert decision.replica_id == order[0]
        assert decision.hit_blocks == 63
    elif row.tokenized:
        held = max((d for r, d in row.combined.items() if r not in row.no_affinity), default=0)
        assert decision.replica_id == home_of(CHAIN[held])
    else:
        assert decision.replica_id == home_of(42)
    assert decision.replica_id not in decision.fallbacks
    assert sorted((decision.replica_id, *decision.fallbacks)) == sorted(IDS)
    assert set(decision.details) == set(IDS)


def test_mooncake_shape_spreads_new_conversations() -> None:
    """Every prompt shares 32 leading blocks held everywhere; new suffixes spread over the ring."""
    shared = list(range(32))
    replicas = [Candidate(rid) for rid in IDS]
    chosen = []
    for conv in range(400):
        chain = shared + [10_000 + conv * 100 + j for j in range(20)]
        depths = {rid: 32 for rid in IDS}
        d = decide("prefix", RouteInput(chain, 52 * 16 + 5, 0), replicas, RING,
                   confirmed=depths, combined=depths, params=PARAMS)
        assert d.reason == "prefix_hit"  # the shared blocks are a hit wherever it goes
        chosen.append(d.replica_id)
    counts = [chosen.count(rid) for rid in IDS]
    assert max(counts) / (400 / 4) < 1.35


@pytest.mark.parametrize("policy", ["prefix", "ttft"])
def test_a_reason_means_the_same_in_a_fleet_of_one(policy: str) -> None:
    """A repeated prompt on the only replica is a hit, as it would be in a fleet of four; a
    prompt nobody holds is cold in both (issue 34: ``cold_ring`` for 304 of 320 tokens hit)."""
    one = HashRing(("replica-0",), vnodes=64)
    alone = [Candidate("replica-0")]
    held = {"replica-0": 40}
    hit = decide(policy, RouteInput(CHAIN, 1030, 0), alone, one, confirmed=held, combined=held,
                 params=PARAMS)
    cold = decide(policy, RouteInput(CHAIN, 1030, 0), alone, one, params=PARAMS)
    assert (hit.reason, cold.reason) == ("prefix_hit", "cold_ring")
    spec = decide(policy, RouteInput(CHAIN, 1030, 0), alone, one, confirmed={}, combined=held,
                  params=PARAMS)
    assert spec.reason == "speculative_hit"


def test_bounded_load_never_exceeds_cap() -> None:
    replicas = [Candidate(rid, inflight_requests=n) for rid, n in zip(IDS, (5, 1, 1, 1), strict=True)]
    depths = {"replica-0": 60}
    d = decide("prefix", RouteInput(CHAIN, 1030, 0), replicas, RING, confirmed=depths,
               combined=depths, params=PARAMS)
    assert d.replica_id != "replica-0" and d.reason == "load_spill"
    assert d.details["replica-0"]["over_load_cap"] is True


def test_engine_load_merges_with_local() -> None:
    view = Candidate("r", inflight_requests=2, engine_running=3,
                       engine_waiting=4, inflight_prefill_tokens=100)
    assert view.load == 7
    # 7 in the engine, 2 of them ours: 5 came from other routers, at most 4 of them waiting.
    assert view.queued_prefill_tokens(avg_prompt_tokens=10) == 100 + 4 * 10
    stale = Candidate("r", inflight_requests=3, engine_running=2,
                        engine_waiting=1, inflight_prefill_tokens=100)
    # A heartbeat listing only our own requests adds no foreign queue.
    assert stale.queued_prefill_tokens(avg_prompt_tokens=10) == 100


def test_baselines() -> None:
    replicas = [Candidate(rid, inflight_requests=n) for rid, n in zip(IDS, (3, 0, 0, 2), strict=True)]
    req = RouteInput(CHAIN, 1030, 7)
    rr = [decide("round_robin", req, replicas, RING, rr_counter=i).replica_id for i in range(4)]
    assert rr == sorted(IDS)
    ll = [decide("least_loaded", req, replicas, RING, rr_counter=i) for i in range(2)]
    assert [d.replica_id for d in ll] == ["replica-1", "replica-2"]
    assert ll[0].reason == "least_loaded"
    ch = decide("consistent_hash", req, replicas, RING, params=PolicyParams(consistent_hash_blocks=4))
    assert ch.replica_id == home_of(CHAIN[3]) and ch.reason == "consistent_hash"
    with pytest.raises(ValueError):
        decide("prefix", req, [], RING)
    with pytest.raises(ValueError):
        decide("nope", req, replicas, RING)


def test_ring_may_hold_ineligible_replicas() -> None:
    replicas = [Candidate("replica-1"), Candidate("replica-9")]
    d = decide("prefix", RouteInput(CHAIN, 1030, 0), replicas, RING)
    assert {d.replica_id, *d.fallbacks} == {"replica-1", "replica-9"}


def test_load_tracker_releases_on_every_path() -> None:
    tracker = LoadTracker()
    t1 = tracker.dispatch("a", 1000)
    t2 = tracker.dispatch("a", 500)
    assert tracker.requests("a") == 2 and tracker.prefill_tokens("a") == 1500
    t1.first_token()
    t1.first_token()
    assert tracker.prefill_tokens("a") == 500 and tracker.prefilling("a") == 1
    t1.finish()
    t2.finish()  # e.g. a client disconnect before the first token
    t2.finish()
    assert tracker.snapshot() == {"a": {"requests": 0, "prefill_tokens": 0, "prefilling": 0,
                                        "context_tokens": 0}}
    assert 500 <= tracker.avg_prompt_tokens <= 1000


def test_requests_at_reconstructs_past_inflight() -> None:
    clock = [100.0]
    tracker = LoadTracker(clock=lambda: clock[0])
    tickets = []
    for t in (100.0, 101.0, 102.0):
        clock[0] = t
        tickets.append(tracker.dispatch("r", 10))
    clock[0] = 103.0
    tickets[0].finish()
    clock[0] = 104.0
    assert tracker.requests("r") == 2
    assert tracker.requests_at("r", 102.5) == 3
    assert tracker.requests_at("r", 101.5) == 2
    assert tracker.requests_at("r", 103.5) == 2
    assert tracker.requests_at("r", 99.5) == 0
    assert tracker.requests_at("r", 104.0 - LoadTracker.HISTORY_S - 1) is None
    assert tracker.requests_at("r", 105.0) is None
    assert tracker.requests_at("other", 103.0) == 0


def test_stale_heartbeat_adds_no_phantom_load() -> None:
    # The heartbeat saw 5 running when 5 of ours were in flight; 4 have finished since.
    view = Candidate("r", inflight_requests=1, engine_running=5, engine_waiting=2,
                       ours_at_heartbeat=7, inflight_prefill_tokens=50)
    assert view.foreign_requests == 0
    assert view.load == 1
    assert view.queued_prefill_tokens(avg_prompt_tokens=1000) == 50
    # Another router's 3 requests show up as foreign load, at most the waiting ones queue.
    shared = Candidate("r", inflight_requests=1, engine_running=6, engine_waiting=2,
                         ours_at_heartbeat=5, inflight_prefill_tokens=50)
    assert shared.foreign_requests == 3
    assert shared.load == 4
    assert shared.queued_prefill_tokens(avg_prompt_tokens=1000) == 50 + 2 * 1000


def test_default_params_keep_a_held_prefix_but_balance_cold_requests() -> None:
    """Defaults: recomputing a held prefix for a shorter queue is (nearly) never worth it,
    while a cold request (nothing to recompute) goes to a short queue."""
    params = PolicyParams(block_size=16)
    home = home_of(CHAIN[0])
    busy = [Candidate(rid, inflight_requests=1,
                        inflight_prefill_tokens=20_000 if rid in (home, "replica-2") else 0)
            for rid in IDS]
    request = RouteInput(CHAIN, 1030, ring_key=42)
    deep = decide("prefix", request, busy, RING, confirmed={"replica-2": 60},
                  combined={"replica-2": 60}, params=params)
    assert (deep.replica_id, deep.reason) == ("replica-2", "prefix_hit")
    cold = decide("prefix", request, busy, RING, params=params)
    assert cold.reason == "cold_ring"  # a cold prefix goes to the shortest queue directly
    assert cold.replica_id not in (home, "replica-2")
    ring_only = decide("prefix", request, busy, RING,
                       params=PolicyParams(block_size=16, cold_candidates=1))
    assert ring_only.reason == "load_balance"  # the ring home only: moved by the queue check
    assert ring_only.replica_id not in (home, "replica-2")


def test_cold_prefix_goes_to_least_written_of_first_ring_candidates() -> None:
    """Cold: the first ``cold_candidates`` ring replicas compete on recent KV writes."""
    order = RING.order(CHAIN[0])
    writes = dict(zip(order, (100.0, 50.0, 10.0, 0.0), strict=True))
    replicas = [Candidate(rid, recent_write_blocks=writes[rid]) for rid in IDS]
    request = RouteInput(CHAIN, 1030, ring_key=42)
    d = decide("prefix", request, replicas, RING, params=PARAMS)  # default: every replica competes
    assert (d.replica_id, d.reason) == (order[3], "cold_ring")
    assert d.details[order[3]]["recent_write_blocks"] == 0.0
    three = PolicyParams(block_size=16, cold_candidates=3)
    # the fourth ring replica wrote least but is outside the first three
    assert decide("prefix", request, replicas, RING, params=three).replica_id == order[2]
    ring_only = PolicyParams(block_size=16, cold_candidates=1)
    assert decide("prefix", request, replicas, RING, params=ring_only).replica_id == order[0]


def test_writes_never_pull_a_request_off_its_deepest_holder() -> None:
    writes = {rid: (1e6 if rid == "replica-2" else 0.0) for rid in IDS}
    replicas = [Candidate(rid, recent_write_blocks=writes[rid]) for rid in IDS]
    depths = {"replica-2": 40, "replica-1": 10}
    d = decide("prefix", RouteInput(CHAIN, 1030, 0), replicas, RING, confirmed=depths,
               combined=depths, params=PARAMS)
    assert (d.replica_id, d.reason) == ("replica-2", "prefix_hit")
    # two replicas holding the same depth: the one that wrote less takes it
    depths = {"replica-2": 40, "replica-1": 40}
    d = decide("prefix", RouteInput(CHAIN, 1030, 0), replicas, RING, confirmed=depths,
               combined=depths, params=PARAMS)
    assert (d.replica_id, d.reason) == ("replica-1", "prefix_hit")


def test_recent_writes_decay_with_fleet_writes() -> None:
    tracker = LoadTracker()
    assert tracker.recent_writes("a", 100.0) == 0.0
    tracker.record_writes("a", 100, 100.0)
    assert tracker.recent_writes("a", 100.0) == pytest.approx(100.0)
    tracker.record_writes("b", 100, 100.0)  # 100 blocks written elsewhere: one e-folding for a
    assert tracker.recent_writes("a", 100.0) == pytest.approx(100.0 * math.exp(-1.0))
    assert tracker.recent_writes("b", 100.0) == pytest.approx(100.0)
    tracker.record_writes("a", 0, 100.0)
    assert tracker.recent_writes("a", 100.0) == pytest.approx(100.0 * math.exp(-1.0))


def test_cold_prefix_goes_to_the_fewest_writes_among_the_shortest_queues() -> None:
    order = RING.order(CHAIN[0])
    writes = dict(zip(order, (0.0, 10.0, 20.0, 5.0), strict=True))
    prefill = dict(zip(order, (4000, 0, 0, 200), strict=True))
    replicas = [Candidate(rid, inflight_requests=1, inflight_prefill_tokens=prefill[rid],
                            recent_write_blocks=writes[rid]) for rid in IDS]
    d = decide("prefix", RouteInput(CHAIN, 1030, ring_key=42), replicas, RING, params=PARAMS)
    # order[1] and order[2] have nothing queued, order[3] is within the cold slack (1024) of nothing
    # but order[0] (the least written) is not; of the three, order[3] wrote least
    assert (d.replica_id, d.reason) == (order[3], "cold_ring")


@pytest.mark.parametrize("policy", ["prefix", "ttft"])
def test_the_decision_carries_typed_hit_depths_for_dispatch(policy: str) -> None:
    replicas = [Candidate(rid) for rid in IDS]
    combined = {"replica-0": 40, "replica-1": 10}
    confirmed = {"replica-0": 30}
    decision = decide(policy, RouteInput(CHAIN, 1024, ring_key=42), replicas, RING,
                      confirmed=confirmed, combined=combined, params=PARAMS)
    assert decision.hit("replica-0") == HitDepth(blocks=40, confirmed=30)
    assert decision.hit("replica-1") == HitDepth(blocks=10, confirmed=0)
    assert decision.hit("replica-3") == HitDepth() and decision.hit("unknown") is NO_HIT
    for rid, hit in decision.hits.items():  # the explanation shows the same numbers
        assert (hit.blocks, hit.confirmed) == (decision.details[rid]["hit_blocks"],
                                               decision.details[rid]["confirmed_hit_blocks"])
    assert bool(decision.predictions) == (policy == "ttft")
    for rid, predicted in decision.predictions.items():
        assert predicted.ttft_s == decision.details[rid]["ttft_s"] > 0
