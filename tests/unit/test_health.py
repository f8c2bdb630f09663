"""Circuit breaker and stall detector of ``router.decision.health`` (pure, explicit clock)."""

from __future__ import annotations

import pytest

from router.decision.health import (
    CLOSED,
    HALF_OPEN,
    HUNG,
    MISSED,
    OPEN,
    ROUTER_LATE,
    HealthParams,
    Overdue,
    ReplicaHealth,
    first_byte_deadline_s,
)
from router.observability.loop_lag import LoopLag


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


def test_half_open_takes_no_client_request_until_a_probe_succeeds() -> None:
    """Issue 29: past its ejection a replica is probed by the router (``probes_due``), never
    given a client's prompt; only a successful probe puts it back in rotation."""
    h = make()
    for t in (0.0, 0.1, 0.2):
        h.record_failure("a", t, "x")
    assert h.problem("a", 5.1) is not None  # opened at 0.2 for 5 s
    assert h.probes_due(5.1) == []
    assert "waiting for a probe" in (h.problem("a", 5.3) or "")  # ejection over: still out
    assert h.probes_due(5.3) == ["a"] and h.probes_due(5.3) == []  # one probe at a time
    assert h.state("a") == HALF_OPEN and "probe" in (h.problem("a", 5.3) or "")
    h.probe_done("a", 5.4, False)  # the probe failed: open for 10 s
    assert h.problem("a", 15.3) is not None and h.probes_due(15.3) == []
    assert h.probes_due(15.5) == ["a"]
    h.probe_done("a", 15.6, False)  # capped at max_ejection_s (12, not 20)
    assert h.probes_due(27.5) == [] and h.probes_due(27.7) == ["a"]
    h.probe_done("a", 27.7, None)  # not judged (the router's loop ran late): probed again
    assert h.problem("a", 27.8) is not None and h.probes_due(27.8) == ["a"]
    h.probe_done("a", 27.9, True)
    assert h.state("a") == CLOSED and h.problem("a", 27.9) is None
    for t in (30.0, 30.1, 30.2):  # closed after a good probe: the ejection starts over at 5 s
        h.record_failure("a", t, "x")
    assert h.problem("a", 35.1) is not None and h.probes_due(35.3) == ["a"]


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


def test_a_first_byte_deadline_follows_the_expected_time_with_a_floor() -> None:
    assert first_byte_deadline_s(0.05, 4.0, 5.0) == 5.0
    assert first_byte_deadline_s(3.0, 4.0, 5.0) == 12.0
    h = make(deadline_factor=4.0, deadline_floor_s=5.0)
    h.attempt_started("a", 0.0, streamed=False, expected_s=3.0)
    h.progress("b", 11.0)
    assert h.overdue(11.9) == []  # 12 s: 4 x the 3 s it should take
    assert [o.verdict for o in h.overdue(12.0)] == [HUNG]


def test_a_silent_replica_past_a_deadline_is_hung_while_others_progress() -> None:
    h = make(deadline_floor_s=5.0)
    token = h.attempt_started("a", 0.0, streamed=False, expected_s=0.1, fallback=True)
    h.attempt_started("a", 1.0, streamed=False, expected_s=0.1)
    h.progress("b", 2.0)  # another replica answered meanwhile
    assert h.overdue(4.9) == []
    assert h.overdue(5.0) == [Overdue("a", token, HUNG, True)]
    h.trip("a", 5.0, HUNG)
    assert h.overdue(6.0) == []  # benched: nothing more to judge
    assert h.state("a") == OPEN


def test_a_deadline_missed_while_the_router_ran_late_is_not_judged() -> None:
    """The router's own loop ran late over the deadline's span (``router.observability.loop_lag``): the
    replica's first byte may be unread, so the attempt is reported once as ``ROUTER_LATE`` and
    waits on; judged as usual once a span is clean."""
    h = make(deadline_floor_s=5.0)
    token = h.attempt_started("a", 0.0, streamed=False, expected_s=0.1)
    h.progress("b", 5.5)

    def late(since: float, now: float) -> bool:
        return since < 3.0

    assert h.overdue(6.0, late) == [Overdue("a", token, ROUTER_LATE, False)]
    assert h.overdue(7.0, late) == []  # reported once
    h.progress("b", 8.5)
    assert h.overdue(9.0, late) == [Overdue("a", token, HUNG, False)]  # span 4-9: clean


