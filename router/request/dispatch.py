"""Step 4 of the request path: one record per dispatched request. Pure (asyncio only).

A request may be sent to several replicas in turn (the proxy retries before the first byte). For
each replica it is sent to, its ``Dispatch`` owns three things and settles them once, when the
request ends (``settle``):

- the **load ticket** (``LoadTracker.dispatch``: in-flight request and prefill tokens), released by
  the proxy at the first byte and the end; a non-streamed request's prefill is released at the
  time streamed ones to that replica took per prefill token (``Dispatcher.observe_first_byte``);
- the **placement**: the prompt's anchor keys recorded as speculatively placed there (index
  policies), and, for a lazily hashed chain, the rest once ``PromptChainer.hash_rest`` has it;
- the **expected first-byte time** there (``Dispatch.expected_first_byte_s``: the ttft policy's
  prediction, or the same model's estimate from the learned prefill rate, plus, for a
  non-streamed answer, the longest generation recent answers took), which sets the attempt's
  first-byte deadline (``router.decision.health``);
- the **KV writes** counted for it there (``LoadTracker.record_writes``: full blocks beyond the
  predicted hit, CPU-tier hits included: loaded, not written), corrected when a lazily
  tokenized text's exact length is known.

Settling (see ``Dispatch.settle``): the replica that served keeps all three; attempts that failed,
and an answer refusing the request, left no blocks, so their placements are withdrawn. A refusal
of the request itself (a 4xx, e.g. a prompt over the context length) and a stale connection's
repeat withdraw their KV writes too; a replica failure (5xx, connection, timeout) counts its
writes twice, so a replica failing every request never looks the emptiest (cold placement
prefers the fewest recent writes) even against the replica that then served it.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

from router.decision.fleet import Fleet
from router.decision.load import LoadTicket, LoadTracker
from router.decision.policy import TtftPrediction
from router.decision.ttft import PrefillRateLearner, prefill_work_tokens
from router.request.chain_cache import PromptChain
from router.request.errors import STATUS_CLIENT_CLOSED
from router.request.prompt_path import PromptChainer
from router.request.prompts import PromptSpec
from router.request.routing import Routed
from router.shared.contract import BlockKey, anchor_keys

PREFILL_RATE_EWMA_ALPHA = 0.1  # weight of the newest first-byte-per-prefill-token sample
ANSWER_WINDOW: Final = 64  # recent non-streamed answers whose generation time bounds the next
# one's (the router does not read max_tokens: the longest recent generation stands for it)


class GaugedTicket:
    """A ``LoadTicket`` that reports every change of its replica's load (``on_change(replica_id)``,
    e.g. to refresh the in-flight gauges).

    ``release_prefill_after(delay_s)`` releases the prefill part early, at an
    estimated first-token time (non-streamed requests, whose first byte is the
    whole answer); the timer is cancelled when the ticket is released otherwise.
    """

    __slots__ = ("_on_change", "_ticket", "_timer", "replica_id")

    def __init__(self, ticket: LoadTicket, on_change: Callable[[str], None]) -> None:
        self._ticket = ticket
        self._on_change = on_change
        self._timer: asyncio.TimerHandle | None = None
        self.replica_id = ticket.replica_id

    def release_prefill_after(self, delay_s: float) -> None:
        self._timer = asyncio.get_running_loop().call_later(delay_s, self._estimated_first_token)

    def resize_prefill(self, prefill_tokens: int) -> None:
        self._ticket.resize_prefill(prefill_tokens)
        self._on_change(self.replica_id)

    def _estimated_first_token(self) -> None:
        self._timer = None
        self._ticket.first_token()
        self._on_change(self.replica_id)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def first_token(self) -> None:
        self._cancel_timer()
        self._ticket.first_token()
        self._on_change(self.replica_id)

    def finish(self) -> None:
        self._cancel_timer()
        self._ticket.finish()
        self._on_change(self.replica_id)


@dataclass(slots=True)
class Placement:
    """What one send of a request to ``replica_id`` recorded there: the anchor keys placed
    speculatively (none outside the index policies), the KV-write blocks counted, its load
    ticket; ``withdrawn``: settled as not served, record nothing more."""

    replica_id: str
    keys: list[BlockKey] = field(default_factory=list)
    blocks: int = 0
    ticket: GaugedTicket | None = None
    withdrawn: bool = False
    sent_at: float = 0.0  # perf_counter at the send


class Dispatcher:
    """Makes a ``Dispatch`` per request, with what they share: the load tracker, the fleet's
    index and speculative placements, the prompt chainer (lazy rests), and the learned first-byte
    time per prefill token of each replica (streamed answers, for non-streamed ones)."""

    def __init__(self, fleet: Fleet, tracker: LoadTracker, chainer: PromptChainer,
                 block_size: int, index_stride: int, uses_index: bool,
                 on_load_change: Callable[[str], None],
                 learner: PrefillRateLearner | None = None) -> None:
        self.fleet = fleet
        self.tracker = tracker
        self.learner = learner or PrefillRateLearner()
        self.chainer = chainer
        self.block_size = block_size
        self.index_stride = index_stride  # only anchor keys are ever looked up
        self.uses_index = uses_index
        self.on_load_change = on_load_change
        # {replica_id: EWMA of streamed first-byte seconds per prefill token (incl. queueing)}
        self.prefill_s_per_token: dict[str, float] = {}
        # seconds recent non-streamed answers took beyond their predicted TTFT (generation)
        self.generation_s: deque[float] = deque(maxlen=ANSWER_WINDOW)
        # seconds recent pooling, scoring and tokenizer answers took from their send
        self.passthrough_s: deque[float] = deque(maxlen=ANSWER_WINDOW)

    def generation_allowance_s(self) -> float:
        """Seconds a non-streamed answer may take beyond its TTFT: the longest generation of the
        last ``ANSWER_WINDOW`` non-streamed answers (0 before any)."""
        return max(self.generation_s, default=0.0)

    def passthrough_allowance_s(self) -> float:
        """Seconds a pooling, scoring or tokenizer answer should take (its first byte is the whole
        answer): the longest of the last ``ANSWER_WINDOW`` such answers (0 before any: the
        first-byte deadline is then its floor). No prediction: the router does not tokenize them."""
        return max(self.passthrough_s, default=0.0)

    def begin(self, routed: Routed, spec: PromptSpec) -> Dispatch:
        return Dispatch(self, routed, spec)

    def passthrough(self) -> PassthroughDispatch:
        """The record of a request that is not a generation (pooling, scoring, tokenizer)."""
        return PassthroughDispatch(self)

    def observe_first_byte(self, replica_id: str, first_byte_s: float, prefill_tokens: int) -> None:
        """A streamed answer's first byte came ``first_byte_s`` after arrival."""
        sample = first_byte_s / max(prefill_tokens, 1)
        old = self.prefill_s_per_token.get(replica_id)
        self.prefill_s_per_token[replica_id] = sample if old is None else (
            old + PREFILL_RATE_EWMA_ALPHA * (sample - old))


