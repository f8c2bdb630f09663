"""Circuit breaker and stall detector of ``router.health`` (pure, explicit clock)."""

from __future__ import annotations

from router.health import CLOSED, HALF_OPEN, OPEN, HealthParams, ReplicaHealth


def make(**kw: float) -> ReplicaHealth:
    return ReplicaHealth(HealthParams(**{"failure_threshold": 3, "failure_window_s": 10.0,
                                         "ejection_s": 5.0, "max_ejection_s": 12.0,
                                         "stall_timeout_s": 4.0, **kw}))


def test_consecutive_failures_in_the_window_open_the_circuit() -> None:
    h = make()
    assert not h.record_failure("a", 0.0, "http_500")
    assert not h.record_failure("a", 1.0, "http_500")
    assert h.problem("a", 1.0) is None
    assert h.record_failure("a", 2.0, "http_500")
    assert h.state("a") == OPEN and "circuit open" in (h.problem("a", 2.0) or "")
    assert h.problem("b", 2.0) is None


def test_a_success_or_the_window_resets_the_count() -> None:
    h = make()
    h.record_failure("a", 0.0, "x")
    h.record_failure("a", 1.0, "x")
    h.record_success("a")
    assert not h.record_failure("a", 2.0, "x")
    h.record_failure("a", 3.0, "x")
    assert not h.record_failure("a", 20.0, "x")  # the two before fell out of the 10 s window
    assert h.state("a") == CLOSED


def test_half_open_admits_one_probe_and_ejections_grow() -> None:
    h = make()
    for t in (0.0, 0.1, 0.2):
        h.record_failure("a", t, "x")
    assert h.problem("a", 5.1) is not None  # opened at 0.2 for 5 s
    assert h.problem("a", 5.3) is None
    h.on_dispatch("a", 5.3)
    assert h.state("a") == HALF_OPEN and "probe" in (h.problem("a", 5.3) or "")
    h.record_failure("a", 5.4, "x")  # the probe failed: open for 10 s
    assert h.problem("a", 15.3) is not None and h.problem("a", 15.5) is None
    h.on_dispatch("a", 15.5)
    h.record_failure("a", 15.6, "x")  # capped at max_ejection_s (12, not 20)
    assert h.problem("a", 27.5) is not None and h.problem("a", 27.7) is None
    h.on_dispatch("a", 27.7)
    h.record_neutral("a")  # the client went away: another probe may go
    assert h.problem("a", 27.8) is None
    h.on_dispatch("a", 27.8)
    h.record_success("a")
    assert h.state("a") == CLOSED and h.problem("a", 27.9) is None
    for t in (30.0, 30.1, 30.2):  # closed after a good probe: the ejection starts over at 5 s
        h.record_failure("a", t, "x")
    assert h.problem("a", 35.1) is not None and h.problem("a", 35.3) is None


def test_a_silent_replica_is_stalled_only_while_others_progress() -> None:
    h = make()
    token = h.attempt_started("a", 0.0)
    h.attempt_started("b", 0.0)
    assert h.stalled(5.0) == []  # nobody sent anything: the whole fleet (or router) is idle
    h.progress("b", 4.5)
    assert h.stalled(5.0) == ["a"]
    h.progress("a", 4.8)
    assert h.stalled(5.0) == []
    h.progress("b", 8.5)
    assert h.stalled(8.9) == ["a"]
    h.trip("a", 8.9, "stalled")
    assert h.stalled(9.0) == []  # already benched
    h.attempt_ended("a", token)
    assert h.stalled(30.0) == []  # nothing in flight on it