def test_loop_lag_sums_the_late_wake_ups_of_a_span() -> None:
    lag = LoopLag()
    lag._due = 10.0
    lag.record(10.001)  # noise: not recorded
    lag._due = 11.0
    lag.record(13.0)  # 2 s late
    lag._due = 13.05
    assert lag.lateness(9.0, 13.05) == pytest.approx(2.0)
    assert lag.lateness(13.0, 13.05) == 0.0  # the late wake-up ended at the span's start
    assert lag.late(9.0, 13.05) and not lag.late(13.0, 13.05)
    assert lag.lateness(13.0, 14.05) == pytest.approx(1.0)  # the sampler overdue by 1 s now
    assert lag.lateness(13.9, 14.0) == pytest.approx(0.1)  # never more than the span


def test_a_busy_replica_past_a_deadline_is_not_judged() -> None:
    """Any byte (another request's answer) or KV event from the replica within the deadline's
    span means it is working: a long prompt or a long queue, not a hang."""
    h = make(deadline_floor_s=5.0)
    h.attempt_started("a", 0.0, streamed=False, expected_s=0.1)
    h.progress("b", 4.0)
    h.progress("a", 3.0)  # e.g. its engine's KV events
    assert h.overdue(7.0) == []
    assert h.overdue(7.9) == []
    assert [o.verdict for o in h.overdue(8.1)] == [HUNG]  # silent for a whole deadline since
    h.record_success("a")


def test_a_missed_deadline_with_nothing_progressing_counts_once_against_the_breaker() -> None:
    h = make(deadline_floor_s=5.0)
    first = h.attempt_started("a", 0.0, streamed=False, expected_s=0.1, fallback=True)
    assert h.overdue(5.0) == [Overdue("a", first, MISSED, True)]
    assert h.overdue(6.0) == []  # reported once
    last = h.attempt_started("a", 6.0, streamed=False, expected_s=0.1)
    assert h.overdue(11.0) == [Overdue("a", last, MISSED, False)]
    # the breaker counts what the caller records: three in a row open the circuit
    assert not h.record_failure("a", 5.0, MISSED)
    assert not h.record_failure("a", 11.0, MISSED)
    assert h.record_failure("a", 12.0, MISSED)


def test_an_answered_attempt_or_an_open_circuit_is_not_judged() -> None:
    h = make(deadline_floor_s=5.0)
    token = h.attempt_started("a", 0.0, streamed=False, expected_s=0.1)
    h.first_byte("a", token, 0.5)
    h.progress("b", 9.0)
    assert h.overdue(10.0) == []  # answered (a non-streamed body still arriving is the relay's)
    old = h.attempt_started("c", 0.0, streamed=False, expected_s=0.1)
    h.trip("c", 1.0, "http_500")
    assert h.overdue(5.5) == []
    h.attempt_ended("c", old)
    assert h.probes_due(7.0) == ["c"]  # half-open: a request in panic mode is judged
    probe = h.attempt_started("c", 7.0, streamed=False, expected_s=0.1)
    h.progress("b", 11.0)
    assert Overdue("c", probe, HUNG, False) in h.overdue(12.0)


def test_a_client_giving_up_far_past_the_expected_time_counts() -> None:
    h = make(deadline_factor=4.0)
    token = h.attempt_started("a", 0.0, streamed=False, expected_s=0.5)
    assert not h.gave_up("a", token, 1.9)  # within 4 x 0.5 s
    assert h.gave_up("a", token, 2.0)
    h.progress("a", 1.0)
    assert not h.gave_up("a", token, 3.0)  # it was working meanwhile
    quick = h.attempt_started("a", 10.0, streamed=False, expected_s=0.01)
    assert not h.gave_up("a", quick, 10.5)  # under MIN_GIVE_UP_S: a user pressing stop
    answered = h.attempt_started("a", 20.0, streamed=True, expected_s=0.01)
    h.first_byte("a", answered, 20.1)
    assert not h.gave_up("a", answered, 30.0)  # mid-stream: not a wait for a first byte


