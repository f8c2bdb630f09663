"""ZMQ subscriber for one engine's KV events, with sequence tracking and replay. Does I/O (ZMQ).

The engine (vLLM 0.33 ``ZmqEventPublisher``) publishes each batch as
``[topic, seq (8-byte big-endian), msgpack batch]`` on a PUB socket and keeps the
last ``buffer_steps`` batches for a ROUTER replay socket: a DEALER sends
``[b"", start_seq]`` and receives ``[b"", topic, seq, payload]`` per buffered
batch with ``seq >= start_seq``, then ``[b"", b"", seq=-1, b""]``.

Sequence rules applied here (the sink does the state changes):

* ``seq == last + 1``: apply.
* ``seq > last + 1`` (a gap): ask the replay socket for ``last + 1`` onwards and
  apply what it returns; if the replay is missing, times out or starts after
  ``last + 1``, the view cannot be trusted: ``sink.resync`` (clear, epoch bump)
  and rebuild from what follows.
* ``seq <= last`` (seq went backwards: the engine restarted): ``sink.resync``,
  then treat the engine as new (replay from 0 if the first batch seen is not 0).
  Live batches that merely repeat what a replay already applied are skipped.
* Malformed messages are logged (one line per ``BAD_MESSAGE_LOG_INTERVAL_S`` with a count),
  counted and dropped; the loop never dies on one and lets ``CancelledError`` through.
* Input bounds against a rogue or broken publisher: a message of more than 3 frames or
  ``max_message_bytes`` bytes in all is refused as it arrives, at most that much of it held
  (``worker.zmtp_sub``: libzmq's SUB buffers a whole multipart message before handing it over,
  and its ``MAXMSGSIZE`` bounds each frame only): the connection is dropped and re-made,
  counted in ``num_disconnects``; and a batch the sink refuses (``BatchRefused``: more blocks than the engine's KV cache holds) is
  counted once and dropped, its sequence number used up: the next batch follows it without a
  gap, so no replay fetches (and refuses) the buffer again. ``precheck`` (the sink's) sees the
  payload before it is decoded, so a batch of impossibly many blocks is refused the same way
  before its blocks take memory (``router.shared.kv_events.count_blocks``); a replay skips the seqs
  already handled before that check.
* Batches are decoded lazily (``decode_batch(lazy=True)``): a store's token ids stay msgpack
  until a key mapper or the hash probe reads them.
* ``rebuild`` re-applies the whole replay buffer to another sink (a key-mode switch
  re-keys the view from the engine's history); live messages wait meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, Protocol

import zmq
import zmq.asyncio

from router.shared.kv_events import (
    REPLAY_END_SEQ,
    KVEventBatch,
    KVEventDecodeError,
    decode_batch,
    parse_seq,
    seq_bytes,
)
from router.shared.logs import IntervalLog
from worker.replica_view import NO_SEQ
from worker.zmtp_sub import BoundedSubscriber

logger = logging.getLogger(__name__)

DEFAULT_REPLAY_TIMEOUT_S: Final = 2.0  # max wait for the next replay reply frame
SUB_RCVHWM: Final = 100_000  # messages; as vLLM's default publisher hwm
MESSAGE_FRAMES: Final = 3  # a live message: [topic, seq, payload]; more is refused as it arrives
_YIELD_EVERY: Final = 8  # live messages between forced yields, so the writer task can run
_DRAIN_MAX: Final = 256  # queued messages handled per yield with an event window
BAD_MESSAGE_LOG_INTERVAL_S: Final = 10.0  # one warning line per this many seconds of bad input
# the largest legitimate batch when the engine's KV capacity is unknown: 64 MiB holds a step
# that stores and evicts 250,000 blocks of 16 tokens (``max_message_bytes``)
DEFAULT_MAX_MESSAGE_BYTES: Final = 64 * 1024 * 1024
# bytes one block can take in a msgpack batch, beyond 5 per token id (a uint32): its hash (a
# 32-byte digest at most), in the store and again in the eviction that makes room for it,
# parent hash, extra keys, LoRA name and the event's framing, with room to spare
_BLOCK_OVERHEAD_BYTES: Final = 256
_BATCH_OVERHEAD_BYTES: Final = 1024 * 1024  # the batch's own framing and small events


def max_message_bytes(num_gpu_blocks: int | None, block_size: int | None) -> int:
    """The bound on one event message (all its frames): the largest batch a legitimate engine can
    send, from its KV capacity. One engine step cannot store more blocks than the cache holds
    (vLLM's ``BlockPool`` has ``num_gpu_blocks``), and it evicts at most as many to make room,
    so a batch is bounded by ``num_gpu_blocks`` blocks of ``block_size`` token ids (5 bytes
    each in msgpack at most) plus ``_BLOCK_OVERHEAD_BYTES`` per block and 1 MiB.
    ``DEFAULT_MAX_MESSAGE_BYTES`` when the capacity is unknown."""
    if not num_gpu_blocks or not block_size:
        return DEFAULT_MAX_MESSAGE_BYTES
    return num_gpu_blocks * (5 * block_size + _BLOCK_OVERHEAD_BYTES) + _BATCH_OVERHEAD_BYTES


class BatchRefused(Exception):
    """The sink refuses a well-formed batch it knows to be impossible (the message says why)."""


class BatchSink(Protocol):
    """Receives the ordered, de-duplicated stream of batches."""

    def apply(self, seq: int, batch: KVEventBatch) -> None:
        """Apply batch ``seq`` (always ``last + 1``, or the first after a resync)."""

    def resync(self, reason: str) -> None:
        """The view is untrustworthy: clear the replica's set and bump the epoch."""


@dataclass(slots=True)
class SubscriberStats:
    """Cumulative counters read by the metrics collector."""

    num_messages: int = 0
    num_malformed: int = 0
    num_gaps: int = 0
    num_replays: int = 0
    num_replay_failures: int = 0  # replay missing, timed out or not covering the gap
    num_restarts: int = 0  # seq went backwards
    num_duplicates: int = 0
    num_refused: int = 0  # well-formed batches the sink refused (impossible for the engine)
    num_disconnects: int = 0  # the publisher's connection dropped (an oversized message, or gone)


class KVEventSubscriber:
    """SUB client of ``endpoint`` plus DEALER client of ``replay_endpoint`` (None: no replay).

    ``last_seq`` is the last applied sequence number (``NO_SEQ`` = nothing yet);
    ``start_replay`` asks the replay socket for everything after it on start-up,
    so a restarted worker continues without losing or double counting batches.
    ``event_window_s`` > 0: after a batch arrives, wait that many seconds, then handle it and
    every batch queued meanwhile in one go (one wake-up, so the writer flushes them together);
    0 handles each batch as it arrives.
    """

    def __init__(
        self,
        endpoint: str,
        sink: BatchSink,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        last_seq: int = NO_SEQ,
        start_replay: bool = True,
        replay_timeout_s: float = DEFAULT_REPLAY_TIMEOUT_S,
        event_window_s: float = 0.0,
        context: zmq.asyncio.Context | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        precheck: Callable[[bytes], None] | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self.sink = sink
        self.last_seq = last_seq
        self.start_replay = start_replay
        self.replay_timeout_s = replay_timeout_s
        self.event_window_s = event_window_s
        self.stats = SubscriberStats()
        self.max_message_bytes = max_message_bytes
        self.precheck = precheck  # (payload) -> None; raises BatchRefused before the decode
        # one line per interval for each kind of bad input
        self._bad_log = IntervalLog(logger, BAD_MESSAGE_LOG_INTERVAL_S)
        self._refused_log = IntervalLog(logger, BAD_MESSAGE_LOG_INTERVAL_S)
        self._disconnect_log = IntervalLog(logger, BAD_MESSAGE_LOG_INTERVAL_S)
        self._events = BoundedSubscriber(endpoint, self.topic, MESSAGE_FRAMES, max_message_bytes,
                                         self._publisher_dropped, SUB_RCVHWM)
        # set while the event socket is subscribed (the publisher sends it what it publishes
        # from then on), cleared while it connects again
        self.connected = self._events.subscribed
        self._replay_socket = ReplaySocket(
            replay_endpoint, context or zmq.asyncio.Context.instance(), max_message_bytes,
            replay_timeout_s) if replay_endpoint else None
        self._dup_floor: int | None = None  # live seqs in [floor, last] were applied by a replay
        # live handling and a rebuild never interleave: a rebuild swaps the sink and the seq
        self._lock = asyncio.Lock()

    # -- main loop ---------------------------------------------------------------

    async def run(self) -> None:
        """Receive batches until cancelled. Never returns otherwise."""
        sub = self._events
        sub.start()
        logger.info("subscribing to KV events at %s (replay %s, messages up to %d bytes)",
                    self.endpoint, self.replay_endpoint or "off", self.max_message_bytes)
        try:
            if self.start_replay and self.replay_endpoint:
                async with self._lock:
                    await self._replay(self.last_seq + 1, trigger=None, reason="start-up")
            received = 0
            lock = self._lock
            while True:
                try:
                    frames = await sub.recv_multipart()
                    if self.event_window_s:
                        await asyncio.sleep(self.event_window_s)
                    async with lock:
                        await self.handle_live(frames)
                    while self.event_window_s:
                        # what queued meanwhile, yielding every _DRAIN_MAX so that a backlog
                        # is flushed in parts and cannot starve the writer or the heartbeat
                        async with lock:
                            handled = await self._handle_queued(sub, _DRAIN_MAX)
                        received += handled
                        if handled < _DRAIN_MAX:
                            break
                        await asyncio.sleep(0)
                except asyncio.CancelledError:
                    raise
                except Exception:  # the loop must survive anything one message does
                    self.stats.num_malformed += 1
                    logger.exception("KV event subscriber: unexpected error; continuing")
                    await asyncio.sleep(0.05)
                received += 1
                if received % _YIELD_EVERY == 0:
                    await asyncio.sleep(0)
        finally:
            await sub.close()
            if self._replay_socket is not None:
                self._replay_socket.close()

    def _publisher_dropped(self, reason: str) -> None:
        """The event socket's connection dropped (``BoundedSubscriber`` connects again; a gap
        that follows is replayed)."""
        self.stats.num_disconnects += 1
        self._disconnect_log.warning(
            "KV event publisher at %s disconnected (%s): a message over %d bytes or %d frames "
            "(refused as it arrived) or the publisher went away", self.endpoint, reason,
            self.max_message_bytes, MESSAGE_FRAMES)

    async def _handle_queued(self, sub: BoundedSubscriber, limit: int) -> int:
        """Handle up to ``limit`` messages already queued on ``sub`` without waiting; returns
        how many. A malformed one is counted and dropped by ``handle_live`` like any other."""
        handled = 0
        while handled < limit:
            frames = sub.recv_nowait()
            if frames is None:
                return handled
            await self.handle_live(frames)
            handled += 1
        return handled

    async def handle_live(self, frames: list[bytes]) -> None:
        """Handle one live PUB message ``[topic, seq, payload]``."""
        self.stats.num_messages += 1
        decoded = self._decode(frames, live=True)
        if decoded is None:
            return
        seq, batch = decoded
        expected = self.last_seq + 1
        if seq == expected:
            self._dup_floor = None
            self._apply(seq, batch)
        elif seq > expected:
            self.stats.num_gaps += 1
            if self.last_seq != NO_SEQ:
                logger.warning("KV event seq gap: expected %d, got %d", expected, seq)
            await self._replay(expected, trigger=(seq, batch), reason="gap")
        elif self._dup_floor is not None and seq >= self._dup_floor:
            self.stats.num_duplicates += 1  # already applied from the replay buffer
        else:
            self.stats.num_restarts += 1
            self.sink.resync(f"engine restarted: KV event seq went from {self.last_seq} to {seq}")
            self.last_seq = NO_SEQ
            self._dup_floor = None
            if seq == 0:
                self._apply(seq, batch)
            else:  # the new engine published before we saw it: fetch its history
                await self._replay(0, trigger=(seq, batch), reason="engine restart")

    def restart_from_scratch(self) -> None:
        """The engine restarted (seen elsewhere): accept its next batch as new history.

        A next batch with seq > 0 triggers a replay from 0 without another resync.
        """
        self.stats.num_restarts += 1
        self.last_seq = NO_SEQ
        self._dup_floor = None

    async def rebuild(self, replay_into: BatchSink, reason: str,
                      on_done: Callable[[bool], None]) -> bool:
        """Apply the engine's whole replay buffer to ``replay_into``, then call ``on_done``.

        For a sink that starts empty (a view under another key mapper): it gets every batch
        the engine still buffers (vLLM keeps the last ``buffer_steps``); ``on_done(covered)``
        runs before any live batch is handled (it swaps the rebuilt view in), and the live
        stream then continues into ``self.sink`` without a batch lost or applied twice.
        Returns ``covered``: True when the replay ended normally, False when it was disabled
        or timed out (``replay_into`` then holds what arrived).
        """
        async with self._lock:
            sink, self.sink = self.sink, replay_into
            self.last_seq = NO_SEQ
            self._dup_floor = None
            covered = False
            try:
                if self.replay_endpoint:
                    self.stats.num_replays += 1
                    covered = await self._fetch_replay(0, reason)
                if not covered:
                    self.stats.num_replay_failures += 1
            finally:
                self.sink = sink
                self._dup_floor = 0
            on_done(covered)
            return covered

    # -- replay ------------------------------------------------------------------

    async def _replay(self, start: int, trigger: tuple[int, KVEventBatch | None] | None,
                      reason: str) -> None:
        """Apply buffered batches from ``start``; resync if they do not connect to ``last_seq``.

        ``trigger`` is the live batch that revealed the gap (applied afterwards if
        the replay did not already include it). With ``last_seq == NO_SEQ`` any
        starting point is accepted: there is no history to connect to.
        """
        covered = False
        if self.replay_endpoint:
            self.stats.num_replays += 1
            # a refused trigger is used up where the replay reaches it, not checked again
            refused = trigger[0] if trigger is not None and trigger[1] is None else None
            covered = await self._fetch_replay(start, reason, refused=refused)
        if not covered:
            self.stats.num_replay_failures += 1
        if trigger is not None:
            seq, batch = trigger
            if seq <= self.last_seq:
                self.stats.num_duplicates += 1
            else:
                if seq != self.last_seq + 1 and self.last_seq != NO_SEQ:
                    self._resync(f"batches {self.last_seq + 1}..{seq - 1} lost "
                                 f"(replay {'could not cover them' if self.replay_endpoint else 'disabled'})")
                self._apply(seq, batch)
            self._dup_floor = seq
        else:
            self._dup_floor = start

    async def _fetch_replay(self, start: int, reason: str, refused: int | None = None) -> bool:
        """Request and apply ``start..``; True when the replay ended normally. ``refused``: the
        seq of a batch already refused (and counted), used up unread when the replay has it."""
        replay = self._replay_socket
        assert replay is not None
        logger.info("requesting KV event replay from seq %d (%s)", start, reason)
        await replay.request(start)
        while True:
            frames = await replay.recv()
            if frames is None:
                logger.warning("KV event replay from %d timed out after %.1fs", start,
                               self.replay_timeout_s)
                return False
            if len(frames) == 4 and frames[2] and parse_seq_safe(frames[2]) == REPLAY_END_SEQ:
                return True
            expected = self.last_seq + 1
            if len(frames) == 4 and parse_seq_safe(frames[2]) == refused == expected:
                self._apply(expected, None)
                continue
            # seqs below ``expected`` were applied or refused already: skipped before the
            # precheck, so a refused batch is neither counted nor checked twice
            decoded = self._decode(frames[1:], live=False, skip_below=expected)
            if decoded is None:
                continue
            seq, batch = decoded
            if seq > expected and self.last_seq != NO_SEQ:
                self.stats.num_replay_failures += 1
                self._resync(f"replay buffer starts at seq {seq}, needed {expected}")
            self._apply(seq, batch)

    # -- helpers -----------------------------------------------------------------

    def _apply(self, seq: int, batch: KVEventBatch | None) -> None:
        """Apply ``batch`` to the sink; ``None`` (refused by the precheck) or a batch the sink
        refuses uses its seq up all the same: the engine sent it, nothing of it is applied, and
        the next batch follows it (not a gap to replay, which would refuse it again)."""
        if batch is not None:
            try:
                self.sink.apply(seq, batch)
            except BatchRefused as exc:
                self._count_refused(seq, exc)
        self.last_seq = seq

    def _count_refused(self, seq: int, exc: BatchRefused) -> None:
        self.stats.num_refused += 1
        self._refused_log.warning("refusing KV event batch %d: %s", seq, exc)

    def _resync(self, reason: str) -> None:
        self.sink.resync(reason)

    def _decode(self, frames: list[bytes], *, live: bool,
                skip_below: int = NO_SEQ) -> tuple[int, KVEventBatch | None] | None:
        """``(seq, batch)``, ``(seq, None)`` for a batch the precheck refused (counted here), or
        None for a message to drop: malformed (counted), another topic, or seq < ``skip_below``."""
        where = "live" if live else "replayed"
        if len(frames) != 3:
            self.stats.num_malformed += 1
            self._bad_log.warning("dropping %s KV event message with %d frames (want 3)", where,
                                  len(frames))
            return None
        if frames[0] != self.topic and self.topic:
            return None
        try:
            seq = parse_seq(frames[1])
            if seq < skip_below:
                return None
            if self.precheck is not None:
                self.precheck(frames[2])
            batch = decode_batch(frames[2], lazy=True)
        except KVEventDecodeError as exc:
            self.stats.num_malformed += 1
            self._bad_log.warning("dropping malformed %s KV event batch: %s", where, exc)
            return None
        except BatchRefused as exc:  # (as ``_apply`` does, before the blocks are decoded)
            self._count_refused(seq, exc)
            return seq, None
        return seq, batch


class ReplaySocket:
    """DEALER client of the engine's replay ROUTER socket at ``endpoint``: connected on first
    use, closed when a reply is late (late replies must not leak into the next replay) and
    connected again by the next request."""

    def __init__(self, endpoint: str, context: zmq.asyncio.Context, max_message_bytes: int,
                 timeout_s: float) -> None:
        self.endpoint = endpoint
        self.max_message_bytes = max_message_bytes
        self.timeout_s = timeout_s  # longest wait for the next reply frame
        self._ctx = context
        self._dealer: zmq.asyncio.Socket | None = None

    async def request(self, start: int) -> None:
        """Ask for every buffered batch with ``seq >= start``."""
        await self._socket().send_multipart([b"", seq_bytes(start)])

    async def recv(self) -> list[bytes] | None:
        """The next reply's frames, or None (and the socket closed) after ``timeout_s``."""
        dealer = self._socket()
        if not await dealer.poll(int(self.timeout_s * 1000)):
            self.close()
            return None
        return await dealer.recv_multipart()

    def _socket(self) -> zmq.asyncio.Socket:
        if self._dealer is None:
            dealer = self._ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
            dealer.connect(self.endpoint)
            self._dealer = dealer
        return self._dealer

    def close(self) -> None:
        if self._dealer is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._dealer.close(linger=0)
            self._dealer = None


def parse_seq_safe(frame: bytes) -> int | None:
    """``parse_seq`` that returns None instead of raising."""
    try:
        return parse_seq(frame)
    except KVEventDecodeError:
        return None

