"""This router's in-flight work per replica, counted at dispatch: ``LoadTracker`` and the
``LoadTicket`` each dispatched request holds. Pure bookkeeping.

The policies (``router.decision.policy``) read it through ``Candidate``: requests, prefill tokens
and recent KV writes per replica, and ``requests_at`` to line a heartbeat's load up with what this
router had sent by then.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from typing import Final

from router.decision.ttft import DEFAULT_OUTPUT_TOKENS


class LoadTracker:
    """This router's in-flight work per replica, counted at dispatch. Pure bookkeeping.

    ``dispatch`` adds one request and its prefill tokens; ``first_token``
    releases the prefill tokens; ``finish`` releases whatever is still held.
    Both are idempotent per ticket, so every exit path (success, upstream
    error, client disconnect, timeout) can call ``finish`` safely.
    """

    __slots__ = ("_avg_output_tokens", "_avg_prompt_tokens", "_clock", "_context", "_history",
                 "_prefill", "_prefilling", "_requests", "_writes", "_written")

    _EWMA_ALPHA: Final = 0.05
    HISTORY_S: Final = 10.0  # seconds of dispatch/finish times kept for ``requests_at``

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock  # wall clock, comparable with heartbeat timestamps
        self._requests: dict[str, int] = {}  # {replica_id: in-flight requests}
        self._prefill: dict[str, int] = {}  # {replica_id: prefill tokens before first token}
        self._prefilling: dict[str, int] = {}  # {replica_id: requests before first token}
        # {replica_id: deque of (wall time, +1 dispatch | -1 finish)}, oldest first
        self._history: dict[str, deque[tuple[float, int]]] = {}
        self._avg_prompt_tokens = 0.0
        self._avg_output_tokens = 0.0  # 0: nothing reported yet
        self._context: dict[str, int] = {}  # {replica_id: prompt tokens of in-flight requests}
        self._written = 0.0  # KV blocks sent to be written, all replicas, ever
        self._writes: dict[str, tuple[float, float]] = {}  # {replica_id: (decayed blocks, _written then)}

    @property
    def avg_prompt_tokens(self) -> float:
        """Exponentially weighted mean prompt length (tokens) of dispatched requests."""
        return self._avg_prompt_tokens

    @property
    def avg_output_tokens(self) -> float:
        """Exponentially weighted mean of the generated tokens engines reported
        (``observe_output``); ``DEFAULT_OUTPUT_TOKENS`` before the first report."""
        return self._avg_output_tokens or float(DEFAULT_OUTPUT_TOKENS)

    def observe_output(self, tokens: int) -> None:
        """A request ended having generated ``tokens`` (the engine's ``usage.completion_tokens``)."""
        if tokens <= 0:
            return
        if self._avg_output_tokens == 0.0:
            self._avg_output_tokens = float(tokens)
        else:
            self._avg_output_tokens += self._EWMA_ALPHA * (tokens - self._avg_output_tokens)

    def _record(self, replica_id: str, delta: int) -> None:
        now = self._clock()
        history = self._history.get(replica_id)
        if history is None:
            history = self._history[replica_id] = deque()
        history.append((now, delta))
        horizon = now - self.HISTORY_S
        while history and history[0][0] < horizon:
            history.popleft()

    def requests_at(self, replica_id: str, wall_ts: float) -> int | None:
        """This router's in-flight requests on ``replica_id`` at wall time ``wall_ts``.

        Reconstructed from the dispatch/finish times of the last ``HISTORY_S``
        seconds; None when ``wall_ts`` is older than that (or in the future).
        """
        now = self._clock()
        if not now - self.HISTORY_S <= wall_ts <= now:
            return None
        count = self._requests.get(replica_id, 0)
        for ts, delta in reversed(self._history.get(replica_id, ())):
            if ts <= wall_ts:
                break
            count -= delta
        return max(count, 0)

    def dispatch(self, replica_id: str, prefill_tokens: int, context_tokens: int = 0) -> LoadTicket:
        """Count one request on ``replica_id``: ``prefill_tokens`` to compute (released at its
        first token), ``context_tokens`` of KV it holds there until it ends (its prompt)."""
        self._record(replica_id, +1)
        self._context[replica_id] = self._context.get(replica_id, 0) + context_tokens
        self._requests[replica_id] = self._requests.get(replica_id, 0) + 1
        self._prefill[replica_id] = self._prefill.get(replica_id, 0) + prefill_tokens
        self._prefilling[replica_id] = self._prefilling.get(replica_id, 0) + 1
        if self._avg_prompt_tokens == 0.0:
            self._avg_prompt_tokens = float(prefill_tokens)
        else:
            self._avg_prompt_tokens += self._EWMA_ALPHA * (prefill_tokens - self._avg_prompt_tokens)
        return LoadTicket(self, replica_id, prefill_tokens, context_tokens)

    def _release_prefill(self, ticket: LoadTicket) -> None:
        rid = ticket.replica_id
        self._prefill[rid] -= ticket.prefill_tokens
        self._prefilling[rid] -= 1

    def _release_request(self, ticket: LoadTicket) -> None:
        self._record(ticket.replica_id, -1)
        self._requests[ticket.replica_id] -= 1
        self._context[ticket.replica_id] -= ticket.context_tokens

    def record_writes(self, replica_id: str, blocks: int, window_blocks: float) -> None:
        """Count ``blocks`` new KV blocks (the prompt's blocks beyond its predicted hit) sent to
        ``replica_id``; see ``recent_writes``."""
        self._written += blocks
        self._writes[replica_id] = (self.recent_writes(replica_id, window_blocks) + blocks,
                                    self._written)

    def withdraw_writes(self, replica_id: str, blocks: int, window_blocks: float) -> None:
        """Undo ``record_writes`` for a request the replica refused (clamped at 0)."""
        if replica_id in self._writes:
            self._writes[replica_id] = (
                max(self.recent_writes(replica_id, window_blocks) - blocks, 0.0), self._written)

    def recent_writes(self, replica_id: str, window_blocks: float) -> float:
        """KV blocks this router recently had ``replica_id`` write, each weighted
        ``exp(-x / window_blocks)`` where ``x`` is the blocks written fleet-wide since. Decaying by
        writes rather than seconds matches an LRU cache, which forgets at the rate it writes."""
        entry = self._writes.get(replica_id)
        if entry is None:
            return 0.0
        value, at = entry
        return value * math.exp(-(self._written - at) / window_blocks)

    def requests(self, replica_id: str) -> int:
        return self._requests.get(replica_id, 0)

    def prefill_tokens(self, replica_id: str) -> int:
        return self._prefill.get(replica_id, 0)

    def prefilling(self, replica_id: str) -> int:
        return self._prefilling.get(replica_id, 0)

    def context_tokens(self, replica_id: str) -> int:
        return self._context.get(replica_id, 0)

    def snapshot(self) -> dict[str, dict[str, int]]:
        """``{replica_id: {"requests", "prefill_tokens", "prefilling", "context_tokens"}}`` for
        every replica seen."""
        return {rid: {"requests": self.requests(rid), "prefill_tokens": self.prefill_tokens(rid),
                      "prefilling": self.prefilling(rid), "context_tokens": self.context_tokens(rid)}
                for rid in sorted(self._requests)}


class LoadTicket:
    """One dispatched request's hold on a replica's load (see ``LoadTracker``)."""

    __slots__ = ("_done", "_prefill_done", "context_tokens", "prefill_tokens", "replica_id",
                 "tracker")

    def __init__(self, tracker: LoadTracker, replica_id: str, prefill_tokens: int,
                 context_tokens: int = 0) -> None:
        self.tracker = tracker
        self.replica_id = replica_id
        self.prefill_tokens = prefill_tokens
        self.context_tokens = context_tokens
        self._prefill_done = False
        self._done = False

    def first_token(self) -> None:
        """The replica produced its first byte: the prefill is over."""
        if not self._prefill_done:
            self._prefill_done = True
            self.tracker._release_prefill(self)

    def resize_prefill(self, prefill_tokens: int) -> None:
        """Correct the prefill held (an estimated prompt length became exact); no-op once the
        prefill was released."""
        if not self._prefill_done:
            self.tracker._prefill[self.replica_id] += prefill_tokens - self.prefill_tokens
            self.prefill_tokens = prefill_tokens

    def finish(self) -> None:
        """The request ended, on any path. Releases everything still held."""
        self.first_token()
        if not self._done:
            self._done = True
            self.tracker._release_request(self)
