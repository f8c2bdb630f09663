"""Heartbeat freshness (``Fleet.apply_heartbeat``) and panic mode (``Fleet.eligible``)."""

from __future__ import annotations

import time

import pytest

from router.decision.fleet import Fleet
from router.request.errors import NoRoutableReplica
from router.service.config import RouterConfig
from router.shared import contract as c
from router.shared.hashing import BlockHasher


def fleet_of(num: int, panic_threshold: float = 0.5) -> Fleet:
    config = RouterConfig(redis_url="redis://127.0.0.1:1", panic_threshold=panic_threshold)
    fleet = Fleet(config, BlockHasher(config.block_size, config.hash_algo, config.hash_seed))
    now = time.time()
    for i in range(num):
        fleet.apply_heartbeat(f"r{i}", {c.F_URL: f"http://127.0.0.1:{9000 + i}",
                                        c.F_MODELS: '["m"]', c.F_HEARTBEAT_TS: str(now)}, now,
                              ttl_ms=3000)
    return fleet


def test_a_key_redis_holds_with_an_expiry_is_fresh_whatever_the_clocks() -> None:
    fleet = fleet_of(0)
    fields = {c.F_URL: "http://127.0.0.1:9", c.F_HEARTBEAT_TS: "1000.0"}
    # read an hour after heartbeat_ts by this router's clock (skewed, or a loop that got to
    # the reply late): the key's remaining time to live says it was written < 3 s ago
    fleet.apply_heartbeat("expiring", fields, 1000.0 + 3600, ttl_ms=1200)
    assert fleet.replicas["expiring"].healthy
    # without an expiry only the timestamp can tell: stale beyond HEARTBEAT_TTL_S + 0.5
    fleet.apply_heartbeat("no-expiry", fields, 1000.0 + c.HEARTBEAT_TTL_S + 0.4, ttl_ms=-1)
    assert fleet.replicas["no-expiry"].healthy
    fleet.apply_heartbeat("no-expiry", fields, 1000.0 + c.HEARTBEAT_TTL_S + 0.6, ttl_ms=-1)
    assert not fleet.replicas["no-expiry"].healthy


def test_panic_below_the_threshold_routes_to_every_replica_up_or_not() -> None:
    fleet = fleet_of(4)
    now = time.monotonic()
    for rid in ("r0", "r1"):  # half down: at the threshold, not below it
        fleet.replicas[rid].healthy = False
    ready, _, panic = fleet.eligible("m", now)
    assert sorted(r.replica_id for r in ready) == ["r2", "r3"] and not panic
    fleet.replicas["r2"].healthy = False
    fleet.health.trip("r3", now, "stalled")  # an open circuit counts as down too
    ready, _, panic = fleet.eligible("m", now)
    assert sorted(r.replica_id for r in ready) == ["r0", "r1", "r2", "r3"] and panic
    assert fleet.panic(now) == (True, 0, 4)
    # a failed or timed-out connection is ignored too (a burst of connects times out on every
    # replica at once), a data-parallel rank the engine lacks is not
    fleet.mark_failed("r0", now)
    fleet.replicas["r1"].rank_problem = "data-parallel rank 1 is not one of the engine's ranks"
    ready, _, panic = fleet.eligible("m", now)
    assert sorted(r.replica_id for r in ready) == ["r0", "r2", "r3"] and panic


def test_panic_threshold_zero_is_off() -> None:
    fleet = fleet_of(2, panic_threshold=0.0)
    now = time.monotonic()
    for replica in fleet.replicas.values():
        replica.healthy = False
    with pytest.raises(NoRoutableReplica):
        fleet.eligible("m", now)
    assert fleet.panic(now) == (False, 0, 2)
    # every replica up but with its circuit open: routed to anyway, as before
    for replica in fleet.replicas.values():
        replica.healthy = True
        fleet.health.trip(replica.replica_id, now, "stalled")
    ready, _, panic = fleet.eligible("m", now)
    assert len(ready) == 2 and not panic


def test_panic_skips_static_replicas_never_seen_up() -> None:
    config = RouterConfig(replicas=("http://127.0.0.1:9001", "http://127.0.0.1:9002"))
    fleet = Fleet(config, BlockHasher(config.block_size, config.hash_algo, config.hash_seed))
    now = time.monotonic()
    for replica in fleet.replicas.values():
        replica.healthy = False
    with pytest.raises(NoRoutableReplica):  # nothing says either was ever up
        fleet.eligible(None, now)
    first = next(iter(fleet.replicas.values()))
    first.probed_ok = True  # was up, its probes fail now
    ready, _, panic = fleet.eligible(None, now)
    assert ready == [first] and panic


def test_panic_skips_replicas_refusing_connections_unless_none_is_left() -> None:
    """A refused connection (nothing listens) is direct evidence: panic mode skips the replica
    while another is left, and ``not_ready`` names the cause once every routed one refuses."""
    fleet = fleet_of(3)
    now = time.monotonic()
    for rid in ("r0", "r1", "r2"):
        fleet.replicas[rid].healthy = False  # stale heartbeats: panic mode
    fleet.health.record_refused("r0", now)
    ready, _, panic = fleet.eligible("m", now)
    assert panic and sorted(r.replica_id for r in ready) == ["r1", "r2"]
    assert sorted(r.replica_id for r in fleet.routed(now)) == ["r1", "r2"]
    assert fleet.not_ready(now) is None
    fleet.health.record_refused("r1", now)
    fleet.health.record_refused("r2", now)
    ready, _, panic = fleet.eligible("m", now)  # none left: all of them (a retry is cheap)
    assert panic and len(ready) == 3
    assert "refused its last connection" in (fleet.not_ready(now) or "")
    fleet.health.record_success("r2")  # it answers again
    assert fleet.not_ready(now) is None
    assert [r.replica_id for r in fleet.eligible("m", now)[0]] == ["r2"]


def test_the_no_replica_error_says_every_known_replica_left() -> None:
    fleet = fleet_of(0)
    with pytest.raises(NoRoutableReplica, match="known to the router yet"):
        fleet.eligible("m", time.monotonic())
    fleet = fleet_of(2)
    fleet.drop_replica("r0")
    fleet.drop_replica("r1")
    with pytest.raises(NoRoutableReplica, match=r"of model 'm' is registered \(all 2 known"):
        fleet.eligible("m", time.monotonic())
    assert "all 2 known replicas left" in (fleet.not_ready(time.monotonic()) or "")
