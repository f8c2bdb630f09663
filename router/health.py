"""Passive health of replicas from request outcomes: a circuit breaker and a stall detector. Pure.

Two rules, both fed by the proxy and evaluated with the caller's monotonic clock:

* **Circuit breaker** (Envoy's outlier detection: ``consecutive_5xx`` / gateway failures, an
  ejection that grows with each repeat, then a half-open probe). ``failure_threshold``
  consecutive failed attempts within ``failure_window_s`` open a replica's circuit: it takes
  no traffic for ``ejection_s`` x 2^(ejections so far), at most ``max_ejection_s``. Then it is
  half-open: exactly one request may go to it; success closes the circuit, failure opens it
  again for longer. A failure is a 5xx answer, a refused, reset or timed-out connection, a
  response that is not HTTP, a broken or stalled stream; a 4xx is the replica answering (the
  request's fault), a client disconnect is neither.
* **Stall detection** (a hung replica answers nothing, so no error ever arrives): a replica
  with streamed requests in flight that has sent no byte for ``stall_timeout_s`` while another
  replica did send bytes in that time is stalled; the caller opens its circuit and moves its
  waiting requests. Non-streamed requests are judged by the first-byte timeout only (their
  first byte is the whole answer, which may take minutes).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Final

CLOSED: Final = "closed"
OPEN: Final = "open"
HALF_OPEN: Final = "half_open"


@dataclass(slots=True)
class _Breaker:
    state: str = CLOSED
    failures: deque[float] = field(default_factory=deque)  # monotonic times of consecutive failures
    open_until: float = 0.0
    ejections: int = 0  # times opened since it last closed after a successful probe
    trial_inflight: bool = False  # half-open: the one probe request is out
    cause: str = ""  # of the last opening


@dataclass(frozen=True, slots=True)
class HealthParams:
    """Thresholds (see the module docstring); times in seconds."""

    failure_threshold: int = 3
    failure_window_s: float = 30.0
    ejection_s: float = 5.0
    max_ejection_s: float = 60.0
    stall_timeout_s: float = 15.0


class ReplicaHealth:
    """Breaker state and streamed-attempt progress per replica id."""

    def __init__(self, params: HealthParams | None = None) -> None:
        self.params = params or HealthParams()
        self._breakers: dict[str, _Breaker] = {}  # {replica_id: breaker}
        self._last_byte: dict[str, float] = {}  # {replica_id: monotonic time of its last byte}
        # {replica_id: {attempt token: monotonic start}} for streamed attempts in flight
        self._streamed: dict[str, dict[int, float]] = {}
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
        return None

    def state(self, replica_id: str) -> str:
        b = self._breakers.get(replica_id)
        return CLOSED if b is None else b.state

    def on_dispatch(self, replica_id: str, now: float) -> None:
        """A request is sent to ``replica_id``: past its ejection it becomes the half-open probe."""
        b = self._breakers.get(replica_id)
        if b is not None and b.state != CLOSED and now >= b.open_until and not b.trial_inflight:
            b.state = HALF_OPEN
            b.trial_inflight = True

    def record_success(self, replica_id: str) -> None:
        """An attempt the replica answered (any status below 500): closes a half-open circuit
        and resets the consecutive-failure count."""
        b = self._breakers.get(replica_id)
        if b is None:
            return
        b.failures.clear()
        if b.state == HALF_OPEN:
            b.state, b.trial_inflight, b.ejections = CLOSED, False, 0

    def record_neutral(self, replica_id: str) -> None:
        """An attempt that ended saying nothing about the replica (the client went away)."""
        b = self._breakers.get(replica_id)
        if b is not None and b.state == HALF_OPEN:
            b.trial_inflight = False

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
        b.open_until = now + min(p.ejection_s * 2 ** b.ejections, p.max_ejection_s)
        b.state, b.trial_inflight, b.cause = OPEN, False, cause
        b.ejections += 1
        b.failures.clear()

    def forget(self, replica_id: str) -> None:
        """The replica left the fleet."""
        self._breakers.pop(replica_id, None)
        self._last_byte.pop(replica_id, None)
        self._streamed.pop(replica_id, None)

    # -- stall detection --------------------------------------------------------

    def attempt_started(self, replica_id: str, now: float) -> int:
        """A streamed attempt was sent; returns its token for ``attempt_ended``."""
        self._next_token += 1
        self._streamed.setdefault(replica_id, {})[self._next_token] = now
        return self._next_token

    def attempt_ended(self, replica_id: str, token: int) -> None:
        attempts = self._streamed.get(replica_id)
        if attempts is not None:
            attempts.pop(token, None)

    def progress(self, replica_id: str, now: float) -> None:
        """``replica_id`` sent bytes (a first byte or a stream chunk)."""
        self._last_byte[replica_id] = now

    def stalled(self, now: float) -> list[str]:
        """Replicas silent for ``stall_timeout_s`` with streamed requests in flight, while some
        other replica sent bytes within that time; circuits already open are left out."""
        limit = self.params.stall_timeout_s
        recent = {rid for rid, ts in self._last_byte.items() if now - ts < limit}
        found = []
        for rid, attempts in self._streamed.items():
            if not attempts or not recent - {rid} or self.problem(rid, now) is not None:
                continue
            silent_since = max(self._last_byte.get(rid, float("-inf")), min(attempts.values()))
            if now - silent_since >= limit:
                found.append(rid)
        return found