class PassthroughDispatch:
    """The per-attempt record of a pooling, scoring or tokenizer request
    (``router.edges.proxy.ProxyDispatch``): a load ticket of no prefill, nothing placed, and the
    first-byte deadline of a non-streamed answer: the expected time is
    ``Dispatcher.passthrough_allowance_s`` (a hung replica's request moves before its first
    byte, and the miss counts against it, as generate's do)."""

    __slots__ = ("_d", "_sent_at")

    def __init__(self, dispatcher: Dispatcher) -> None:
        self._d = dispatcher
        self._sent_at: dict[str, float] = {}  # {replica_id: perf_counter at the send}

    def start_ticket(self, replica_id: str) -> GaugedTicket:
        d = self._d
        return GaugedTicket(d.tracker.dispatch(replica_id, 0), d.on_load_change)

    def expected_first_byte_s(self, replica_id: str) -> float:
        return self._d.passthrough_allowance_s()

    def sent(self, replica_id: str) -> None:
        self._sent_at[replica_id] = time.perf_counter()

    def observe_answer(self, replica_id: str, answered_at: float) -> None:
        """``replica_id`` answered (``answered_at``: ``time.perf_counter`` of its first byte): the
        time since the send is a sample of ``Dispatcher.passthrough_allowance_s``."""
        sent_at = self._sent_at.get(replica_id)
        if sent_at is not None:
            self._d.passthrough_s.append(max(answered_at - sent_at, 0.0))

    def connect_failed(self, replica_id: str) -> None:
        self._d.fleet.mark_failed(replica_id, time.monotonic())


