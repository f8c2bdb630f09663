"""The worker's hash agreement check and the key mode it decides. Does I/O (the probe
completion through the engine's HTTP API; the re-keying replay through the subscriber).

At start and after every epoch change the worker sends the probe completion
(``worker.probe``), catches the probe's ``BlockStored`` in its event stream and publishes the
verdict as ``hash_verified``. Engine hashes that match the routers' keep ``key_mode=engine``;
hashes that differ switch the replica to keys re-computed from the events' token ids
(``key_mode=recomputed``), re-keying the set from the engine's replay buffer.

A probe is sent once the event socket is subscribed (a PUB socket drops what it publishes
before a subscriber's subscription reached it), and a probe whose ``BlockStored`` does not
come within the probe timeout is sent again (a new prompt) up to ``PROBE_ATTEMPTS`` times with
backoff: an engine slow to publish, or a subscription that reached the engine just after the
probe's batch (nothing after it reveals the gap until the next batch, which the next probe
is), leaves the worker unverified only until a later probe's events arrive. Each miss is
logged and counted (``worker_probe_misses_total``; ``worker_probe_retrying`` is 1 while the
next attempt waits); after the last the worker stays unverified until the next epoch change.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING, Final

from router.shared.contract import HashVerified
from router.shared.hashing import BlockHasher, HashConfigError
from router.shared.kv_events import BlockStored, KVEventBatch
from worker.block_keys import EngineKeys, RecomputedKeys
from worker.heartbeat import EngineUnreachable
from worker.probe import PROBE_TIMEOUT_S, ProbeCatcher, judge, probe_tokens
from worker.replica_view import ReplicaView

if TYPE_CHECKING:
    from worker.report import Worker

logger = logging.getLogger(__name__)

PROBE_RETRY_S: Final = 2.0  # wait after an engine that did not answer; the first backoff
PROBE_ATTEMPTS: Final = 8  # probes without their BlockStored before waiting for an epoch change
PROBE_BACKOFF_MAX_S: Final = 60.0  # backoff doubles from PROBE_RETRY_S up to this
_NO_EVENTS_HINT: Final = (
    "are KV events enabled on the engine, and does it bind its endpoint, e.g. tcp://*:5557? "
    "vLLM connects instead for a concrete host, and so does this worker, so no events flow")


class HashCheck:
    """One worker's hash probe: ``run`` probes at start and whenever ``want`` is called,
    ``observe`` feeds it the batches the worker applies. ``hash_verified`` is the verdict the
    heartbeat publishes (``HashVerified.UNKNOWN`` until a probe finished), ``num_probes`` the
    probes judged, ``num_misses`` the probes that missed (the event socket not subscribed, or
    the probe's ``BlockStored`` not arrived, in time),
    ``retrying`` True while the next attempt after a miss waits. ``timeout_s``: how long a
    probe waits for the event socket's subscription, the completion and its ``BlockStored``."""

    def __init__(self, worker: Worker, timeout_s: float = PROBE_TIMEOUT_S) -> None:
        self.worker = worker
        self.timeout_s = timeout_s
        self.hash_verified = HashVerified.UNKNOWN
        self.num_probes = 0
        self.num_misses = 0
        self.retrying = False
        self._wanted = asyncio.Event()
        self._catcher: ProbeCatcher | None = None

    def want(self) -> None:
        """Probe again (the epoch changed: the engine may have restarted with other settings)."""
        self._wanted.set()

    def observe(self, batch: KVEventBatch) -> None:
        """Look for the probe's blocks among ``batch``'s stores while a probe is out."""
        catcher = self._catcher
        if catcher is not None:
            for event in batch.events:
                if isinstance(event, BlockStored):
                    catcher.observe(event)

    async def run(self) -> None:
        """Probe at start and after every ``want`` until a verdict (``probe_until_judged``)."""
        self._wanted.set()
        while True:
            await self._wanted.wait()
            self._wanted.clear()
            try:
                await self.probe_until_judged()
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("hash probe failed unexpectedly")
            finally:
                self._catcher = None
                self.retrying = False

    async def probe_until_judged(self) -> None:
        """Probe until a verdict: every ``PROBE_RETRY_S`` while the engine does not answer,
        and up to ``PROBE_ATTEMPTS`` probes whose ``BlockStored`` does not arrive, the wait
        between them doubling from ``PROBE_RETRY_S`` to ``PROBE_BACKOFF_MAX_S``."""
        misses = 0
        backoff = PROBE_RETRY_S
        while True:
            try:
                await self.worker.engine_known.wait()
                missed = await self.probe_once()
            except EngineUnreachable as exc:
                logger.warning("hash probe failed (%s); retrying in %.0fs", exc, PROBE_RETRY_S)
                await self._pause(PROBE_RETRY_S)
                continue
            if missed is None:
                return
            misses += 1
            self.num_misses += 1
            if misses >= PROBE_ATTEMPTS:
                logger.error("hash probe %d/%d: %s; no more probes until the engine restarts "
                             "or the set is reset (%s); hash_verified stays %r", misses,
                             PROBE_ATTEMPTS, missed, _NO_EVENTS_HINT, self.hash_verified.value)
                return
            logger.warning("hash probe %d/%d: %s; unverified, probing again in %.0fs", misses,
                           PROBE_ATTEMPTS, missed, backoff)
            self.retrying = True
            wanted = await self._pause(backoff)
            self.retrying = False
            if wanted:  # the epoch changed meanwhile: a new engine gets all its attempts
                misses, backoff = 0, PROBE_RETRY_S
            else:
                backoff = min(backoff * 2, PROBE_BACKOFF_MAX_S)

    async def _pause(self, seconds: float) -> bool:
        """Sleep ``seconds``, or less when ``want`` asks for a probe meanwhile (the probe
        after the pause is that one); returns whether it did."""
        wanted = False
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wanted.wait(), seconds)
            wanted = True
        self._wanted.clear()
        return wanted

    async def probe_once(self) -> str | None:
        """Send the probe completion once the event socket is subscribed, catch its
        ``BlockStored``, publish the verdict. Returns None once judged, else what was missing
        (the subscription or the ``BlockStored``, within ``timeout_s`` each). Raises
        ``EngineUnreachable``."""
        worker = self.worker
        try:
            hasher = worker.hasher()
        except HashConfigError as exc:
            logger.error("cannot reproduce the engine's block hashes: %s", exc)
            self.hash_verified = HashVerified.MISMATCH
            return None
        models = worker.heartbeat.models
        if models is None or not models.models:
            raise EngineUnreachable("engine serves no models yet")
        subscriber = worker.subscriber
        if subscriber is not None and not subscriber.connected.is_set():
            try:
                await asyncio.wait_for(subscriber.connected.wait(), self.timeout_s)
            except TimeoutError:
                return (f"the KV event socket {subscriber.endpoint} is not subscribed after "
                        f"{self.timeout_s:.0f}s (the engine is not publishing there yet)")
        tokens = probe_tokens(worker.engine_block_size or hasher.block_size)
        catcher = ProbeCatcher(tokens, worker.engine_block_size or hasher.block_size)
        self._catcher = catcher
        try:
            await worker.engine.complete(models.models[0], tokens, self.timeout_s)
            await asyncio.wait_for(catcher.done.wait(), self.timeout_s)
        except TimeoutError:
            return f"no BlockStored for the probe prompt within {self.timeout_s:.0f}s"
        finally:
            self._catcher = None
        verdict = judge(catcher, hasher)
        self.num_probes += 1
        self.hash_verified = HashVerified.VERIFIED if verdict.verified else HashVerified.MISMATCH
        if verdict.verified:
            await self._verified(hasher)
        else:
            logger.error("hash probe: engine block hashes DIFFER from the routers' (likely cause: %s); "
                         "re-computing keys from token_ids (key_mode=recomputed)", verdict.cause)
            current = worker.view.mapper
            same = (isinstance(current, RecomputedKeys)
                    and (current.hasher.block_size, current.hasher.hash_algo, current.hasher.seed)
                    == (hasher.block_size, hasher.hash_algo, hasher.seed))
            if not same:
                await self._switch(RecomputedKeys(hasher, worker.lora_paths.get),
                                   f"hash mismatch ({verdict.cause}): key_mode=recomputed")
        worker.heartbeat.wake.set()
        return None

    async def _verified(self, hasher: BlockHasher) -> None:
        config = self.worker.config
        # what was checked: the engine's hashes against this worker's hasher, whose
        # settings are the routers' only where they are configured here
        given = [name for name, value in (("block size", config.block_size),
                                          ("hash algo", config.hash_algo),
                                          ("hash seed", config.hash_seed)) if value]
        logger.info("hash probe: engine block hashes match this worker's hasher (%s, block "
                    "size %d, seed fingerprint %s; %s); routers with other settings report "
                    "this replica as config_mismatch", hasher.hash_algo, hasher.block_size,
                    hasher.seed_fingerprint,
                    f"{', '.join(given)} set for this worker" if given else
                    "the engine's own settings: none of block size, hash algo, hash seed "
                    "set for this worker")
        if self.worker.view.key_mode != EngineKeys.mode:
            await self._switch(EngineKeys(), "engine hashes verified: back to key_mode=engine")

    async def _switch(self, mapper: EngineKeys | RecomputedKeys, reason: str) -> None:
        """Re-key the replica's set under ``mapper`` from the engine's replay buffer.

        The engine keeps its cached blocks across the switch, so the set is rebuilt from
        the history the engine still buffers and published whole under the next epoch
        (one Redis change) rather than emptied. A mode switch needs no new probe.
        """
        worker = self.worker
        fresh = worker.view.rekeyed(mapper, reason)

        def swap(covered: bool) -> None:
            if not covered:
                logger.warning("key mode switch: the engine's replay did not complete; %d "
                               "blocks re-keyed, the rest appears as the engine stores it again",
                               len(fresh.blocks))
            worker.view = fresh
            worker.writer.enqueue(fresh.publish_whole())

        if worker.subscriber is None:
            swap(True)
        else:
            await worker.subscriber.rebuild(_Rekeying(worker, fresh),
                                            f"key mode switch: {reason}", swap)
        worker.heartbeat.wake.set()


class _Rekeying:
    """The subscriber's sink while a key-mode switch replays the engine's history into a
    fresh view: changes stay in the view (published whole at the end), nothing reaches Redis."""

    def __init__(self, worker: Worker, view: ReplicaView) -> None:
        self.worker = worker
        self.view = view

    def apply(self, seq: int, batch: KVEventBatch) -> None:
        self.view.apply_batch(seq, self.worker.filtered(batch))

    def resync(self, reason: str) -> None:
        self.view.reset(reason)