def test_others_progress_counts_within_the_stall_span_even_before_the_send() -> None:
    """Closed-loop clients stuck on a hung replica stop the others' traffic: the others'
    answers just before the send still show that the router reaches the fleet."""
    h = make(deadline_floor_s=5.0, stall_timeout_s=10.0)
    h.progress("b", -1.0)
    token = h.attempt_started("a", 0.0, streamed=False, expected_s=0.1)
    assert h.overdue(5.0) == [Overdue("a", token, HUNG, False)]
    h = make(deadline_floor_s=5.0, stall_timeout_s=4.0)
    h.progress("b", -1.0)  # 6 s before: beyond both spans
    token = h.attempt_started("a", 0.0, streamed=False, expected_s=0.1)
    assert h.overdue(5.0) == [Overdue("a", token, MISSED, False)]


def test_an_engine_holding_requests_whose_kv_events_still_come_is_busy() -> None:
    """Events come once per 256 generated tokens (coarse index): a long generation leaves
    gaps longer than a deadline, but its engine reports the request running."""
    h = make(deadline_floor_s=5.0)
    h.engine_report("a", 0.0, active=True, events=True)
    h.attempt_started("a", 1.0, streamed=False, expected_s=0.1)
    h.progress("b", 9.0)
    assert h.overdue(9.0) == []  # running, last events 9 s ago
    h.engine_report("a", 9.5, active=False, events=False)  # the engine holds nothing: not ours
    assert [o.verdict for o in h.overdue(10.0)] == [HUNG]
    h = make(deadline_floor_s=5.0)
    h.engine_report("a", 0.0, active=True, events=True)
    token = h.attempt_started("a", 1.0, streamed=False, expected_s=0.1)
    h.progress("b", 58.0)
    assert h.overdue(59.0) == []  # events 59 s ago: within ENGINE_EVENT_SPAN_S
    assert h.overdue(61.0) == [Overdue("a", token, HUNG, False)]  # holding, no events: hung


def test_a_refused_connection_counts_until_an_answer_or_the_window_ends() -> None:
    h = make()  # failure_window_s 10
    assert not h.refused("a", 0.0)
    h.record_refused("a", 0.0)
    assert h.refused("a", 9.0) and not h.refused("a", 11.0)  # circuit closed: the window
    for t in (0.0, 1.0, 2.0):
        h.record_failure("a", t, "connect_refused")
    h.record_refused("a", 2.0)
    assert h.state("a") == OPEN and h.refused("a", 100.0)  # not answered since: still refusing
    assert h.probes_due(100.0) == ["a"]
    h.probe_done("a", 100.0, True)
    assert not h.refused("a", 100.0)
    h.record_refused("b", 0.0)
    h.first_byte("b", 0, 1.0)  # it answered
    assert not h.refused("b", 1.0)


def test_a_client_request_served_after_the_circuit_opened_closes_it() -> None:
    """Panic mode routes to a replica whose circuit is open: a 2xx answer to a request sent
    since it opened shows it serves, and /ready says so at once (it waited for the next probe,
    up to max_ejection_s); a 4xx (the API server alone) or an answer to an older request does
    not."""
    h = make()
    for t in (0.0, 1.0, 2.0):
        h.record_failure("a", t, "connect_refused")
    h.record_refused("a", 2.0)
    assert h.state("a") == OPEN and h.refused("a", 3.0)
    h.record_success("a", 1.5, served=True)  # sent before it opened (at 2.0)
    assert h.state("a") == OPEN and not h.refused("a", 3.0)  # it answered: it listens
    h.record_success("a", 3.0, served=False)  # a 4xx
    assert h.state("a") == OPEN
    h.record_success("a", 3.0, served=True)
    assert h.state("a") == CLOSED and h.problem("a", 3.1) is None


def test_a_static_health_probe_answered_ends_refused() -> None:
    h = make()
    for t in (0.0, 1.0, 2.0):
        h.record_failure("a", t, "connect_refused")
    h.record_refused("a", 2.0)
    assert h.refused("a", 50.0)  # the circuit open, no probe yet
    h.listening("a")  # its /health answered
    assert not h.refused("a", 50.0) and h.state("a") == OPEN


def test_only_a_completion_proves_a_probed_replica_serves() -> None:
    from router.edges.circuit_probe import probe_verdict

    completion = b'{"id": "c", "object": "text_completion", "choices": [{"text": "!"}]}'
    assert probe_verdict(200, completion) is None
    assert "API key" in (probe_verdict(401, b'{"error": "Unauthorized"}') or "")
    for status, body in ((404, b'{"error": {}}'), (400, b"{}"), (200, b"ok"),
                         (200, b'{"status": "ok"}'), (503, b"")):
        assert probe_verdict(status, body) is not None, (status, body)