class Dispatch:
    """One request's sends: load tickets, placements and KV writes, settled once.

    The proxy (``router.edges.proxy.ProxyDispatch``) calls ``start_ticket(replica_id)`` and
    ``expected_first_byte_s(replica_id)`` before each attempt, ``sent(replica_id)`` as the
    attempt's request goes out and ``connect_failed(replica_id)`` for a failed connection; the handler calls ``settle(status, replica_id)`` at
    the end, whatever happened (a second call does nothing).
    """

    def __init__(self, dispatcher: Dispatcher, routed: Routed, spec: PromptSpec) -> None:
        self._d = dispatcher
        self.routed = routed
        self.spec = spec
        # a CPU-tier hit is loaded, not prefilled
        self.prefill_tokens = max(routed.num_tokens - routed.decision.hit(
            routed.decision.replica_id).total_blocks * dispatcher.block_size, 1)
        self.placements: list[Placement] = []  # one per send, in order
        self._tickets: dict[str, GaugedTicket] = {}
        self._predicted: dict[str, TtftPrediction] = {}  # {replica_id: TTFT expected at the send}
        self._rest: asyncio.Future[PromptChain] | None = None
        self._settled = False

    def start_ticket(self, replica_id: str) -> GaugedTicket:
        """Count the request's load on ``replica_id`` (the proxy releases the ticket)."""
        d = self._d
        self._predicted[replica_id] = self._predict(replica_id)  # the queue ahead, without it
        ticket = GaugedTicket(d.tracker.dispatch(replica_id, self.prefill_tokens,
                                                 self.routed.num_tokens), d.on_load_change)
        d.on_load_change(replica_id)
        self._tickets[replica_id] = ticket
        if not self.spec.stream:
            # the first byte of a non-streamed answer comes only at the end: release its
            # prefill at the time streamed requests to this replica took per prefill token
            per_token = d.prefill_s_per_token.get(replica_id)
            if per_token is not None:
                ticket.release_prefill_after(per_token * self.prefill_tokens)
        return ticket

    def _predict(self, replica_id: str) -> TtftPrediction:
        """The ttft policy's prediction for ``replica_id``, or (other policies) the same model
        (``router.decision.ttft``): this router's prefill queued there plus the request's own prefill
        work past its hit there, at the replica's learned rate."""
        predicted = self.routed.decision.predictions.get(replica_id)
        if predicted is not None:
            return predicted
        d = self._d
        hit_tokens = self.routed.decision.hit(replica_id).total_blocks * d.block_size
        work = d.tracker.prefill_tokens(replica_id) + prefill_work_tokens(
            self.routed.num_tokens - hit_tokens, hit_tokens)
        return TtftPrediction(work, d.learner.estimate(replica_id).predict_s(work))

    def prediction(self, replica_id: str) -> TtftPrediction | None:
        """The TTFT expected when the request was sent to ``replica_id`` (None: never sent)."""
        return self._predicted.get(replica_id)

    def expected_first_byte_s(self, replica_id: str) -> float:
        """Seconds ``replica_id`` should take to the answer's first byte (after ``start_ticket``):
        the expected TTFT, plus for a non-streamed answer (its first byte is the whole answer)
        ``Dispatcher.generation_allowance_s``. Raises ``KeyError`` before ``start_ticket``."""
        ttft_s = self._predicted[replica_id].ttft_s
        return ttft_s if self.spec.stream else ttft_s + self._d.generation_allowance_s()

    def observe_answer(self, replica_id: str, answer_s: float) -> None:
        """A non-streamed answer from ``replica_id`` came ``answer_s`` after its send: its time
        beyond the expected TTFT is a generation sample."""
        predicted = self._predicted.get(replica_id)
        if predicted is not None:
            self._d.generation_s.append(max(answer_s - predicted.ttft_s, 0.0))

    def connect_failed(self, replica_id: str) -> None:
        """``replica_id`` refused or timed out a connection: the fleet skips it a while
        (``Fleet.mark_failed``)."""
        self._d.fleet.mark_failed(replica_id, time.monotonic())

    def sent(self, replica_id: str) -> Placement:
        """The request went out to ``replica_id``: place its chain there and count its KV writes
        (the first send of a lazily hashed chain also starts hashing its rest)."""
        d = self._d
        routed = self.routed
        placement = Placement(replica_id, sent_at=time.perf_counter(),
                              ticket=self._tickets.get(replica_id))
        if d.uses_index and routed.chain:
            held = routed.decision.hit(replica_id).confirmed
            placement.keys = anchor_keys(routed.chain, d.index_stride, held)
            d.fleet.speculative.place(d.fleet.index.bit(replica_id), placement.keys,
                                      time.monotonic())
            if not routed.complete and self._rest is None:
                self._rest = d.chainer.hash_rest(self.spec, routed.lora, routed.chain[-1],
                                                 self._record_rest)
        placement.blocks = self._write_blocks(replica_id)
        d.tracker.record_writes(replica_id, placement.blocks, routed.write_window_blocks)
        self.placements.append(placement)
        return placement

    def sent_at(self, replica_id: str) -> float:
        """perf_counter of the last send to ``replica_id``. Raises ``KeyError`` if never sent."""
        for placement in reversed(self.placements):
            if placement.replica_id == replica_id:
                return placement.sent_at
        raise KeyError(replica_id)

    def settle(self, status: int, replica_id: str) -> None:
        """The request ended with ``status`` from ``replica_id`` (499: the client left): keep
        what the serving send recorded, withdraw the rest (see the module docstring)."""
        if self._settled:
            return
        self._settled = True
        d = self._d
        window = self.routed.write_window_blocks
        refused = status >= 400 and status != STATUS_CLIENT_CLOSED
        last = len(self.placements) - 1
        for i, placement in enumerate(self.placements):
            rid = placement.replica_id
            if not refused and rid == replica_id and i == last:
                continue  # it served: keeps its placement, writes and (lazy) rest
            placement.withdrawn = True
            repeated = any(p.replica_id == rid for p in self.placements[i + 1:])
            if repeated or (i == last and refused and status < 500):
                d.tracker.withdraw_writes(rid, placement.blocks, window)
            elif i < last or refused:
                d.tracker.record_writes(rid, placement.blocks, window)
            slot = d.fleet.index.slot_of(rid)
            if placement.keys and slot is not None and not (rid == replica_id and not refused):
                # (a retry on the same replica re-placed the same keys: they stay)
                d.fleet.speculative.withdraw(slot, placement.keys)
        if self._rest is not None and all(p.withdrawn for p in self.placements):
            self._rest.cancel()  # not hashed yet: never will be

    def _write_blocks(self, replica_id: str) -> int:
        """New KV blocks the request makes ``replica_id`` write: its full blocks beyond the hit
        predicted there in both tiers (a CPU-tier hit is loaded into the GPU, not computed, and
        its host copy stays: write-through; ``router.decision.policy._ttft``'s evict term agrees)."""
        hit_blocks = self.routed.decision.hit(replica_id).total_blocks
        return max(self.routed.num_tokens // self._d.block_size - hit_blocks, 0)

    def _record_rest(self, whole: PromptChain) -> None:
        """The rest of a lazy chain is hashed: place it on every send not withdrawn, and correct
        a lazily tokenized text's estimated length in their KV writes and prefill load."""
        d = self._d
        routed = self.routed
        live = [p for p in self.placements if not p.withdrawn]
        if not live:
            return
        resized = whole.num_tokens != routed.num_tokens
        routed.num_tokens = whole.num_tokens
        rest = anchor_keys(whole.keys, d.index_stride, len(routed.chain))
        now = time.monotonic()
        for placement in live:
            rid = placement.replica_id
            if resized:
                blocks = self._write_blocks(rid)
                if blocks > placement.blocks:
                    d.tracker.record_writes(rid, blocks - placement.blocks,
                                            routed.write_window_blocks)
                elif blocks < placement.blocks:
                    d.tracker.withdraw_writes(rid, placement.blocks - blocks,
                                              routed.write_window_blocks)
                placement.blocks = blocks
                if placement.ticket is not None:
                    hit_tokens = routed.decision.hit(rid).total_blocks * d.block_size
                    placement.ticket.resize_prefill(max(whole.num_tokens - hit_tokens, 1))
            d.fleet.speculative.place(d.fleet.index.bit(rid), rest, now)
            placement.keys.extend(rest)
