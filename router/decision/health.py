"""Passive health of replicas from request outcomes: a circuit breaker, a stall detector and
first-byte deadlines. Pure.

Three rules, all fed by the proxy and evaluated with the caller's monotonic clock:

* **Circuit breaker** (Envoy's outlier detection: ``consecutive_5xx`` / gateway failures, an
  ejection that grows with each repeat, then a half-open probe). ``failure_threshold``
  consecutive failed attempts within ``failure_window_s`` open a replica's circuit: it takes
  no traffic for ``ejection_s`` x 2^(ejections so far), at most ``max_ejection_s``. Then it is
  half-open: still no client request goes to it, but the router sends it a probe of its own
  (``probes_due`` / ``probe_done``; ``router.edges.circuit_probe``: a 1-token completion, which only an
  engine that runs can answer); success closes the circuit, failure opens it again for longer.
  A client prompt used as the probe waited a whole deadline on a hung replica before moving
  (issue 29: 5 of 60 prompts reached one over 120 s). A failure is a 5xx answer, a refused, reset or timed-out connection, a
  response that is not HTTP, a broken or stalled stream, a missed first-byte deadline (below)
  and a client that gave up waiting for a first byte far past its expected time (it waited
  ``deadline_factor`` x the expected time, and at least ``MIN_GIVE_UP_S``, while the replica
  sent nothing); a 4xx is the replica answering (the request's fault), any other client
  disconnect is neither.
* **Stall detection** (a hung replica answers nothing, so no error ever arrives): a replica
  with streamed requests in flight that has sent no byte for ``stall_timeout_s`` while another
  replica did send bytes in that time is stalled; the caller opens its circuit and moves its
  waiting requests.
* **First-byte deadlines**, streamed or not: each attempt carries the time its replica should
  take to a first byte (the TTFT model's estimate, queue wait and prefill included, plus the
  generation of a non-streamed answer; ``router.request.dispatch``) and a deadline,
  ``first_byte_deadline_s`` of it. An attempt past its deadline is judged (``overdue``) by the
  replica's progress (any byte it sent, or its engine's KV events, ``progress`` and
  ``engine_report``) over the deadline's span: some progress, or an engine that reports
  requests running or waiting while its KV events still come (``ENGINE_EVENT_SPAN_S``: the
  coarse index keeps one key in 16 blocks, so events come every 256 tokens), means the replica
  is busy, not hung (nothing is counted, the attempt waits on); none, while another replica progressed within ``stall_timeout_s`` (or the
  deadline's span if longer), means it is hung (the caller
  opens its circuit and moves every attempt still waiting there: the first byte has not come,
  so a retry is safe); none anywhere counts one failure against its breaker and moves that
  attempt only if it has a fallback (the last one keeps waiting, up to the first-byte timeout).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

CLOSED: Final = "closed"
OPEN: Final = "open"
HALF_OPEN: Final = "half_open"
HUNG: Final = "hung"  # ``overdue`` verdicts
MISSED: Final = "first_byte_deadline"
ROUTER_LATE: Final = "router_late"  # ``overdue``: not judged, the router's own loop ran late
ENGINE_EVENT_SPAN_S: Final = 60.0  # a replica whose engine reports requests running or waiting is
# busy while its KV events came within this: the index keeps one key per index_stride blocks, so
# one entry comes per 256 generated tokens at the defaults (16 x 16), 13 s at 50 ms per token;
# a hung engine holding requests sends none
MIN_GIVE_UP_S: Final = 1.0  # a client leaving sooner says nothing of the replica (a user
# pressing stop): it never counts as a failure


def first_byte_deadline_s(expected_s: float, factor: float, floor_s: float) -> float:
    """Seconds an attempt may wait for its first byte before it is judged: ``factor`` x
    ``expected_s`` (what the replica should take), at least ``floor_s``."""
    return max(floor_s, factor * expected_s)


@dataclass(slots=True)
class _Breaker:
    state: str = CLOSED
    failures: deque[float] = field(default_factory=deque)  # monotonic times of consecutive failures
    open_until: float = 0.0
    opened_at: float = 0.0  # monotonic time it last opened
    ejections: int = 0  # times opened since it last closed after a successful probe
    trial_inflight: bool = False  # half-open: the one probe request is out
    cause: str = ""  # of the last opening
    # monotonic time of its last refused connection (ECONNREFUSED) with no answer since, or None
    refused_at: float | None = None


@dataclass(frozen=True, slots=True)
class HealthParams:
    """Thresholds (see the module docstring); times in seconds."""

    failure_threshold: int = 3
    failure_window_s: float = 30.0
    ejection_s: float = 5.0
    max_ejection_s: float = 60.0
    stall_timeout_s: float = 15.0
    deadline_factor: float = 4.0  # a first-byte deadline is this x the expected time ...
    deadline_floor_s: float = 5.0  # ... and at least this


@dataclass(slots=True)
class _Attempt:
    """One attempt in flight (monotonic seconds)."""

    replica_id: str
    sent_at: float
    streamed: bool
    expected_s: float  # time to its first byte the replica should take
    deadline_s: float  # ``first_byte_deadline_s`` of ``expected_s``
    fallback: bool  # another replica would take it if it were moved
    answered: bool = False  # its first byte came
    counted: bool = False  # a missed deadline was counted against the replica
    late: bool = False  # reported once as not judged: the router's loop ran late


@dataclass(frozen=True, slots=True)
class Overdue:
    """An attempt past its first-byte deadline with no progress from its replica: ``verdict``
    ``HUNG`` (others progressed: bench the replica, move its waiting attempts) or ``MISSED``
    (count one failure; move the attempt when ``fallback``)."""

    replica_id: str
    token: int
    verdict: str
    fallback: bool


class ReplicaHealth:
    """Breaker state, attempts in flight and progress per replica id."""

    def __init__(self, params: HealthParams | None = None) -> None:
        self.params = params or HealthParams()
        self._breakers: dict[str, _Breaker] = {}  # {replica_id: breaker}
        # {replica_id: monotonic time of its last progress: a byte, or its engine's KV events}
        self._last_byte: dict[str, float] = {}
        self._attempts: dict[str, dict[int, _Attempt]] = {}  # {replica_id: {token: attempt}}
        self._last_event: dict[str, float] = {}  # {replica_id: monotonic time of its KV events}
        self._engine_active: set[str] = set()  # replicas whose engine runs or queues requests
        self._next_token = 0

    # -- circuit breaker --------------------------------------------------------

    def problem(self, replica_id: str, now: float) -> str | None:
        """Why the breaker keeps ``replica_id`` out of rotation now, or ``None``."""
        b = self._breakers.get(replica_id)
        if b is None or b.state == CLOSED:
            return None
        if b.state == OPEN and now < b.open_until:
            return (f"circuit open for {b.open_until - now:.1f} s more after {b.cause} "
                    f"(ejection {b.ejections})")
        if b.trial_inflight:
            return "circuit half-open: a probe request is in flight"
        return "circuit half-open: waiting for a probe to succeed"

    def state(self, replica_id: str) -> str:
        b = self._breakers.get(replica_id)
        return CLOSED if b is None else b.state

    def probes_due(self, now: float) -> list[str]:
        """Replicas past their ejection with no probe out: each is half-open now, its probe
        counted as out until ``probe_done``."""
        due = []
        for rid, b in self._breakers.items():
            if b.state != CLOSED and now >= b.open_until and not b.trial_inflight:
                b.state, b.trial_inflight = HALF_OPEN, True
                due.append(rid)
        return due

    def probe_done(self, replica_id: str, now: float, ok: bool | None) -> None:
        """The probe of ``replica_id`` ended: answered (``ok``: closes the circuit), failed
        (opens it again, for longer) or ``None``: judged nothing (the router's own loop ran
        late; another probe goes next time)."""
        b = self._breakers.get(replica_id)
        if b is None or b.state != HALF_OPEN:
            return  # closed meanwhile (a request in panic mode answered), or forgotten
        if ok:
            b.state, b.trial_inflight, b.ejections = CLOSED, False, 0
            b.failures.clear()
            b.refused_at = None
        elif ok is None:
            b.trial_inflight = False
        else:
            self._open(b, now, "probe_failed")

    def record_success(self, replica_id: str, sent_at: float | None = None,
                       served: bool = False) -> None:
        """An attempt the replica answered (any status below 500): resets the consecutive-failure
        count and the refused connection. ``served``: the answer proves the engine serves (a
        2xx; a 4xx may come from the API server alone): it closes the circuit, half-open or
        open, if the attempt was sent at ``sent_at`` (monotonic) after the circuit opened (panic
        mode routes to a replica whose circuit is open; an older attempt says nothing of the
        replica since), as a successful probe does."""
        b = self._breakers.get(replica_id)
        if b is None:
            return
        b.failures.clear()
        b.refused_at = None
        if b.state == HALF_OPEN or (served and b.state == OPEN and sent_at is not None
                                    and sent_at >= b.opened_at):
            b.state, b.trial_inflight, b.ejections = CLOSED, False, 0

    def listening(self, replica_id: str) -> None:
        """``replica_id`` answered on its port (a static ``/health`` probe): it no longer
        refuses connections (``refused``), whatever its circuit says."""
        b = self._breakers.get(replica_id)
        if b is not None:
            b.refused_at = None

    def record_refused(self, replica_id: str, now: float) -> None:
        """A connection to ``replica_id`` was refused (ECONNREFUSED: nothing listens on its
        port). Unlike a timeout, which a late router loop or a burst of connects can cause, a
        refusal is the kernel of the replica's host saying it is down (``refused``)."""
        self._breakers.setdefault(replica_id, _Breaker()).refused_at = now

    def refused(self, replica_id: str, now: float) -> bool:
        """Whether ``replica_id`` refused its last connection with no answer since: within
        ``failure_window_s``, or at any time while its circuit is not closed (it has not
        answered a probe since). Panic mode skips such a replica while another is left, and a
        router whose every replica refuses is not ready (``router.decision.fleet``)."""
        b = self._breakers.get(replica_id)
        if b is None or b.refused_at is None:
            return False
        return b.state != CLOSED or now - b.refused_at <= self.params.failure_window_s

    def record_failure(self, replica_id: str, now: float, cause: str) -> bool:
        """A failed attempt. Returns True when this opened the circuit."""
        b = self._breakers.setdefault(replica_id, _Breaker())
        p = self.params
        if b.state == OPEN and now < b.open_until:
            return False  # an attempt sent before the circuit opened
        if b.state == CLOSED:
            b.failures.append(now)
            while b.failures and b.failures[0] < now - p.failure_window_s:
                b.failures.popleft()
            if len(b.failures) < p.failure_threshold:
                return False
        self._open(b, now, cause)
        return True

    def trip(self, replica_id: str, now: float, cause: str) -> bool:
        """Open the circuit now (a stalled replica). Returns False if it was open already."""
        b = self._breakers.setdefault(replica_id, _Breaker())
        if b.state == OPEN and now < b.open_until:
            return False
        self._open(b, now, cause)
        return True

    def _open(self, b: _Breaker, now: float, cause: str) -> None:
        p = self.params
        b.opened_at = now
        b.open_until = now + min(p.ejection_s * 2 ** b.ejections, p.max_ejection_s)
        b.state, b.trial_inflight, b.cause = OPEN, False, cause
        b.ejections += 1
        b.failures.clear()

    def forget(self, replica_id: str) -> None:
        """The replica left the fleet."""
        self._breakers.pop(replica_id, None)
        self._last_byte.pop(replica_id, None)
        self._attempts.pop(replica_id, None)
        self._last_event.pop(replica_id, None)
        self._engine_active.discard(replica_id)

    # -- attempts in flight -----------------------------------------------------

    def attempt_started(self, replica_id: str, now: float, streamed: bool = True,
                        expected_s: float = math.inf, fallback: bool = False) -> int:
        """An attempt was sent to ``replica_id``; ``expected_s``: seconds the replica should take
        to its first byte (``math.inf``: no deadline); ``fallback``: another replica would take
        it if it were moved. Returns its token for ``first_byte`` and ``attempt_ended``."""
        p = self.params
        self._next_token += 1
        self._attempts.setdefault(replica_id, {})[self._next_token] = _Attempt(
            replica_id, now, streamed, expected_s,
            first_byte_deadline_s(expected_s, p.deadline_factor, p.deadline_floor_s), fallback)
        return self._next_token

    def first_byte(self, replica_id: str, token: int, now: float) -> None:
        """The attempt's first byte came (its deadline no longer applies)."""
        attempt = self._attempts.get(replica_id, {}).get(token)
        if attempt is not None:
            attempt.answered = True
        b = self._breakers.get(replica_id)
        if b is not None:
            b.refused_at = None  # it answers: whatever refused before is up now
        self.progress(replica_id, now)

    def attempt_ended(self, replica_id: str, token: int) -> None:
        attempts = self._attempts.get(replica_id)
        if attempts is not None:
            attempts.pop(token, None)

    def gave_up(self, replica_id: str, token: int, now: float) -> bool:
        """The client left while the attempt waited for its first byte: True when that counts
        against the replica (see the module docstring), which the caller then records."""
        attempt = self._attempts.get(replica_id, {}).get(token)
        if attempt is None or attempt.answered or attempt.counted:
            return False
        waited = now - attempt.sent_at
        return (waited >= max(self.params.deadline_factor * attempt.expected_s, MIN_GIVE_UP_S)
                and self._last_byte.get(replica_id, -math.inf) < attempt.sent_at)

    def progress(self, replica_id: str, now: float) -> None:
        """``replica_id`` sent bytes (a first byte or a stream chunk)."""
        self._last_byte[replica_id] = now

    def engine_report(self, replica_id: str, now: float, active: bool, events: bool) -> None:
        """What ``replica_id``'s worker reported: its engine runs or queues requests
        (``active``, the heartbeat's counts), new KV events came (``events``: progress)."""
        if events:
            self._last_byte[replica_id] = self._last_event[replica_id] = now
        if active:
            self._engine_active.add(replica_id)
        else:
            self._engine_active.discard(replica_id)

    def _busy(self, replica_id: str, since: float, now: float) -> bool:
        """Progress since ``since``, or an engine holding requests whose KV events still come
        (``ENGINE_EVENT_SPAN_S``)."""
        if self._last_byte.get(replica_id, -math.inf) >= since:
            return True
        return (replica_id in self._engine_active
                and self._last_event.get(replica_id, -math.inf) >= now - ENGINE_EVENT_SPAN_S)

    def overdue(self, now: float,
                router_late: Callable[[float, float], bool] | None = None) -> list[Overdue]:
        """Attempts waiting for a first byte past their deadline whose replica sent nothing in
        the deadline's span (see the module docstring); a replica whose circuit is open already
        is left out (a half-open one's are judged: panic mode sends requests there), and a
        ``MISSED`` attempt is reported once. ``router_late(since, now)``: the router's own loop
        ran late over that span (``router.observability.loop_lag``): the replica's bytes may be unread, so the
        attempt is not judged (reported once as ``ROUTER_LATE``) and waits on."""
        found = []
        for rid, attempts in self._attempts.items():
            b = self._breakers.get(rid)
            if not attempts or (b is not None and b.state == OPEN and now < b.open_until):
                continue
            for token, a in attempts.items():
                if a.answered or a.counted or now - a.sent_at < a.deadline_s:
                    continue
                since = now - a.deadline_s  # the deadline's span, ending now
                if self._busy(rid, since, now):
                    continue  # busy, not hung: it waits on
                if router_late is not None and router_late(since, now):
                    if not a.late:
                        a.late = True
                        found.append(Overdue(rid, token, ROUTER_LATE, a.fallback))
                    continue
                # the router itself reaches the fleet: another replica progressed lately (the
                # stall rule's span, or this deadline's if longer)
                lately = now - max(a.deadline_s, self.params.stall_timeout_s)
                others = any(ts >= lately for other, ts in self._last_byte.items() if other != rid)
                if others:
                    found.append(Overdue(rid, token, HUNG, a.fallback))
                    break  # the whole replica is benched
                a.counted = True
                found.append(Overdue(rid, token, MISSED, a.fallback))
        return found

    def stalled(self, now: float) -> list[str]:
        """Replicas silent for ``stall_timeout_s`` with streamed requests in flight, while some
        other replica sent bytes within that time; circuits already open are left out."""
        limit = self.params.stall_timeout_s
        recent = {rid for rid, ts in self._last_byte.items() if now - ts < limit}
        found = []
        for rid, attempts in self._attempts.items():
            streamed = [a.sent_at for a in attempts.values() if a.streamed]
            if not streamed or not recent - {rid} or self.problem(rid, now) is not None:
                continue
            silent_since = max(self._last_byte.get(rid, float("-inf")), min(streamed))
            if now - silent_since >= limit:
                found.append(rid)
        return found
